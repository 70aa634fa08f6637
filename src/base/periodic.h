/* Registry of periodic background threads: every long-lived background job runs
 * as one of these, so operators can see (and probe) what it is doing. */
#ifndef LMCACHE_BASE_PERIODIC_H
#define LMCACHE_BASE_PERIODIC_H

#include <jansson.h>

enum periodic_level {
    PERIODIC_CRITICAL,
    PERIODIC_HIGH,
    PERIODIC_MEDIUM,
    PERIODIC_LOW,
    PERIODIC_NLEVELS
};

/* One tick of a job. Returns 0 on success, negative on failure. It may set
 * *summary to a new JSON object describing the tick (ownership passes to the
 * registry). Runs on the job's own thread, never concurrently with itself. */
typedef int (*periodic_fn)(void *arg, json_t **summary);

struct periodic_registry;

struct periodic_registry *periodic_registry_new(void);
/* Stops every job (waking sleepers at once, waiting for running ticks) and frees. */
void periodic_registry_free(struct periodic_registry *r);

/* Starts a job named `name` (unique) that calls fn every interval_s seconds, the
 * first time at once. Returns 0, or -1 with err filled. */
int periodic_start(struct periodic_registry *r, const char *name, enum periodic_level level,
                   double interval_s, periodic_fn fn, void *arg, char *err, size_t errlen);

/* Signals every job to stop and joins them. Idempotent. */
void periodic_stop_all(struct periodic_registry *r);

/* Level names are "critical", "high", "medium", "low"; -1 when unknown. */
int periodic_level_parse(const char *s);
const char *periodic_level_name(int level);

/* A job is active when its last completed tick (or its start, before the first
 * one completes) is at most 2 * interval + 1 s old at `now` (monotonic seconds). */
/* GET /periodic-threads: level < 0 means all. */
json_t *periodic_snapshot(struct periodic_registry *r, int level, int running_only, int active_only,
                          double now);
/* One job's status object, or NULL when no job has that name. */
json_t *periodic_status(struct periodic_registry *r, const char *name, double now);
/* GET /periodic-threads-health: critical and high jobs that are running but not active. */
json_t *periodic_health(struct periodic_registry *r, double now);

#endif
