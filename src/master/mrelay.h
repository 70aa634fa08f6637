/* Relayed metrics: series that clients push through ReportMetrics (and the per-node series
 * whose label set includes the node's registered tags). Unlike base/metrics.h, families
 * here have free-form label sets and histograms arrive as cumulative aggregates whose
 * bounds the first write fixes. */
#ifndef LMCACHE_MASTER_MRELAY_H
#define LMCACHE_MASTER_MRELAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct strbuf;
struct mrelay;

enum mrelay_type { MRELAY_COUNTER, MRELAY_GAUGE, MRELAY_HISTOGRAM };

struct mrelay_label {
    const char *name;
    const char *value;
};

struct mrelay *mrelay_new(void);
void mrelay_free(struct mrelay *r);

/* Limits on one relayed sample (ReportMetrics rejects a call that exceeds them) and on
 * the whole registry (samples that would grow it past MRELAY_MAX_BYTES are dropped). */
#define MRELAY_MAX_NAME   256  /* metric and label names, bytes */
#define MRELAY_MAX_VALUE  1024 /* label values, bytes */
#define MRELAY_MAX_HELP   4096 /* help text, bytes */
#define MRELAY_MAX_LABELS 32   /* labels of one sample (besides node and tags) */
#define MRELAY_MAX_BOUNDS 256  /* histogram bounds */
#define MRELAY_MAX_BYTES  (64u << 20)

/* Prometheus names: metric [a-zA-Z_:][a-zA-Z0-9_:]*, label [a-zA-Z_][a-zA-Z0-9_]*. A label
 * name starting with "__" is reserved to Prometheus and not valid here. */
bool mrelay_metric_name_ok(const char *s);
bool mrelay_label_name_ok(const char *s);

/* NULL when the histogram is well formed: as many buckets as bounds, bounds finite and
 * strictly increasing (+Inf is implicit: its bucket is count), buckets cumulative and not
 * above count. Else why. */
const char *mrelay_hist_defect(const double *bounds, size_t nbounds, const uint64_t *buckets,
                               size_t nbuckets, uint64_t count);

/* Marks a family name as owned by the master's own registry: relayed samples may neither
 * use it nor a name whose exposition lines would mix with it (histogram suffixes). */
int mrelay_reserve(struct mrelay *r, const char *name);

/* Shortest text that reads back as v (%.15g, then %.16g, then %.17g); NaN, +Inf, -Inf as
 * Prometheus spells them. buf needs 32 bytes. */
const char *mrelay_fmt_double(double v, char *buf, size_t len);

/* Counter deltas are truncated toward zero; negative deltas are ignored. Returns 0, or -1
 * when the sample was dropped (invalid or reserved name, type clash, histogram shape
 * mismatch, series or byte cap, no memory); *why then says why. Labels with an invalid
 * name and repeats of an earlier label's name are left out. */
int mrelay_counter_add(struct mrelay *r, const char *name, const char *help,
                       const struct mrelay_label *l, size_t nl, double delta, const char **why);
int mrelay_gauge_set(struct mrelay *r, const char *name, const char *help,
                     const struct mrelay_label *l, size_t nl, double v, const char **why);
int mrelay_hist_merge(struct mrelay *r, const char *name, const char *help,
                      const struct mrelay_label *l, size_t nl, const double *bounds, size_t nbounds,
                      const uint64_t *buckets, size_t nbuckets, uint64_t count, double sum,
                      const char **why);

/* Appends every family sorted by name, series sorted by label string. */
int mrelay_render(struct mrelay *r, struct strbuf *out);

#define MRELAY_MAX_SERIES 20000

#endif
