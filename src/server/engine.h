/* THE engine: the one object every thread of the daemon shares, and the API every front end
 * (ZMQ data plane, HTTP admin) calls. Front ends never reach into L1 or L2: every operation they
 * need on the caches, the lookup sessions or the L2 adapters is a function of this header, and
 * the engine never calls a front end (server.c starts and stops them around it). What the
 * engine's own floor offers besides (kvctx.h: the shared-memory KV contexts and their copies;
 * keys.h: the checks of wire fields) front ends may use directly. */
#ifndef LMCACHE_SERVER_ENGINE_H
#define LMCACHE_SERVER_ENGINE_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/check.h"
#include "server/config.h"
#include "server/keys.h"
#include "server/kvctx.h"
#include "server/l1/l1.h"
#include "server/session.h"

#define ENGINE_MAGIC 0x4c4d4345u /* "LMCE" */

struct metrics;
struct metric_family;
struct periodic_registry;

struct metric;
struct logger;
struct l2_adapter;

/* Data-plane metrics (names from the LMCache MP server's catalogue). */
struct engine_dp_metrics {
    struct metric_family *requests, *duration, *lookups, *lookup_requested, *lookup_hit;
    struct metric_family *lookup_hit_l2;
    struct metric_family *store_gbps, *load_gbps;
    struct metric *stores_submitted, *stores_finished, *retrieves_submitted, *retrieves_finished;
    struct metric *read_pauses;     /* the data socket stopped reading (backpressure) */
    struct metric *loop_requests;   /* requests the loop thread ran itself (small, worker idle) */
    struct metric *conns_cut;       /* data connections cut for holding too much in libzmq */
    struct metric *heap_cuts;       /* ... of them, for the heap limit (--max-heap-mb) */
    struct metric *unread_refusals; /* requests refused: --max-unread-reply-mb */
};

struct l2ctl;
struct engine_l2_wait;

/* L2 metrics mirrored from the controller's and adapters' counters at each scrape. */
struct engine_l2_metrics {
    struct metric_family *store_completed, *load_completed, *store_objects, *load_objects;
    struct metric_family *prefetch_failure, *evicted, *store_submitted;
    /* last values seen, per adapter: store tasks, load tasks, store ok keys, load ok keys */
    uint64_t (*last)[4];
    uint64_t last_fail_oom, last_fail_nf, last_evicted, last_submitted;
};

/* Mirrors of L1's monotonic counters into the metrics registry (see engine_refresh_metrics). */
struct engine_l1_metrics {
    pthread_mutex_t lock;
    struct metric_family *read, *write, *evicted, *alloc_fail, *ticks, *triggered, *pin_refused;
    uint64_t last_alloc_fail, last_ticks, last_triggered, last_pin_refused;
    /* per salt id: last read/write/evicted seen, and 1 + the id's generation they belong to (an
     * id L1 reuses for another salt starts again from 0) */
    size_t seen, cap;
    uint64_t (*last)[4];
    struct l1_stats snap; /* taken at the last refresh, read by the gauges */
};

/* Placement listener (the master reporter, the KV-event publisher): told when an object appears
 * or goes. hash is the object's placement hash (fleethash.h); tier is ENGINE_TIER_DRAM (L1),
 * ENGINE_TIER_SSD (fs and dax adapters) or ENGINE_TIER_OBJ (s3 adapters: shared by the fleet, so
 * the master reporter ignores it; the KV events show it as medium OBJ). Called on data-path
 * threads with cache locks held: it must be quick and take only leaf locks. The optional cleared
 * callback runs after a clear of L1 (POST /cache/clear, the data-plane clear), on that thread,
 * with no cache lock held. */
#define ENGINE_TIER_DRAM 2
#define ENGINE_TIER_SSD  3
#define ENGINE_TIER_OBJ  4
typedef void (*engine_placement_fn)(void *arg, const uint8_t hash[32], int tier, bool present);
typedef void (*engine_cleared_fn)(void *arg);
#define ENGINE_PLACEMENT_LISTENERS 2 /* the master reporter, the KV-event publisher */

struct engine {
    unsigned magic;
    const struct server_config *cfg;
    /* Set once initialisation completed; read without a lock by the admin API. */
    _Atomic int ready;
    char instance_id[64];
    double start_time; /* wall clock */
    struct metrics *metrics;
    struct periodic_registry *periodic;
    struct quota *quota; /* per-cache_salt limits (IsolatedLRU) */
    struct l1 *l1;       /* set before ready, never changes after */
    struct engine_l1_metrics l1m;
    /* data plane */
    uint8_t seed[32]; /* chunk-hash chain seed */
    struct kv_registry contexts;
    struct session_table sessions;
    struct engine_dp_metrics dpm;
    struct logger *lg_dp;
    /* helpers for the data plane's copies (set by the server before the data plane starts,
     * which stops first; NULL: every copy runs on its dp-worker) */
    struct copypool *copypool;
    /* L2: the configured adapters in configuration order (index 0 is primary); set before
     * ready, never changes after. */
    struct l2ctl *l2ctl; /* NULL without L2 adapters */
    struct l2_adapter **l2;
    size_t nl2;
    _Atomic uint64_t session_gen;
    struct engine_l2_metrics l2m;
    /* stores waiting for their write-through to L2 (engine_source.wait_l2_ns): a list of
     * struct engine_l2_wait under l2w_mu, woken through l2w_cv by the controller's store_done */
    pthread_mutex_t l2w_mu;
    pthread_cond_t l2w_cv;
    struct engine_l2_wait *l2w_head;
    /* background prefault of the L1 arena */
    pthread_t prefault_tid;
    int prefault_started;
    _Atomic int prefault_stop;
    _Atomic uint64_t prefaulted_bytes;
    /* placement listener and the `master` section of /status (both optional, set before
     * engine_start_caches) */
    engine_placement_fn placement_fn[ENGINE_PLACEMENT_LISTENERS];
    engine_cleared_fn cleared_fn[ENGINE_PLACEMENT_LISTENERS];
    void *placement_arg[ENGINE_PLACEMENT_LISTENERS];
    int nplacement;
    json_t *(*master_status_fn)(void *arg);
    void *master_status_arg;
};

#define ENGINE_CHECK(e) CHECK((e) && (e)->magic == ENGINE_MAGIC)

/* Outcomes of the engine API: ENGINE_OK, or one of these with a message in err. */
#define ENGINE_OK                 0
#define ENGINE_AGAIN              1     /* not an error: a resumable store parked (engine_store) */
#define ENGINE_ERR_INTERNAL       (-1)  /* out of process memory, or a failure of ours */
#define ENGINE_ERR_CONFIG         (-2)  /* an adapter rejects its --l2-adapter configuration */
#define ENGINE_ERR_INVAL          (-3)  /* a field the caller passed is invalid */
#define ENGINE_ERR_FULL           (-4)  /* L1 has no room left, even after eviction */
#define ENGINE_ERR_TOO_MANY_NAMES (-5)  /* every model-name or cache-salt id is in use */
#define ENGINE_ERR_SOURCE         (-6)  /* the caller's fill or copy callback failed */
#define ENGINE_ERR_NOT_FOUND      (-7)  /* not cached, not locked, unknown id */
#define ENGINE_ERR_BUSY           (-8)  /* still running (a warm prefetch) */
#define ENGINE_ERR_NO_L2          (-9)  /* no L2 adapters configured */
#define ENGINE_ERR_NOT_SUPPORTED  (-10) /* the adapter cannot do that */
#define ENGINE_ERR_BAD_TOKEN      (-11) /* a malformed page token */
#define ENGINE_ERR_NO_LAYOUT      (-12) /* no KV layout registered for (model, world size) */
#define ENGINE_ERR_UNAVAILABLE    (-13) /* L2 refused the request (shutting down, queue full) */
#define ENGINE_ERR_LIMIT          (-14) /* the request would take a per-client limit past it */

#define ENGINE_REQUEST_ID_MAX SESSION_ID_MAX /* bytes of a lookup's request id */
#define ENGINE_OWNER_LEN      SESSION_OWNER  /* bytes of the key of a connection */
#define ENGINE_PAGE_SIZE_MAX  5000           /* objects per page of engine_l2_list */

/* ---- life cycle (server.c) ---------------------------------------------------------------- */

/* Creates the parts that the admin API needs before the engine is ready (metrics, periodic
 * registry). Returns 0 or -1 with err. */
int engine_create(struct engine *e, const struct server_config *cfg, char *err, size_t errlen);
/* Creates the caches (L1, L2 adapters) and their metrics, without the periodic threads; the
 * daemon calls it before binding any port, tests and fuzzers alone. Returns 0,
 * ENGINE_ERR_CONFIG when an adapter rejects its --l2-adapter configuration, or -1 for other
 * failures, with err filled. */
int engine_start_caches(struct engine *e, char *err, size_t errlen);
/* Before engine_start_caches: who is told of placements (objects on disk at start included)
 * and, with cleared non-NULL, of clears. Returns 0, or -1 when ENGINE_PLACEMENT_LISTENERS are
 * set already. */
int engine_add_placement_listener(struct engine *e, engine_placement_fn fn,
                                  engine_cleared_fn cleared, void *arg);
/* Before the admin API starts: fills the `master` section of /status (fn returns a new object). */
void engine_set_master_status(struct engine *e, json_t *(*fn)(void *arg), void *arg);
/* Capacities of the node-local tiers: DRAM (L1) and SSD (fs and dax adapters). */
struct engine_tier_capacity {
    uint64_t dram_total, dram_available, ssd_total, ssd_available;
};
void engine_tier_capacities(struct engine *e, struct engine_tier_capacity *out);

/* After engine_start_caches: starts the background jobs (evictors, reaper, session clean-up,
 * L1 prefault). The engine is ready once the caller says so (engine_set_ready). */
int engine_start(struct engine *e, char *err, size_t errlen);
/* server.c marks the engine ready once its front ends are up (GET /healthcheck turns 200), and
 * not ready before it stops them. */
void engine_set_ready(struct engine *e, int ready);
int engine_is_ready(const struct engine *e);
/* Stops background jobs and releases everything; the front ends must be stopped already. */
void engine_destroy(struct engine *e);

/* ---- prompts ------------------------------------------------------------------------------ */

/* The chunks of a prompt an operation covers: the hash of every chunk up to end_chunk (client
 * hashes may be shorter than KEYS_HASH_LEN), [start_chunk, end_chunk), and the cache_salt. The
 * objects of chunk c are (hash c, model, kv_rank of (world size, rank), salt). */
struct engine_prompt {
    uint8_t (*hashes)[KEYS_HASH_LEN]; /* hashes[0..end_chunk) */
    uint8_t *hash_len;                /* per chunk */
    uint32_t start_chunk, end_chunk;
    char salt[KEYS_SALT_MAX + 1];
};

/* ---- data plane: store, lookup, retrieve -------------------------------------------------- */

/* Where a store's bytes come from: chunk i (0 = start_chunk) has size(arg, i) bytes and
 * fill(arg, i, dst) copies them (0, or -1 when the source cannot be read). replace: a resident
 * object of another size is replaced (a store from a registered layout: such an object could
 * never be retrieved into it); without it, it counts as skipped. */
struct engine_store_state; /* a parked store (engine_source.resume) */
struct engine_source {
    uint64_t (*size)(void *arg, uint32_t i);
    int (*fill)(void *arg, uint32_t i, void *dst);
    void *arg;
    bool replace;
    uint64_t wait_l2_ns; /* > 0: wait up to this long for the write-through of what is stored */
    /* With wait_l2_ns: do not wait, hand the wait to the caller (engine_store_result.l2_wait),
     * and call l2_notify(l2_notify_arg) once every chunk is written or failed. */
    void (*l2_notify)(void *arg);
    void *l2_notify_arg;
    /* Optional: fills n chunks at once (idx[j] into dsts[j], idx ascending), e.g. as one copy
     * job; 0, or -1 when chunk idx[*done] could not be read (those before it are filled).
     * Without it, fill is called chunk by chunk. */
    int (*fill_many)(void *arg, const uint32_t *idx, void *const *dsts, uint32_t n, uint32_t *done);
    /* Optional: a resumable store. Where the store would wait for another request writing one
     * of its chunks, it stops instead and returns ENGINE_AGAIN with *resume set (where it
     * stopped, its counts so far, what it stored). The caller calls engine_store again with the
     * same prompt and source, *resume unchanged, once engine_store_retry_at(*resume) passed:
     * the call goes on from there (and sets *resume to NULL once it returns anything else), or
     * ends it with engine_store_abandon. NULL: the wait runs in the call. */
    struct engine_store_state **resume;
};

/* Chunks (and bytes: at most an eighth of L1) engine_store holds reserved before filling
 * them as one batch. */
#define ENGINE_STORE_BATCH       32u
#define ENGINE_STORE_BATCH_BYTES (64ull << 20)

/* How long engine_store waits, in total per call, for other requests writing the same chunks. */
#define ENGINE_STORE_WAIT_NS (2000ull * 1000 * 1000)

/* Every count is true when the call returns: stored chunks were written by this call and are
 * resident, skipped ones were already resident (or written by a concurrent request, which this
 * call waited for). pending: chunks another request was still writing when the wait ran out
 * (or an object of another size still read-locked, with replace): not stored by this call, they
 * may or may not appear. */
struct engine_store_result {
    int64_t stored, skipped, pending;
    uint64_t bytes; /* of the chunks stored */
    /* With wait_l2_ns (and L2 adapters): of the stored chunks, those every L2 adapter stored
     * before the call returned (the others failed, were dropped, or were still being written
     * when the wait ran out). */
    int64_t l2_stored;
    /* With l2_notify: the wait the caller took over (NULL: nothing to wait for, l2_stored is
     * final). The caller ends it with engine_l2_wait_end, at the latest by its deadline. */
    struct engine_l2_wait *l2_wait;
};

/* An asynchronous write-through wait (engine_source.l2_notify). The notify callback runs once,
 * on the thread that settles the last chunk (the L2 controller, or the caller of engine_store
 * when none was queued), with the engine's write-through mutex held: it may take only leaf
 * locks. */
/* When the wait runs out (CLOCK_MONOTONIC ns). */
uint64_t engine_l2_wait_deadline(const struct engine_l2_wait *w);
/* Stops waiting and frees w (no notify runs after it returns): the chunks every adapter stored
 * by now. */
int64_t engine_l2_wait_end(struct engine *e, struct engine_l2_wait *w);

/* Stores the chunks of p for one rank into L1 and queues what was admitted for write-through
 * to every L2 adapter. A chunk another request is writing is waited for (at most
 * ENGINE_STORE_WAIT_NS per store, in all, parked or not): skipped once it turned resident,
 * written by this store when that writer failed, pending when the wait ran out. The chunks
 * before a failure stay stored. Returns ENGINE_OK, ENGINE_AGAIN (parked: src->resume), or
 * ENGINE_ERR_FULL / _TOO_MANY_NAMES / _INVAL (L1 refused), _SOURCE (fill failed), with err. */
int engine_store(struct engine *e, const struct engine_prompt *p, const char *model,
                 uint32_t world_size, uint32_t rank, const struct engine_source *src,
                 uint64_t now_ns, struct engine_store_result *res, char *err, size_t errlen);

/* A parked store (engine_source.resume): when to call engine_store again (CLOCK_MONOTONIC ns;
 * the poll of the other writer grows from 20 us to 2 ms, never past the wait's deadline). */
uint64_t engine_store_retry_at(const struct engine_store_state *st);
/* The next call of the parked store waits no more: what is still being written by others is
 * pending (a stopping server). */
void engine_store_stop_waiting(struct engine_store_state *st);
/* Ends a parked store without resuming it (its request failed or was dropped): what it stored
 * stays stored and is queued for write-through; st is freed. */
void engine_store_abandon(struct engine *e, struct engine_store_state *st);

/* A cached chunk held for reading: data/size stay valid until engine_read_done. */
struct engine_ref {
    const void *data;
    uint64_t size;
    struct l1_key key; /* the engine's */
};

/* Holds chunk c (absolute) of p for one rank: through a read lock of the lookup session
 * (owner, rid) when rid is not empty (only the very object the lookup locked), else by taking a
 * lock of its own. ENGINE_OK, ENGINE_ERR_NOT_FOUND (not cached, or not locked by that lookup),
 * or ENGINE_ERR_INVAL with err. */
int engine_read(struct engine *e, const struct engine_prompt *p, uint32_t c, const char *model,
                uint32_t world_size, uint32_t rank, const uint8_t *owner, const char *rid,
                uint64_t now_ns, struct engine_ref *ref, char *err, size_t errlen);
/* Releases what engine_read holds. */
void engine_read_done(struct engine *e, const struct engine_ref *ref, uint64_t now_ns);

/* A reply pin on a chunk held by engine_read, for a reply sent straight from its memory: it
 * outlives the read (never expires) and keeps ref->data valid until engine_unpin, which any
 * thread holding no engine lock may call (libzmq's I/O thread). NULL when the pinned reply
 * bytes are at their cap (--l1-pinned-reply-ratio) or the chunk cannot be pinned: send a copy. */
struct engine_pin;
struct engine_pin *engine_pin(struct engine *e, const struct engine_ref *ref, uint64_t now_ns);
void engine_unpin(struct engine_pin *pin, uint64_t now_ns);

/* lookup: locks, chunk-major (every rank of chunk c before chunk c+1), the leading chunks of p
 * cached for every rank, `readers` read locks each, and opens the session (owner, rid) that
 * holds them (replacing one of the same name). The chunks after the first miss are prefetched
 * from L2 when there is L2; the session's job turns ready when that ends. ENGINE_OK, or
 * ENGINE_ERR_INTERNAL / ENGINE_ERR_INVAL with err. */
int engine_lookup(struct engine *e, const uint8_t *owner, const char *rid,
                  const struct engine_prompt *p, const char *model, uint32_t world_size,
                  uint32_t readers, uint64_t now_ns, char *err, size_t errlen);
/* query_prefetch_status: 1 = ready (*hits set; reported once), 0 = pending; an unknown session
 * or a job already reported counts as ready with 0 hits. */
int engine_lookup_status(struct engine *e, const uint8_t *owner, const char *rid, uint32_t *hits);
/* free_lookup_locks: releases the session's locks on chunks [from, to) of one rank (every rank
 * when rank < 0). Returns the number of locks released. */
uint64_t engine_lookup_release(struct engine *e, const uint8_t *owner, const char *rid,
                               uint32_t from, uint32_t to, int64_t rank);
/* end_session: touches the session's objects, releases what it still holds and forgets it. */
void engine_end_session(struct engine *e, const uint8_t *owner, const char *rid);
/* Objects the session (owner, rid) spans, 0 when there is none (session_objects). */
uint64_t engine_session_objects(struct engine *e, const uint8_t *owner, const char *rid);

/* ---- KV contexts (the registry of kvctx.h, owned by the engine) --------------------------- */

/* kvreg_register on the engine's registry (same arguments and results). */
int engine_register_context(struct engine *e, const struct kv_context *c,
                            const struct kv_auth *auth, uint64_t now_ns,
                            unsigned char nonce[KV_PROOF_NONCE], uint64_t *proof_offset, char *err,
                            size_t errlen);
/* 0, or -1 when unknown or (owner not NULL) not registered by that connection. */
int engine_unregister_context(struct engine *e, int64_t instance_id, const uint8_t *owner);
/* A reference on a registered context (NULL when unknown or, with owner, not one of that
 * connection's); refreshes its liveness. Release it with engine_context_put. */
struct kv_context *engine_context_get(struct engine *e, int64_t instance_id, const uint8_t *owner,
                                      uint64_t now_ns);
void engine_context_put(struct kv_context *c);
/* The first registered layout for (model, world_size): 0, or -1 when none is registered. */
int engine_context_layout(struct engine *e, const char *model, uint32_t world_size,
                          struct kv_layout *out);
/* ping: refreshes liveness; 0, or -1 when unknown. warm_state (may be NULL): KV_WARM_*. */
int engine_context_ping(struct engine *e, int64_t instance_id, const uint8_t *owner,
                        uint64_t now_ns, int *warm_state);
/* POST /cache/checksums: calls fn(arg, bytes, len) for layers [l0, l1), K then V, each of the n
 * blocks in turn, under the SIGBUS guard. 0, -1 when the mapping shrank, or fn's nonzero. */
int engine_context_read_blocks(struct engine *e, const struct kv_context *c, const uint32_t *ids,
                               size_t n, uint32_t l0, uint32_t l1,
                               int (*fn)(void *arg, const void *bytes, size_t len), void *arg);

/* ---- admin: caches ------------------------------------------------------------------------ */

/* POST /cache/clear and the data-plane clear for L1: frees every object, locks ignored. Returns
 * objects freed. */
size_t engine_clear_l1(struct engine *e);
/* Bytes of one cache_salt over every tier ("" = the empty salt). */
uint64_t engine_salt_usage_bytes(struct engine *e, const char *salt);
/* Tells the tiers that the quota table changed (after PUT/DELETE /quota). */
void engine_quota_changed(struct engine *e);

/* POST /cache/prefetches: loads the chunks of tokens (every rank of world_size, chunk-major)
 * from L2 into L1. ENGINE_OK with *nchunks (0: nothing to do) and *id (poll it with
 * engine_warm_prefetch_poll); ENGINE_ERR_NO_LAYOUT when no engine registered a KV layout for
 * (model, world_size) (checked first); ENGINE_ERR_NO_L2, _INTERNAL, _TOO_MANY_NAMES or
 * _UNAVAILABLE with err. */
int engine_warm_prefetch(struct engine *e, const char *model, uint32_t world_size, const char *salt,
                         const uint32_t *tokens, size_t ntokens, uint64_t *id, size_t *nchunks,
                         char *err, size_t errlen);
/* ENGINE_OK with the keys found in L2 and loaded, and those asked for (reported once);
 * ENGINE_ERR_BUSY while it runs; ENGINE_ERR_NOT_FOUND for an unknown or consumed id. */
int engine_warm_prefetch_poll(struct engine *e, uint64_t id, uint64_t *found, uint64_t *total);

/* ---- admin: L2 objects -------------------------------------------------------------------- */

/* The adapter an ?adapter= selector names (NULL or "": the primary): its index, or
 * ENGINE_ERR_NO_L2, or ENGINE_ERR_NOT_FOUND. */
int engine_l2_find(struct engine *e, const char *name);
/* The type name of adapter idx (from engine_l2_find). */
const char *engine_l2_name(struct engine *e, int idx);

struct engine_object {
    struct keys_object_key key;
    uint64_t size;
};
struct engine_object_page {
    struct engine_object *entries;
    size_t count;
    char *next_token; /* NULL when the listing is exhausted */
};
/* One page (1..ENGINE_PAGE_SIZE_MAX objects) of adapter idx, optionally one model's only.
 * ENGINE_OK, or ENGINE_ERR_NOT_SUPPORTED, _BAD_TOKEN (err may be empty), _INVAL, _INTERNAL. */
int engine_l2_list(struct engine *e, int idx, const char *model, size_t page_size,
                   const char *token, struct engine_object_page *out, char *err, size_t errlen);
void engine_object_page_free(struct engine_object_page *p);
/* Deletes keys from adapter idx; locked ones are skipped (*skipped). deleted gets n flags.
 * ENGINE_OK, or ENGINE_ERR_INTERNAL with err (the adapter's failure). */
int engine_l2_delete(struct engine *e, int idx, const struct keys_object_key *keys, size_t n,
                     uint8_t *deleted, size_t *skipped, char *err, size_t errlen);

/* ---- admin: runtime reconfiguration of L2 adapters ---------------------------------------- */

/* Reconfigurable adapters whose type name is backend (without regard to case). */
size_t engine_reconfigurable_count(struct engine *e, const char *backend);
/* The status object of the i-th of them (a new reference; {"type": ...} when the adapter has
 * none); NULL when i is out of range. */
json_t *engine_reconfigure_status(struct engine *e, const char *backend, size_t i);
/* Applies operation op with body to the i-th of them: the adapter's result (a new reference)
 * and its HTTP status; NULL when i is out of range or the adapter returned nothing. */
json_t *engine_reconfigure(struct engine *e, const char *backend, size_t i, const char *op,
                           json_t *body, int *http_status);

/* ---- admin: status and metrics ------------------------------------------------------------ */

/* GET /status body (a new reference). */
json_t *engine_status(struct engine *e);
/* GET /config body (a new reference), NULL before the configuration is known. */
json_t *engine_config_json(struct engine *e);
/* Updates gauges that mirror engine state, just before a scrape. */
void engine_refresh_metrics(struct engine *e);
/* GET /config/adapters "adapters" array (a new reference). */
json_t *engine_adapters(struct engine *e);

#endif
