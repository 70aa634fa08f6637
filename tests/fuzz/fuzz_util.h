/* Shared set-up for the server's fuzz drivers: an engine with a small L1, no threads, no
 * sockets. */
#ifndef LMCACHE_FUZZ_UTIL_H
#define LMCACHE_FUZZ_UTIL_H

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/log.h"
#include "server/config.h"
#include "server/engine.h"

static struct engine *fuzz_engine(void) {
    static struct server_config cfg;
    static struct engine e;
    static int ready;
    if (ready) return &e;
    char err[256];
    char *argv[] = {"server",      "--l1-size-gb", "0.0625", "--eviction-policy",
                    "IsolatedLRU", "--chunk-size", "16"};
    log_set_level(log_get("lmcache"), LOG_CRITICAL);
    if (config_parse(&cfg, 7, argv, err, sizeof(err)) != 0 ||
        engine_create(&e, &cfg, err, sizeof(err)) < 0 ||
        engine_start_caches(&e, err, sizeof(err)) < 0) {
        fprintf(stderr, "fuzz set-up: %s\n", err);
        abort();
    }
    atomic_store(&e.ready, 1);
    ready = 1;
    return &e;
}

#endif
