/* L1 key table (striped locks), object state machine, LRU / IsolatedLRU lists and eviction.
 *
 * Layout. The table is split into a power-of-two number of stripes; a key's stripe and its
 * bucket come from one 64-bit mix of the key. Each stripe owns a chained hash table that grows
 * by doubling under the stripe lock. Every entry is on exactly one list, guarded by the LRU
 * lock: the staging list (insertion order = write-deadline order, since the write TTL is fixed)
 * while STAGING; when RESIDENT, the global LRU list (policy LRU/noop) or its salt's list
 * (IsolatedLRU). Lists run from the least recently used head to the MRU tail.
 *
 * Eviction without breaking the lock order (stripe -> LRU -> arena). A victim is chosen under the
 * LRU lock, but removing it needs its stripe lock, which must not be taken while holding the LRU
 * lock. So the evictor copies up to EVICT_BATCH keys from the list head (keys are immutable, so
 * reading them under the LRU lock alone is safe), drops the LRU lock, then takes each key's
 * stripe lock, looks the key up again and frees it if it is still resident and unlocked. A
 * locked candidate is moved to the MRU end (it is in use), so repeated passes make progress and
 * a pass over n entries examines each at most once. All counts of victims examined are bounded
 * by the caller (alloc_evict_max, or the list length at the start of a tick).
 *
 * Doomed entries. A forced clear or delete must not free memory a lease holder may still copy
 * (the bytes would then show up in another object, or another object's bytes in a reply). It
 * moves such an entry to state DOOMED instead: the entry stays in its hash chain, so releases
 * and the finishing writer find it by key, but every call that would start a new use (reads,
 * writes, touch, delete, eviction) treats it as absent, and a new writer of the key gets BUSY
 * until it is gone. It leaves its LRU/staging list for the doomed list; the last release, the
 * writer's finish or abort, or the evictor once its lease ran out frees it. Its bytes count
 * for its salt until then, since they are still in use.
 *
 * Name ids. An entry pins its model and salt ids (per-id object counts under the LRU lock); a
 * name with no object left is dropped only when its table is full and a new name needs the
 * room. Ids are dropped under the LRU lock, which is also what a store holds while it checks
 * that its key's generations are still current and counts its object in. */
#include "base/errbuf.h"
#include "server/l1/l1.h"

#include <assert.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/htab.h"
#include "base/log.h"
#include "server/l1/arena.h"

#define ENTRY_MAGIC      0x4c45u     /* "LE" */
#define L1_MAGIC         0x4c314341u /* "L1CA" */
#define EVICT_BATCH      8
#define MAX_READERS      UINT32_MAX
#define MAX_OBJECT_BYTES UINT32_MAX

#ifndef NDEBUG
#define CHECK_ENTRY(e) assert((e)->magic == ENTRY_MAGIC)
#define CHECK_L1(l)    assert((l) && (l)->magic == L1_MAGIC)
#else
#define CHECK_ENTRY(e) ((void)0)
#define CHECK_L1(l)    ((void)0)
#endif

enum { ST_STAGING = 1, ST_RESIDENT = 2, ST_DOOMED = 3 };
enum {
    F_TEMP = 1,   /* freed at its last read release (prefetched data) */
    F_WRITER = 2, /* DOOMED while STAGING: its writer still holds the write lease */
    F_LCOUNT = 4  /* its bytes are in its salt's locked_bytes (IsolatedLRU) */
};
#define NO_NAME 0xffffu /* the id of a name l1_key_lookup did not find: above every real id */

struct l1_entry {
    uint16_t magic;
    uint8_t state;
    uint8_t flags;
    /* Read locks: 32 bits, so that no client can fill them (sessions are held to a memory
     * budget, a session locks an object at most once with at most 1024 readers); a 16-bit count
     * was filled by 64 lookups, making another tenant's objects unreadable. */
    uint32_t readers;
    struct l1_key key;     /* immutable while in the table */
    struct htab_node hn;   /* bucket chain: stripe lock */
    struct l1_entry *prev; /* list links: LRU lock */
    struct l1_entry *next;
    uint64_t deadline;  /* write lease (STAGING) or read lease (RESIDENT, readers > 0) */
    uint32_t off_units; /* arena offset in units */
    uint32_t size;      /* bytes requested by the writer */
    uint32_t token;     /* write token of the current writer */
    uint32_t touched;   /* last LRU move, now_ns >> 20 (about 1 ms), wraps */
};

struct l1_list {
    struct l1_entry *head, *tail;
    uint64_t n;
};

struct l1_salt {
    /* LRU lock */
    struct l1_list list; /* IsolatedLRU only */
    uint64_t bytes;
    uint64_t objects;      /* resident + staging + doomed: pins the salt's name id */
    uint64_t locked_bytes; /* IsolatedLRU: bytes of objects with F_LCOUNT */
    /* atomics */
    _Atomic uint64_t limit; /* cached from the quota table */
    _Atomic uint64_t read_chunks, write_chunks, evicted_chunks;
};

/* The stripe's table is indexed by key_hash >> stripe_bits (the low bits chose the stripe). */
struct stripe {
    pthread_mutex_t mu;
    struct htab t;
} __attribute__((aligned(64)));

struct l1 {
    uint32_t magic;
    struct l1_config cfg;
    struct arena *arena;
    uint32_t unit_shift;
    struct stripe *stripes;
    uint32_t nstripes;
    uint32_t stripe_bits;
    struct keys_intern *models, *salts_names;
    struct logger *log;
    _Atomic uint32_t next_token;

    pthread_mutex_t lru_mu;
    /* LRU lock */
    struct l1_list lru;      /* LRU / noop */
    struct l1_list staging;  /* STAGING entries, oldest first */
    struct l1_list doomed;   /* DOOMED entries, oldest first */
    struct l1_salt *salts;   /* [max_salts] */
    uint64_t *model_objects; /* [max_models]: objects per model id, pins the id */
    uint64_t n_resident, n_staging, staging_bytes, n_temp, n_doomed;

    _Atomic uint64_t read_chunks, write_chunks, evicted_chunks, alloc_failures;
    _Atomic uint64_t reclaimed, ticks, triggered;
};

static inline void cnt_add(_Atomic uint64_t *c, uint64_t v) {
    atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}
static inline uint64_t cnt_get(_Atomic uint64_t *c) {
    return atomic_load_explicit(c, memory_order_relaxed);
}

/* ---- keys and stripes -------------------------------------------------------------------- */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t key_hash(const struct l1_key *k) {
    uint64_t w[6];
    memcpy(w, k, sizeof(w));
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 6; i++) h = mix64(h ^ w[i]) + (uint64_t)i;
    return h;
}
_Static_assert(sizeof(struct l1_key) == 48, "l1_key is six 64-bit words");

static inline bool key_eq(const struct l1_key *a, const struct l1_key *b) {
    return memcmp(a, b, sizeof(*a)) == 0;
}

static inline struct stripe *stripe_of(struct l1 *l1, uint64_t h) {
    return &l1->stripes[h & (l1->nstripes - 1)];
}

#define ENTRY_OF(n) HTAB_ENTRY(n, struct l1_entry, hn)

/* The stripe table's hash of an entry, recomputed from its key when the table grows, so entries
 * do not carry it. */
static uint64_t entry_rehash(const struct htab_node *n, void *arg) {
    const struct l1 *l1 = arg;
    return key_hash(&ENTRY_OF(n)->key) >> l1->stripe_bits;
}

/* Caller holds s->mu. */
static struct l1_entry *do_find(struct l1 *l1, struct stripe *s, const struct l1_key *k,
                                uint64_t h) {
    for (struct htab_node *n = *htab_bucket(&s->t, h >> l1->stripe_bits); n; n = n->next) {
        struct l1_entry *e = ENTRY_OF(n);
        CHECK_ENTRY(e);
        if (key_eq(&e->key, k)) return e;
    }
    return NULL;
}

/* Caller holds s->mu. The table doubles when the load factor passes 1; on allocation failure it
 * keeps working with longer chains. */
static void do_insert(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h) {
    htab_insert(&s->t, &e->hn, h >> l1->stripe_bits);
}

/* Caller holds s->mu. */
static void do_unhash(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h) {
    htab_remove(&s->t, &e->hn, h >> l1->stripe_bits);
}

/* ---- lists (caller holds the LRU lock) ----------------------------------------------------- */

static void do_list_push(struct l1_list *l, struct l1_entry *e) {
    e->next = NULL;
    e->prev = l->tail;
    if (l->tail)
        l->tail->next = e;
    else
        l->head = e;
    l->tail = e;
    l->n++;
}

static void do_list_unlink(struct l1_list *l, struct l1_entry *e) {
    if (e->prev)
        e->prev->next = e->next;
    else
        l->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        l->tail = e->prev;
    e->prev = e->next = NULL;
    l->n--;
}

static inline struct l1_list *resident_list(struct l1 *l1, const struct l1_entry *e) {
    return l1->cfg.policy == L1_POLICY_ISOLATED_LRU ? &l1->salts[e->key.salt_id].list : &l1->lru;
}

static inline uint64_t rounded(const struct l1 *l1, uint64_t size) {
    return arena_rounded(l1->arena, size);
}

/* ---- entry life cycle (caller holds the entry's stripe lock) ------------------------------ */

static inline bool is_locked(const struct l1_entry *e, uint64_t now) {
    if (e->state == ST_STAGING || (e->state == ST_DOOMED && (e->flags & F_WRITER)))
        return e->deadline > now;
    return e->readers > 0 && e->deadline > now;
}

static bool do_count_lock(struct l1 *l1, struct l1_entry *e);

/* Caller holds the LRU lock. Takes the entry's bytes out of its salt's locked bytes. */
static void do_uncount_lock(struct l1 *l1, struct l1_entry *e) {
    if (!(e->flags & F_LCOUNT)) return;
    l1->salts[e->key.salt_id].locked_bytes -= rounded(l1, e->size);
    e->flags &= (uint8_t)~F_LCOUNT;
}

/* Tells the listener about a non-temporary entry that turns resident or leaves. The caller holds
 * the entry's stripe mutex; the entry still counts for its names, so they are valid. */
static void do_notify(struct l1 *l1, const struct l1_entry *e, bool present) {
    if (!l1->cfg.listener.on_change || (e->flags & F_TEMP) || e->state != ST_RESIDENT) return;
    const char *model = keys_intern_str(l1->models, e->key.model_id);
    const char *salt = keys_intern_str(l1->salts_names, e->key.salt_id);
    l1->cfg.listener.on_change(l1->cfg.listener.arg, &e->key, model ? model : "", salt ? salt : "",
                               present);
}

/* Unhashes, unlists and frees an entry and its memory. */
static void do_remove(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h) {
    CHECK_ENTRY(e);
    do_notify(l1, e, false);
    do_unhash(l1, s, e, h);
    uint64_t bytes = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    struct l1_salt *salt = &l1->salts[e->key.salt_id];
    if (e->state == ST_STAGING) {
        do_list_unlink(&l1->staging, e);
        l1->n_staging--;
        l1->staging_bytes -= bytes;
    } else if (e->state == ST_DOOMED) {
        do_list_unlink(&l1->doomed, e);
        l1->n_doomed--;
    } else {
        do_list_unlink(resident_list(l1, e), e);
        l1->n_resident--;
        if (e->flags & F_TEMP) l1->n_temp--;
    }
    salt->bytes -= bytes;
    salt->objects--;
    l1->model_objects[e->key.model_id]--;
    do_uncount_lock(l1, e);
    pthread_mutex_unlock(&l1->lru_mu);
    if (arena_free(l1->arena, (uint64_t)e->off_units << l1->unit_shift, e->size) != 0 && l1->log)
        log_error(l1->log, "arena refused to free an L1 object at unit %u (%u bytes)", e->off_units,
                  e->size);
    e->magic = 0;
    free(e);
}

/* Takes a locked entry out of view without freeing its memory (see "Doomed entries"). */
static void do_doom(struct l1 *l1, struct l1_entry *e) {
    CHECK_ENTRY(e);
    do_notify(l1, e, false);
    uint64_t bytes = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    if (e->state == ST_STAGING) {
        do_list_unlink(&l1->staging, e);
        l1->n_staging--;
        l1->staging_bytes -= bytes;
        e->flags |= F_WRITER;
    } else {
        do_list_unlink(resident_list(l1, e), e);
        l1->n_resident--;
        if (e->flags & F_TEMP) l1->n_temp--;
    }
    do_list_push(&l1->doomed, e);
    l1->n_doomed++;
    pthread_mutex_unlock(&l1->lru_mu);
    e->state = ST_DOOMED;
}

/* Removes an entry for a forced clear or delete: frees it, or dooms it while it is locked. */
static void do_remove_forced(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h,
                             uint64_t now) {
    if (!is_locked(e, now))
        do_remove(l1, s, e, h);
    else if (e->state != ST_DOOMED)
        do_doom(l1, e);
}

/* Moves a resident entry to the MRU end unless it moved within touch_interval. */
static void do_touch(struct l1 *l1, struct l1_entry *e, uint64_t now, bool force) {
    uint32_t t = (uint32_t)(now >> 20);
    uint32_t iv = (uint32_t)(l1->cfg.touch_interval_ns >> 20);
    if (!force && l1->cfg.touch_interval_ns && (uint32_t)(t - e->touched) < iv) return;
    e->touched = t;
    pthread_mutex_lock(&l1->lru_mu);
    struct l1_list *l = resident_list(l1, e);
    if (l->tail != e) {
        do_list_unlink(l, e);
        do_list_push(l, e);
    }
    pthread_mutex_unlock(&l1->lru_mu);
}

static void fill_ref(struct l1 *l1, const struct l1_entry *e, struct l1_ref *out) {
    if (!out) return;
    out->data = arena_ptr(l1->arena, (uint64_t)e->off_units << l1->unit_shift);
    out->size = e->size;
    out->token = e->token;
}

static uint32_t new_token(struct l1 *l1) {
    uint32_t t;
    do t = atomic_fetch_add_explicit(&l1->next_token, 1, memory_order_relaxed);
    while (t == 0);
    return t;
}

/* ---- eviction ------------------------------------------------------------------------------ */

/* Which list a victim comes from. salt < 0 means the global LRU list, otherwise a salt's list;
 * -2 means the staging list (reclaiming expired write leases). */
#define LIST_GLOBAL  (-1)
#define LIST_STAGING (-2)
#define LIST_DOOMED  (-3)

static struct l1_list *list_by_id(struct l1 *l1, int id) {
    if (id == LIST_GLOBAL) return &l1->lru;
    if (id == LIST_STAGING) return &l1->staging;
    if (id == LIST_DOOMED) return &l1->doomed;
    return &l1->salts[id].list;
}

/* Examines up to EVICT_BATCH entries from the head of a list and frees the evictable ones
 * (staging list: expired write leases only), stopping once max_bytes were freed. Adds to
 * *examined and *bytes, returns the objects freed. Takes and releases the locks itself; the
 * caller holds none. */
static uint64_t evict_batch(struct l1 *l1, int list_id, uint64_t now, uint64_t max_bytes,
                            uint64_t *examined, uint64_t *bytes, bool *stop) {
    uint64_t got = 0;
    struct l1_key keys[EVICT_BATCH];
    int n = 0;
    pthread_mutex_lock(&l1->lru_mu);
    for (struct l1_entry *e = list_by_id(l1, list_id)->head; e && n < EVICT_BATCH; e = e->next)
        keys[n++] = e->key;
    pthread_mutex_unlock(&l1->lru_mu);
    if (n == 0) {
        *stop = true;
        return 0;
    }
    uint64_t freed = 0;
    for (int i = 0; i < n; i++) {
        uint64_t h = key_hash(&keys[i]);
        struct stripe *s = stripe_of(l1, h);
        pthread_mutex_lock(&s->mu);
        struct l1_entry *e = do_find(l1, s, &keys[i], h);
        if (e && list_id == LIST_STAGING) {
            if (e->state == ST_STAGING && e->deadline <= now) {
                got += rounded(l1, e->size);
                do_remove(l1, s, e, h);
                freed++;
                cnt_add(&l1->reclaimed, 1);
            } else if (e->state == ST_STAGING) {
                *stop = true; /* the rest of the list expires later */
            }
        } else if (e && e->state == ST_RESIDENT) {
            if (!is_locked(e, now)) {
                uint16_t salt = e->key.salt_id;
                got += rounded(l1, e->size);
                do_remove(l1, s, e, h);
                freed++;
                cnt_add(&l1->evicted_chunks, 1);
                cnt_add(&l1->salts[salt].evicted_chunks, 1);
            } else {
                do_touch(l1, e, now, true); /* in use: out of the evictor's way */
            }
        }
        pthread_mutex_unlock(&s->mu);
        (*examined)++;
        if (*stop || got >= max_bytes) break;
    }
    *bytes += got;
    return freed;
}

/* Frees expired staging entries; returns how many. */
static uint64_t reclaim_staging(struct l1 *l1, uint64_t now, uint64_t max_examined) {
    uint64_t examined = 0, bytes = 0, freed = 0;
    bool stop = false;
    while (!stop && examined < max_examined)
        freed += evict_batch(l1, LIST_STAGING, now, UINT64_MAX, &examined, &bytes, &stop);
    return freed;
}

/* IsolatedLRU: the list to take the next victim from -- the salt furthest over its limit, else
 * `own` (the allocating salt), else the salt with the most bytes. -1 when nothing is listed. */
static int pick_salt(struct l1 *l1, int own) {
    uint32_t n = keys_intern_count(l1->salts_names);
    int best_over = -1, best_big = -1;
    uint64_t over_max = 0, big_max = 0;
    pthread_mutex_lock(&l1->lru_mu);
    for (uint32_t i = 0; i < n; i++) {
        struct l1_salt *s = &l1->salts[i];
        if (s->list.n == 0) continue;
        uint64_t lim = atomic_load_explicit(&s->limit, memory_order_relaxed);
        if (s->bytes > lim && s->bytes - lim > over_max) {
            over_max = s->bytes - lim;
            best_over = (int)i;
        }
        if (s->bytes > big_max) {
            big_max = s->bytes;
            best_big = (int)i;
        }
    }
    bool own_ok = own >= 0 && l1->salts[own].list.n > 0;
    pthread_mutex_unlock(&l1->lru_mu);
    if (best_over >= 0) return best_over;
    if (own_ok) return own;
    return best_big;
}

/* Allocates, evicting LRU-first when the arena is full. Caller holds no lock. */
static int alloc_evict(struct l1 *l1, uint64_t size, int salt, uint64_t now, uint64_t *off) {
    if (arena_alloc(l1->arena, size, off) == 0) return 0;
    if (l1->cfg.policy == L1_POLICY_NOOP) return -1;
    if (reclaim_staging(l1, now, l1->cfg.alloc_evict_max) > 0 &&
        arena_alloc(l1->arena, size, off) == 0)
        return 0;
    uint64_t examined = 0, bytes = 0;
    while (examined < l1->cfg.alloc_evict_max) {
        int id = LIST_GLOBAL;
        if (l1->cfg.policy == L1_POLICY_ISOLATED_LRU) {
            id = pick_salt(l1, salt);
            if (id < 0) return -1;
        }
        bool stop = false;
        uint64_t freed = evict_batch(l1, id, now, 1, &examined, &bytes, &stop);
        if (stop && freed == 0) return -1; /* list empty */
        if (freed && arena_alloc(l1->arena, size, off) == 0) return 0;
    }
    return arena_alloc(l1->arena, size, off);
}

/* ---- public API ---------------------------------------------------------------------------- */

int l1_create(const struct l1_config *cfg, struct l1 **out, char *err, size_t errlen) {
    struct l1 *l1 = calloc(1, sizeof(*l1));
    if (!l1) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    l1->cfg = *cfg;
    struct l1_config *c = &l1->cfg;
    if (c->trigger_watermark <= 0 || c->trigger_watermark > 1) c->trigger_watermark = 0.8;
    if (c->eviction_ratio <= 0 || c->eviction_ratio >= 1) c->eviction_ratio = 0.1;
    if (!c->read_ttl_ns) c->read_ttl_ns = 300ull * 1000000000ull;
    if (!c->write_ttl_ns) c->write_ttl_ns = 600ull * 1000000000ull;
    if (!c->stripes) c->stripes = 1024;
    if (c->stripes > (1u << 20)) c->stripes = 1u << 20;
    if (!c->alloc_evict_max) c->alloc_evict_max = 4096;
    if (!c->max_salts) c->max_salts = 4096;
    if (!c->max_models) c->max_models = 1024;
    if (c->max_salts > UINT16_MAX) c->max_salts = UINT16_MAX;
    if (c->max_models > UINT16_MAX) c->max_models = UINT16_MAX;
    if (c->policy != L1_POLICY_LRU && c->policy != L1_POLICY_ISOLATED_LRU &&
        c->policy != L1_POLICY_NOOP) {
        errbuf_set(err, errlen, "unknown eviction policy %d", (int)c->policy);
        free(l1);
        return -1;
    }
    l1->magic = L1_MAGIC;
    l1->log = log_get("lmcache.l1");
    atomic_init(&l1->next_token, 1);
    struct arena_config ac = {.size_bytes = c->size_bytes,
                              .unit = c->unit,
                              .use_hugepages = c->use_hugepages,
                              .lock_memory = c->lock_memory};
    if (arena_create(&ac, &l1->arena, err, errlen) != 0) {
        free(l1);
        return -1;
    }
    l1->unit_shift = (uint32_t)__builtin_ctz(arena_unit(l1->arena));
    l1->nstripes = 1;
    while (l1->nstripes < c->stripes) l1->nstripes <<= 1;
    l1->stripe_bits = (uint32_t)__builtin_ctz(l1->nstripes);
    l1->stripes = aligned_alloc(64, l1->nstripes * sizeof(struct stripe));
    l1->models = keys_intern_create(c->max_models);
    l1->salts_names = keys_intern_create(c->max_salts);
    l1->salts = calloc(c->max_salts, sizeof(struct l1_salt));
    l1->model_objects = calloc(c->max_models, sizeof(*l1->model_objects));
    if (!l1->stripes || !l1->models || !l1->salts_names || !l1->salts || !l1->model_objects ||
        pthread_mutex_init(&l1->lru_mu, NULL) != 0) {
        errbuf_set(err, errlen, "out of memory for the L1 table");
        goto fail;
    }
    memset(l1->stripes, 0, l1->nstripes * sizeof(struct stripe));
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        if (htab_init(&s->t, 16, entry_rehash, l1) != 0 || pthread_mutex_init(&s->mu, NULL) != 0) {
            errbuf_set(err, errlen, "out of memory for the L1 table");
            for (uint32_t j = 0; j <= i; j++) htab_fini(&l1->stripes[j].t);
            for (uint32_t j = 0; j < i; j++) pthread_mutex_destroy(&l1->stripes[j].mu);
            pthread_mutex_destroy(&l1->lru_mu);
            free(l1->stripes);
            l1->stripes = NULL;
            goto fail;
        }
    }
    *out = l1;
    if (l1->log)
        log_info(l1->log, "L1: %llu bytes, %u stripes, policy %s%s",
                 (unsigned long long)arena_total_bytes(l1->arena), l1->nstripes,
                 c->policy == L1_POLICY_LRU            ? "LRU"
                 : c->policy == L1_POLICY_ISOLATED_LRU ? "IsolatedLRU"
                                                       : "noop",
                 c->use_hugepages ? " (huge pages requested)" : "");
    return 0;
fail:
    free(l1->stripes);
    keys_intern_destroy(l1->models);
    keys_intern_destroy(l1->salts_names);
    free(l1->salts);
    free(l1->model_objects);
    arena_destroy(l1->arena);
    free(l1);
    return -1;
}

void l1_destroy(struct l1 *l1) {
    if (!l1) return;
    CHECK_L1(l1);
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        for (size_t b = 0; b < s->t.nb; b++) {
            for (struct htab_node *n = s->t.b[b], *next; n; n = next) {
                next = n->next;
                free(ENTRY_OF(n));
            }
        }
        htab_fini(&s->t);
        pthread_mutex_destroy(&s->mu);
    }
    free(l1->stripes);
    pthread_mutex_destroy(&l1->lru_mu);
    keys_intern_destroy(l1->models);
    keys_intern_destroy(l1->salts_names);
    free(l1->salts);
    free(l1->model_objects);
    arena_destroy(l1->arena);
    l1->magic = 0;
    free(l1);
}

/* Drops every name of one table that no object uses; returns how many. The LRU lock excludes
 * a store counting in its object meanwhile (it checks its key's generations under it). */
static uint32_t reclaim_names(struct l1 *l1, bool salts) {
    struct keys_intern *t = salts ? l1->salts_names : l1->models;
    uint32_t n = keys_intern_count(t), dropped = 0;
    pthread_mutex_lock(&l1->lru_mu);
    for (uint32_t i = 0; i < n; i++) {
        if ((salts ? l1->salts[i].objects : l1->model_objects[i]) != 0 || !keys_intern_str(t, i))
            continue;
        if (keys_intern_remove(t, i) != 0) continue;
        dropped++;
        if (!salts) continue;
        struct l1_salt *sa = &l1->salts[i];
        sa->bytes = sa->locked_bytes = 0;
        atomic_store_explicit(&sa->limit, 0, memory_order_relaxed);
        atomic_store_explicit(&sa->read_chunks, 0, memory_order_relaxed);
        atomic_store_explicit(&sa->write_chunks, 0, memory_order_relaxed);
        atomic_store_explicit(&sa->evicted_chunks, 0, memory_order_relaxed);
    }
    pthread_mutex_unlock(&l1->lru_mu);
    if (l1->log && dropped)
        log_info(l1->log, "%u unused %s dropped from a full name table", dropped,
                 salts ? "cache salts" : "model names");
    return dropped;
}

static int intern_name(struct l1 *l1, bool salts, const char *s, uint32_t *id, uint32_t *gen) {
    struct keys_intern *t = salts ? l1->salts_names : l1->models;
    if (keys_intern(t, s, strlen(s), id, gen) == 0) return 0;
    if (reclaim_names(l1, salts) == 0) return -1;
    return keys_intern(t, s, strlen(s), id, gen);
}

static void key_fill(const struct keys_object_key *k, uint32_t mid, uint32_t mgen, uint32_t sid,
                     uint32_t sgen, struct l1_key *out) {
    memset(out, 0, sizeof(*out));
    memcpy(out->hash, k->hash, k->hash_len);
    out->hash_len = k->hash_len;
    out->kv_rank = k->kv_rank;
    out->object_group_id = k->object_group_id;
    out->model_id = (uint16_t)mid;
    out->salt_id = (uint16_t)sid;
    out->model_gen = (uint8_t)mgen;
    out->salt_gen = (uint16_t)sgen;
}

int l1_key_make(struct l1 *l1, const struct keys_object_key *k, struct l1_key *out) {
    CHECK_L1(l1);
    uint32_t mid, sid, mgen, sgen;
    if (intern_name(l1, false, k->model_name, &mid, &mgen) != 0 ||
        intern_name(l1, true, k->cache_salt, &sid, &sgen) != 0)
        return L1_ERR_TOO_MANY_NAMES;
    key_fill(k, mid, mgen, sid, sgen, out);
    return L1_OK;
}

int l1_key_lookup(struct l1 *l1, const struct keys_object_key *k, struct l1_key *out) {
    CHECK_L1(l1);
    uint32_t mid, sid, mgen, sgen;
    if (keys_intern_find(l1->models, k->model_name, strlen(k->model_name), &mid, &mgen) != 0 ||
        keys_intern_find(l1->salts_names, k->cache_salt, strlen(k->cache_salt), &sid, &sgen) != 0) {
        mid = sid = NO_NAME;
        mgen = sgen = 0;
    }
    key_fill(k, mid, mgen, sid, sgen, out);
    return L1_OK;
}

const char *l1_model_name(struct l1 *l1, uint16_t id) { return keys_intern_str(l1->models, id); }
const char *l1_salt_name(struct l1 *l1, uint16_t id) {
    return keys_intern_str(l1->salts_names, id);
}

static bool key_ok(struct l1 *l1, const struct l1_key *k) {
    return k->salt_id < keys_intern_count(l1->salts_names) &&
           k->model_id < keys_intern_count(l1->models);
}

/* Caller holds the LRU lock. Whether the key's names are still the ones it was made with. */
static bool do_names_current(struct l1 *l1, const struct l1_key *k) {
    return keys_intern_str(l1->salts_names, k->salt_id) &&
           (uint16_t)keys_intern_gen(l1->salts_names, k->salt_id) == k->salt_gen &&
           keys_intern_str(l1->models, k->model_id) &&
           (uint8_t)keys_intern_gen(l1->models, k->model_id) == k->model_gen;
}

int l1_reserve_write(struct l1 *l1, const struct l1_key *key, uint64_t size, bool temporary,
                     uint64_t now, struct l1_ref *out) {
    CHECK_L1(l1);
    if (size == 0 || size > MAX_OBJECT_BYTES || size > arena_total_bytes(l1->arena) ||
        !key_ok(l1, key))
        return L1_ERR_INVAL;
    uint64_t h = key_hash(key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    struct l1_entry *e = do_find(l1, s, key, h);
    if (e && e->state == ST_DOOMED) {
        if (is_locked(e, now)) {
            pthread_mutex_unlock(&s->mu);
            return L1_ERR_BUSY;
        }
        do_remove(l1, s, e, h); /* a doomed entry whose lease ran out */
        e = NULL;
    }
    if (e) {
        if (e->state == ST_RESIDENT) {
            pthread_mutex_unlock(&s->mu);
            return L1_EXISTS;
        }
        if (e->deadline > now) {
            pthread_mutex_unlock(&s->mu);
            return L1_ERR_BUSY;
        }
        /* An expired write lease: the entry goes to the new writer. */
        cnt_add(&l1->reclaimed, 1);
        if (rounded(l1, e->size) == rounded(l1, size)) {
            e->token = new_token(l1);
            e->size = (uint32_t)size;
            e->flags = temporary ? F_TEMP : 0;
            e->deadline = now + l1->cfg.write_ttl_ns;
            pthread_mutex_lock(&l1->lru_mu);
            do_list_unlink(&l1->staging, e);
            do_list_push(&l1->staging, e);
            pthread_mutex_unlock(&l1->lru_mu);
            fill_ref(l1, e, out);
            pthread_mutex_unlock(&s->mu);
            return L1_OK;
        }
        do_remove(l1, s, e, h);
    }
    pthread_mutex_unlock(&s->mu);

    struct l1_entry *ne = malloc(sizeof(*ne));
    if (!ne) return L1_ERR_NOMEM;
    uint64_t off;
    if (alloc_evict(l1, size, key->salt_id, now, &off) != 0) {
        free(ne);
        cnt_add(&l1->alloc_failures, 1);
        return L1_ERR_NOMEM;
    }
    memset(ne, 0, sizeof(*ne));
    ne->magic = ENTRY_MAGIC;
    ne->state = ST_STAGING;
    ne->flags = temporary ? F_TEMP : 0;
    ne->key = *key;
    ne->off_units = (uint32_t)(off >> l1->unit_shift);
    ne->size = (uint32_t)size;
    ne->token = new_token(l1);
    ne->deadline = now + l1->cfg.write_ttl_ns;
    ne->touched = (uint32_t)(now >> 20);

    pthread_mutex_lock(&s->mu);
    e = do_find(l1, s, key, h);
    if (e) { /* another writer won the race while we allocated */
        int rc = e->state == ST_RESIDENT ? L1_EXISTS : L1_ERR_BUSY;
        pthread_mutex_unlock(&s->mu);
        arena_free(l1->arena, off, size);
        free(ne);
        return rc;
    }
    uint64_t bytes = rounded(l1, size);
    pthread_mutex_lock(&l1->lru_mu);
    if (!do_names_current(l1, key)) { /* a name was dropped since the key was made */
        pthread_mutex_unlock(&l1->lru_mu);
        pthread_mutex_unlock(&s->mu);
        arena_free(l1->arena, off, size);
        free(ne);
        return L1_ERR_TOO_MANY_NAMES;
    }
    do_insert(l1, s, ne, h);
    l1->model_objects[key->model_id]++;
    do_list_push(&l1->staging, ne);
    l1->n_staging++;
    l1->staging_bytes += bytes;
    l1->salts[key->salt_id].bytes += bytes;
    l1->salts[key->salt_id].objects++;
    pthread_mutex_unlock(&l1->lru_mu);
    fill_ref(l1, ne, out);
    pthread_mutex_unlock(&s->mu);
    return L1_OK;
}

int l1_finish_write(struct l1 *l1, const struct l1_key *key, uint32_t token, uint32_t read_locks,
                    uint64_t now) {
    CHECK_L1(l1);
    uint64_t h = key_hash(key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    struct l1_entry *e = do_find(l1, s, key, h);
    if (e && e->state == ST_DOOMED && (e->flags & F_WRITER) && e->token == token) {
        do_remove(l1, s, e, h); /* cleared while being written: its writer is done with it */
        e = NULL;
    }
    if (!e || e->state != ST_STAGING || e->token != token) {
        pthread_mutex_unlock(&s->mu);
        return L1_ERR_NOT_FOUND;
    }
    if (e->deadline <= now) {
        pthread_mutex_unlock(&s->mu);
        return L1_ERR_EXPIRED;
    }
    e->state = ST_RESIDENT;
    e->readers = read_locks;
    int rc = L1_OK;
    if (e->readers && !do_count_lock(l1, e)) {
        e->readers = 0;
        rc = L1_ERR_OVER_QUOTA;
    }
    e->deadline = e->readers ? now + l1->cfg.read_ttl_ns : 0;
    e->touched = (uint32_t)(now >> 20);
    uint64_t bytes = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    do_list_unlink(&l1->staging, e);
    do_list_push(resident_list(l1, e), e);
    l1->n_staging--;
    l1->staging_bytes -= bytes;
    l1->n_resident++;
    if (e->flags & F_TEMP) l1->n_temp++;
    pthread_mutex_unlock(&l1->lru_mu);
    cnt_add(&l1->write_chunks, 1);
    cnt_add(&l1->salts[key->salt_id].write_chunks, 1);
    do_notify(l1, e, true);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Locks the stripe of key and finds its entry (NULL when absent). The caller unlocks (*sp)->mu. */
static struct l1_entry *lock_find(struct l1 *l1, const struct l1_key *key, struct stripe **sp,
                                  uint64_t *hp) {
    CHECK_L1(l1);
    uint64_t h = key_hash(key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    *sp = s;
    *hp = h;
    return do_find(l1, s, key, h);
}

int l1_abort_write(struct l1 *l1, const struct l1_key *key, uint32_t token) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->token == token &&
        (e->state == ST_STAGING || (e->state == ST_DOOMED && (e->flags & F_WRITER)))) {
        do_remove(l1, s, e, h);
        rc = L1_OK;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Caller holds the stripe lock. IsolatedLRU: counts e's bytes into its salt's locked bytes
 * unless that would exceed the salt's quota (returns false). The limit is re-read from the
 * quota table before refusing, so a quota set moments ago already counts. */
static bool do_count_lock(struct l1 *l1, struct l1_entry *e) {
    if (l1->cfg.policy != L1_POLICY_ISOLATED_LRU || (e->flags & F_LCOUNT)) return true;
    uint64_t b = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    struct l1_salt *sa = &l1->salts[e->key.salt_id];
    uint64_t lim = atomic_load_explicit(&sa->limit, memory_order_relaxed);
    if (sa->locked_bytes + b > lim && l1->cfg.quota) {
        const char *name = keys_intern_str(l1->salts_names, e->key.salt_id);
        lim = 0;
        if (name) quota_get(l1->cfg.quota, name, &lim);
        atomic_store_explicit(&sa->limit, lim, memory_order_relaxed);
    }
    bool ok = sa->locked_bytes + b <= lim;
    if (ok) sa->locked_bytes += b;
    pthread_mutex_unlock(&l1->lru_mu);
    if (ok) e->flags |= F_LCOUNT;
    return ok;
}

/* Caller holds the stripe lock; e is RESIDENT. Refuses rather than saturate the count (a
 * saturated count would let one holder's release wipe out another's locks): L1_ERR_BUSY, or
 * L1_ERR_OVER_QUOTA from do_count_lock. */
static int do_take_read(struct l1 *l1, struct l1_entry *e, uint32_t n, uint64_t now) {
    uint32_t r = e->deadline > now ? e->readers : 0;
    if (n > MAX_READERS - r) return L1_ERR_BUSY;
    if (n && !do_count_lock(l1, e)) return L1_ERR_OVER_QUOTA;
    e->readers = r + n;
    e->deadline = now + l1->cfg.read_ttl_ns;
    return L1_OK;
}

/* Read counters are bumped once per call, not per key: shared atomics are the one thing two
 * lookups on different stripes would otherwise contend on. */
static void count_reads(struct l1 *l1, uint16_t salt_id, uint64_t n) {
    if (!n) return;
    cnt_add(&l1->read_chunks, n);
    cnt_add(&l1->salts[salt_id].read_chunks, n);
}

static int reserve_read_one(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now,
                            struct l1_ref *out) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state == ST_RESIDENT) {
        rc = do_take_read(l1, e, n, now);
        if (rc == L1_OK) fill_ref(l1, e, out);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_reserve_read(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now,
                    struct l1_ref *out) {
    int rc = reserve_read_one(l1, key, n, now, out);
    if (rc == L1_OK) count_reads(l1, key->salt_id, 1);
    return rc;
}

size_t l1_reserve_read_prefix(struct l1 *l1, const struct l1_key *keys, size_t count, uint32_t n,
                              uint64_t now) {
    size_t i = 0;
    while (i < count && reserve_read_one(l1, &keys[i], n, now, NULL) == L1_OK) i++;
    if (i) count_reads(l1, keys[0].salt_id, i);
    return i;
}

int l1_read_locked(struct l1 *l1, const struct l1_key *key, uint64_t now, struct l1_ref *out) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    /* A doomed entry is still readable by the holders of its read locks. */
    if (e && (e->state == ST_RESIDENT || (e->state == ST_DOOMED && !(e->flags & F_WRITER)))) {
        if (e->readers > 0 && e->deadline > now) {
            fill_ref(l1, e, out);
            rc = L1_OK;
        } else {
            rc = e->state == ST_DOOMED ? L1_ERR_NOT_FOUND : L1_ERR_NOT_READABLE;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_finish_read(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state == ST_DOOMED && !(e->flags & F_WRITER)) {
        rc = L1_OK;
        uint32_t r = e->deadline > now ? e->readers : 0;
        e->readers = r > n ? r - n : 0;
        if (e->readers == 0) do_remove(l1, s, e, h); /* the last user of a cleared object */
    } else if (e && e->state == ST_RESIDENT) {
        rc = L1_OK;
        uint32_t r = e->deadline > now ? e->readers : 0;
        e->readers = r > n ? r - n : 0;
        if (e->readers == 0 && (e->flags & F_TEMP)) {
            do_remove(l1, s, e, h);
        } else {
            if (e->readers == 0 && (e->flags & F_LCOUNT)) {
                pthread_mutex_lock(&l1->lru_mu);
                do_uncount_lock(l1, e);
                pthread_mutex_unlock(&l1->lru_mu);
            }
            do_touch(l1, e, now, false);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_delete(struct l1 *l1, const struct l1_key *key, bool force, uint64_t now) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state != ST_DOOMED) {
        if (!force && is_locked(e, now)) {
            rc = L1_ERR_BUSY;
        } else {
            do_remove_forced(l1, s, e, h, now);
            rc = L1_OK;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_touch(struct l1 *l1, const struct l1_key *key, uint64_t now) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state == ST_RESIDENT) {
        do_touch(l1, e, now, false);
        rc = L1_OK;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

size_t l1_clear(struct l1 *l1, bool force, uint64_t now) {
    CHECK_L1(l1);
    size_t freed = 0;
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        pthread_mutex_lock(&s->mu);
        for (size_t b = 0; b < s->t.nb; b++) {
            for (struct htab_node *n = s->t.b[b], *next; n; n = next) {
                next = n->next;
                struct l1_entry *e = ENTRY_OF(n);
                if (e->state == ST_DOOMED) {
                    if (!is_locked(e, now)) do_remove(l1, s, e, key_hash(&e->key));
                } else if (force || !is_locked(e, now)) {
                    do_remove_forced(l1, s, e, key_hash(&e->key), now);
                    freed++;
                }
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (l1->log && freed)
        log_info(l1->log, "L1 clear%s: %zu objects removed", force ? " (forced)" : "", freed);
    return freed;
}

/* Copies the name of a salt id into buf ("" and false for a free id). Names are dropped only
 * under the LRU lock, so the string stays valid while it is held. */
static bool salt_name_copy(struct l1 *l1, uint32_t id, char buf[KEYS_SALT_MAX + 1]) {
    pthread_mutex_lock(&l1->lru_mu);
    const char *s = keys_intern_str(l1->salts_names, id);
    snprintf(buf, KEYS_SALT_MAX + 1, "%s", s ? s : "");
    pthread_mutex_unlock(&l1->lru_mu);
    return s != NULL;
}

static void refresh_limits(struct l1 *l1) {
    uint32_t n = keys_intern_count(l1->salts_names);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t lim = 0;
        char name[KEYS_SALT_MAX + 1];
        if (!salt_name_copy(l1, i, name)) continue;
        if (l1->cfg.quota) quota_get(l1->cfg.quota, name, &lim);
        atomic_store_explicit(&l1->salts[i].limit, lim, memory_order_relaxed);
    }
}

void l1_quota_changed(struct l1 *l1) {
    CHECK_L1(l1);
    refresh_limits(l1);
}

static uint64_t list_len(struct l1 *l1, int id) {
    pthread_mutex_lock(&l1->lru_mu);
    uint64_t n = list_by_id(l1, id)->n;
    pthread_mutex_unlock(&l1->lru_mu);
    return n;
}

/* Frees doomed entries whose lease ran out (their holders are presumed gone, as for any lapsed
 * lease); the ones still in use move to the end of the list. Returns how many were freed. */
static uint64_t reclaim_doomed(struct l1 *l1, uint64_t now) {
    uint64_t budget = list_len(l1, LIST_DOOMED), examined = 0, freed = 0;
    while (examined < budget) {
        struct l1_key keys[EVICT_BATCH];
        int n = 0;
        pthread_mutex_lock(&l1->lru_mu);
        for (struct l1_entry *e = l1->doomed.head; e && n < EVICT_BATCH; e = e->next)
            keys[n++] = e->key;
        pthread_mutex_unlock(&l1->lru_mu);
        if (n == 0) break;
        for (int i = 0; i < n && examined < budget; i++, examined++) {
            uint64_t h = key_hash(&keys[i]);
            struct stripe *s = stripe_of(l1, h);
            pthread_mutex_lock(&s->mu);
            struct l1_entry *e = do_find(l1, s, &keys[i], h);
            if (e && e->state == ST_DOOMED) {
                if (!is_locked(e, now)) {
                    do_remove(l1, s, e, h);
                    freed++;
                } else {
                    pthread_mutex_lock(&l1->lru_mu);
                    do_list_unlink(&l1->doomed, e);
                    do_list_push(&l1->doomed, e);
                    pthread_mutex_unlock(&l1->lru_mu);
                }
            }
            pthread_mutex_unlock(&s->mu);
        }
    }
    return freed;
}

int l1_evict_tick(struct l1 *l1, uint64_t now, struct l1_tick_report *out) {
    CHECK_L1(l1);
    struct l1_tick_report rep = {0};
    cnt_add(&l1->ticks, 1);
    uint64_t total = arena_total_bytes(l1->arena);
    rep.usage_before = (double)arena_used_bytes(l1->arena) / (double)total;
    rep.reclaimed_staging = reclaim_staging(l1, now, list_len(l1, LIST_STAGING) + EVICT_BATCH);
    rep.reclaimed_staging += reclaim_doomed(l1, now);

    if (l1->cfg.policy == L1_POLICY_ISOLATED_LRU) {
        refresh_limits(l1);
        uint32_t n = keys_intern_count(l1->salts_names);
        for (uint32_t i = 0; i < n; i++) {
            struct l1_salt *sa = &l1->salts[i];
            uint64_t budget = list_len(l1, (int)i) + EVICT_BATCH, examined = 0;
            for (;;) {
                pthread_mutex_lock(&l1->lru_mu);
                uint64_t lim = atomic_load(&sa->limit);
                uint64_t over = sa->bytes > lim ? sa->bytes - lim : 0;
                pthread_mutex_unlock(&l1->lru_mu);
                if (!over || examined >= budget) break;
                bool stop = false;
                uint64_t f =
                    evict_batch(l1, (int)i, now, over, &examined, &rep.evicted_bytes, &stop);
                rep.evicted_objects += f;
                rep.quota_evicted_objects += f;
                if (stop) break;
            }
        }
    }

    if (l1->cfg.policy != L1_POLICY_NOOP &&
        arena_used_bytes(l1->arena) >= (uint64_t)(l1->cfg.trigger_watermark * (double)total)) {
        rep.triggered = true;
        cnt_add(&l1->triggered, 1);
        uint64_t target =
            (uint64_t)((double)total * l1->cfg.trigger_watermark * (1 - l1->cfg.eviction_ratio));
        pthread_mutex_lock(&l1->lru_mu);
        uint64_t budget = l1->n_resident + EVICT_BATCH, examined = 0;
        pthread_mutex_unlock(&l1->lru_mu);
        uint64_t used;
        while ((used = arena_used_bytes(l1->arena)) > target && examined < budget) {
            int id = LIST_GLOBAL;
            if (l1->cfg.policy == L1_POLICY_ISOLATED_LRU && (id = pick_salt(l1, -1)) < 0) break;
            bool stop = false;
            uint64_t f =
                evict_batch(l1, id, now, used - target, &examined, &rep.evicted_bytes, &stop);
            rep.evicted_objects += f;
            if (stop && f == 0 && l1->cfg.policy != L1_POLICY_ISOLATED_LRU) break;
        }
    }
    rep.usage_after = (double)arena_used_bytes(l1->arena) / (double)total;
    if (l1->log && rep.evicted_objects)
        log_debug(l1->log, "evictor: %llu objects (%llu bytes) evicted, usage %.3f -> %.3f",
                  (unsigned long long)rep.evicted_objects, (unsigned long long)rep.evicted_bytes,
                  rep.usage_before, rep.usage_after);
    if (out) *out = rep;
    return 0;
}

void l1_get_stats(struct l1 *l1, uint64_t now, struct l1_stats *st) {
    CHECK_L1(l1);
    memset(st, 0, sizeof(*st));
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        pthread_mutex_lock(&s->mu);
        for (size_t b = 0; b < s->t.nb; b++)
            for (struct htab_node *n = s->t.b[b]; n; n = n->next) {
                const struct l1_entry *e = ENTRY_OF(n);
                if (e->state == ST_DOOMED || !is_locked(e, now)) continue;
                if (e->state == ST_STAGING)
                    st->write_locked_objects++;
                else
                    st->read_locked_objects++;
            }
        pthread_mutex_unlock(&s->mu);
    }
    st->locked_objects = st->read_locked_objects + st->write_locked_objects;
    pthread_mutex_lock(&l1->lru_mu);
    st->objects = l1->n_resident;
    st->staging_objects = l1->n_staging;
    st->staging_bytes = l1->staging_bytes;
    st->temporary_objects = l1->n_temp;
    st->doomed_objects = l1->n_doomed;
    pthread_mutex_unlock(&l1->lru_mu);
    struct arena_stats as;
    arena_get_stats(l1->arena, &as);
    st->bytes_used = as.used_bytes;
    st->bytes_total = as.total_bytes;
    st->usage_ratio = (double)as.used_bytes / (double)as.total_bytes;
    st->hugetlb = as.hugetlb;
    st->read_chunks = cnt_get(&l1->read_chunks);
    st->write_chunks = cnt_get(&l1->write_chunks);
    st->evicted_chunks = cnt_get(&l1->evicted_chunks);
    st->alloc_failures = cnt_get(&l1->alloc_failures);
    st->reclaimed_staging = cnt_get(&l1->reclaimed);
    st->eviction_ticks = cnt_get(&l1->ticks);
    st->eviction_triggered = cnt_get(&l1->triggered);
}

void l1_salt_foreach(struct l1 *l1,
                     void (*fn)(const char *salt, const struct l1_salt_stats *st, void *arg),
                     void *arg) {
    CHECK_L1(l1);
    uint32_t n = keys_intern_count(l1->salts_names);
    for (uint32_t i = 0; i < n; i++) {
        struct l1_salt *sa = &l1->salts[i];
        struct l1_salt_stats st;
        char name[KEYS_SALT_MAX + 1];
        pthread_mutex_lock(&l1->lru_mu);
        const char *s = keys_intern_str(l1->salts_names, i);
        if (s) snprintf(name, sizeof(name), "%s", s);
        st.id = i;
        st.gen = keys_intern_gen(l1->salts_names, i);
        st.bytes = sa->bytes;
        st.objects = sa->objects;
        pthread_mutex_unlock(&l1->lru_mu);
        if (!s) continue;
        st.read_chunks = cnt_get(&sa->read_chunks);
        st.write_chunks = cnt_get(&sa->write_chunks);
        st.evicted_chunks = cnt_get(&sa->evicted_chunks);
        fn(name, &st, arg);
    }
}

uint64_t l1_salt_usage_bytes(struct l1 *l1, const char *salt) {
    CHECK_L1(l1);
    uint32_t id;
    if (keys_intern_find(l1->salts_names, salt, strlen(salt), &id, NULL) != 0) return 0;
    pthread_mutex_lock(&l1->lru_mu);
    uint64_t b = l1->salts[id].bytes;
    pthread_mutex_unlock(&l1->lru_mu);
    return b;
}

const char *l1_strerror(int rc) {
    switch (rc) {
    case L1_OK:
        return "ok";
    case L1_EXISTS:
        return "already resident";
    case L1_ERR_NOT_FOUND:
        return "not found";
    case L1_ERR_BUSY:
        return "locked by another holder";
    case L1_ERR_NOMEM:
        return "out of memory (nothing evictable left)";
    case L1_ERR_EXPIRED:
        return "lease expired";
    case L1_ERR_NOT_READABLE:
        return "not read-locked";
    case L1_ERR_INVAL:
        return "invalid object size";
    case L1_ERR_TOO_MANY_NAMES:
        return "too many distinct model names or cache salts in use";
    case L1_ERR_OVER_QUOTA:
        return "read locks would exceed the cache salt's quota";
    default:
        return "unknown error";
    }
}

size_t l1_entry_overhead_bytes(void) {
    /* The entry rounded to malloc's 16-byte chunks plus its 8-byte header, and one bucket
     * pointer (load factor <= 1). The arena's 12 bytes per unit are reported separately. */
    size_t e = (sizeof(struct l1_entry) + 8 + 15) / 16 * 16;
    return e + sizeof(struct htab_node *);
}

void l1_arena_region(struct l1 *l1, void **base, uint64_t *len) {
    *base = arena_base(l1->arena);
    *len = arena_total_bytes(l1->arena);
}
