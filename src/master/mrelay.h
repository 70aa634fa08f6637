/* Relayed metrics: series that clients push through ReportMetrics (and the per-node series
 * whose label set includes the node's registered tags). Unlike base/metrics.h, families
 * here have free-form label sets and histograms arrive as cumulative aggregates whose
 * bounds the first write fixes. */
#ifndef LMCACHE_MASTER_MRELAY_H
#define LMCACHE_MASTER_MRELAY_H

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

/* Counter deltas are truncated toward zero; negative deltas are ignored. Returns 0, or -1
 * when the sample was dropped (type clash, histogram shape mismatch, series cap, no
 * memory); *why then says why. */
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
