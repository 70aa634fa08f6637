/* `lmcache server`: parses options, owns the start and stop order of the layers (engine, then
 * the admin API, then the data plane; the reverse on SIGINT/SIGTERM), and reports readiness to
 * systemd. The front ends call the engine; the engine never calls them. */
#include "server/server.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/errbuf.h"
#include "base/log.h"
#include "base/sdnotify.h"
#include "base/stackdump.h"
#include "server/admin/http.h"
#include "server/config.h"
#include "server/copypool.h"
#include "server/dataplane/dataplane.h"
#include "server/engine.h"
#include "server/fleet/kvevents.h"
#include "server/fleet/reporter.h"

/* Loggers that exist from the start so GET /loglevel lists them. */
static const char *const LOGGERS[] = {"lmcache",          "lmcache.server", "lmcache.http",
                                      "lmcache.l1",       "lmcache.l2",     "lmcache.zmq",
                                      "lmcache.periodic", "lmcache.master"};

/* --copy-threads: -1 is one helper per online CPU beyond the first (the worker's own), at most
 * 8 (a single client's copy gains little past memory bandwidth). */
static unsigned server_copy_threads(long opt) {
    if (opt >= 0) return (unsigned)opt;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (ncpu <= 1) return 0;
    return ncpu - 1 > 8 ? 8u : (unsigned)(ncpu - 1);
}

int server_main(int argc, char **argv) {
    char err[512];
    struct server_config cfg;
    for (size_t i = 0; i < sizeof(LOGGERS) / sizeof(LOGGERS[0]); i++) log_get(LOGGERS[i]);
    if (log_init_from_env() < 0) {
        fprintf(stderr, "lmcache server: error: LMCACHE_LOG_LEVEL: invalid level '%s'\n",
                getenv("LMCACHE_LOG_LEVEL"));
        return 2;
    }
    int rc = config_parse(&cfg, argc, argv, err, sizeof(err));
    if (rc != 0) {
        config_free(&cfg);
        if (rc > 0) return 0;
        fprintf(stderr, "lmcache server: error: %s\n", err);
        return 2;
    }
    if (cfg.log_level) log_set_level(log_get("lmcache"), log_level_parse(cfg.log_level));
    dataplane_tune_malloc(&cfg); /* before any thread exists */
    struct logger *lg = log_get("lmcache.server");
    /* Token and TLS files are option values: a bad one is reported before anything starts. */
    struct admin_options aopt;
    if (admin_options_load(&aopt, &cfg, err, sizeof(err)) < 0) {
        fprintf(stderr, "lmcache server: error: %s\n", err);
        config_free(&cfg);
        return 2;
    }

    /* Signals are taken by sigwait in this thread only; every thread created from
     * here on inherits the mask. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    stackdump_init();

    static struct engine engine;
    if (engine_create(&engine, &cfg, err, sizeof(err)) < 0) {
        fprintf(stderr, "lmcache server: error: %s\n", err);
        admin_options_free(&aopt);
        config_free(&cfg);
        return 1;
    }
    /* The master reporter hooks into the engine before the caches exist: objects found on disk
     * at start are its first placements. */
    struct reporter *reporter = NULL;
    if (cfg.master_address && cfg.master_address[0]) {
        reporter = reporter_create(&engine, err, sizeof(err));
        if (!reporter) {
            fprintf(stderr, "lmcache server: error: %s\n", err);
            engine_destroy(&engine);
            admin_options_free(&aopt);
            config_free(&cfg);
            return 1;
        }
    }
    struct kvevents *kvev = NULL;
    bool kv_on = cfg.kv_events_endpoint && cfg.kv_events_endpoint[0];
    if (kv_on || (cfg.kv_events_replay_endpoint && cfg.kv_events_replay_endpoint[0])) {
        if (kv_on)
            kvev = kvevents_create(&engine, err, sizeof(err));
        else
            errbuf_set(err, sizeof(err),
                       "argument --kv-events-replay-endpoint: needs --kv-events-endpoint");
        if (!kvev) {
            fprintf(stderr, "lmcache server: error: %s\n", err);
            engine_destroy(&engine);
            reporter_free(reporter);
            admin_options_free(&aopt);
            config_free(&cfg);
            return 2;
        }
    }
    /* Caches first: an L2 adapter that rejects its configuration is a bad option value, reported
     * before any port is bound. */
    int crc = engine_start_caches(&engine, err, sizeof(err));
    if (crc < 0) {
        fprintf(stderr, "lmcache server: error: %s\n", err);
        engine_destroy(&engine);
        reporter_free(reporter);
        kvevents_free(kvev);
        admin_options_free(&aopt);
        config_free(&cfg);
        return crc == ENGINE_ERR_CONFIG ? 2 : 1;
    }
    struct admin *admin = admin_start(&engine, &aopt, err, sizeof(err));
    int tls = aopt.tls_cert != NULL, auth = aopt.token_set;
    admin_options_free(&aopt);
    if (!admin) {
        log_error(lg, "HTTP admin API: %s", err);
        engine_destroy(&engine);
        reporter_free(reporter);
        kvevents_free(kvev);
        config_free(&cfg);
        return 1;
    }
    log_info(lg, "LMCache HTTP API is running on %s://%s:%ld (instance %s%s)",
             tls ? "https" : "http", cfg.http_host, cfg.http_port, engine.instance_id,
             auth ? ", bearer token required" : "");

    /* Test hook: hold the engine back so probes can observe the not-ready state. */
    const char *delay = getenv("LMCACHE_TEST_INIT_DELAY_MS");
    if (delay && atol(delay) > 0) {
        struct timespec ts = {atol(delay) / 1000, (atol(delay) % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
    /* The copy helpers start before the data plane and stop after it: no copy is running
     * once dataplane_stop returned. */
    struct copypool *copypool = NULL;
    const char *what = "engine";
    if (engine_start(&engine, err, sizeof(err)) == 0) {
        what = "copy pool";
        copypool = copypool_start(server_copy_threads(cfg.copy_threads), err, sizeof(err));
    }
    if (!copypool) {
        log_error(lg, "%s failed to start: %s", what, err);
        admin_stop(admin, 1.0);
        engine_destroy(&engine);
        reporter_free(reporter);
        kvevents_free(kvev);
        config_free(&cfg);
        return 1;
    }
    /* helpers only where a core is free (a shared machine's other load included) */
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (!cfg.copy_threads_always)
        copypool_set_gate(copypool, copypool_runnable_proc, NULL, ncpu > 0 ? (unsigned)ncpu : 1);
    engine.copypool = copypool;
    log_info(lg, "copy pool: %u helper threads (--copy-threads %ld)%s", copypool_threads(copypool),
             cfg.copy_threads, cfg.copy_threads_always ? "" : ", used while a core is free");
    struct dataplane *dp = dataplane_start(&engine, cfg.host, (int)cfg.port, (int)cfg.max_workers,
                                           (size_t)cfg.max_message_mb << 20, err, sizeof(err));
    if (!dp) {
        log_error(lg, "engine failed to start: data socket: %s", err);
        engine.copypool = NULL;
        copypool_stop(copypool);
        admin_stop(admin, 1.0);
        engine_destroy(&engine);
        reporter_free(reporter);
        kvevents_free(kvev);
        config_free(&cfg);
        return 1;
    }
    /* Reporting starts once the node serves: peers and routers are sent to it from then on. */
    if (reporter && reporter_start(reporter, err, sizeof(err)) < 0)
        log_error(lg, "%s; not reporting to the master", err);
    if (kvev && kvevents_start(kvev, err, sizeof(err)) < 0)
        log_error(lg, "%s; not publishing KV events", err);
    engine_set_ready(&engine, 1);
    log_info(lg, "engine ready (L1 %.3g GiB, policy %s, chunk size %ld)", cfg.l1_size_gb,
             cfg.eviction_policy, cfg.chunk_size);
    sd_notify_send("READY=1");

    int sig = 0;
    sigwait(&set, &sig);
    log_info(lg, "received %s, shutting down", sig == SIGINT ? "SIGINT" : "SIGTERM");
    sd_notify_send("STOPPING=1");
    /* Front ends first (admin API answering 503, master told we are gone, data socket drained),
     * then the engine. */
    admin_stop(admin, 5.0);
    engine_set_ready(&engine, 0);
    reporter_stop(reporter); /* routers stop sending requests here first: unregister */
    kvevents_stop(kvev);
    dataplane_stop(dp);
    engine.copypool = NULL;
    struct copypool_stats cps;
    copypool_get_stats(copypool, &cps);
    log_info(lg,
             "copy pool: %llu copies split with the helpers (%llu pieces copied by them), %llu "
             "kept on their worker as no core was free",
             (unsigned long long)cps.jobs, (unsigned long long)cps.helper_pieces,
             (unsigned long long)cps.gated);
    copypool_stop(copypool);
    engine_destroy(&engine);
    reporter_free(reporter);
    kvevents_free(kvev);
    config_free(&cfg);
    log_info(lg, "stopped");
    return 0;
}
