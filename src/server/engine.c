/* The engine: owns configuration, metrics, background jobs and (as they land)
 * the caches; answers the admin API's questions about them. */
#include "server/engine.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/periodic.h"
#include "base/version.h"

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

int engine_create(struct engine *e, const struct server_config *cfg, char *errbuf, size_t errlen) {
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
        snprintf(errbuf, errlen, "out of memory");
        return -1;
    }
    metrics_register_process(e->metrics);
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

int engine_start(struct engine *e, char *errbuf, size_t errlen) {
    (void)errbuf;
    (void)errlen;
    atomic_store(&e->ready, 1);
    return 0;
}

int engine_is_ready(const struct engine *e) { return e && atomic_load(&e->ready); }

void engine_destroy(struct engine *e) {
    atomic_store(&e->ready, 0);
    periodic_registry_free(e->periodic);
    metrics_free(e->metrics);
    e->periodic = NULL;
    e->metrics = NULL;
    e->magic = 0;
}

void engine_refresh_metrics(struct engine *e) { (void)e; }

json_t *engine_status(struct engine *e) {
    const struct server_config *c = e->cfg;
    json_t *sm = json_pack("{s:b}", "is_healthy", 1);
    return json_pack("{s:b, s:s, s:s, s:i, s:s, s:i, s:[], s:{}, s:i, s:o}", "is_healthy", 1,
                     "engine_type", "MPCacheServer", "instance_id", e->instance_id, "chunk_size",
                     (int)c->chunk_size, "hash_algorithm", c->hash_algorithm, "active_sessions", 0,
                     "registered_gpu_ids", "cache_context_meta", "active_prefetch_jobs", 0,
                     "storage_manager", sm);
}

json_t *engine_adapters(struct engine *e) {
    (void)e;
    return json_array();
}
