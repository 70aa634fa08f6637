/* Relayed metrics registry: one mutex; series found through an open-addressing map keyed
 * by "name{labels}". Writes are rare (one ReportMetrics per client per second). */
#include "master/mrelay.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/strbuf.h"

struct rseries {
    char *key;    /* name + label string: the identity */
    char *labels; /* points into key: "{...}" or "" */
    size_t fam;
    uint64_t counter;
    double gauge;
    double *bounds;
    uint64_t *buckets; /* cumulative, nbounds entries (+Inf is count) */
    size_t nbounds;
    uint64_t count;
    double sum;
};

struct rfam {
    char *name;
    char *help;
    enum mrelay_type type;
};

struct mrelay {
    pthread_mutex_t lock;
    struct rfam *fams;
    size_t nfams, fcap;
    struct rseries **map;
    size_t mcap, n;
};

static uint64_t shash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

struct mrelay *mrelay_new(void) {
    struct mrelay *r = calloc(1, sizeof(*r));
    if (!r) return NULL;
    r->mcap = 256;
    r->map = calloc(r->mcap, sizeof(*r->map));
    if (!r->map) {
        free(r);
        return NULL;
    }
    pthread_mutex_init(&r->lock, NULL);
    return r;
}

void mrelay_free(struct mrelay *r) {
    if (!r) return;
    for (size_t i = 0; i < r->mcap; i++)
        if (r->map[i]) {
            free(r->map[i]->key);
            free(r->map[i]->bounds);
            free(r->map[i]->buckets);
            free(r->map[i]);
        }
    for (size_t i = 0; i < r->nfams; i++) {
        free(r->fams[i].name);
        free(r->fams[i].help);
    }
    free(r->fams);
    free(r->map);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

static void esc(struct strbuf *sb, const char *s) {
    for (; *s; s++) {
        if (*s == '\\')
            sb_puts(sb, "\\\\");
        else if (*s == '"')
            sb_puts(sb, "\\\"");
        else if (*s == '\n')
            sb_puts(sb, "\\n");
        else
            sb_append(sb, s, 1);
    }
}

static int valid_name(const char *s) {
    if (!*s) return 0;
    for (const char *p = s; *p; p++) {
        char c = *p;
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                 (p != s && c >= '0' && c <= '9');
        if (!ok) return 0;
    }
    return 1;
}

/* Caller holds the lock. */
static struct rseries *do_get(struct mrelay *r, const char *name, const char *help,
                              enum mrelay_type type, const struct mrelay_label *l, size_t nl,
                              const char **why) {
    if (!valid_name(name)) {
        *why = "invalid metric name";
        return NULL;
    }
    size_t f = 0;
    for (; f < r->nfams; f++)
        if (strcmp(r->fams[f].name, name) == 0) break;
    if (f < r->nfams && r->fams[f].type != type) {
        *why = "type differs from the first sample of this name";
        return NULL;
    }
    struct strbuf k = STRBUF_INIT;
    sb_puts(&k, name);
    size_t lpos = k.len;
    size_t shown = 0;
    for (size_t i = 0; i < nl; i++) {
        if (!valid_name(l[i].name)) continue;
        sb_puts(&k, shown++ ? "," : "{");
        sb_puts(&k, l[i].name);
        sb_puts(&k, "=\"");
        esc(&k, l[i].value ? l[i].value : "");
        sb_puts(&k, "\"");
    }
    if (shown) sb_puts(&k, "}");
    if (k.oom || !k.buf) {
        sb_free(&k);
        *why = "out of memory";
        return NULL;
    }
    uint64_t h = shash(k.buf);
    size_t i = h & (r->mcap - 1);
    for (; r->map[i]; i = (i + 1) & (r->mcap - 1))
        if (strcmp(r->map[i]->key, k.buf) == 0) {
            sb_free(&k);
            if (help && *help) {
                char *nh = strdup(help); /* help is last-write-wins */
                if (nh) {
                    free(r->fams[r->map[i]->fam].help);
                    r->fams[r->map[i]->fam].help = nh;
                }
            }
            return r->map[i];
        }
    if (r->n >= MRELAY_MAX_SERIES) {
        sb_free(&k);
        *why = "series limit reached";
        return NULL;
    }
    if (f == r->nfams) {
        if (r->nfams == r->fcap) {
            size_t nc = r->fcap ? r->fcap * 2 : 16;
            void *p = realloc(r->fams, nc * sizeof(*r->fams));
            if (!p) goto oom;
            r->fams = p;
            r->fcap = nc;
        }
        r->fams[f] = (struct rfam){strdup(name), strdup(help ? help : ""), type};
        if (!r->fams[f].name || !r->fams[f].help) {
            free(r->fams[f].name);
            free(r->fams[f].help);
            goto oom;
        }
        r->nfams++;
    }
    struct rseries *s = calloc(1, sizeof(*s));
    if (!s) goto oom;
    s->key = sb_detach(&k, NULL);
    s->labels = s->key + lpos;
    s->fam = f;
    r->map[i] = s;
    r->n++;
    if (r->n * 2 > r->mcap) { /* grow: rehash into a table twice the size */
        size_t nc = r->mcap * 2;
        struct rseries **nm = calloc(nc, sizeof(*nm));
        if (nm) {
            for (size_t j = 0; j < r->mcap; j++)
                if (r->map[j]) {
                    size_t p = shash(r->map[j]->key) & (nc - 1);
                    while (nm[p]) p = (p + 1) & (nc - 1);
                    nm[p] = r->map[j];
                }
            free(r->map);
            r->map = nm;
            r->mcap = nc;
        }
    }
    return s;
oom:
    sb_free(&k);
    *why = "out of memory";
    return NULL;
}

int mrelay_counter_add(struct mrelay *r, const char *name, const char *help,
                       const struct mrelay_label *l, size_t nl, double delta, const char **why) {
    pthread_mutex_lock(&r->lock);
    struct rseries *s = do_get(r, name, help, MRELAY_COUNTER, l, nl, why);
    if (s && delta >= 1.0 && delta < 1.8e19) s->counter += (uint64_t)delta;
    pthread_mutex_unlock(&r->lock);
    return s ? 0 : -1;
}

int mrelay_gauge_set(struct mrelay *r, const char *name, const char *help,
                     const struct mrelay_label *l, size_t nl, double v, const char **why) {
    pthread_mutex_lock(&r->lock);
    struct rseries *s = do_get(r, name, help, MRELAY_GAUGE, l, nl, why);
    if (s) s->gauge = v;
    pthread_mutex_unlock(&r->lock);
    return s ? 0 : -1;
}

int mrelay_hist_merge(struct mrelay *r, const char *name, const char *help,
                      const struct mrelay_label *l, size_t nl, const double *bounds, size_t nbounds,
                      const uint64_t *buckets, size_t nbuckets, uint64_t count, double sum,
                      const char **why) {
    int rc = -1;
    if (nbuckets != nbounds) {
        *why = "bucket count differs from bound count";
        return -1;
    }
    pthread_mutex_lock(&r->lock);
    struct rseries *s = do_get(r, name, help, MRELAY_HISTOGRAM, l, nl, why);
    if (!s) goto out;
    if (!s->bounds && !s->count && !s->nbounds) {
        s->bounds = calloc(nbounds ? nbounds : 1, sizeof(double));
        s->buckets = calloc(nbounds ? nbounds : 1, sizeof(uint64_t));
        if (!s->bounds || !s->buckets) {
            free(s->bounds);
            free(s->buckets);
            s->bounds = NULL;
            s->buckets = NULL;
            *why = "out of memory";
            goto out;
        }
        memcpy(s->bounds, bounds, nbounds * sizeof(double));
        s->nbounds = nbounds;
    } else if (s->nbounds != nbounds) {
        *why = "bounds differ from the first sample of this series";
        goto out;
    }
    for (size_t i = 0; i < nbounds; i++) s->buckets[i] += buckets[i];
    s->count += count;
    s->sum += sum;
    rc = 0;
out:
    pthread_mutex_unlock(&r->lock);
    return rc;
}

static int cmp_series(const void *a, const void *b) {
    const struct rseries *x = *(const struct rseries *const *)a;
    const struct rseries *y = *(const struct rseries *const *)b;
    return strcmp(x->labels, y->labels);
}

static int cmp_fam_idx(const void *a, const void *b, void *fams) {
    const struct rfam *f = fams;
    return strcmp(f[*(const size_t *)a].name, f[*(const size_t *)b].name);
}

static const char *TYPE_NAMES[] = {"counter", "gauge", "histogram"};

/* "{a="b"}" + le -> "{a="b",le="x"}" */
static void with_le(struct strbuf *sb, const char *labels, const char *le) {
    if (*labels) {
        sb_append(sb, labels, strlen(labels) - 1);
        sb_printf(sb, ",le=\"%s\"}", le);
    } else {
        sb_printf(sb, "{le=\"%s\"}", le);
    }
}

int mrelay_render(struct mrelay *r, struct strbuf *out) {
    pthread_mutex_lock(&r->lock);
    size_t *order = calloc(r->nfams + 1, sizeof(size_t));
    struct rseries **ss = calloc(r->n + 1, sizeof(*ss));
    if (!order || !ss) {
        free(order);
        free(ss);
        pthread_mutex_unlock(&r->lock);
        return -1;
    }
    for (size_t i = 0; i < r->nfams; i++) order[i] = i;
    qsort_r(order, r->nfams, sizeof(size_t), cmp_fam_idx, r->fams);
    for (size_t oi = 0; oi < r->nfams; oi++) {
        size_t f = order[oi], ns = 0;
        for (size_t i = 0; i < r->mcap; i++)
            if (r->map[i] && r->map[i]->fam == f) ss[ns++] = r->map[i];
        qsort(ss, ns, sizeof(*ss), cmp_series);
        const struct rfam *fam = &r->fams[f];
        sb_printf(out, "# HELP %s %s\n# TYPE %s %s\n", fam->name, fam->help, fam->name,
                  TYPE_NAMES[fam->type]);
        for (size_t i = 0; i < ns; i++) {
            const struct rseries *s = ss[i];
            if (fam->type == MRELAY_COUNTER) {
                sb_printf(out, "%s %llu\n", s->key, (unsigned long long)s->counter);
            } else if (fam->type == MRELAY_GAUGE) {
                sb_printf(out, "%s %g\n", s->key, s->gauge);
            } else {
                for (size_t b = 0; b < s->nbounds; b++) {
                    char le[64];
                    snprintf(le, sizeof(le), "%g", s->bounds[b]);
                    sb_printf(out, "%s_bucket", fam->name);
                    with_le(out, s->labels, le);
                    sb_printf(out, " %llu\n", (unsigned long long)s->buckets[b]);
                }
                sb_printf(out, "%s_bucket", fam->name);
                with_le(out, s->labels, "+Inf");
                sb_printf(out, " %llu\n", (unsigned long long)s->count);
                sb_printf(out, "%s_sum%s %g\n%s_count%s %llu\n", fam->name, s->labels, s->sum,
                          fam->name, s->labels, (unsigned long long)s->count);
            }
        }
        sb_puts(out, "\n");
    }
    pthread_mutex_unlock(&r->lock);
    free(order);
    free(ss);
    return out->oom ? -1 : 0;
}
