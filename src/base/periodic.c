/* Periodic-thread registry: each job is a pthread that sleeps on a condition
 * variable (so stop is immediate), runs its tick, and records the outcome. */
#include "base/periodic.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/errbuf.h"
#include "base/clock.h"
#include "base/log.h"

struct job {
    char name[64];
    enum periodic_level level;
    double interval;
    periodic_fn fn;
    void *arg;
    pthread_t tid;
    int started;
    /* guarded by r->lock */
    int running;
    double start_time;
    double last_run; /* monotonic time the last tick completed; 0 = never */
    unsigned long total_runs, failed_runs;
    json_t *last_summary;
    struct periodic_registry *r;
    struct job *next;
};

struct periodic_registry {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int stopping;
    struct job *jobs, *last;
};

static const char *LEVEL_NAMES[PERIODIC_NLEVELS] = {"critical", "high", "medium", "low"};

int periodic_level_parse(const char *s) {
    for (int i = 0; s && i < PERIODIC_NLEVELS; i++)
        if (strcmp(s, LEVEL_NAMES[i]) == 0) return i;
    return -1;
}

const char *periodic_level_name(int level) {
    return level >= 0 && level < PERIODIC_NLEVELS ? LEVEL_NAMES[level] : "unknown";
}

struct periodic_registry *periodic_registry_new(void) {
    struct periodic_registry *r = calloc(1, sizeof(*r));
    if (!r) return NULL;
    pthread_mutex_init(&r->lock, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cond, &ca);
    pthread_condattr_destroy(&ca);
    return r;
}

static void *job_main(void *p) {
    struct job *j = p;
    struct periodic_registry *r = j->r;
    char tname[16]; /* the kernel keeps 15 characters of a thread name */
    memcpy(tname, j->name, sizeof(tname) - 1);
    tname[sizeof(tname) - 1] = 0;
    pthread_setname_np(pthread_self(), tname);
    struct logger *lg = log_get("lmcache.periodic");
    pthread_mutex_lock(&r->lock);
    while (!r->stopping) {
        pthread_mutex_unlock(&r->lock);
        json_t *summary = NULL;
        int rc = j->fn(j->arg, &summary);
        double done = clock_mono();
        pthread_mutex_lock(&r->lock);
        j->total_runs++;
        if (rc < 0) {
            j->failed_runs++;
            log_warn(lg, "periodic thread %s: tick failed (%d)", j->name, rc);
        }
        j->last_run = done;
        if (summary) {
            json_decref(j->last_summary);
            j->last_summary = summary;
        }
        /* Sleep until the next tick or until stop is requested. */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double until = (double)ts.tv_sec + (double)ts.tv_nsec / 1e9 + j->interval;
        ts.tv_sec = (time_t)until;
        ts.tv_nsec = (long)((until - (double)ts.tv_sec) * 1e9);
        while (!r->stopping) {
            int w = pthread_cond_timedwait(&r->cond, &r->lock, &ts);
            if (w == ETIMEDOUT) break;
        }
    }
    j->running = 0;
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

int periodic_start(struct periodic_registry *r, const char *name, enum periodic_level level,
                   double interval_s, periodic_fn fn, void *arg, char *err, size_t errlen) {
    if (!name || !*name || strlen(name) >= sizeof(((struct job *)0)->name) || !fn ||
        interval_s <= 0 || (int)level < 0 || level >= PERIODIC_NLEVELS) {
        errbuf_set(err, errlen, "invalid periodic thread parameters");
        return -1;
    }
    struct job *j = calloc(1, sizeof(*j));
    if (!j) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    snprintf(j->name, sizeof(j->name), "%s", name);
    j->level = level;
    j->interval = interval_s;
    j->fn = fn;
    j->arg = arg;
    j->r = r;
    pthread_mutex_lock(&r->lock);
    for (struct job *o = r->jobs; o; o = o->next) {
        if (strcmp(o->name, name) == 0) {
            pthread_mutex_unlock(&r->lock);
            free(j);
            errbuf_set(err, errlen, "periodic thread %s already registered", name);
            return -1;
        }
    }
    if (r->stopping) {
        pthread_mutex_unlock(&r->lock);
        free(j);
        errbuf_set(err, errlen, "registry is stopping");
        return -1;
    }
    j->running = 1;
    j->start_time = clock_mono();
    int e = pthread_create(&j->tid, NULL, job_main, j);
    if (e != 0) {
        pthread_mutex_unlock(&r->lock);
        free(j);
        errbuf_set(err, errlen, "pthread_create: %s", strerror(e));
        return -1;
    }
    j->started = 1;
    if (r->last)
        r->last->next = j;
    else
        r->jobs = j;
    r->last = j;
    pthread_mutex_unlock(&r->lock);
    return 0;
}

void periodic_stop_all(struct periodic_registry *r) {
    if (!r) return;
    pthread_mutex_lock(&r->lock);
    r->stopping = 1;
    pthread_cond_broadcast(&r->cond);
    pthread_mutex_unlock(&r->lock);
    for (struct job *j = r->jobs; j; j = j->next) {
        if (j->started) {
            pthread_join(j->tid, NULL);
            j->started = 0;
        }
    }
}

void periodic_registry_free(struct periodic_registry *r) {
    if (!r) return;
    periodic_stop_all(r);
    struct job *j = r->jobs;
    while (j) {
        struct job *n = j->next;
        json_decref(j->last_summary);
        free(j);
        j = n;
    }
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->cond);
    free(r);
}

/* Caller holds r->lock. */
static double do_last_run_ago(const struct job *j, double now) {
    double ref = j->last_run > 0 ? j->last_run : j->start_time;
    double ago = now - ref;
    return ago < 0 ? 0 : ago;
}

static int do_is_active(const struct job *j, double now) {
    return j->running && do_last_run_ago(j, now) <= 2 * j->interval + 1.0;
}

static json_t *do_status(const struct job *j, double now) {
    double rate = j->total_runs
                      ? 100.0 * (double)(j->total_runs - j->failed_runs) / (double)j->total_runs
                      : 100.0;
    json_t *o = json_pack("{s:s, s:s, s:f, s:b, s:b, s:f, s:I, s:I, s:f}", "name", j->name, "level",
                          LEVEL_NAMES[j->level], "interval", j->interval, "is_running", j->running,
                          "is_active", do_is_active(j, now), "last_run_ago",
                          do_last_run_ago(j, now), "total_runs", (json_int_t)j->total_runs,
                          "failed_runs", (json_int_t)j->failed_runs, "success_rate", rate);
    if (o)
        json_object_set_new(o, "last_summary",
                            j->last_summary ? json_deep_copy(j->last_summary) : json_object());
    return o;
}

json_t *periodic_snapshot(struct periodic_registry *r, int level, int running_only, int active_only,
                          double now) {
    json_t *threads = json_array();
    json_t *by_level = json_object();
    int tot = 0, run = 0, act = 0;
    int lt[PERIODIC_NLEVELS] = {0}, lr[PERIODIC_NLEVELS] = {0}, la[PERIODIC_NLEVELS] = {0};
    pthread_mutex_lock(&r->lock);
    for (struct job *j = r->jobs; j; j = j->next) {
        int a = do_is_active(j, now);
        if (level >= 0 && (int)j->level != level) continue;
        if (running_only && !j->running) continue;
        if (active_only && !a) continue;
        tot++;
        run += j->running;
        act += a;
        lt[j->level]++;
        lr[j->level] += j->running;
        la[j->level] += a;
        json_array_append_new(threads, do_status(j, now));
    }
    pthread_mutex_unlock(&r->lock);
    for (int i = 0; i < PERIODIC_NLEVELS; i++)
        json_object_set_new(
            by_level, LEVEL_NAMES[i],
            json_pack("{s:i, s:i, s:i}", "total", lt[i], "running", lr[i], "active", la[i]));
    return json_pack("{s:{s:i, s:i, s:i, s:o}, s:o}", "summary", "total_count", tot,
                     "running_count", run, "active_count", act, "by_level", by_level, "threads",
                     threads);
}

json_t *periodic_status(struct periodic_registry *r, const char *name, double now) {
    json_t *o = NULL;
    pthread_mutex_lock(&r->lock);
    for (struct job *j = r->jobs; j; j = j->next)
        if (strcmp(j->name, name) == 0) {
            o = do_status(j, now);
            break;
        }
    pthread_mutex_unlock(&r->lock);
    return o;
}

json_t *periodic_health(struct periodic_registry *r, double now) {
    json_t *bad = json_array();
    pthread_mutex_lock(&r->lock);
    for (struct job *j = r->jobs; j; j = j->next) {
        if (j->level != PERIODIC_CRITICAL && j->level != PERIODIC_HIGH) continue;
        if (!j->running || do_is_active(j, now)) continue;
        json_array_append_new(bad, json_pack("{s:s, s:s, s:f, s:f}", "name", j->name, "level",
                                             LEVEL_NAMES[j->level], "last_run_ago",
                                             do_last_run_ago(j, now), "interval", j->interval));
    }
    pthread_mutex_unlock(&r->lock);
    size_t n = json_array_size(bad);
    return json_pack("{s:b, s:i, s:o}", "healthy", n == 0, "unhealthy_count", (int)n,
                     "unhealthy_threads", bad);
}
