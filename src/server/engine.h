/* THE engine: the one object every thread of the daemon shares, and the API
 * every front end (ZMQ data plane, HTTP admin) calls. Front ends never reach
 * into L1 or L2 directly. */
#ifndef LMCACHE_SERVER_ENGINE_H
#define LMCACHE_SERVER_ENGINE_H

#include <jansson.h>
#include <stdatomic.h>

#include "base/check.h"
#include "server/config.h"

#define ENGINE_MAGIC 0x4c4d4345u /* "LMCE" */

struct metrics;
struct periodic_registry;

struct engine {
    unsigned magic;
    const struct server_config *cfg;
    /* Set once initialisation completed; read without a lock by the admin API. */
    _Atomic int ready;
    char instance_id[64];
    double start_time; /* wall clock */
    struct metrics *metrics;
    struct periodic_registry *periodic;
};

#define ENGINE_CHECK(e) CHECK((e) && (e)->magic == ENGINE_MAGIC)

/* Creates the parts that the admin API needs before the engine is ready
 * (metrics, periodic registry). Returns 0 or -1 with errbuf. */
int engine_create(struct engine *e, const struct server_config *cfg, char *errbuf, size_t errlen);
/* Brings the cache up (memory, background jobs) and marks the engine ready. */
int engine_start(struct engine *e, char *errbuf, size_t errlen);
int engine_is_ready(const struct engine *e);
/* Stops background jobs and releases everything. */
void engine_destroy(struct engine *e);

/* GET /status body (a new reference). */
json_t *engine_status(struct engine *e);
/* Updates gauges that mirror engine state, just before a scrape. */
void engine_refresh_metrics(struct engine *e);
/* GET /config/adapters "adapters" array (a new reference). */
json_t *engine_adapters(struct engine *e);

#endif
