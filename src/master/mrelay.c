/* Relayed metrics registry: one mutex; series found through an open-addressing map keyed
 * by "name{labels}". Writes are rare (one ReportMetrics per client per second).
 *
 * Whatever clients send, the exposition stays parseable: names are checked, label values
 * and help are escaped, a family name never collides with another family's lines. */
#include "master/mrelay.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/strbuf.h"
#include "base/hash.h"

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
    char **reserved; /* family names of the master's own registry */
    size_t nreserved;
    size_t bytes; /* keys, help texts and histogram arrays held */
};

static uint64_t shash(const char *s) { return fnv1a64_str(s); }

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
    for (size_t i = 0; i < r->nreserved; i++) free(r->reserved[i]);
    free(r->reserved);
    pthread_mutex_destroy(&r->lock);
    free(r);
}

/* Label values: backslash, double quote and newline; help: backslash and newline. */
static void esc(struct strbuf *sb, const char *s, bool quote) {
    for (; *s; s++) {
        if (*s == '\\')
            sb_puts(sb, "\\\\");
        else if (*s == '"' && quote)
            sb_puts(sb, "\\\"");
        else if (*s == '\n')
            sb_puts(sb, "\\n");
        else
            sb_append(sb, s, 1);
    }
}

static bool name_chars_ok(const char *s, bool colon) {
    if (!*s) return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                  (colon && c == ':') || (p != s && c >= '0' && c <= '9');
        if (!ok) return false;
    }
    return true;
}

bool mrelay_metric_name_ok(const char *s) { return name_chars_ok(s, true); }

bool mrelay_label_name_ok(const char *s) {
    return name_chars_ok(s, false) && strncmp(s, "__", 2) != 0;
}

const char *mrelay_hist_defect(const double *bounds, size_t nbounds, const uint64_t *buckets,
                               size_t nbuckets, uint64_t count) {
    if (nbuckets != nbounds) return "bucket count differs from bound count";
    for (size_t i = 0; i < nbounds; i++) {
        if (!isfinite(bounds[i])) return "bounds must be finite (+Inf is implicit)";
        if (i && !(bounds[i] > bounds[i - 1])) return "bounds must be strictly increasing";
        if (i && buckets[i] < buckets[i - 1]) return "bucket counts must be cumulative";
    }
    if (nbounds && buckets[nbounds - 1] > count) return "bucket counts exceed count (+Inf)";
    return NULL;
}

const char *mrelay_fmt_double(double v, char *buf, size_t len) {
    if (isnan(v)) return "NaN";
    if (isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    return buf;
}

int mrelay_reserve(struct mrelay *r, const char *name) {
    pthread_mutex_lock(&r->lock);
    int rc = -1;
    char **p = realloc(r->reserved, (r->nreserved + 1) * sizeof(*p));
    if (p) {
        r->reserved = p;
        if ((p[r->nreserved] = strdup(name))) {
            r->nreserved++;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

/* a is b plus one of the lines' suffixes of a histogram. */
static bool is_hist_line_of(const char *a, const char *b) {
    size_t lb = strlen(b);
    if (strncmp(a, b, lb) != 0) return false;
    return !strcmp(a + lb, "_bucket") || !strcmp(a + lb, "_count") || !strcmp(a + lb, "_sum");
}

/* Caller holds the lock. Whether a new family (name, type) would share exposition lines
 * with an existing or reserved one: a histogram's _bucket/_count/_sum are names too. */
static bool do_name_clash(const struct mrelay *r, const char *name, enum mrelay_type type) {
    for (size_t i = 0; i < r->nreserved; i++)
        if (!strcmp(r->reserved[i], name) ||
            (type == MRELAY_HISTOGRAM && is_hist_line_of(r->reserved[i], name)))
            return true;
    for (size_t i = 0; i < r->nfams; i++) {
        const struct rfam *f = &r->fams[i];
        if ((f->type == MRELAY_HISTOGRAM && is_hist_line_of(name, f->name)) ||
            (type == MRELAY_HISTOGRAM && is_hist_line_of(f->name, name)))
            return true;
    }
    return false;
}

/* Caller holds the lock. */
static struct rseries *do_get(struct mrelay *r, const char *name, const char *help,
                              enum mrelay_type type, const struct mrelay_label *l, size_t nl,
                              const char **why) {
    if (!mrelay_metric_name_ok(name)) {
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
    if (f == r->nfams && do_name_clash(r, name, type)) {
        *why = "name collides with another metric family";
        return NULL;
    }
    struct strbuf k = STRBUF_INIT;
    sb_puts(&k, name);
    size_t lpos = k.len;
    size_t shown = 0;
    for (size_t i = 0; i < nl; i++) {
        if (!mrelay_label_name_ok(l[i].name) ||
            (type == MRELAY_HISTOGRAM && !strcmp(l[i].name, "le")))
            continue;
        size_t j = 0;
        while (j < i && strcmp(l[j].name, l[i].name)) j++;
        if (j < i) continue; /* a repeated name: the first one stands */
        sb_puts(&k, shown++ ? "," : "{");
        sb_puts(&k, l[i].name);
        sb_puts(&k, "=\"");
        esc(&k, l[i].value ? l[i].value : "", true);
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
            struct rfam *fm = &r->fams[r->map[i]->fam];
            size_t ol = strlen(fm->help), nl2 = help ? strlen(help) : 0;
            if (nl2 && strcmp(help, fm->help) && r->bytes - ol + nl2 <= MRELAY_MAX_BYTES) {
                char *nh = strdup(help); /* help is last-write-wins */
                if (nh) {
                    free(fm->help);
                    fm->help = nh;
                    r->bytes = r->bytes - ol + nl2;
                }
            }
            return r->map[i];
        }
    if (r->n >= MRELAY_MAX_SERIES) {
        sb_free(&k);
        *why = "series limit reached";
        return NULL;
    }
    size_t need = k.len + 1 + (f == r->nfams ? strlen(name) + 1 + (help ? strlen(help) : 0) : 0);
    if (r->bytes + need > MRELAY_MAX_BYTES) {
        sb_free(&k);
        *why = "relayed metrics memory limit reached";
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
    r->bytes += need;
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
    if ((*why = mrelay_hist_defect(bounds, nbounds, buckets, nbuckets, count))) return -1;
    pthread_mutex_lock(&r->lock);
    struct rseries *s = do_get(r, name, help, MRELAY_HISTOGRAM, l, nl, why);
    if (!s) goto out;
    if (!s->bounds && !s->count && !s->nbounds) {
        if (r->bytes + nbounds * (sizeof(double) + sizeof(uint64_t)) > MRELAY_MAX_BYTES) {
            *why = "relayed metrics memory limit reached";
            goto out;
        }
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
        r->bytes += nbounds * (sizeof(double) + sizeof(uint64_t));
    } else if (s->nbounds != nbounds ||
               (nbounds && memcmp(s->bounds, bounds, nbounds * sizeof(double)))) {
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
        sb_printf(out, "# HELP %s ", fam->name);
        esc(out, fam->help, false);
        sb_printf(out, "\n# TYPE %s %s\n", fam->name, TYPE_NAMES[fam->type]);
        for (size_t i = 0; i < ns; i++) {
            const struct rseries *s = ss[i];
            if (fam->type == MRELAY_COUNTER) {
                sb_printf(out, "%s %llu\n", s->key, (unsigned long long)s->counter);
            } else if (fam->type == MRELAY_GAUGE) {
                char num[32];
                sb_printf(out, "%s %s\n", s->key, mrelay_fmt_double(s->gauge, num, sizeof(num)));
            } else {
                for (size_t b = 0; b < s->nbounds; b++) {
                    char le[32];
                    sb_printf(out, "%s_bucket", fam->name);
                    with_le(out, s->labels, mrelay_fmt_double(s->bounds[b], le, sizeof(le)));
                    sb_printf(out, " %llu\n", (unsigned long long)s->buckets[b]);
                }
                sb_printf(out, "%s_bucket", fam->name);
                with_le(out, s->labels, "+Inf");
                sb_printf(out, " %llu\n", (unsigned long long)s->count);
                char sum[32];
                sb_printf(out, "%s_sum%s %s\n%s_count%s %llu\n", fam->name, s->labels,
                          mrelay_fmt_double(s->sum, sum, sizeof(sum)), fam->name, s->labels,
                          (unsigned long long)s->count);
            }
        }
        sb_puts(out, "\n");
    }
    pthread_mutex_unlock(&r->lock);
    free(order);
    free(ss);
    return out->oom ? -1 : 0;
}
