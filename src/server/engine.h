/* THE engine: the one object every thread of the daemon shares, and the API
 * every front end (ZMQ data plane, HTTP admin) calls. Front ends never reach
 * into L1 or L2 directly. */
#ifndef LMCACHE_SERVER_ENGINE_H
#define LMCACHE_SERVER_ENGINE_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "base/check.h"
#include "server/config.h"
#include "server/dataplane/context.h"
#include "server/l1/l1.h"
#include "server/session.h"

#define ENGINE_MAGIC 0x4c4d4345u /* "LMCE" */

struct metrics;
struct metric_family;
struct periodic_registry;

struct metric;
struct logger;
struct dataplane;
struct l2_adapter;

/* Data-plane metrics (names from the LMCache MP server's catalogue). */
struct engine_dp_metrics {
    struct metric_family *requests, *duration, *lookups, *lookup_requested, *lookup_hit;
    struct metric_family *lookup_hit_l2;
    struct metric_family *store_gbps, *load_gbps;
    struct metric *stores_submitted, *stores_finished, *retrieves_submitted, *retrieves_finished;
    struct metric *read_pauses; /* the data socket stopped reading (backpressure) */
};

struct l2ctl;

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
    struct metric_family *read, *write, *evicted, *alloc_fail, *ticks, *triggered;
    uint64_t last_alloc_fail, last_ticks, last_triggered;
    /* per salt id: last read/write/evicted seen, and 1 + the id's generation they belong to (an
     * id L1 reuses for another salt starts again from 0) */
    size_t seen, cap;
    uint64_t (*last)[4];
    struct l1_stats snap; /* taken at the last refresh, read by the gauges */
};

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
    struct dataplane *dp;
    struct engine_dp_metrics dpm;
    struct logger *lg_dp;
    /* L2: the configured adapters in configuration order (index 0 is primary); set before
     * ready, never changes after. */
    struct l2ctl *l2ctl; /* NULL without L2 adapters */
    struct l2_adapter **l2;
    size_t nl2;
    _Atomic uint64_t session_gen;
    struct engine_l2_metrics l2m;
    /* background prefault of the L1 arena */
    pthread_t prefault_tid;
    int prefault_started;
    _Atomic int prefault_stop;
    _Atomic uint64_t prefaulted_bytes;
};

#define ENGINE_CHECK(e) CHECK((e) && (e)->magic == ENGINE_MAGIC)

/* Creates the parts that the admin API needs before the engine is ready
 * (metrics, periodic registry). Returns 0 or -1 with errbuf. */
int engine_create(struct engine *e, const struct server_config *cfg, char *errbuf, size_t errlen);
/* Creates the caches (L1, L2 adapters) and their metrics, without the data socket or the
 * periodic threads; the daemon calls it before binding any port, tests and fuzzers alone.
 * Returns 0, ENGINE_ERR_CONFIG when an adapter rejects its --l2-adapter configuration, or -1
 * for other failures, with errbuf filled. */
#define ENGINE_ERR_CONFIG (-2)
int engine_start_caches(struct engine *e, char *errbuf, size_t errlen);
/* After engine_start_caches: starts the background jobs and the data socket, and marks the
 * engine ready. */
int engine_start(struct engine *e, char *errbuf, size_t errlen);
int engine_is_ready(const struct engine *e);
/* Stops background jobs and releases everything. */
void engine_destroy(struct engine *e);

/* Releases a lookup session's remaining locks (touching its objects when touch) and frees it. */
void dataplane_session_release(struct engine *e, struct session *s, int touch);

/* POST /cache/clear for L1: frees every object, locks ignored. Returns objects freed. */
size_t engine_clear_l1(struct engine *e);
/* Bytes of one cache_salt over every tier ("" = the empty salt). */
uint64_t engine_salt_usage_bytes(struct engine *e, const char *salt);
/* Tells the tiers that the quota table changed (after PUT/DELETE /quota). */
void engine_quota_changed(struct engine *e);

/* The L2 adapters in configuration order (*n = 0 without L2). Valid while the engine is ready. */
struct l2_adapter **engine_l2_adapters(struct engine *e, size_t *n);

/* GET /status body (a new reference). */
json_t *engine_status(struct engine *e);
/* Updates gauges that mirror engine state, just before a scrape. */
void engine_refresh_metrics(struct engine *e);
/* GET /config/adapters "adapters" array (a new reference). */
json_t *engine_adapters(struct engine *e);

#endif
