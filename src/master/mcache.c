/* The Redis store's read cache (mcache.h): 256 stripes, each a mutex, a chained hash table,
 * an LRU list, a byte budget and an invalidation generation.
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
    struct ment *lprev, *lnext; /* LRU list, most recent first */
    uint64_t hv;
    uint32_t klen, vlen;
    uint8_t kind;
    uint8_t data[]; /* key, then value */
};

struct stripe {
    pthread_mutex_t mu;
    struct ment **b;
    size_t nb, n;
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
    return (size_t)((hv / NSTRIPES) & (s->nb - 1));
}

struct mcache *mcache_new(size_t max_bytes) {
    struct mcache *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    for (uint32_t i = 0; i < NSTRIPES; i++) {
        struct stripe *s = &c->st[i];
        pthread_mutex_init(&s->mu, NULL);
        s->budget = max_bytes / NSTRIPES;
        s->nb = 16;
        s->b = calloc(s->nb, sizeof(*s->b));
        if (!s->b) {
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
    if (s->b) memset(s->b, 0, s->nb * sizeof(*s->b));
    s->head = s->tail = NULL;
    s->n = s->bytes = 0;
    s->gen++;
}

void mcache_free(struct mcache *c) {
    if (!c) return;
    for (uint32_t i = 0; i < NSTRIPES; i++) {
        do_clear(&c->st[i]);
        free(c->st[i].b);
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
    struct ment **pp = &s->b[bucket_of(s, hv)];
    for (; *pp; pp = &(*pp)->next) {
        const struct ment *e = *pp;
        if (e->hv == hv && e->kind == kind && e->klen == klen && memcmp(e->data, key, klen) == 0)
            break;
    }
    return pp;
}

static void do_remove(struct stripe *s, struct ment **pp) {
    struct ment *e = *pp;
    *pp = e->next;
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
        if (e != s->head) {
            lru_unlink(s, e);
            lru_push(s, e);
        }
        s->hits++;
    } else {
        s->misses++;
        *ticket = s->gen;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static void do_grow(struct stripe *s) {
    size_t nb = s->nb * 2;
    struct ment **b = calloc(nb, sizeof(*b));
    if (!b) return; /* longer chains, still correct */
    for (size_t i = 0; i < s->nb; i++)
        for (struct ment *e = s->b[i], *nx; e; e = nx) {
            nx = e->next;
            size_t k = (size_t)((e->hv / NSTRIPES) & (nb - 1));
            e->next = b[k];
            b[k] = e;
        }
    free(s->b);
    s->b = b;
    s->nb = nb;
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
    while (s->bytes + need > s->budget && s->tail) {
        struct ment *v = s->tail;
        do_remove(s, do_find(s, v->kind, v->data, v->klen, v->hv));
        s->evict++;
    }
    if (s->n >= s->nb) do_grow(s);
    size_t k = bucket_of(s, hv);
    e->next = s->b[k];
    s->b[k] = e;
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
