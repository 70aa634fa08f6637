/* Private to the in-memory master store (mstore_mem.c: client records, block index, life
 * cycle; mstore_xkv.c: the external-KV index): its structures and shared helpers. */
#ifndef LMCACHE_MASTER_MSTORE_MEM_INTERNAL_H
#define LMCACHE_MASTER_MSTORE_MEM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/htab.h"
#include "master/mstore.h"

static inline uint64_t hkey(const char *k, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, k, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        k += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, k, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 32;
    return h;
}

/* ---- nodes and client records (under meta) ---- */

struct node {
    char *id;
    bool present; /* a client record exists */
    int status;
    int64_t last_hb, reg_at;
    uint64_t last_seq;
    char *node_address, *peer_address;
    uint8_t *engine;
    size_t engine_len;
    char **tags;
    size_t ntags;
    struct mstore_caps caps;
};

/* ---- external-KV entries (under their xshard lock) ---- */

struct xplace {
    uint32_t node;
    uint8_t tiers;
    uint32_t ridx[MSTORE_NTIERS]; /* slot in the shard's reverse vector per tier */
};

struct xent {
    struct htab_node hn; /* first: a bucket head points at the entry itself */
    struct xplace *pl;
    uint64_t hits;
    int64_t last_seen;
    uint32_t hv;
    uint32_t nplace, plcap; /* one placement per node: as many as nodes */
    uint16_t klen;
    char key[];
};

struct xrev {
    struct xent **v;
    uint32_t n, cap;
};

struct xshard {
    pthread_mutex_t lock;
    struct htab t; /* of xent, by hv */
    /* Copies of t.b and t.nb that mem_ext_match may read unlocked for a prefetch hint;
     * refreshed under lock after every insert. */
    struct htab_node **_Atomic hint_b;
    _Atomic size_t hint_nb;
    struct xrev (*rev)[MSTORE_NTIERS]; /* indexed by node */
    uint32_t nrev;
} __attribute__((aligned(64)));

/* ---- block index (under its bshard lock) ---- */

struct bloc {
    uint32_t node;
    int32_t tier;
    uint64_t size;
};

struct bent {
    struct htab_node hn;
    struct bloc *locs;
    uint32_t nloc, loccap;
    uint32_t hv;
    int64_t lease, lacc, created;
    uint64_t acnt;
    char key[];
};

struct bshard {
    pthread_mutex_t lock;
    struct htab t; /* of bent, by hv */
} __attribute__((aligned(64)));

struct mem {
    struct mstore base;
    uint32_t magic;
    pthread_rwlock_t meta;
    struct node **nodes;
    uint32_t nnodes, ncap;
    uint32_t *nmap; /* open addressing: node index + 1, 0 = empty */
    uint32_t nmap_cap;
    uint32_t nshards;
    struct xshard *xs;
    struct bshard *bs;
    _Atomic size_t xbytes;
    size_t rbytes; /* client records' heap bytes (do_record_bytes); under meta */
};

#define MEM(s) ((struct mem *)(s))

static inline void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

/* The next capacity of an array grown by doubling, first when empty; 0 when the doubled
 * count would not fit its 32 bits (callers treat that as out of memory). */
static inline uint32_t cap_next(uint32_t cap, uint32_t first) {
    if (!cap) return first;
    return cap > UINT32_MAX / 2 ? 0 : cap * 2;
}

/* ---- mstore_mem.c ---- */
/* Caller holds meta (any mode). UINT32_MAX when absent. */
uint32_t mem_node_find(struct mem *m, const char *id);

/* ---- mstore_xkv.c ---- */
/* One shard's table and lock (0, or -1 when out of memory: then fini it), and its release
 * with every entry. */
int mem_xshard_init(struct xshard *sh);
void mem_xshard_fini(struct xshard *sh);
/* Drops every ext-KV placement of a node (unregister, expiry). Caller holds meta. */
void mem_xkv_wipe_node(struct mem *m, uint32_t node);
/* The mstore_ops of the external-KV index (see mstore.h). */
int mem_ext_report(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier);
void mem_ext_revoke(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier);
void mem_ext_revoke_tier(struct mstore *s, const char *node_id, int tier);
void mem_ext_revoke_node(struct mstore *s, const char *node_id);
int mem_ext_match(struct mstore *s, const struct mstore_key *keys, size_t n, bool count_as_hit,
                  int64_t now, struct mstore_match *out);
int mem_hit_counts(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                   size_t *nout);
size_t mem_hit_gc(struct mstore *s, int64_t cutoff);
size_t mem_ext_count(struct mstore *s);

#endif
