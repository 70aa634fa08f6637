/* Metrics registry: counters, gauges and histograms with labels, and the
 * Prometheus text exposition format 0.0.4. Updates are lock-free atomics on a
 * child series the caller looks up once and keeps. */
#ifndef LMCACHE_BASE_METRICS_H
#define LMCACHE_BASE_METRICS_H

#include <stddef.h>
#include <stdint.h>

enum metric_type { METRIC_COUNTER, METRIC_GAUGE, METRIC_HISTOGRAM };

#define METRIC_MAX_LABELS  4
#define METRIC_MAX_BUCKETS 24

struct metrics;       /* a registry */
struct metric_family; /* one name, type, help and label names */
struct metric;        /* one series: a family with concrete label values */
struct strbuf;

struct metrics *metrics_new(void);
void metrics_free(struct metrics *m);

/* Registers a family. label_names is NULL-terminated (or NULL for none); buckets
 * (histograms only) are upper bounds in increasing order, +Inf is implicit.
 * Registering an existing name returns the existing family if the type matches,
 * NULL otherwise. Counter names must end in _total. */
struct metric_family *metrics_counter(struct metrics *m, const char *name, const char *help,
                                      const char *const *label_names);
struct metric_family *metrics_gauge(struct metrics *m, const char *name, const char *help,
                                    const char *const *label_names);
struct metric_family *metrics_histogram(struct metrics *m, const char *name, const char *help,
                                        const char *const *label_names, const double *buckets,
                                        size_t nbuckets);

/* A gauge whose value is computed at scrape time (no labels). */
typedef double (*metric_gauge_fn)(void *arg);
struct metric_family *metrics_gauge_fn(struct metrics *m, const char *name, const char *help,
                                       metric_gauge_fn fn, void *arg);

/* Returns the series for these label values (as many as the family has label
 * names), creating it on first use. Never NULL for a valid family except on OOM
 * or when the family already holds METRIC_MAX_SERIES series. */
#define METRIC_MAX_SERIES 4096
struct metric *metric_labels(struct metric_family *f, const char *const *values);
/* The unlabelled series of a family without labels. */
struct metric *metric_series(struct metric_family *f);

void metric_inc(struct metric *s, double v);     /* counters and gauges */
void metric_set(struct metric *s, double v);     /* gauges */
void metric_observe(struct metric *s, double v); /* histograms */
double metric_value(const struct metric *s);
uint64_t metric_hist_count(const struct metric *s);

/* Look up (creating) and add or set in one step under the family's lock: the only way to
 * update a family whose series metrics_remove_label may remove (a pointer from metric_labels
 * would not survive the removal). */
void metrics_add(struct metric_family *f, const char *const *values, double v);
void metrics_set(struct metric_family *f, const char *const *values, double v);
/* Removes the series whose label number `label` has this value (a departed node's); returns
 * how many. Only for families updated through metrics_add/metrics_set. */
size_t metrics_remove_label(struct metric_family *f, size_t label, const char *value);

/* Zeroes every counter and histogram and every set-gauge (computed gauges are
 * left alone: they report live state). */
void metrics_reset(struct metrics *m);

/* Appends the exposition text of every family, sorted by name. 0 on success. */
int metrics_render(struct metrics *m, struct strbuf *out);

/* Standard process_* metrics (CPU, memory, fds, threads, start time). */
void metrics_register_process(struct metrics *m);

/* Default buckets for latencies in seconds. */
extern const double METRICS_LATENCY_BUCKETS[];
extern const size_t METRICS_LATENCY_NBUCKETS;

#endif
