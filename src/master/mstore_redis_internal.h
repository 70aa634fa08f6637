/* Private to the Redis metadata store: mstore_redis.c (the operations, key names, encodings)
 * and mstore_redis_conn.c (command batches, connection pools, routing to endpoints in single,
 * multi and cluster mode, redirections, NOSCRIPT, failures). */
#ifndef LMCACHE_MASTER_MSTORE_REDIS_INTERNAL_H
#define LMCACHE_MASTER_MSTORE_REDIS_INTERNAL_H

#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/htab.h"
#include "master/mstore.h"
#include "master/mstore_redis.h"

enum {
    S_REGISTER,
    S_HEARTBEAT,
    S_EVENTS,
    S_WIPE_BLOCKS,
    S_WIPE_EXTKV,
    S_EXT_REPORT,
    S_EXT_REVOKE,
    S_EXT_REVOKE_TIER,
    S_MATCH,
    S_HIT_GC,
    S_ROUTE_GET,
    S_EXISTS,
    S_LIST_ALIVE,
    S_UNREGISTER,
    S_EXPIRE,
    S_COUNT
};

/* A command's route: a key shard, or the control keys. */
#define ROUTE_CTL UINT32_MAX
/* Redirections (MOVED, ASK, TRYAGAIN) one command may follow within one store call. */
#define RS_MAX_REDIRECTS 5
/* Cluster nodes the store keeps endpoints for (masters seen in slot maps and redirections). */
#define RS_MAX_NODES 1024
#define RS_NSLOTS    16384
/* Listeners a fence waits for; more masters than this: the cache does not serve. */
#define RS_TRACK_MAX 64

/* One command of a batch: arguments [a0, a0 + argc) of the batch's buffer. After rs_run,
 * rep is its reply, or NULL when its endpoint failed in a degraded read. */
struct bcmd {
    size_t a0, argc;
    int script; /* -1: plain command */
    uint32_t route;
    redisReply *rep;
};

/* Where a batch's replies live: hiredis builds them here (bump allocation, freed at once
 * with the batch) instead of two mallocs per element; a 256-hash match reads ~2 300. */
struct rarena {
    struct rachunk *head;
};

/* Commands whose arguments are copied into one buffer; rs_run sends them as one pipeline
 * per endpoint. Replies are never freed one by one (rs_batch_free frees them all). */
struct batch {
    char *buf;
    size_t blen, bcap;
    size_t *aoff, *alen;
    size_t na, acap;
    size_t astart; /* offset of the argument being written */
    struct bcmd *c;
    size_t nc, ccap;
    bool oom;
    struct rarena arena;
};

void rs_arena_free(struct rarena *a);

struct slot {
    redisContext *c;
    bool busy;
};

/* One Redis endpoint and its connection pool. */
struct endpoint {
    char host[256];
    int port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct slot *slots;
    uint32_t nslots;
};

struct ident {
    struct htab_node hn;
    uint64_t h;
    uint32_t idx;
    char id[];
};

struct rstore {
    struct mstore base;
    struct logger *lg;
    /* Single: ep[0]. Multi: ep[s] holds shard s, ep[0] the control keys too. Cluster: every
     * master seen so far (never removed before destroy), the slot map says which is which. */
    struct endpoint **ep;
    _Atomic uint32_t nep;
    bool multi, cluster, split; /* split = multi || cluster: control and shard steps apart */
    char *password;
    uint32_t connect_ms, socket_ms, pool_size;
    uint32_t nshards;
    char ctl[300]; /* "{umbp:<ns>}" */
    char **tag;    /* per shard */
    char k_alive[320], k_peers[320], k_expired[320], k_node_prefix[320];

    /* Cluster mode: slot -> index into ep (UINT16_MAX: no owner known), under smu. */
    pthread_rwlock_t smu;
    uint16_t *owner;
    /* Masters CLUSTER NODES named at the last re-read, with or without slots (written by
     * the read cache's start and watch thread), under smu. */
    uint16_t listed_m[RS_TRACK_MAX];
    uint32_t nlisted_m;
    uint16_t ctl_slot, *tslot;
    char *seeds;
    _Atomic bool refresh;
    _Atomic uint64_t last_refresh_ns;

    pthread_mutex_t mu; /* sha */
    char sha[S_COUNT][41];

    pthread_mutex_t imu; /* interned node ids */
    struct htab itab;
    struct ident **ids;
    uint32_t nids, capids;

    struct metric *m_transport, *m_noscript, *m_pool_exhausted, *m_pool_wait;
    struct metric *m_moved, *m_ask, *m_refresh;

    /* The read cache (mstore_redis_track.c; NULL: off): one listener per endpoint (trk[e]
     * for ep[e], trk[0..ntrk) allocated; cluster mode: started for the masters of the slot
     * map as it changes). The cache serves only while every listener of need[0..nneed) is
     * up and, in cluster mode, need was computed for the current map (need_gen == map_gen;
     * map_gen is bumped by every slot-map change, MOVED, ASK and TRYAGAIN). Under tmu:
     * need, nneed, trk's entries, ntrk, wstop. */
    struct mcache *cache;
    struct rtrack **trk;
    uint32_t ntrk;
    pthread_mutex_t tmu;
    uint32_t need[RS_TRACK_MAX];
    uint32_t nneed;
    _Atomic uint64_t map_gen, need_gen;
    _Atomic uint64_t last_map_log_ns;
    pthread_t watch; /* cluster mode: re-reads the slot map every second */
    pthread_cond_t wcv;
    bool watching, wstop;
    struct metric *m_c_hit, *m_c_miss, *m_c_inval, *m_c_flush, *m_c_up, *m_c_bypass;
    struct metric *m_lat[32]; /* per store operation (mstore_redis.c) */
    struct metric_family *f_degraded;
    _Atomic uint64_t last_warn_ns;
};
#define RS(s) ((struct rstore *)(s))

/* The thread's failure: the first reason is kept until take_error reads it. */
void rs_set_err(struct rstore *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool rs_has_err(const struct rstore *r);
/* True within one connect timeout after a recorded failure: fail fast, no I/O. */
bool rs_failing(struct rstore *r);
int rs_take_error(struct mstore *s, char *buf, size_t len);

/* Runs every command of b on the endpoint its route names, one pipeline per endpoint (all
 * written before any reply is read, so the endpoints work in parallel), following cluster
 * redirections. 0, or -1 with the thread's failure recorded. degrade (the store method's
 * name) makes a failed endpoint's commands read as misses (rep NULL, WARN, degraded counter)
 * instead; a call still redirected after RS_MAX_REDIRECTS fails either way. */
int rs_run(struct rstore *r, struct batch *b, const char *degrade);

/* The endpoints and connections of cfg (one URI, the multi list, or the cluster seeds with
 * the slot map read from them); 0 or -1 with err. */
int rs_conn_init(struct rstore *r, const struct mstore_redis_cfg *cfg, char *err, size_t errlen);
/* Cluster mode: the hash slot of a key (its "{...}" tag when it has one, as Redis hashes
 * it); the endpoint owning a slot (UINT32_MAX: none known); the masters (endpoint indices)
 * in the order of their smallest slot, up to max. */
uint16_t rs_tag_slot(const char *key);
uint32_t rs_slot_owner(struct rstore *r, uint16_t slot);
uint32_t rs_cluster_masters(struct rstore *r, uint32_t *out, uint32_t max);
/* The masters of the slot map and those CLUSTER NODES named at the last rs_cluster_reread
 * (a master that serves no slot yet), up to max. */
uint32_t rs_cluster_all_masters(struct rstore *r, uint32_t *out, uint32_t max);
/* Reads the slot map (CLUSTER SLOTS) and the masters (CLUSTER NODES) again now, from a
 * master of the current map first; a change calls rs_track_map_changed. */
void rs_cluster_reread(struct rstore *r);
void rs_conn_fini(struct rstore *r);

/* A connection to host:port with the store's timeouts and AUTH; NULL with why. */
redisContext *rs_dial(struct rstore *r, const char *host, int port, char *why, size_t wlen);

/* mstore_redis_track.c: the read cache's listeners. rs_track_start starts one thread per
 * endpoint (single and multi mode) or per master of the slot map (cluster mode, plus a
 * thread re-reading the map every second); cache_mb 0: no cache. It registers the cache's
 * metrics; 0 or -1 on no memory. rs_track_stop joins them and frees the cache.
 * rs_track_fence: 0 when every invalidation of a write acknowledged before the call has
 * been applied to the cache (one PING answered on every listener, grouped with concurrent
 * callers), -1 when coherence cannot be proven now (the caller reads Redis directly).
 * rs_track_map_changed (cluster mode; no lock held): the slot map changed or a slot is
 * migrating: the cache is flushed and bypassed until listeners match the map. */
int rs_track_start(struct rstore *r, size_t cache_mb, struct metrics *m);
void rs_track_stop(struct rstore *r);
void rs_track_map_changed(struct rstore *r);
int rs_track_fence(struct rstore *r);

/* mstore_redis.c: a node id interned for the store's lifetime (stable pointer, its index in
 * idx; NULL on no memory); a node's blocks and/or external-KV entries dropped shard by
 * shard in bounded chunks. */
const char *rs_intern(struct rstore *r, const char *p, size_t n, uint32_t *idx);
void rs_wipe_node(struct rstore *r, const char *id, bool blocks, bool extkv);

/* mstore_redis_xkv.c: the external-KV operations of the vtable (mstore.h). */
int rs_ext_report(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier);
void rs_ext_revoke(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier);
void rs_ext_revoke_tier(struct mstore *s, const char *node_id, int tier);
void rs_ext_revoke_node(struct mstore *s, const char *node_id);
int rs_ext_match(struct mstore *s, const struct mstore_key *keys, size_t n, bool count_as_hit,
                 int64_t now, struct mstore_match *mt);
int rs_hit_counts(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                  size_t *nout);
size_t rs_hit_gc(struct mstore *s, int64_t cutoff);
size_t rs_ext_count(struct mstore *s);
void rs_metrics_init(struct rstore *r, struct metrics *m);

#endif
