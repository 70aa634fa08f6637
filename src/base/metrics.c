/* Metrics registry and Prometheus text exposition (format 0.0.4).
 *
 * Families live in a registry list guarded by the registry lock; series of a
 * family live in a small hash table guarded by the family lock. Values are
 * doubles stored as bit patterns in 64-bit atomics, updated with CAS, so a hot
 * path that kept its series pointer takes no lock at all. */
#include "base/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include "base/strbuf.h"
#include "base/hash.h"

#define SERIES_BUCKETS 64

struct metric {
    struct metric_family *fam;
    char *values[METRIC_MAX_LABELS];
    uint64_t hash;
    _Atomic uint64_t bits;       /* counter/gauge value, or histogram sum */
    _Atomic uint64_t count;      /* histogram observation count */
    _Atomic uint64_t *bucket_ct; /* histogram: nbuckets + 1 (the last is +Inf) */
    struct metric *next;         /* hash chain */
    struct metric *order;        /* creation order, for stable output */
};

struct metric_family {
    char *name;
    char *help;
    enum metric_type type;
    int computed; /* value comes from fn at scrape time */
    metric_gauge_fn fn;
    void *fn_arg;
    size_t nlabels;
    char *label_names[METRIC_MAX_LABELS];
    size_t nbuckets;
    double buckets[METRIC_MAX_BUCKETS];
    pthread_mutex_t lock;
    struct metric *table[SERIES_BUCKETS];
    struct metric *first, *last;
    size_t nseries;
    struct metric_family *next;
};

struct metrics {
    pthread_mutex_t lock;
    struct metric_family *families;
};

const double METRICS_LATENCY_BUCKETS[16] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                                            0.01,   0.025,   0.05,   0.1,   0.25,   0.5,
                                            1,      2.5,     5,      10};
const size_t METRICS_LATENCY_NBUCKETS = 16;

static inline double bits2d(uint64_t b) {
    double d;
    memcpy(&d, &b, sizeof(d));
    return d;
}

static inline uint64_t d2bits(double d) {
    uint64_t b;
    memcpy(&b, &d, sizeof(b));
    return b;
}

static void atomic_add_double(_Atomic uint64_t *p, double v) {
    uint64_t old = atomic_load_explicit(p, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(p, &old, d2bits(bits2d(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

struct metrics *metrics_new(void) {
    struct metrics *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    pthread_mutex_init(&m->lock, NULL);
    return m;
}

static void free_series(struct metric *s) {
    for (size_t i = 0; i < METRIC_MAX_LABELS; i++) free(s->values[i]);
    free(s->bucket_ct);
    free(s);
}

void metrics_free(struct metrics *m) {
    if (!m) return;
    struct metric_family *f = m->families;
    while (f) {
        struct metric_family *nf = f->next;
        struct metric *s = f->first;
        while (s) {
            struct metric *ns = s->order;
            free_series(s);
            s = ns;
        }
        for (size_t i = 0; i < f->nlabels; i++) free(f->label_names[i]);
        free(f->name);
        free(f->help);
        pthread_mutex_destroy(&f->lock);
        free(f);
        f = nf;
    }
    pthread_mutex_destroy(&m->lock);
    free(m);
}

static struct metric_family *do_find_family(struct metrics *m, const char *name) {
    for (struct metric_family *f = m->families; f; f = f->next)
        if (strcmp(f->name, name) == 0) return f;
    return NULL;
}

static struct metric_family *add_family(struct metrics *m, const char *name, const char *help,
                                        enum metric_type type, const char *const *label_names,
                                        const double *buckets, size_t nbuckets) {
    if (!m || !name || nbuckets > METRIC_MAX_BUCKETS) return NULL;
    pthread_mutex_lock(&m->lock);
    struct metric_family *f = do_find_family(m, name);
    if (f) {
        pthread_mutex_unlock(&m->lock);
        return f->type == type ? f : NULL;
    }
    f = calloc(1, sizeof(*f));
    if (!f) goto oom;
    f->name = strdup(name);
    f->help = strdup(help ? help : "");
    if (!f->name || !f->help) goto oom;
    f->type = type;
    for (size_t i = 0; label_names && label_names[i]; i++) {
        if (i >= METRIC_MAX_LABELS || !(f->label_names[i] = strdup(label_names[i]))) goto oom;
        f->nlabels = i + 1;
    }
    for (size_t i = 0; i < nbuckets; i++) f->buckets[i] = buckets[i];
    f->nbuckets = nbuckets;
    pthread_mutex_init(&f->lock, NULL);
    f->next = m->families;
    m->families = f;
    pthread_mutex_unlock(&m->lock);
    return f;
oom:
    if (f) {
        for (size_t i = 0; i < METRIC_MAX_LABELS; i++) free(f->label_names[i]);
        free(f->name);
        free(f->help);
        free(f);
    }
    pthread_mutex_unlock(&m->lock);
    return NULL;
}

struct metric_family *metrics_counter(struct metrics *m, const char *name, const char *help,
                                      const char *const *label_names) {
    return add_family(m, name, help, METRIC_COUNTER, label_names, NULL, 0);
}

struct metric_family *metrics_gauge(struct metrics *m, const char *name, const char *help,
                                    const char *const *label_names) {
    return add_family(m, name, help, METRIC_GAUGE, label_names, NULL, 0);
}

struct metric_family *metrics_histogram(struct metrics *m, const char *name, const char *help,
                                        const char *const *label_names, const double *buckets,
                                        size_t nbuckets) {
    return add_family(m, name, help, METRIC_HISTOGRAM, label_names, buckets, nbuckets);
}

static struct metric_family *add_computed(struct metrics *m, const char *name, const char *help,
                                          enum metric_type type, metric_gauge_fn fn, void *arg) {
    struct metric_family *f = add_family(m, name, help, type, NULL, NULL, 0);
    if (f) {
        pthread_mutex_lock(&f->lock);
        f->computed = 1;
        f->fn = fn;
        f->fn_arg = arg;
        pthread_mutex_unlock(&f->lock);
    }
    return f;
}

struct metric_family *metrics_gauge_fn(struct metrics *m, const char *name, const char *help,
                                       metric_gauge_fn fn, void *arg) {
    return add_computed(m, name, help, METRIC_GAUGE, fn, arg);
}

static uint64_t hash_values(const char *const *values, size_t n) {
    static const unsigned char sep = 0xff; /* no label value contains it */
    uint64_t h = FNV1A64_INIT;
    for (size_t i = 0; i < n; i++) {
        const char *v = values[i] ? values[i] : "";
        h = fnv1a64_add(h, v, strlen(v));
        h = fnv1a64_add(h, &sep, 1);
    }
    return h;
}

static int same_values(const struct metric *s, const char *const *values, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (strcmp(s->values[i], values[i] ? values[i] : "") != 0) return 0;
    return 1;
}

/* Caller holds f->lock. */
static struct metric *labels_locked(struct metric_family *f, const char *const *values) {
    uint64_t h = hash_values(values, f->nlabels);
    struct metric *s = f->table[h % SERIES_BUCKETS];
    for (; s; s = s->next)
        if (s->hash == h && same_values(s, values, f->nlabels)) break;
    if (!s && f->nseries < METRIC_MAX_SERIES && (s = calloc(1, sizeof(*s)))) {
        s->fam = f;
        s->hash = h;
        int ok = 1;
        for (size_t i = 0; i < f->nlabels; i++)
            if (!(s->values[i] = strdup(values[i] ? values[i] : ""))) ok = 0;
        if (ok && f->type == METRIC_HISTOGRAM &&
            !(s->bucket_ct = calloc(f->nbuckets + 1, sizeof(*s->bucket_ct))))
            ok = 0;
        if (!ok) {
            free_series(s);
            s = NULL;
        } else {
            s->next = f->table[h % SERIES_BUCKETS];
            f->table[h % SERIES_BUCKETS] = s;
            if (f->last)
                f->last->order = s;
            else
                f->first = s;
            f->last = s;
            f->nseries++;
        }
    }
    return s;
}

struct metric *metric_labels(struct metric_family *f, const char *const *values) {
    if (!f) return NULL;
    pthread_mutex_lock(&f->lock);
    struct metric *s = labels_locked(f, values);
    pthread_mutex_unlock(&f->lock);
    return s;
}

struct metric *metric_series(struct metric_family *f) {
    return metric_labels(f, NULL);
}

void metric_inc(struct metric *s, double v) {
    if (s) atomic_add_double(&s->bits, v);
}

void metric_set(struct metric *s, double v) {
    if (s) atomic_store_explicit(&s->bits, d2bits(v), memory_order_relaxed);
}

void metric_observe(struct metric *s, double v) {
    if (!s || !s->bucket_ct) return;
    const struct metric_family *f = s->fam;
    size_t i = 0;
    while (i < f->nbuckets && v > f->buckets[i]) i++;
    atomic_fetch_add_explicit(&s->bucket_ct[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
    atomic_add_double(&s->bits, v);
}

double metric_value(const struct metric *s) {
    return s ? bits2d(atomic_load_explicit(&((struct metric *)s)->bits, memory_order_relaxed)) : 0;
}

uint64_t metric_hist_count(const struct metric *s) {
    return s ? atomic_load_explicit(&((struct metric *)s)->count, memory_order_relaxed) : 0;
}

void metrics_add(struct metric_family *f, const char *const *values, double v) {
    if (!f) return;
    pthread_mutex_lock(&f->lock);
    metric_inc(labels_locked(f, values), v);
    pthread_mutex_unlock(&f->lock);
}

void metrics_set(struct metric_family *f, const char *const *values, double v) {
    if (!f) return;
    pthread_mutex_lock(&f->lock);
    metric_set(labels_locked(f, values), v);
    pthread_mutex_unlock(&f->lock);
}

size_t metrics_remove_label(struct metric_family *f, size_t label, const char *value) {
    if (!f || label >= f->nlabels) return 0;
    size_t n = 0;
    pthread_mutex_lock(&f->lock);
    struct metric *prev = NULL;
    for (struct metric *s = f->first; s;) {
        struct metric *next = s->order;
        if (strcmp(s->values[label], value) != 0) {
            prev = s;
            s = next;
            continue;
        }
        for (struct metric **pp = &f->table[s->hash % SERIES_BUCKETS]; *pp; pp = &(*pp)->next)
            if (*pp == s) {
                *pp = s->next;
                break;
            }
        if (prev)
            prev->order = next;
        else
            f->first = next;
        if (f->last == s) f->last = prev;
        f->nseries--;
        free_series(s);
        n++;
        s = next;
    }
    pthread_mutex_unlock(&f->lock);
    return n;
}

void metrics_reset(struct metrics *m) {
    pthread_mutex_lock(&m->lock);
    for (struct metric_family *f = m->families; f; f = f->next) {
        if (f->computed) continue;
        pthread_mutex_lock(&f->lock);
        for (struct metric *s = f->first; s; s = s->order) {
            atomic_store(&s->bits, d2bits(0));
            atomic_store(&s->count, 0);
            for (size_t i = 0; s->bucket_ct && i <= f->nbuckets; i++)
                atomic_store(&s->bucket_ct[i], 0);
        }
        pthread_mutex_unlock(&f->lock);
    }
    pthread_mutex_unlock(&m->lock);
}

/* ---- exposition ---- */

static void put_double(struct strbuf *out, double v) {
    if (isnan(v))
        sb_puts(out, "NaN");
    else if (isinf(v))
        sb_puts(out, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15)
        sb_printf(out, "%.1f", v);
    else
        sb_printf(out, "%.15g", v);
}

static void put_escaped(struct strbuf *out, const char *s, int quote) {
    for (; *s; s++) {
        if (*s == '\\')
            sb_puts(out, "\\\\");
        else if (*s == '\n')
            sb_puts(out, "\\n");
        else if (quote && *s == '"')
            sb_puts(out, "\\\"");
        else
            sb_append(out, s, 1);
    }
}

/* name{l1="v1",...,extra="x"} */
static void put_series_name(struct strbuf *out, const char *name, const char *suffix,
                            const struct metric_family *f, const struct metric *s,
                            const char *extra_k, const char *extra_v) {
    sb_puts(out, name);
    sb_puts(out, suffix);
    size_t n = s ? f->nlabels : 0;
    if (n == 0 && !extra_k) return;
    sb_puts(out, "{");
    for (size_t i = 0; i < n; i++) {
        sb_printf(out, "%s%s=\"", i ? "," : "", f->label_names[i]);
        put_escaped(out, s->values[i], 1);
        sb_puts(out, "\"");
    }
    if (extra_k) sb_printf(out, "%s%s=\"%s\"", n ? "," : "", extra_k, extra_v);
    sb_puts(out, "}");
}

static void render_family(struct strbuf *out, struct metric_family *f) {
    static const char *TYPES[] = {"counter", "gauge", "histogram"};
    sb_printf(out, "# HELP %s ", f->name);
    put_escaped(out, f->help, 0);
    sb_printf(out, "\n# TYPE %s %s\n", f->name, TYPES[f->type]);
    if (f->computed) {
        sb_puts(out, f->name);
        sb_puts(out, " ");
        put_double(out, f->fn(f->fn_arg));
        sb_puts(out, "\n");
        return;
    }
    pthread_mutex_lock(&f->lock);
    for (struct metric *s = f->first; s; s = s->order) {
        if (f->type != METRIC_HISTOGRAM) {
            put_series_name(out, f->name, "", f, s, NULL, NULL);
            sb_puts(out, " ");
            put_double(out, metric_value(s));
            sb_puts(out, "\n");
            continue;
        }
        uint64_t cum = 0;
        char le[48];
        for (size_t i = 0; i <= f->nbuckets; i++) {
            cum += atomic_load_explicit(&s->bucket_ct[i], memory_order_relaxed);
            if (i < f->nbuckets)
                snprintf(le, sizeof(le), "%.15g", f->buckets[i]);
            else
                snprintf(le, sizeof(le), "+Inf");
            put_series_name(out, f->name, "_bucket", f, s, "le", le);
            sb_printf(out, " %llu\n", (unsigned long long)cum);
        }
        put_series_name(out, f->name, "_sum", f, s, NULL, NULL);
        sb_puts(out, " ");
        put_double(out, metric_value(s));
        sb_puts(out, "\n");
        put_series_name(out, f->name, "_count", f, s, NULL, NULL);
        /* The count is the +Inf bucket so the two never disagree in one scrape. */
        sb_printf(out, " %llu\n", (unsigned long long)cum);
    }
    pthread_mutex_unlock(&f->lock);
}

static int cmp_family(const void *a, const void *b) {
    return strcmp((*(struct metric_family *const *)a)->name,
                  (*(struct metric_family *const *)b)->name);
}

int metrics_render(struct metrics *m, struct strbuf *out) {
    pthread_mutex_lock(&m->lock);
    size_t n = 0;
    for (struct metric_family *f = m->families; f; f = f->next) n++;
    struct metric_family **v = calloc(n ? n : 1, sizeof(*v));
    if (!v) {
        pthread_mutex_unlock(&m->lock);
        return -1;
    }
    n = 0;
    for (struct metric_family *f = m->families; f; f = f->next) v[n++] = f;
    qsort(v, n, sizeof(*v), cmp_family);
    for (size_t i = 0; i < n; i++) render_family(out, v[i]);
    pthread_mutex_unlock(&m->lock);
    free(v);
    return out->oom ? -1 : 0;
}

/* ---- process metrics (Linux /proc) ---- */

struct proc_stat {
    double utime, stime, vsize, rss;
    double starttime_ticks;
};

static int read_proc_stat(struct proc_stat *ps) {
    char buf[1024];
    FILE *fp = fopen("/proc/self/stat", "r");
    if (!fp) return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, fp);
    fclose(fp);
    buf[n] = 0;
    /* Fields after the parenthesised comm (which may contain spaces). */
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    p += 2;
    unsigned long long f[40] = {0};
    int i = 0;
    char *save = NULL;
    for (char *tok = strtok_r(p, " ", &save); tok && i < 40; tok = strtok_r(NULL, " ", &save))
        f[i++] = strtoull(tok, NULL, 10);
    if (i < 22) return -1;
    /* f[0] is field 3 (state). utime=14, stime=15, starttime=22, vsize=23, rss=24. */
    ps->utime = (double)f[11];
    ps->stime = (double)f[12];
    ps->starttime_ticks = (double)f[19];
    ps->vsize = (double)f[20];
    ps->rss = (double)f[21];
    return 0;
}

static double proc_cpu(void *arg) {
    (void)arg;
    struct proc_stat ps;
    if (read_proc_stat(&ps) < 0) return 0;
    return (ps.utime + ps.stime) / (double)sysconf(_SC_CLK_TCK);
}

static double proc_rss(void *arg) {
    (void)arg;
    struct proc_stat ps;
    return read_proc_stat(&ps) < 0 ? 0 : ps.rss * (double)sysconf(_SC_PAGESIZE);
}

static double proc_vsize(void *arg) {
    (void)arg;
    struct proc_stat ps;
    return read_proc_stat(&ps) < 0 ? 0 : ps.vsize;
}

static double count_dir(const char *path) {
    DIR *d = opendir(path);
    if (!d) return 0;
    double n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static double proc_fds(void *arg) {
    (void)arg;
    return count_dir("/proc/self/fd") - 1; /* minus the directory's own fd */
}

static double proc_threads(void *arg) {
    (void)arg;
    return count_dir("/proc/self/task");
}

static double proc_max_fds(void *arg) {
    (void)arg;
    struct rlimit rl;
    return getrlimit(RLIMIT_NOFILE, &rl) == 0 ? (double)rl.rlim_cur : 0;
}

static double g_start_time;

static double proc_start(void *arg) {
    (void)arg;
    return g_start_time;
}

static double boot_time(void) {
    FILE *fp = fopen("/proc/stat", "r");
    if (!fp) return 0;
    char line[256];
    double bt = 0;
    while (fgets(line, sizeof(line), fp))
        if (strncmp(line, "btime ", 6) == 0) bt = strtod(line + 6, NULL);
    fclose(fp);
    return bt;
}

void metrics_register_process(struct metrics *m) {
    struct proc_stat ps;
    if (read_proc_stat(&ps) == 0)
        g_start_time = boot_time() + ps.starttime_ticks / (double)sysconf(_SC_CLK_TCK);
    add_computed(m, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                 METRIC_COUNTER, proc_cpu, NULL);
    metrics_gauge_fn(m, "process_resident_memory_bytes", "Resident memory size in bytes.", proc_rss,
                     NULL);
    metrics_gauge_fn(m, "process_virtual_memory_bytes", "Virtual memory size in bytes.", proc_vsize,
                     NULL);
    metrics_gauge_fn(m, "process_open_fds", "Number of open file descriptors.", proc_fds, NULL);
    metrics_gauge_fn(m, "process_max_fds", "Maximum number of open file descriptors.", proc_max_fds,
                     NULL);
    metrics_gauge_fn(m, "process_threads", "Number of OS threads in the process.", proc_threads,
                     NULL);
    metrics_gauge_fn(m, "process_start_time_seconds",
                     "Start time of the process since unix epoch in seconds.", proc_start, NULL);
}
