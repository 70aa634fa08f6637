/* Private to src/server/l1/: the structures the L1 pieces share, and the small helpers they all
 * use. Nothing outside this folder includes it; the engine includes l1.h.
 *
 * Layout. The table is split into a power-of-two number of stripes; a key's stripe and its
 * bucket come from one 64-bit mix of the key. Each stripe owns a chained hash table that grows
 * by doubling under the stripe lock. Every entry is on exactly one list, guarded by the LRU
 * lock: the staging list (insertion order = write-deadline order, since the write TTL is fixed)
 * while STAGING; when RESIDENT, the global LRU list (policy LRU/noop) or its salt's list
 * (IsolatedLRU). Lists run from the least recently used head to the MRU tail.
 *
 * Files: l1.c (create/destroy, statistics), names.c (model/salt name ids, key making),
 * lease.c (entry life cycle: write and read leases, delete, clear, doomed entries), evict.c
 * (victim choice, eviction on allocation and on the periodic tick, lease reclaim). */
#ifndef LMCACHE_SERVER_L1_L1_INTERNAL_H
#define LMCACHE_SERVER_L1_L1_INTERNAL_H

#include <assert.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "base/htab.h"
#include "base/log.h"
#include "server/l1/arena.h"
#include "server/l1/l1.h"

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
    /* The write token while a writer holds the entry (STAGING, or DOOMED with F_WRITER); the
     * count of reply pins (l1_pin) once it is readable (RESIDENT, DOOMED without F_WRITER). The
     * two never coexist, so they share the word and the entry stays 104 bytes. */
    union {
        uint32_t token;
        uint32_t pins;
    };
    uint32_t touched; /* last LRU move, now_ns >> 20 (about 1 ms), wraps */
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
    /* reply pins: bytes held (one object's size per pin), pins held, refusals */
    _Atomic uint64_t pinned_bytes, pins, pin_refused;
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

static inline uint64_t key_hash(const struct l1_key *k) {
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

/* Caller holds s->mu. */
static inline struct l1_entry *do_find(struct l1 *l1, struct stripe *s, const struct l1_key *k,
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
static inline void do_insert(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h) {
    htab_insert(&s->t, &e->hn, h >> l1->stripe_bits);
}

/* Caller holds s->mu. */
static inline void do_unhash(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h) {
    htab_remove(&s->t, &e->hn, h >> l1->stripe_bits);
}

/* ---- lists (caller holds the LRU lock) ----------------------------------------------------- */

static inline void do_list_push(struct l1_list *l, struct l1_entry *e) {
    e->next = NULL;
    e->prev = l->tail;
    if (l->tail)
        l->tail->next = e;
    else
        l->head = e;
    l->tail = e;
    l->n++;
}

static inline void do_list_unlink(struct l1_list *l, struct l1_entry *e) {
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

static inline bool has_writer(const struct l1_entry *e) {
    return e->state == ST_STAGING || (e->state == ST_DOOMED && (e->flags & F_WRITER));
}

/* Caller holds the entry's stripe lock. Reply pins never expire. */
static inline uint32_t pins_of(const struct l1_entry *e) { return has_writer(e) ? 0 : e->pins; }

/* Caller holds the entry's stripe lock. Pinned entries are locked whatever their leases. */
static inline bool is_locked(const struct l1_entry *e, uint64_t now) {
    if (has_writer(e)) return e->deadline > now;
    return e->pins > 0 || (e->readers > 0 && e->deadline > now);
}

static inline void fill_ref(struct l1 *l1, const struct l1_entry *e, struct l1_ref *out) {
    if (!out) return;
    out->data = arena_ptr(l1->arena, (uint64_t)e->off_units << l1->unit_shift);
    out->size = e->size;
    out->token = has_writer(e) ? e->token : 0;
}

/* Locks the stripe of key and finds its entry (NULL when absent). The caller unlocks (*sp)->mu. */
static inline struct l1_entry *lock_find(struct l1 *l1, const struct l1_key *key,
                                         struct stripe **sp, uint64_t *hp) {
    CHECK_L1(l1);
    uint64_t h = key_hash(key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    *sp = s;
    *hp = h;
    return do_find(l1, s, key, h);
}

/* ---- shared between the files of src/server/l1/ ---------------------------------------------- */

/* names.c */
bool l1_key_ok(struct l1 *l1, const struct l1_key *k);
/* Caller holds the LRU lock. Whether the key's names are still the ones it was made with. */
bool do_l1_names_current(struct l1 *l1, const struct l1_key *k);
/* Copies the name of a salt id into buf ("" and false for a free id). Takes the LRU lock. */
bool l1_salt_name_copy(struct l1 *l1, uint32_t id, char buf[KEYS_SALT_MAX + 1]);

/* lease.c. Caller holds the entry's stripe lock. */
/* Unhashes, unlists and frees an entry and its memory. */
void do_l1_remove(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h);
/* Moves a resident entry to the MRU end unless it moved within touch_interval (or force). */
void do_l1_touch(struct l1 *l1, struct l1_entry *e, uint64_t now, bool force);

/* evict.c */
/* Allocates, evicting LRU-first when the arena is full. Caller holds no lock. */
int l1_alloc_evict(struct l1 *l1, uint64_t size, int salt, uint64_t now, uint64_t *off);

#endif
