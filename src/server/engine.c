/* The engine: owns configuration, metrics, background jobs, the caches (L1, the L2 controller),
 * the lookup sessions and the KV-context registry, and carries out every operation the front
 * ends ask for (engine.h). This file: life cycle, metrics, periodic jobs, placements, status,
 * L2 objects and reconfiguration; the request path is in engine_data.c. It calls only
 * downward: L1, L2, sessions, kvctx, keys, base. */
#include "server/engine.h"
#include "server/engine_internal.h"

#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/heap.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/periodic.h"
#include "base/prefault.h"
#include "base/version.h"
#include "base/fleethash.h"
#include "server/keys.h"
#include "server/l1/l1.h"
#include "server/l2/adapter.h"
#include "server/l2/controller.h"
#include "server/l2/s3.h"

static void random_uuid(char *out, size_t len) {
    unsigned char b[16];
    if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b)) {
        /* Never fails for 16 bytes once the pool is initialised; keep going anyway. */
        uint64_t t = clock_mono_ns() ^ (uint64_t)getpid() << 32;
        memcpy(b, &t, 8);
        memcpy(b + 8, &t, 8);
    }
    b[6] = (unsigned char)((b[6] & 0x0f) | 0x40);
    b[8] = (unsigned char)((b[8] & 0x3f) | 0x80);
    snprintf(out, len, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static double uptime(void *arg) {
    const struct engine *e = arg;
    return clock_wall() - e->start_time;
}

int engine_create(struct engine *e, const struct server_config *cfg, char *err, size_t errlen) {
    memset(e, 0, sizeof(*e));
    e->magic = ENGINE_MAGIC;
    e->cfg = cfg;
    e->start_time = clock_wall();
    if (cfg->instance_id && *cfg->instance_id)
        snprintf(e->instance_id, sizeof(e->instance_id), "%s", cfg->instance_id);
    else
        random_uuid(e->instance_id, sizeof(e->instance_id));
    e->metrics = metrics_new();
    e->periodic = periodic_registry_new();
    if (!e->metrics || !e->periodic) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    metrics_register_process(e->metrics);
    e->lg_dp = log_get("lmcache.zmq");
    if (cfg->hash_seed && *cfg->hash_seed)
        keys_seed_from_string(cfg->hash_seed, e->seed);
    else
        keys_default_seed(e->seed);
    kvreg_init(&e->contexts);
    if (session_table_init(&e->sessions) != 0) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_init(&e->l2w_mu, NULL);
    pthread_cond_init(&e->l2w_cv, NULL);
    static const char *const INFO_LABELS[] = {"version", "commit", "instance_id", NULL};
    const char *info[] = {version_lmc(), version_commit(), e->instance_id};
    metric_set(
        metric_labels(metrics_gauge(e->metrics, "lmcache_build_info",
                                    "Build and identity of this server (always 1).", INFO_LABELS),
                      info),
        1);
    metrics_gauge_fn(e->metrics, "lmcache_uptime_seconds", "Seconds since the server started.",
                     uptime, e);
    return 0;
}

/* The `l1-evictor` periodic thread: holds L1 under its watermark and every salt under its
 * quota, and reclaims expired write leases. */
static int l1_evictor_tick(void *arg, json_t **summary) {
    struct engine *e = arg;
    struct l1_tick_report rep;
    if (l1_evict_tick(e->l1, clock_mono_ns(), &rep) < 0) return -1;
    *summary = json_pack("{s:b, s:I, s:I, s:I, s:I, s:f, s:f}", "triggered", rep.triggered,
                         "evicted_objects", (json_int_t)rep.evicted_objects, "evicted_bytes",
                         (json_int_t)rep.evicted_bytes, "quota_evicted_objects",
                         (json_int_t)rep.quota_evicted_objects, "reclaimed_staging",
                         (json_int_t)rep.reclaimed_staging, "usage_before", rep.usage_before,
                         "usage_after", rep.usage_after);
    return 0;
}

/* Gauges read the snapshot taken by engine_refresh_metrics just before each scrape, so one
 * scrape walks the table once. */
static double l1_gauge(struct engine *e, int which) {
    pthread_mutex_lock(&e->l1m.lock);
    const struct l1_stats *st = &e->l1m.snap;
    double v = which == 0   ? (double)st->bytes_used
               : which == 1 ? st->usage_ratio
               : which == 2 ? (double)st->staging_bytes
               : which == 3 ? (double)st->objects
               : which == 5 ? (double)st->pinned_bytes
                            : (double)st->bytes_total;
    pthread_mutex_unlock(&e->l1m.lock);
    return v;
}
static double g_l1_used(void *a) { return l1_gauge(a, 0); }
static double g_l1_ratio(void *a) { return l1_gauge(a, 1); }
static double g_l1_staging(void *a) { return l1_gauge(a, 2); }
static double g_l1_objects(void *a) { return l1_gauge(a, 3); }
static double g_l1_total(void *a) { return l1_gauge(a, 4); }
static double g_l1_pinned(void *a) { return l1_gauge(a, 5); }

static void register_l1_metrics(struct engine *e) {
    struct engine_l1_metrics *m = &e->l1m;
    static const char *const SALT[] = {"cache_salt", NULL};
    static const char *const DURING[] = {"during", NULL};
    pthread_mutex_init(&m->lock, NULL);
    m->read = metrics_counter(e->metrics, "lmcache_mp_l1_read_chunks_total", "Chunks read from L1.",
                              SALT);
    m->write = metrics_counter(e->metrics, "lmcache_mp_l1_write_chunks_total",
                               "Chunks written to L1.", SALT);
    m->evicted = metrics_counter(e->metrics, "lmcache_mp_l1_evicted_chunks_total",
                                 "Chunks evicted from L1.", SALT);
    m->alloc_fail =
        metrics_counter(e->metrics, "lmcache_mp_l1_allocation_failure_total",
                        "L1 allocations that failed with nothing left to evict.", DURING);
    m->ticks = metrics_counter(e->metrics, "lmcache_mp_l1_eviction_loop_ticks_total",
                               "Passes of the L1 background evictor.", NULL);
    m->triggered = metrics_counter(e->metrics, "lmcache_mp_l1_eviction_loop_triggered_total",
                                   "Evictor passes that found L1 above its watermark.", NULL);
    m->pin_refused = metrics_counter(
        e->metrics, "lmcache_mp_l1_pin_refused_total",
        "retrieve_bytes chunk frames copied because the pinned reply bytes were at their cap "
        "(--l1-pinned-reply-ratio).",
        NULL);
    /* Series that exist from the start, so dashboards see zeros rather than gaps. */
    metric_series(m->pin_refused);
    static const char *const STORE[] = {"l1_store"};
    metric_labels(m->alloc_fail, STORE);
    metric_series(m->ticks);
    metric_series(m->triggered);
    metrics_gauge_fn(e->metrics, "lmcache_mp_l1_memory_usage_bytes", "L1 bytes in use.", g_l1_used,
                     e);
    metrics_gauge_fn(e->metrics, "lmcache_mp_l1_memory_total_bytes", "L1 capacity in bytes.",
                     g_l1_total, e);
    metrics_gauge_fn(e->metrics, "lmcache_mp_l1_usage_ratio", "L1 bytes in use / capacity (0-1).",
                     g_l1_ratio, e);
    metrics_gauge_fn(e->metrics, "lmcache_mp_l1_staging_bytes",
                     "L1 bytes held by objects being written.", g_l1_staging, e);
    metrics_gauge_fn(e->metrics, "lmcache_mp_l1_objects", "Objects resident in L1.", g_l1_objects,
                     e);
    metrics_gauge_fn(e->metrics, "lmcache_mp_l1_pinned_reply_bytes",
                     "L1 bytes pinned by retrieve_bytes replies sent as chunk frames (one object's "
                     "size per reply).",
                     g_l1_pinned, e);
}

static double g_sessions(void *a) {
    size_t s, j;
    session_counts(&((struct engine *)a)->sessions, &s, &j);
    return (double)s;
}

static double g_jobs(void *a) {
    size_t s, j;
    session_counts(&((struct engine *)a)->sessions, &s, &j);
    return (double)j;
}

static double g_heap(void *a) {
    (void)a;
    return (double)heap_in_use();
}

static double g_contexts(void *a) {
    struct engine *e = a;
    pthread_mutex_lock(&e->contexts.lock);
    double n = (double)e->contexts.count;
    pthread_mutex_unlock(&e->contexts.lock);
    return n;
}

static void register_dp_metrics(struct engine *e) {
    struct engine_dp_metrics *m = &e->dpm;
    struct metrics *r = e->metrics;
    static const char *const OPRES[] = {"operation", "result", NULL};
    static const char *const OP[] = {"operation", NULL};
    static const char *const MS[] = {"model_name", "cache_salt", NULL};
    static const char *const MODEL[] = {"model_name", NULL};
    static const double GBPS[] = {1e8, 2.5e8, 5e8, 1e9, 2e9, 4e9, 8e9, 16e9, 32e9, 64e9};
    m->requests = metrics_counter(r, "lmcache_mp_dataplane_requests_total",
                                  "Data-plane requests by operation and result.", OPRES);
    m->duration = metrics_histogram(r, "lmcache_mp_dataplane_request_duration_seconds",
                                    "Data-plane request handling time.", OP,
                                    METRICS_LATENCY_BUCKETS, METRICS_LATENCY_NBUCKETS);
    m->lookups = metrics_counter(r, "lmcache_mp_lookups_requests_total", "Lookup requests.", MS);
    m->lookup_requested = metrics_counter(r, "lmcache_mp_lookup_requested_tokens_total",
                                          "Tokens asked for by lookups.", MS);
    m->lookup_hit = metrics_counter(r, "lmcache_mp_lookup_hit_tokens_total",
                                    "Tokens found by lookups (L1 and L2).", MS);
    m->lookup_hit_l2 = metrics_counter(r, "lmcache_mp_lookup_hit_l2_tokens_total",
                                       "Tokens found by lookups in L2 (loaded into L1).", MS);
    m->store_gbps = metrics_histogram(r, "lmcache_mp_l0_l1_store_throughput_bytes_per_second",
                                      "Engine-to-L1 store throughput per request.", MODEL, GBPS,
                                      sizeof(GBPS) / sizeof(GBPS[0]));
    m->load_gbps = metrics_histogram(r, "lmcache_mp_l0_l1_load_throughput_bytes_per_second",
                                     "L1-to-engine load throughput per request.", MODEL, GBPS,
                                     sizeof(GBPS) / sizeof(GBPS[0]));
    m->stores_submitted = metric_series(metrics_counter(r, "lmcache_mp_num_submitted_stores_total",
                                                        "Store requests received.", NULL));
    m->stores_finished = metric_series(metrics_counter(r, "lmcache_mp_num_finished_stores_total",
                                                       "Store requests completed.", NULL));
    m->retrieves_submitted = metric_series(metrics_counter(
        r, "lmcache_mp_num_submitted_retrieves_total", "Retrieve requests received.", NULL));
    m->retrieves_finished = metric_series(metrics_counter(
        r, "lmcache_mp_num_finished_retrieves_total", "Retrieve requests completed.", NULL));
    m->read_pauses = metric_series(metrics_counter(
        r, "lmcache_mp_dataplane_read_pauses_total",
        "Times the data socket stopped reading because a worker held --worker-queue-mb.", NULL));
    m->loop_requests = metric_series(metrics_counter(
        r, "lmcache_mp_dataplane_loop_requests_total",
        "Small requests run by the data socket's loop thread instead of a worker.", NULL));
    m->conns_cut = metric_series(metrics_counter(
        r, "lmcache_mp_dataplane_connections_cut_total",
        "Data connections cut because libzmq held more of them unread than --zmq-rcvhwm + 1 "
        "messages, or the most of any while malloc held more than --max-heap-mb.",
        NULL));
    m->heap_cuts = metric_series(metrics_counter(
        r, "lmcache_mp_dataplane_heap_cuts_total",
        "Data connections cut because malloc held more than --max-heap-mb while they held the "
        "most unread bytes or unread replies (also counted in "
        "lmcache_mp_dataplane_connections_cut_total).",
        NULL));
    m->unread_refusals = metric_series(metrics_counter(
        r, "lmcache_mp_dataplane_unread_reply_refusals_total",
        "Requests answered too_large because their client left more than --max-unread-reply-mb "
        "of replies unread.",
        NULL));
    metrics_gauge_fn(r, "lmcache_mp_heap_bytes",
                     "Bytes malloc holds: requests libzmq buffers, worker queues, replies, indexes "
                     "(L1 and registered shared memory are not in it).",
                     g_heap, e);
    metrics_gauge_fn(r, "lmcache_mp_active_prefetch_jobs", "Lookup jobs not yet reported.", g_jobs,
                     e);
    metrics_gauge_fn(r, "lmcache_mp_active_sessions", "Open lookup sessions.", g_sessions, e);
    metrics_gauge_fn(r, "lmcache_mp_registered_kv_caches", "Registered engine KV caches.",
                     g_contexts, e);
}

/* `worker-reaper`: drops registrations of engines that went silent. */
static int reaper_tick(void *arg, json_t **summary) {
    struct engine *e = arg;
    const struct server_config *c = e->cfg;
    size_t n = 0;
    if (c->worker_reap_timeout_seconds > 0)
        n = kvreg_reap(&e->contexts, clock_mono_ns(),
                       (uint64_t)(c->worker_reap_timeout_seconds * 1e9),
                       (uint64_t)(c->worker_registration_grace_seconds * 1e9));
    if (n) log_warn(e->lg_dp, "worker-reaper: dropped %zu silent KV registrations", n);
    *summary = json_pack("{s:I}", "reaped", (json_int_t)n);
    return 0;
}

/* `session-cleanup`: ends sessions nobody ended, releasing their read locks. */
static int session_cleanup_tick(void *arg, json_t **summary) {
    struct engine *e = arg;
    uint64_t now = clock_mono_ns(), ttl = (uint64_t)(e->cfg->session_ttl_seconds * 1e9);
    struct session *s = now > ttl ? session_expire(&e->sessions, now - ttl) : NULL;
    size_t n = 0;
    while (s) {
        struct session *next = s->next;
        engine_session_release(e, s, 0);
        n++;
        s = next;
    }
    *summary = json_pack("{s:I}", "expired", (json_int_t)n);
    return 0;
}

static void add_delta(struct metric_family *f, const char *const *labels, uint64_t now,
                      uint64_t *last) {
    if (now > *last) metrics_add(f, labels, (double)(now - *last));
    *last = now;
}

/* `l2-evictor`: per-adapter L2 eviction (watermark, IsolatedLRU quotas). */
static int l2_evictor_tick(void *arg, json_t **summary) {
    struct engine *e = arg;
    struct l2ctl_tick_report rep = {0};
    if (l2ctl_evict_tick(e->l2ctl, clock_mono_ns(), &rep) != L2_OK) return -1;
    *summary = json_pack("{s:I, s:I, s:I}", "evicted_objects", (json_int_t)rep.evicted_objects,
                         "evicted_bytes", (json_int_t)rep.evicted_bytes, "skipped_locked",
                         (json_int_t)rep.skipped_locked);
    return 0;
}

static double g_l2_usage(void *a) {
    struct engine *e = a;
    return e->l2ctl ? (double)l2ctl_usage_bytes(e->l2ctl) : 0;
}

static double g_l2_queue(void *a) {
    struct engine *e = a;
    struct l2ctl_stats st;
    l2ctl_stats(e->l2ctl, &st);
    return (double)st.store_queue_depth;
}

static double g_l2_inflight(void *a) {
    struct engine *e = a;
    struct l2ctl_stats st;
    l2ctl_stats(e->l2ctl, &st);
    return (double)(st.store_in_flight + st.prefetch_active);
}

static void register_l2_metrics(struct engine *e) {
    struct engine_l2_metrics *m = &e->l2m;
    struct metrics *r = e->metrics;
    static const char *const NAME[] = {"l2_name", NULL};
    static const char *const REASON[] = {"reason", NULL};
    m->last = calloc(e->nl2, sizeof(*m->last));
    m->store_completed = metrics_counter(r, "lmcache_mp_l2_store_completed_requests_total",
                                         "L2 store tasks completed, per adapter.", NAME);
    m->load_completed = metrics_counter(r, "lmcache_mp_l2_load_completed_requests_total",
                                        "L2 load tasks completed, per adapter.", NAME);
    m->store_objects = metrics_counter(r, "lmcache_mp_l2_store_completed_objects_chunks_total",
                                       "Chunks stored into L2, per adapter.", NAME);
    m->load_objects = metrics_counter(r, "lmcache_mp_l2_load_completed_objects_chunks_total",
                                      "Chunks loaded from L2, per adapter.", NAME);
    m->prefetch_failure = metrics_counter(r, "lmcache_mp_l2_prefetch_failure_total",
                                          "L2 prefetch failures by reason.", REASON);
    m->evicted = metrics_counter(r, "lmcache_mp_l2_evicted_objects_chunks_total",
                                 "Chunks evicted from L2.", NULL);
    m->store_submitted = metrics_counter(r, "lmcache_mp_l2_store_submitted_objects_chunks_total",
                                         "Chunks queued for write-through to L2.", NULL);
    metrics_gauge_fn(r, "lmcache_mp_l2_usage_bytes", "Bytes held by every L2 adapter.", g_l2_usage,
                     e);
    metrics_gauge_fn(r, "lmcache_mp_l2_store_queue_depth", "Chunks waiting for write-through.",
                     g_l2_queue, e);
    metrics_gauge_fn(r, "lmcache_mp_num_inflight_l2_operations",
                     "L2 store tasks and prefetch requests in flight.", g_l2_inflight, e);
    metric_series(m->evicted);
    metric_series(m->store_submitted);
    static const char *const OOM[] = {"l1_oom"}, *const NF[] = {"not_found"};
    metric_labels(m->prefetch_failure, OOM);
    metric_labels(m->prefetch_failure, NF);
}

/* Caller holds e->l1m.lock (the one mutex for mirrored counters). */
static void do_refresh_l2_metrics(struct engine *e) {
    struct engine_l2_metrics *m = &e->l2m;
    if (!e->l2ctl || !m->last) return;
    for (size_t i = 0; i < e->nl2; i++) {
        struct l2_counters c;
        l2_adapter_counters(e->l2[i], &c);
        const char *name[] = {l2_adapter_type_name(e->l2[i])};
        add_delta(m->store_completed, name, c.store_tasks, &m->last[i][0]);
        add_delta(m->load_completed, name, c.load_tasks, &m->last[i][1]);
        add_delta(m->store_objects, name, c.store_keys_ok, &m->last[i][2]);
        add_delta(m->load_objects, name, c.load_keys_ok, &m->last[i][3]);
    }
    struct l2ctl_stats st;
    l2ctl_stats(e->l2ctl, &st);
    static const char *const OOM[] = {"l1_oom"}, *const NF[] = {"not_found"};
    add_delta(m->prefetch_failure, OOM, st.prefetch_failure_l1_oom, &m->last_fail_oom);
    add_delta(m->prefetch_failure, NF, st.prefetch_failure_not_found, &m->last_fail_nf);
    add_delta(m->evicted, NULL, st.evicted_objects, &m->last_evicted);
    add_delta(m->store_submitted, NULL, st.store_submitted_objects, &m->last_submitted);
}

/* ---- placements (the master reporter's feed) ---- */

int engine_add_placement_listener(struct engine *e, engine_placement_fn fn,
                                  engine_cleared_fn cleared, void *arg) {
    if (e->nplacement >= ENGINE_PLACEMENT_LISTENERS) return -1;
    e->placement_fn[e->nplacement] = fn;
    e->cleared_fn[e->nplacement] = cleared;
    e->placement_arg[e->nplacement++] = arg;
    return 0;
}

static void placement_tell(struct engine *e, const uint8_t *h, int tier, bool present) {
    for (int i = 0; i < e->nplacement; i++)
        e->placement_fn[i](e->placement_arg[i], h, tier, present);
}

void engine_set_master_status(struct engine *e, json_t *(*fn)(void *arg), void *arg) {
    e->master_status_fn = fn;
    e->master_status_arg = arg;
}

static void placement_l1(void *arg, const struct l1_key *k, const char *model, const char *salt,
                         bool present) {
    struct engine *e = arg;
    uint8_t h[FLEETHASH_LEN];
    if (fleethash_compute(model, salt, k->kv_rank, k->hash, k->hash_len, h) == 0)
        placement_tell(e, h, ENGINE_TIER_DRAM, present);
}

static bool placement_obj(const struct l2_adapter *a) {
    return strcmp(l2_adapter_type_name(a), S3_TYPE_NAME) == 0;
}

static void placement_l2(struct engine *e, int idx, const struct keys_object_key *k, bool present) {
    uint8_t h[FLEETHASH_LEN];
    bool obj = idx >= 0 && (size_t)idx < e->nl2 && placement_obj(e->l2[idx]);
    if (fleethash_compute(k->model_name, k->cache_salt, k->kv_rank, k->hash, k->hash_len, h) == 0)
        placement_tell(e, h, obj ? ENGINE_TIER_OBJ : ENGINE_TIER_SSD, present);
}

static void placement_l2_stored(void *arg, int idx, const struct keys_object_key *k,
                                uint64_t size) {
    (void)size;
    placement_l2(arg, idx, k, true);
}

static void placement_l2_deleted(void *arg, int idx, const struct keys_object_key *k,
                                 uint64_t size) {
    (void)size;
    placement_l2(arg, idx, k, false);
}

/* Node-local adapters (fs, dax) feed the listener, starting with what they found at start. */
static bool placement_local(const struct l2_adapter *a) {
    const char *t = l2_adapter_type_name(a);
    return strcmp(t, "fs") == 0 || strcmp(t, "dax") == 0;
}

/* s3 adapters feed it too (ENGINE_TIER_OBJ), with the objects this process stored or found;
 * the bucket is not listed at start (it is shared and may be large). */
static void placement_attach_l2(struct engine *e) {
    if (!e->nplacement) return;
    for (size_t i = 0; i < e->nl2; i++) {
        struct l2_adapter *a = e->l2[i];
        bool obj = placement_obj(a);
        if (!placement_local(a) && !obj) continue;
        struct l2_listener l = {placement_l2_stored, NULL, placement_l2_deleted, e};
        if (l2_adapter_add_listener(a, &l) != L2_OK) continue;
        if (obj) continue;
        struct l2_usage u;
        l2_adapter_usage(a, &u);
        char *tok = NULL, msg[256];
        while (u.objects && l2_adapter_can_list(a)) {
            struct l2_list_page pg;
            if (l2_adapter_list(a, NULL, L2_PAGE_SIZE_MAX, tok, &pg, msg, sizeof(msg)) != L2_OK)
                break;
            free(tok);
            tok = pg.next_token ? strdup(pg.next_token) : NULL;
            for (size_t k = 0; k < pg.count; k++) placement_l2(e, (int)i, &pg.entries[k].key, true);
            l2_list_page_free(&pg);
            if (!tok) break;
        }
        free(tok);
    }
}

void engine_tier_capacities(struct engine *e, struct engine_tier_capacity *out) {
    memset(out, 0, sizeof(*out));
    if (e->l1) {
        struct l1_stats st;
        l1_get_stats(e->l1, clock_mono_ns(), &st);
        out->dram_total = st.bytes_total;
        out->dram_available = st.bytes_total > st.bytes_used ? st.bytes_total - st.bytes_used : 0;
    }
    for (size_t i = 0; i < e->nl2; i++) {
        if (!placement_local(e->l2[i])) continue;
        struct l2_usage u;
        l2_adapter_usage(e->l2[i], &u);
        out->ssd_total += u.capacity_bytes;
        if (u.capacity_bytes > u.bytes_used) out->ssd_available += u.capacity_bytes - u.bytes_used;
    }
}

int engine_start_caches(struct engine *e, char *err, size_t errlen) {
    const struct server_config *c = e->cfg;
    e->quota = quota_create();
    if (!e->quota) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    struct l1_config lc = {0};
    lc.size_bytes = (uint64_t)(c->l1_size_gb * (double)(1ULL << 30));
    lc.use_hugepages = c->l1_use_hugepages;
    lc.policy =
        strcmp(c->eviction_policy, "IsolatedLRU") == 0 ? L1_POLICY_ISOLATED_LRU : L1_POLICY_LRU;
    lc.trigger_watermark = c->eviction_trigger_watermark;
    lc.read_ttl_ns = (uint64_t)(c->l1_read_ttl_seconds * 1e9);
    lc.write_ttl_ns = (uint64_t)(c->l1_write_ttl_seconds * 1e9);
    lc.touch_interval_ns = 100 * 1000 * 1000ULL; /* lazy LRU: 100 ms */
    lc.pin_max_bytes = (uint64_t)(c->l1_pinned_reply_ratio * (double)lc.size_bytes);
    lc.quota = e->quota;
    if (e->nplacement) lc.listener = (struct l1_listener){placement_l1, e};
    char msg[256];
    if (l1_create(&lc, &e->l1, msg, sizeof(msg)) < 0) {
        errbuf_set(err, errlen, "L1: %s", msg);
        return -1;
    }
    register_l1_metrics(e);
    register_dp_metrics(e);
    if (json_array_size(c->l2_adapter) > 0) {
        struct l2ctl_config l2c = {0};
        l2c.l1 = e->l1;
        l2c.quota = e->quota;
        l2c.prefetch_max_in_flight = (uint32_t)c->l2_prefetch_max_in_flight;
        l2c.prefetch_max_keys = (size_t)c->l2_prefetch_max_keys;
        l2c.store_policy =
            strcmp(c->l2_store_policy, "skip_l1") == 0 ? L2CTL_STORE_SKIP_L1 : L2CTL_STORE_DEFAULT;
        l2c.store_done = engine_l2_store_done;
        l2c.store_done_arg = e;
        int rc = l2ctl_create(&l2c, c->l2_adapter, &e->l2ctl, msg, sizeof(msg));
        if (rc != L2_OK) {
            errbuf_set(err, errlen, "argument --l2-adapter: %s", msg);
            /* A configuration the adapter rejects is a bad option value. */
            return rc == L2_ERR_INVAL || rc == L2_ERR_UNKNOWN_TYPE ? ENGINE_ERR_CONFIG : -1;
        }
        if (l2ctl_start(e->l2ctl, msg, sizeof(msg)) != L2_OK) {
            errbuf_set(err, errlen, "L2: %s", msg);
            return -1;
        }
        e->nl2 = l2ctl_adapter_count(e->l2ctl);
        e->l2 = calloc(e->nl2, sizeof(*e->l2));
        if (!e->l2) {
            errbuf_set(err, errlen, "out of memory");
            return -1;
        }
        for (size_t i = 0; i < e->nl2; i++) e->l2[i] = l2ctl_adapter(e->l2ctl, i);
        placement_attach_l2(e);
        register_l2_metrics(e);
    }
    return 0;
}

/* Faults the L1 arena in ahead of use: a store into never-touched memory runs at a third of
 * memcpy speed (page faults and zeroing), into faulted memory at full speed. prefault_range
 * keeps contents, so it is safe while stores run. One-shot, in 64 MiB steps, stoppable. */
static void *prefault_main(void *arg) {
    struct engine *e = arg;
    pthread_setname_np(pthread_self(), "l1-prefault");
    void *base;
    uint64_t len, step = 64ULL << 20;
    l1_arena_region(e->l1, &base, &len);
    double t0 = clock_mono();
    for (uint64_t off = 0; off < len && !atomic_load(&e->prefault_stop); off += step) {
        uint64_t n = len - off < step ? len - off : step;
        if (prefault_range((char *)base + off, n, 1) != 0) {
            log_warn(log_get("lmcache.l1"), "L1 prefault stopped at %llu MiB: %s",
                     (unsigned long long)(off >> 20), strerror(errno));
            return NULL;
        }
        atomic_store(&e->prefaulted_bytes, off + n);
    }
    log_info(log_get("lmcache.l1"), "L1 prefault: %llu MiB in %.2f s",
             (unsigned long long)(atomic_load(&e->prefaulted_bytes) >> 20), clock_mono() - t0);
    return NULL;
}

int engine_start(struct engine *e, char *err, size_t errlen) {
    const struct server_config *c = e->cfg;
    char msg[256];
    if (c->l1_prefault && pthread_create(&e->prefault_tid, NULL, prefault_main, e) == 0)
        e->prefault_started = 1;
    if (kvwarm_start(&e->contexts) < 0) {
        errbuf_set(err, errlen, "kv-warm thread: %s", strerror(errno));
        return -1;
    }
    if (periodic_start(e->periodic, "l1-evictor", PERIODIC_HIGH, 0.1, l1_evictor_tick, e, msg,
                       sizeof(msg)) < 0) {
        errbuf_set(err, errlen, "l1-evictor: %s", msg);
        return -1;
    }
    if (e->l2ctl && periodic_start(e->periodic, "l2-evictor", PERIODIC_MEDIUM, 1.0, l2_evictor_tick,
                                   e, msg, sizeof(msg)) < 0) {
        errbuf_set(err, errlen, "l2-evictor: %s", msg);
        return -1;
    }
    double reap_every =
        c->worker_reap_timeout_seconds > 0 ? c->worker_reap_timeout_seconds / 4 : 30;
    if (periodic_start(e->periodic, "worker-reaper", PERIODIC_MEDIUM, reap_every, reaper_tick, e,
                       msg, sizeof(msg)) < 0 ||
        periodic_start(e->periodic, "session-cleanup", PERIODIC_MEDIUM, 10, session_cleanup_tick, e,
                       msg, sizeof(msg)) < 0) {
        errbuf_set(err, errlen, "periodic thread: %s", msg);
        return -1;
    }
    return 0;
}

void engine_set_ready(struct engine *e, int ready) { atomic_store(&e->ready, ready ? 1 : 0); }

size_t engine_clear_l1(struct engine *e) {
    size_t n = l1_clear(e->l1, true, clock_mono_ns());
    for (int i = 0; i < e->nplacement; i++)
        if (e->cleared_fn[i]) e->cleared_fn[i](e->placement_arg[i]);
    return n;
}

uint64_t engine_salt_usage_bytes(struct engine *e, const char *salt) {
    return l1_salt_usage_bytes(e->l1, salt) +
           (e->l2ctl ? l2ctl_salt_usage_bytes(e->l2ctl, salt) : 0);
}

void engine_quota_changed(struct engine *e) { l1_quota_changed(e->l1); }

int engine_is_ready(const struct engine *e) { return e && atomic_load(&e->ready); }

void engine_destroy(struct engine *e) {
    atomic_store(&e->ready, 0);
    /* Background jobs first, then what they use (the front ends are stopped already). */
    if (e->prefault_started) {
        atomic_store(&e->prefault_stop, 1);
        pthread_join(e->prefault_tid, NULL);
        e->prefault_started = 0;
    }
    kvwarm_stop(&e->contexts);
    periodic_registry_free(e->periodic);
    /* Pending L2 requests finish (their callbacks release locks through the session table). */
    if (e->l2ctl) l2ctl_destroy(e->l2ctl);
    e->l2ctl = NULL;
    free(e->l2);
    free(e->l2m.last);
    e->l2 = NULL;
    e->nl2 = 0;
    if (e->l1) {
        struct session *s = session_table_drain(&e->sessions);
        while (s) {
            struct session *n = s->next;
            engine_session_release(e, s, 0);
            s = n;
        }
    }
    session_table_destroy(&e->sessions);
    kvreg_destroy(&e->contexts);
    pthread_cond_destroy(&e->l2w_cv);
    pthread_mutex_destroy(&e->l2w_mu);
    if (e->l1) l1_destroy(e->l1);
    if (e->quota) quota_destroy(e->quota);
    free(e->l1m.last);
    metrics_free(e->metrics);
    e->periodic = NULL;
    e->metrics = NULL;
    e->magic = 0;
}

static void refresh_salt(const char *salt, const struct l1_salt_stats *st, void *arg) {
    struct engine_l1_metrics *m = arg;
    size_t i = st->id;
    m->seen++;
    if (i >= m->cap) {
        uint64_t(*grown)[4] = realloc(m->last, (i + 1) * sizeof(*m->last));
        if (!grown) return;
        memset(grown[m->cap], 0, (i + 1 - m->cap) * sizeof(*grown));
        m->last = grown;
        m->cap = i + 1;
    }
    if (m->last[i][3] != (uint64_t)st->gen + 1) { /* a new salt under this id */
        memset(m->last[i], 0, sizeof(m->last[i]));
        m->last[i][3] = (uint64_t)st->gen + 1;
    }
    const char *labels[] = {salt};
    add_delta(m->read, labels, st->read_chunks, &m->last[i][0]);
    add_delta(m->write, labels, st->write_chunks, &m->last[i][1]);
    add_delta(m->evicted, labels, st->evicted_chunks, &m->last[i][2]);
}

/* L1 keeps monotonic counters; the registry's counters get the increase since the last
 * refresh, so POST /metrics/reset zeroes them without touching L1. */
void engine_refresh_metrics(struct engine *e) {
    if (!engine_is_ready(e)) return;
    struct engine_l1_metrics *m = &e->l1m;
    struct l1_stats st;
    l1_get_stats(e->l1, clock_mono_ns(), &st);
    pthread_mutex_lock(&m->lock);
    m->snap = st;
    static const char *const STORE[] = {"l1_store"};
    add_delta(m->alloc_fail, STORE, st.alloc_failures, &m->last_alloc_fail);
    add_delta(m->ticks, NULL, st.eviction_ticks, &m->last_ticks);
    add_delta(m->triggered, NULL, st.eviction_triggered, &m->last_triggered);
    add_delta(m->pin_refused, NULL, st.pins_refused, &m->last_pin_refused);
    m->seen = 0;
    l1_salt_foreach(e->l1, refresh_salt, m);
    do_refresh_l2_metrics(e);
    pthread_mutex_unlock(&m->lock);
}

static json_t *l1_status(struct engine *e) {
    struct l1_stats st;
    l1_get_stats(e->l1, clock_mono_ns(), &st);
    return json_pack(
        "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:b, s:I, s:I, s:I, s:I, "
        "s:I}",
        "policy", e->cfg->eviction_policy, "objects", (json_int_t)st.objects, "doomed_objects",
        (json_int_t)st.doomed_objects, "staging_objects", (json_int_t)st.staging_objects,
        "temporary_objects", (json_int_t)st.temporary_objects, "locked_objects",
        (json_int_t)st.locked_objects, "read_locked_objects", (json_int_t)st.read_locked_objects,
        "write_locked_objects", (json_int_t)st.write_locked_objects, "bytes_used",
        (json_int_t)st.bytes_used, "bytes_total", (json_int_t)st.bytes_total, "staging_bytes",
        (json_int_t)st.staging_bytes, "usage_ratio", st.usage_ratio, "hugepages", st.hugetlb,
        "prefaulted_bytes", (json_int_t)atomic_load(&e->prefaulted_bytes), "pinned_objects",
        (json_int_t)st.pinned_objects, "pins", (json_int_t)st.pins, "pinned_bytes",
        (json_int_t)st.pinned_bytes, "pins_refused", (json_int_t)st.pins_refused);
}

json_t *engine_status(struct engine *e) {
    const struct server_config *c = e->cfg;
    json_t *sm =
        e->l2ctl ? l2ctl_status(e->l2ctl) : json_pack("{s:b, s:[]}", "is_healthy", 1, "adapters");
    json_object_set_new(sm, "l1", l1_status(e));
    size_t sessions = 0, jobs = 0;
    session_counts(&e->sessions, &sessions, &jobs);
    json_t *st =
        json_pack("{s:b, s:s, s:s, s:i, s:s, s:I, s:o, s:o, s:I, s:o}", "is_healthy",
                  json_is_true(json_object_get(sm, "is_healthy")), "engine_type", "MPCacheServer",
                  "instance_id", e->instance_id, "chunk_size", (int)c->chunk_size, "hash_algorithm",
                  c->hash_algorithm, "active_sessions", (json_int_t)sessions, "registered_gpu_ids",
                  kvreg_ids(&e->contexts), "cache_context_meta", kvreg_meta(&e->contexts),
                  "active_prefetch_jobs", (json_int_t)jobs, "storage_manager", sm);
    if (st && e->master_status_fn)
        json_object_set_new(st, "master", e->master_status_fn(e->master_status_arg));
    return st;
}

json_t *engine_adapters(struct engine *e) {
    return e->l2ctl ? l2ctl_adapters_json(e->l2ctl) : json_array();
}

json_t *engine_config_json(struct engine *e) { return e->cfg ? config_to_json(e->cfg) : NULL; }

/* ---- L2 objects ---- */

int engine_l2_find(struct engine *e, const char *name) {
    if (!e->l2ctl) return ENGINE_ERR_NO_L2;
    int idx = l2ctl_find_adapter(e->l2ctl, name);
    return idx < 0 ? ENGINE_ERR_NOT_FOUND : idx;
}

const char *engine_l2_name(struct engine *e, int idx) {
    return l2_adapter_type_name(l2ctl_adapter(e->l2ctl, (size_t)idx));
}

int engine_l2_list(struct engine *e, int idx, const char *model, size_t page_size,
                   const char *token, struct engine_object_page *out, char *err, size_t errlen) {
    struct l2_list_page page = {0};
    int rc = ENGINE_OK;
    memset(out, 0, sizeof(*out));
    errbuf_set(err, errlen, "%s", "");
    int l2rc = l2_adapter_list(l2ctl_adapter(e->l2ctl, (size_t)idx), model, page_size, token, &page,
                               err, errlen);
    if (l2rc == L2_ERR_NOT_SUPPORTED) return ENGINE_ERR_NOT_SUPPORTED;
    if (l2rc == L2_ERR_BAD_TOKEN) return ENGINE_ERR_BAD_TOKEN;
    if (l2rc != L2_OK) {
        if (!*err) errbuf_set(err, errlen, "%s", l2_strerror(l2rc));
        return l2rc == L2_ERR_INVAL ? ENGINE_ERR_INVAL : ENGINE_ERR_INTERNAL;
    }
    out->entries = malloc((page.count ? page.count : 1) * sizeof(*out->entries));
    if (!out->entries) {
        errbuf_set(err, errlen, "out of memory");
        rc = ENGINE_ERR_INTERNAL;
        goto out;
    }
    for (size_t i = 0; i < page.count; i++) {
        out->entries[i].key = page.entries[i].key;
        out->entries[i].size = page.entries[i].size;
    }
    out->count = page.count;
    out->next_token = page.next_token; /* handed over */
    page.next_token = NULL;
out:
    l2_list_page_free(&page);
    return rc;
}

void engine_object_page_free(struct engine_object_page *p) {
    free(p->entries);
    free(p->next_token);
    memset(p, 0, sizeof(*p));
}

int engine_l2_delete(struct engine *e, int idx, const struct keys_object_key *keys, size_t n,
                     uint8_t *deleted, size_t *skipped, char *err, size_t errlen) {
    int rc = l2ctl_delete(e->l2ctl, idx, keys, n, deleted, skipped);
    if (rc == L2_OK) return ENGINE_OK;
    errbuf_set(err, errlen, "%s", l2_strerror(rc));
    return ENGINE_ERR_INTERNAL;
}

/* ---- runtime reconfiguration ---- */

/* The i-th reconfigurable adapter of type backend (without regard to case), in configuration
 * order, or NULL; *count (may be NULL) gets how many there are. */
static struct l2_adapter *reconfigurable(struct engine *e, const char *backend, size_t i,
                                         size_t *count) {
    struct l2_adapter *hit = NULL;
    size_t found = 0;
    for (size_t k = 0; k < e->nl2; k++) {
        if (!l2_adapter_reconfigurable(e->l2[k])) continue;
        if (strcasecmp(l2_adapter_type_name(e->l2[k]), backend) != 0) continue;
        if (found == i) hit = e->l2[k];
        found++;
    }
    if (count) *count = found;
    return hit;
}

size_t engine_reconfigurable_count(struct engine *e, const char *backend) {
    size_t n = 0;
    reconfigurable(e, backend, SIZE_MAX, &n);
    return n;
}

json_t *engine_reconfigure_status(struct engine *e, const char *backend, size_t i) {
    struct l2_adapter *a = reconfigurable(e, backend, i, NULL);
    if (!a) return NULL;
    json_t *st = a->ops->reconfigure_status ? a->ops->reconfigure_status(a) : NULL;
    if (!json_is_object(st)) {
        json_decref(st);
        st = json_pack("{s:s}", "type", l2_adapter_type_name(a));
    }
    return st;
}

json_t *engine_reconfigure(struct engine *e, const char *backend, size_t i, const char *op,
                           json_t *body, int *http_status) {
    struct l2_adapter *a = reconfigurable(e, backend, i, NULL);
    if (!a) return NULL;
    return a->ops->reconfigure(a, op, body, http_status);
}
