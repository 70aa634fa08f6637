/* The Redis store's read cache (mcache.h): 256 stripes, each a mutex, a chained hash table,
 * a CLOCK ring, a byte budget and an invalidation generation.
 *
 * No stale fill: a lookup that misses hands out its stripe's generation as a ticket; every
 * invalidation of a key of the stripe, and every flush, bumps the generation under the
 * stripe mutex. A fill is accepted only while the generation still equals its ticket. So a
 * value read from Redis is inserted only if no invalidation of its stripe was processed
 * between the miss (before the read was sent) and the fill; an invalidation processed after
 * the fill drops the entry. Either way an entry never outlives the invalidation of a write
 * its value predates. (A per-stripe counter rather than a per-key marker: an invalidation
 * may void an unrelated fill of the same stripe, which costs a miss, never correctness.) */
#include "master/mcache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"

#define NSTRIPES 256u

struct ment {
    struct ment *next;          /* bucket chain */
    struct ment *lprev, *lnext; /* the CLOCK ring as a list: newest (or spared) first */
    uint64_t hv;
    uint32_t klen, vlen;
    uint8_t kind;
    uint8_t ref;    /* read since the hand last passed */
    uint8_t data[]; /* key, then value */
};

/* A bucket array with its size, so that one load gives both (the prefetch reads it without
 * the stripe mutex). Arrays outgrown are kept until the cache is freed: a prefetch may still
 * read them (together at most the size of the current one). */
struct btab {
    struct btab *retired;
    size_t nb;
    struct ment *slot[];
};

struct stripe {
    pthread_mutex_t mu;
    struct btab *t; /* written under mu with release, read by prefetches relaxed */
    size_t n;
    struct ment *head, *tail;
    size_t bytes, budget;
    uint64_t gen;
    uint64_t hits, misses, inval, evict, dropped;
} __attribute__((aligned(64)));

struct mcache {
    struct stripe st[NSTRIPES];
    _Atomic bool on;
    _Atomic uint64_t flushes;
};

static size_t cost(const struct ment *e) {
    return (size_t)e->klen + e->vlen + MCACHE_ENTRY_OVERHEAD;
}

uint64_t mcache_hash(uint8_t kind, const void *key, size_t klen) {
    return fnv1a64_add(fnv1a64_add(FNV1A64_INIT, &kind, 1), key, klen);
}

static struct stripe *stripe_of(struct mcache *c, uint64_t hv) { return &c->st[hv % NSTRIPES]; }

static size_t bucket_of(const struct stripe *s, uint64_t hv) {
    return (size_t)((hv / NSTRIPES) & (s->t->nb - 1));
}

struct mcache *mcache_new(size_t max_bytes) {
    struct mcache *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    for (uint32_t i = 0; i < NSTRIPES; i++) {
        struct stripe *s = &c->st[i];
        pthread_mutex_init(&s->mu, NULL);
        s->budget = max_bytes / NSTRIPES;
        s->t = calloc(1, sizeof(struct btab) + 16 * sizeof(struct ment *));
        if (s->t) s->t->nb = 16;
        if (!s->t) {
            mcache_free(c);
            return NULL;
        }
    }
    return c;
}

static void do_clear(struct stripe *s) {
    for (struct ment *e = s->head, *nx; e; e = nx) {
        nx = e->lnext;
        free(e);
    }
    for (size_t i = 0; s->t && i < s->t->nb; i++)
        __atomic_store_n(&s->t->slot[i], NULL, __ATOMIC_RELAXED);
    s->head = s->tail = NULL;
    s->n = s->bytes = 0;
    s->gen++;
}

void mcache_free(struct mcache *c) {
    if (!c) return;
    for (uint32_t i = 0; i < NSTRIPES; i++) {
        do_clear(&c->st[i]);
        for (struct btab *t = c->st[i].t, *nx; t; t = nx) {
            nx = t->retired;
            free(t);
        }
        pthread_mutex_destroy(&c->st[i].mu);
    }
    free(c);
}

static void lru_unlink(struct stripe *s, struct ment *e) {
    if (e->lprev)
        e->lprev->lnext = e->lnext;
    else
        s->head = e->lnext;
    if (e->lnext)
        e->lnext->lprev = e->lprev;
    else
        s->tail = e->lprev;
    e->lprev = e->lnext = NULL;
}

static void lru_push(struct stripe *s, struct ment *e) {
    e->lprev = NULL;
    e->lnext = s->head;
    if (s->head) s->head->lprev = e;
    s->head = e;
    if (!s->tail) s->tail = e;
}

/* The link pointing at the entry of (kind, key), or at the chain's terminating NULL. */
static struct ment **do_find(struct stripe *s, uint8_t kind, const void *key, size_t klen,
                             uint64_t hv) {
    struct ment **pp = &s->t->slot[bucket_of(s, hv)];
    for (; *pp; pp = &(*pp)->next) {
        const struct ment *e = *pp;
        if (e->hv == hv && e->kind == kind && e->klen == klen && memcmp(e->data, key, klen) == 0)
            break;
    }
    return pp;
}

/* Links are stored relaxed-atomically: mcache_prefetch reads bucket heads without the lock. */
static void set_link(struct ment **pp, struct ment *e) {
    __atomic_store_n(pp, e, __ATOMIC_RELAXED);
}

static void do_remove(struct stripe *s, struct ment **pp) {
    struct ment *e = *pp;
    set_link(pp, e->next);
    lru_unlink(s, e);
    s->n--;
    s->bytes -= cost(e);
    free(e);
}

bool mcache_buf_put(struct mcache_buf *b, const void *p, size_t n) {
    if (b->n + n > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n) nc *= 2;
        uint8_t *np = realloc(b->p, nc);
        if (!np) return false;
        b->p = np;
        b->cap = nc;
    }
    if (n) memcpy(b->p + b->n, p, n);
    b->n += n;
    return true;
}

int mcache_get(struct mcache *c, uint8_t kind, const void *key, size_t klen, uint64_t hv,
               struct mcache_buf *out, uint64_t *ticket) {
    if (!atomic_load_explicit(&c->on, memory_order_acquire)) return -1;
    struct stripe *s = stripe_of(c, hv);
    pthread_mutex_lock(&s->mu);
    struct ment *e = *do_find(s, kind, key, klen, hv);
    int rc = 0;
    if (e) {
        rc = mcache_buf_put(out, e->data + e->klen, e->vlen) ? 1 : -1;
        e->ref = 1; /* no list surgery on a hit: its neighbours' cache lines stay cold */
        s->hits++;
    } else {
        s->misses++;
        *ticket = s->gen;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static void do_grow(struct stripe *s) {
    size_t nb = s->t->nb * 2;
    struct btab *t = calloc(1, sizeof(*t) + nb * sizeof(struct ment *));
    if (!t) return; /* longer chains, still correct */
    t->nb = nb;
    for (size_t i = 0; i < s->t->nb; i++)
        for (struct ment *e = s->t->slot[i], *nx; e; e = nx) {
            nx = e->next;
            size_t k = (size_t)((e->hv / NSTRIPES) & (nb - 1));
            e->next = t->slot[k];
            t->slot[k] = e;
        }
    t->retired = s->t;
    __atomic_store_n(&s->t, t, __ATOMIC_RELEASE);
}

void mcache_prefetch(struct mcache *c, const uint64_t *hv, size_t n, int stage) {
    for (size_t i = 0; i < n; i++) {
        if (!hv[i]) continue;
        struct stripe *s = stripe_of(c, hv[i]);
        struct btab *t = __atomic_load_n(&s->t, __ATOMIC_ACQUIRE);
        struct ment **slot = &t->slot[(hv[i] / NSTRIPES) & (t->nb - 1)];
        if (stage == 0) {
            __builtin_prefetch(slot);
        } else {
            /* The head may be freed meanwhile: a prefetch never faults. */
            const char *e = (const char *)__atomic_load_n(slot, __ATOMIC_RELAXED);
            if (e) {
                __builtin_prefetch(e);
                __builtin_prefetch(e + 64);
            }
        }
    }
}

void mcache_fill(struct mcache *c, uint8_t kind, const void *key, size_t klen, uint64_t hv,
                 uint64_t ticket, const void *val, size_t vlen) {
    struct stripe *s = stripe_of(c, hv);
    size_t need = klen + vlen + MCACHE_ENTRY_OVERHEAD;
    if (klen > UINT32_MAX || vlen > UINT32_MAX || need > s->budget) return;
    struct ment *e = malloc(sizeof(*e) + klen + vlen);
    if (!e) return;
    e->hv = hv;
    e->kind = kind;
    e->klen = (uint32_t)klen;
    e->vlen = (uint32_t)vlen;
    e->ref = 0;
    memcpy(e->data, key, klen);
    if (vlen) memcpy(e->data + klen, val, vlen);
    pthread_mutex_lock(&s->mu);
    if (s->gen != ticket || !atomic_load_explicit(&c->on, memory_order_acquire)) {
        s->dropped++;
        pthread_mutex_unlock(&s->mu);
        free(e);
        return;
    }
    struct ment **pp = do_find(s, kind, key, klen, hv);
    if (*pp) do_remove(s, pp);
    /* CLOCK (second chance): the oldest entry goes unless read since the hand last passed
     * it; then it is spared once, moved to the front with its bit cleared. */
    while (s->bytes + need > s->budget && s->tail) {
        struct ment *v = s->tail;
        if (v->ref) {
            v->ref = 0;
            lru_unlink(s, v);
            lru_push(s, v);
            continue;
        }
        do_remove(s, do_find(s, v->kind, v->data, v->klen, v->hv));
        s->evict++;
    }
    if (s->n >= s->t->nb) do_grow(s);
    size_t k = bucket_of(s, hv);
    e->next = s->t->slot[k];
    set_link(&s->t->slot[k], e);
    lru_push(s, e);
    s->n++;
    s->bytes += need;
    pthread_mutex_unlock(&s->mu);
}

void mcache_invalidate(struct mcache *c, uint8_t kind, const void *key, size_t klen) {
    uint64_t hv = mcache_hash(kind, key, klen);
    struct stripe *s = stripe_of(c, hv);
    pthread_mutex_lock(&s->mu);
    struct ment **pp = do_find(s, kind, key, klen, hv);
    if (*pp) do_remove(s, pp);
    s->gen++;
    s->inval++;
    pthread_mutex_unlock(&s->mu);
}

void mcache_flush(struct mcache *c) {
    atomic_fetch_add(&c->flushes, 1);
    for (uint32_t i = 0; i < NSTRIPES; i++) {
        pthread_mutex_lock(&c->st[i].mu);
        do_clear(&c->st[i]);
        pthread_mutex_unlock(&c->st[i].mu);
    }
}

void mcache_disable(struct mcache *c) {
    /* Off first: a fill checks it after its generation, so nothing lands after the flush. */
    atomic_store_explicit(&c->on, false, memory_order_release);
    mcache_flush(c);
}

void mcache_enable(struct mcache *c) { atomic_store_explicit(&c->on, true, memory_order_release); }

bool mcache_enabled(const struct mcache *c) {
    return atomic_load_explicit(&c->on, memory_order_acquire);
}

void mcache_stats(struct mcache *c, struct mcache_stats *st) {
    memset(st, 0, sizeof(*st));
    st->flushes = atomic_load(&c->flushes);
    for (uint32_t i = 0; i < NSTRIPES; i++) {
        struct stripe *s = &c->st[i];
        pthread_mutex_lock(&s->mu);
        st->hits += s->hits;
        st->misses += s->misses;
        st->invalidations += s->inval;
        st->evictions += s->evict;
        st->fills_dropped += s->dropped;
        st->entries += s->n;
        st->bytes += s->bytes;
        pthread_mutex_unlock(&s->mu);
    }
}
