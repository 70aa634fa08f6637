/* `lmcache master` / `umbp_master [listen_address] [metrics_port]`: configuration from the
 * environment, signal handling, the background jobs and the start/stop order. */
#include "master/master.h"

#include <errno.h>
#include <grpc/grpc.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/periodic.h"
#include "base/strbuf.h"
#include "master/mgrpc.h"
#include "master/mhttp.h"
#include "master/mrelay.h"
#include "master/mrpc.h"
#include "master/mstore.h"
#include "master/mstore_redis.h"

static int64_t wall_ms(void) { return (int64_t)(clock_wall() * 1000.0); }

static uint64_t rand64(void) {
    static _Thread_local uint64_t s;
    if (!s) s = clock_mono_ns() ^ ((uint64_t)(uintptr_t)&s << 17) ^ 0x9e3779b97f4a7c15ull;
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
}

static const char *env_get(const char *name) { return getenv(name); }

static void env_warn(const char *msg, void *arg) { log_warn((struct logger *)arg, "%s", msg); }

/* MORI_UMBP_LOG_LEVEL, else MORI_GLOBAL_LOG_LEVEL, else LMCACHE_LOG_LEVEL, else ERROR. */
static void init_log_level(void) {
    const char *names[] = {"MORI_UMBP_LOG_LEVEL", "MORI_GLOBAL_LOG_LEVEL", "LMCACHE_LOG_LEVEL"};
    int lvl = LOG_ERROR;
    for (size_t i = 0; i < 3; i++) {
        const char *v = getenv(names[i]);
        if (!v || !*v) continue;
        if (strcasecmp(v, "trace") == 0)
            lvl = LOG_DEBUG;
        else if ((lvl = log_level_parse(v)) < 0)
            lvl = LOG_ERROR;
        break;
    }
    log_set_level(log_get("lmcache"), lvl);
}

static int tick_reaper(void *arg, json_t **summary) {
    struct master *m = arg;
    size_t n = mrpc_reap(m, wall_ms());
    *summary = json_pack("{s:I}", "expired", (json_int_t)n);
    return 0;
}

static int tick_hit_gc(void *arg, json_t **summary) {
    struct master *m = arg;
    size_t n = mrpc_hit_gc(m, wall_ms());
    *summary = json_pack("{s:I}", "dropped", (json_int_t)n);
    return 0;
}

static int render_metrics(void *arg, struct strbuf *out) {
    struct master *m = arg;
    if (metrics_render(m->metrics, out)) return -1;
    return mrelay_render(m->relay, out);
}

static int parse_port(const char *s, int *port) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 0 || v > 65535) return -1;
    *port = (int)v;
    return 0;
}

static void usage(FILE *f) {
    fprintf(f, "usage: umbp_master [listen_address] [metrics_port]\n"
               "       lmcache master [listen_address] [metrics_port]\n"
               "  listen_address  gRPC host:port (default 0.0.0.0:50051)\n"
               "  metrics_port    Prometheus port, 0 disables it (default 9091)\n"
               "Knobs come from the environment; see docs/master.md.\n");
}

int master_main(int argc, char **argv) {
    if (argc > 1 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)) {
        usage(stdout);
        return 0;
    }
    const char *addr = argc > 1 ? argv[1] : "0.0.0.0:50051";
    int mport = 9091;
    if (argc > 2 && parse_port(argv[2], &mport)) {
        fprintf(stderr, "umbp_master: invalid metrics_port '%s'\n", argv[2]);
        usage(stderr);
        return 2;
    }
    init_log_level();
    struct master m = {.lg = log_get("lmcache.master"), .now_ms = wall_ms, .rand64 = rand64};
    mcfg_load(&m.cfg, env_get, env_warn, m.lg);

    if (!m.cfg.redis_pool_size) {
        long n = sysconf(_SC_NPROCESSORS_ONLN) * 2;
        m.cfg.redis_pool_size = (uint64_t)(n < 4 ? 4 : n > 32 ? 32 : n);
    }

    /* The one line printed whatever the log level (two with the Redis store). */
    char timing[512];
    mcfg_timing_line(&m.cfg, timing, sizeof(timing));
    printf("[Master] Resolved timing: %s\n", timing);
    bool redis = strcmp(m.cfg.metadata_backend, "redis") == 0;
    if (redis) {
        char line[3200];
        mcfg_store_line(&m.cfg, line, sizeof(line));
        printf("[Master] Resolved metadata store: %s\n", line);
    }
    fflush(stdout);
    log_info(m.lg, "[Master] Resolved route-put strategy: select_algo=%s node_affinity=%s",
             m.cfg.route_put_select_algo, m.cfg.route_put_node_affinity);

    /* Block the signals before any thread exists so every thread inherits the mask. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);

    int rc = 1;
    struct mgrpc *g = NULL;
    struct mhttp *h = NULL;
    struct periodic_registry *jobs = NULL;
    char err[256] = "";
    if (mport) {
        m.metrics = metrics_new();
        m.relay = mrelay_new();
        if (!m.metrics || !m.relay) {
            fprintf(stderr, "umbp_master: cannot set up metrics\n");
            goto out_early;
        }
    }
    if (redis) {
        struct mstore_redis_cfg rcfg = {
            .uri = m.cfg.redis_uri,
            .shard_uris = m.cfg.redis_shard_uris,
            .ns = m.cfg.redis_namespace,
            .password = m.cfg.redis_password,
            .connect_timeout_ms = (uint32_t)m.cfg.redis_connect_timeout_ms,
            .socket_timeout_ms = (uint32_t)m.cfg.redis_socket_timeout_ms,
            .pool_size = (uint32_t)m.cfg.redis_pool_size,
            .shards = (uint32_t)m.cfg.redis_block_shards,
            .required = (int)m.cfg.redis_required,
            .cluster = (int)m.cfg.redis_cluster,
            .cache_mb = (uint32_t)m.cfg.redis_cache_mb,
            .metrics = m.metrics,
            .lg = m.lg,
        };
        m.store = mstore_redis_create(&rcfg, err, sizeof(err));
    } else {
        struct mstore_mem_cfg scfg = {.shards = (uint32_t)m.cfg.index_shards};
        m.store = mstore_mem_create(&scfg);
        if (!m.store) errbuf_set(err, sizeof(err), "out of memory");
    }
    if (!m.store) {
        fprintf(stderr, "umbp_master: cannot create the metadata store: %s\n", err);
    out_early:
        mrelay_free(m.relay);
        metrics_free(m.metrics);
        return 1;
    }
    log_info(m.lg, "[MetadataStore] backend=%s", m.store->ops->name);
    log_info(m.lg, "[Master] Starting UMBP master on %s, metrics port %d", addr, mport);
    if (mport) {
        if (mrpc_metrics_init(&m)) {
            fprintf(stderr, "umbp_master: cannot set up metrics\n");
            goto out;
        }
        const char *host = getenv("LMCACHE_MASTER_METRICS_HOST");
        h = mhttp_start(host && *host ? host : "0.0.0.0", mport, render_metrics, &m, err,
                        sizeof(err));
        if (!h) {
            fprintf(stderr, "umbp_master: %s\n", err);
            goto out;
        }
        log_info(m.lg, "[Master] Metrics server listening on port %d", mport);
    }
    grpc_init();
    jobs = periodic_registry_new();
    if (!jobs ||
        periodic_start(jobs, "master.reaper", PERIODIC_HIGH, (double)m.cfg.reaper_interval_sec,
                       tick_reaper, &m, err, sizeof(err)) ||
        periodic_start(jobs, "master.hit_gc", PERIODIC_MEDIUM,
                       (double)m.cfg.hit_index_gc_interval_sec, tick_hit_gc, &m, err,
                       sizeof(err))) {
        fprintf(stderr, "umbp_master: %s\n", *err ? err : "cannot start background jobs");
        goto out_grpc;
    }
    log_info(m.lg, "[Reaper] Started (interval=%llus, expiry=%llus)",
             (unsigned long long)m.cfg.reaper_interval_sec,
             (unsigned long long)(m.cfg.heartbeat_ttl_sec * m.cfg.max_missed_heartbeats));
    log_info(m.lg, "[Master] External KV hit index GC started (ttl=%llus, interval=%llus)",
             (unsigned long long)m.cfg.hit_index_ttl_sec,
             (unsigned long long)m.cfg.hit_index_gc_interval_sec);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nthreads = m.cfg.threads ? (int)m.cfg.threads : (int)(ncpu < 2 ? 2 : ncpu);
    int port = 0;
    g = mgrpc_start(&m, addr, nthreads, &port, err, sizeof(err));
    if (!g) {
        fprintf(stderr, "umbp_master: %s\n", err);
        goto out_grpc;
    }
    log_info(m.lg, "[Master] Listening on %s", addr);

    int sig = 0;
    while (sigwait(&set, &sig) != 0) {
    }
    log_warn(m.lg, "[Master] Caught signal %d, shutting down", sig);
    mgrpc_stop(g, (int)m.cfg.grpc_shutdown_deadline_sec);
    rc = 0;
out_grpc:
    periodic_registry_free(jobs);
    grpc_shutdown();
out:
    mhttp_stop(h);
    m.store->ops->destroy(m.store);
    mrpc_metrics_free(&m);
    mrelay_free(m.relay);
    metrics_free(m.metrics);
    if (rc == 0) log_info(m.lg, "[Master] Exited cleanly");
    return rc;
}
