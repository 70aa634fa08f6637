/* The master's metadata store: client records, the block index (heartbeat events),
 * the external-KV placement index and the per-hash hit counters, behind one vtable so
 * that a Redis-backed store can replace the in-memory one (mstore_mem.c).
 *
 * Every operation is thread-safe and synchronous. Times are wall-clock milliseconds
 * passed in by the caller, randomness too, so TTLs and routing are testable. */
#ifndef LMCACHE_MASTER_MSTORE_H
#define LMCACHE_MASTER_MSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Tier values on the wire: TIER_UNKNOWN 0, HBM 1, DRAM 2, SSD 3. */
#define MSTORE_NTIERS 4
const char *mstore_tier_label(int tier); /* "UNKNOWN", "HBM", "DRAM", "SSD" */
static inline bool mstore_tier_valid(int tier) { return tier >= 0 && tier < MSTORE_NTIERS; }

enum mstore_status {
    MSTORE_STATUS_UNKNOWN = 0,
    MSTORE_STATUS_ALIVE = 1,
    MSTORE_STATUS_EXPIRED = 2
};

struct mstore_caps {
    uint8_t mask; /* bit t set: tier t present */
    uint64_t total[MSTORE_NTIERS];
    uint64_t avail[MSTORE_NTIERS];
};

/* Limits of one registration (RegisterClient rejects more): node_address, peer_address
 * and each tag are at most MSTORE_MAX_STRING bytes (node ids at most 1024, a limit of every
 * RPC: MWIRE_MAX_NODE_ID). engine_desc has its own limit, a knob of the master. */
#define MSTORE_MAX_STRING 4096
#define MSTORE_MAX_TAGS   64

struct mstore_reg {
    const char *node_id;
    const char *node_address;
    const char *peer_address;
    const uint8_t *engine_desc;
    size_t engine_desc_len;
    char *const *tags;
    size_t ntags;
    struct mstore_caps caps;
};

/* REVIVED: the node was EXPIRED and is ALIVE again (its sequence check and events as for
 * APPLIED or SEQ_GAP, *acked likewise); its external-KV placements were wiped at expiry, so
 * the node must report them again (the RPC answers request_full_sync). */
enum mstore_hb { MSTORE_HB_APPLIED, MSTORE_HB_SEQ_GAP, MSTORE_HB_UNKNOWN, MSTORE_HB_REVIVED };
enum mstore_ev_kind { MSTORE_EV_ADD = 0, MSTORE_EV_REMOVE = 1 };

struct mstore_event {
    int kind; /* unknown kinds count as ADD */
    const char *key;
    int tier;
    uint64_t size;
};

/* One block location as seen by readers. node_id points into the store's intern table
 * and stays valid for the store's lifetime. */
struct mstore_loc {
    const char *node_id;
    uint32_t node;
    int tier;
    uint64_t size;
};

/* A key as it arrived on the wire: not NUL-terminated. */
struct mstore_key {
    const char *p;
    size_t n;
};

/* Result of a MatchExternalKv: one entry per node, per node one bucket per tier in
 * ascending tier order, hashes as indices into the request in request order. */
struct mstore_match_tier {
    int tier;
    uint32_t n;
    uint32_t *idx; /* into the match's pool */
};
struct mstore_match_node {
    uint32_t node;
    const char *node_id;
    char *peer_address; /* "" unless the node is ALIVE */
    uint32_t ntiers;
    struct mstore_match_tier tiers[MSTORE_NTIERS];
    uint32_t distinct; /* distinct hashes matched on this node */
};
struct mstore_match {
    uint32_t nnodes;
    struct mstore_match_node *nodes;
    uint32_t *pool; /* every bucket's indices */
};
void mstore_match_free(struct mstore_match *m);

struct mstore_hit {
    uint32_t idx; /* index into the request */
    uint64_t count;
};

/* An ALIVE client, for the put router. */
struct mstore_alive {
    uint32_t node;
    const char *node_id;
    char *peer_address;
    struct mstore_caps caps;
};

struct mstore;
struct mstore_ops {
    const char *name;
    void (*destroy)(struct mstore *s);
    /* 0: registered; 1: the node is ALIVE and not stale (ALREADY_EXISTS); -1: no memory. */
    int (*register_client)(struct mstore *s, const struct mstore_reg *r, int64_t now,
                           int64_t stale_after);
    /* true when a record existed. Cascades to the node's ext-KV entries and blocks. */
    bool (*unregister_client)(struct mstore *s, const char *node_id);
    /* A CAS on the node's sequence: see docs/master.md (Heartbeat). caps replaces the
     * stored capacities on APPLIED. *acked receives the acknowledged sequence. An EXPIRED
     * node is ALIVE again and the result is REVIVED whatever the CAS did. */
    enum mstore_hb (*apply_heartbeat)(struct mstore *s, const char *node_id, uint64_t seq,
                                      int64_t now, const struct mstore_caps *caps,
                                      const struct mstore_event *ev, size_t nev, bool full,
                                      uint64_t *acked);
    /* Flips ALIVE records whose last heartbeat is older than cutoff to EXPIRED, frees their
     * engine_desc and wipes their ext-KV entries and blocks; fn is called with each expired
     * id. Then deletes (as unregister does) EXPIRED records whose last heartbeat is older
     * than forget_before (<= cutoff), so a record expired now with forget_before == cutoff
     * goes at once. Returns the number expired. */
    size_t (*expire_stale)(struct mstore *s, int64_t cutoff, int64_t forget_before,
                           void (*fn)(const char *, void *), void *arg);
    size_t (*alive_count)(struct mstore *s);
    int (*client_status)(struct mstore *s, const char *node_id);
    /* Copies the registered tags into a malloc'd array of malloc'd strings. */
    int (*client_tags)(struct mstore *s, const char *node_id, char ***tags, size_t *ntags);
    int (*list_alive)(struct mstore *s, struct mstore_alive **out, size_t *n);

    /* External KV. report returns 1 when written, 0 when the node is not ALIVE, -1 on
     * no memory. */
    int (*ext_report)(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                      int tier);
    void (*ext_revoke)(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                       int tier);
    void (*ext_revoke_tier)(struct mstore *s, const char *node_id, int tier);
    void (*ext_revoke_node)(struct mstore *s, const char *node_id);
    /* Request duplicates are matched once (their first occurrence). */
    int (*ext_match)(struct mstore *s, const struct mstore_key *keys, size_t n, bool count_as_hit,
                     int64_t now, struct mstore_match *out);
    /* Sparse, de-duplicated; *out is malloc'd (may be NULL when *nout is 0). */
    int (*hit_counts)(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                      size_t *nout);
    size_t (*hit_gc)(struct mstore *s, int64_t cutoff);
    size_t (*ext_count)(struct mstore *s);

    /* Block index. locs[i] (malloc'd, may be NULL) gets key i's locations not held by an
     * excluded node; keys with one get lease/access bumps when lease_until > 0. */
    int (*block_route_get)(struct mstore *s, char *const *keys, size_t n, char *const *excl,
                           size_t nexcl, int64_t now, int64_t lease_until, struct mstore_loc **locs,
                           size_t *nlocs);
    /* found[i]: key i has at least one location. Pure read. */
    void (*block_exists)(struct mstore *s, char *const *keys, size_t n, bool *found);

    /* Optional (NULL for a store that cannot fail, like the in-memory one). A store on a
     * remote backend records a failure of the calling thread's operations (results then read
     * as empty); this returns 1 with a one-line reason in buf and clears it, else 0. The RPC
     * layer turns it into UNAVAILABLE. */
    int (*take_error)(struct mstore *s, char *buf, size_t len);
};

struct mstore {
    const struct mstore_ops *ops;
};

static inline int mstore_take_error(struct mstore *s, char *buf, size_t len) {
    return s->ops->take_error ? s->ops->take_error(s, buf, len) : 0;
}

struct mstore_mem_cfg {
    uint32_t shards; /* power of two rounded up; 0 = 64 */
};
struct mstore *mstore_mem_create(const struct mstore_mem_cfg *cfg);

/* Bytes the in-memory store holds for its indexes (approximate; for the benchmark). */
size_t mstore_mem_bytes(struct mstore *s);

/* Bytes held by client records: engine_desc, addresses and tags (interned node ids, a few
 * dozen bytes each, are not counted: they live as long as the store). */
size_t mstore_mem_record_bytes(struct mstore *s);

#endif
