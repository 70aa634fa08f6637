/* The storage controller: owns the L2 adapters (configuration order, 0 = primary), writes retained
 * L1 objects through to every adapter, prefetches L1 misses from the lowest-index adapter holding
 * them, runs per-adapter L2 eviction and keeps the L2 side of usage and metrics.
 *
 * Threads. l2ctl_start() starts one plain named thread, `l2-controller`, that owns every adapter
 * task: it takes write-through and prefetch requests from a queue, submits adapter tasks and
 * finishes them when the adapters' shared completion eventfd fires. Adapters run their own I/O
 * threads (fs: `l2-fs-uring` or `l2-fs-io`). Eviction does not run on a thread of its own: the
 * daemon registers a periodic thread (`l2-evictor`, ~1 s) that calls l2ctl_evict_tick().
 *
 * Locks (docs/threads.md): the request queue mutex and the per-adapter eviction-tracker mutexes
 * are leaves with respect to L1 -- no L1 lock is held when they are taken and they are never held
 * across an L1 call or an adapter call.
 *
 * Time: calls whose logic depends on time take now_ns (monotonic nanoseconds). */
#ifndef LMCACHE_SERVER_L2_CONTROLLER_H
#define LMCACHE_SERVER_L2_CONTROLLER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server/keys.h"
#include "server/l1/l1.h"
#include "server/l1/quota.h"
#include "server/l2/adapter.h"

enum l2ctl_store_policy {
    L2CTL_STORE_DEFAULT = 0, /* every key to every adapter, keep it in L1 */
    L2CTL_STORE_SKIP_L1 = 1  /* the same, then delete it from L1 once every adapter stored it */
};

enum l2ctl_trim {
    L2CTL_TRIM_PREFIX = 0, /* lookups: load the leading run of keys found in L2, stop at a miss */
    L2CTL_TRIM_SPARSE = 1  /* warm prefetch: load every key found, gaps allowed */
};

struct l2ctl_config {
    struct l1 *l1;                   /* borrowed; required */
    struct quota *quota;             /* borrowed; IsolatedLRU L2 eviction limits (may be NULL) */
    uint32_t prefetch_max_in_flight; /* --l2-prefetch-max-in-flight; 0 = 8 */
    size_t prefetch_max_keys; /* keys of queued and running prefetches together; 0 = 262144 */
    enum l2ctl_store_policy store_policy;
    size_t store_queue_max; /* objects waiting for write-through; 0 = 65536. Beyond it
                               l2ctl_store drops (and counts) the excess */
    size_t store_batch;     /* objects per adapter store task; 0 = 32 */
    /* Optional: told, on the controller thread and without a lock held, when the write-through
     * of an accepted object ends: ok when every adapter stored it, else 0 (an adapter failed,
     * or it left L1 before its turn). It must be quick and must not call l2ctl_*. */
    void (*store_done)(void *arg, const struct l1_key *key, int ok);
    void *store_done_arg;
};

/* The result of one prefetch request. */
struct l2ctl_prefetch_result {
    uint64_t id;
    size_t total;         /* keys submitted */
    size_t found;         /* keys loaded into L1 by this request */
    size_t prefix;        /* leading keys now in L1 with the requested read locks: loaded ones,
                             and (PREFIX) keys that were already resident and got locked */
    size_t l1_oom;        /* keys found in L2 that did not fit into L1 */
    const uint8_t *ready; /* total bytes, 1 = key i is in L1 with its read locks (valid during
                             the callback / until the next poll of this id) */
};

/* Called on the l2-controller thread when a request finishes (no lock held). It must be quick
 * and must not call l2ctl_* functions other than l2ctl_stats. */
typedef void (*l2ctl_prefetch_cb)(void *arg, const struct l2ctl_prefetch_result *r);

struct l2ctl_stats {
    /* write-through */
    uint64_t store_submitted_objects; /* accepted by l2ctl_store */
    uint64_t store_dropped_objects;   /* queue full, or no longer readable in L1 */
    uint64_t store_completed_requests, store_completed_objects, store_failed_objects;
    uint64_t store_bytes;
    uint64_t skip_l1_deleted; /* objects dropped from L1 by the skip_l1 policy */
    /* prefetch */
    uint64_t prefetch_requests, prefetch_completed;
    uint64_t prefetch_refused; /* refused: prefetch_max_keys queued or running */
    uint64_t prefetch_lookup_objects, prefetch_found_objects;
    uint64_t load_completed_objects, load_failed_objects, load_bytes;
    uint64_t prefetch_failure_l1_oom, prefetch_failure_not_found;
    /* gauges */
    uint64_t store_queue_depth;       /* objects waiting */
    uint64_t store_in_flight;         /* adapter store tasks in flight */
    uint64_t prefetch_active;         /* requests in a lookup/load phase */
    uint64_t prefetch_queued;         /* requests waiting for a slot */
    uint64_t prefetch_results_unread; /* finished requests not polled yet */
    /* eviction */
    uint64_t evicted_objects, evicted_bytes, evict_ticks, evict_skipped_locked;
};

struct l2ctl_tick_report {
    uint64_t evicted_objects, evicted_bytes, skipped_locked;
};

struct l2ctl;

/* Creates the controller and one adapter per element of adapter_configs (a JSON array of
 * --l2-adapter objects, in order). Adapters' "eviction" objects ({"eviction_policy": "LRU" |
 * "IsolatedLRU" | "noop", "trigger_watermark": 0.8, "eviction_ratio": 0.2}) are read here.
 * Returns L2_OK, or an error with a message naming the adapter. */
int l2ctl_create(const struct l2ctl_config *cfg, const json_t *adapter_configs, struct l2ctl **out,
                 char *err, size_t errlen);
/* Starts the l2-controller thread. Returns L2_OK or L2_ERR_NOMEM with a message. */
int l2ctl_start(struct l2ctl *c, char *err, size_t errlen);
/* Stops the thread (requests still queued finish as failures; callbacks fire), destroys the
 * adapters, frees everything. */
void l2ctl_destroy(struct l2ctl *c);

size_t l2ctl_adapter_count(const struct l2ctl *c);
struct l2_adapter *l2ctl_adapter(struct l2ctl *c, size_t i);
/* Index of the first adapter whose type_name equals name (the ?adapter= selector); NULL or ""
 * selects the primary. -1 when none matches (or there are no adapters). */
int l2ctl_find_adapter(struct l2ctl *c, const char *name);

/* ---- write-through ----------------------------------------------------------------------------
 * Queues retained L1 objects (call after l1_finish_write of a STORE; never for temporary objects
 * or prefetched data) for asynchronous store into every adapter. keys[i] and l1keys[i] name the
 * same object. Never blocks on I/O. Returns the number of objects accepted (the rest were dropped
 * because the queue is full, and counted). The object is read with an L1 read lock while it is
 * being stored; an object no longer resident when its turn comes is skipped. */
size_t l2ctl_store(struct l2ctl *c, const struct keys_object_key *keys, const struct l1_key *l1keys,
                   size_t n);

/* ---- prefetch ---------------------------------------------------------------------------------
 * Submits a request to bring keys[0..n) (in order; all missing from L1 at the caller's last look)
 * from L2 into L1. Each key is looked up in every adapter and loaded from the lowest-index one
 * that has it, into l1_reserve_write(temporary) and l1_finish_write(read_locks). Keys that are
 * resident in L1 by then are not loaded: under PREFIX they get read_locks read locks (when
 * read_locks > 0) and count towards the prefix; under SPARSE they are skipped and not counted.
 * At most prefetch_max_in_flight requests are in their lookup/load phases; the rest wait.
 * When cb is set it receives the result on the controller thread and the result is not kept;
 * otherwise poll it with l2ctl_prefetch_poll. Returns L2_OK and the request id (> 0), or
 * L2_ERR_NOMEM / L2_ERR_CLOSED / L2_ERR_NOT_FOUND (no adapters), or L2_ERR_BUSY when the keys
 * of the queued and running requests would pass prefetch_max_keys (nothing is queued: about
 * 1 KiB of the controller's per key, so the queue's memory is bounded). */
int l2ctl_prefetch_submit(struct l2ctl *c, const struct keys_object_key *keys,
                          const struct l1_key *l1keys, size_t n, enum l2ctl_trim trim,
                          uint32_t read_locks, bool temporary, l2ctl_prefetch_cb cb, void *cb_arg,
                          uint64_t *id);
/* Finished results of requests without a callback kept for polling; older ones are dropped. */
#define L2CTL_MAX_UNREAD 1024

/* L2_OK with *out filled and the result dropped (exactly once), L2_ERR_BUSY while the request
 * runs, L2_ERR_NOT_FOUND for an unknown or already-consumed id. out->ready stays valid until the
 * next l2ctl_prefetch_poll or l2ctl_destroy. */
int l2ctl_prefetch_poll(struct l2ctl *c, uint64_t id, struct l2ctl_prefetch_result *out);

/* ---- admin ------------------------------------------------------------------------------------
 * Deletes keys from adapter `index` (DELETE /cache/objects): locked keys are skipped. deleted (may
 * be NULL) gets n bytes. Returns the adapter's status, L2_ERR_NOT_FOUND for a bad index. */
int l2ctl_delete(struct l2ctl *c, int index, const struct keys_object_key *keys, size_t n,
                 uint8_t *deleted, size_t *skipped);
/* Bytes of one salt over every adapter ("" = the empty salt): the L2 part of GET /quota. */
uint64_t l2ctl_salt_usage_bytes(struct l2ctl *c, const char *salt);
/* Total bytes over every adapter. */
uint64_t l2ctl_usage_bytes(struct l2ctl *c);

/* One pass of L2 eviction over every adapter that has an "eviction" config:
 *   LRU: when capacity > 0 and bytes_used >= watermark * capacity, delete least recently stored
 *        or accessed objects until bytes_used <= capacity * watermark * (1 - ratio).
 *   IsolatedLRU: for every salt with bytes, limit = its quota (unregistered: 0); when bytes >=
 *        watermark * limit, delete that salt's LRU objects down to limit * watermark * (1 - ratio)
 *        (all of them when the limit is 0). Works without a capacity.
 * Locked objects are skipped (and moved to the recent end). Returns L2_OK; fills *out. */
int l2ctl_evict_tick(struct l2ctl *c, uint64_t now_ns, struct l2ctl_tick_report *out);

void l2ctl_stats(struct l2ctl *c, struct l2ctl_stats *out);
/* The "storage_manager" section of GET /status (a new JSON object): is_healthy (every adapter
 * healthy), the controller's counters and "adapters": [l2_adapter_status of each]. */
json_t *l2ctl_status(struct l2ctl *c);
/* GET /config/adapters "adapters" (a new JSON array): index, type_name, tier "l2", primary,
 * reconfigurable. */
json_t *l2ctl_adapters_json(struct l2ctl *c);

#endif
