/* Named loggers: a fixed registry, levels as atomics so the hot path takes no lock. */
#include "base/log.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

struct logger {
    char name[LOG_NAME_MAX];
    _Atomic int level;     /* own level, LOG_NOTSET = inherit */
    _Atomic int effective; /* cached effective level, refreshed on every set */
};

static struct logger g_loggers[LOG_MAX_LOGGERS];
static _Atomic int g_nloggers;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int g_fd = 2;
/* Level of the implicit root above every dotted name. */
static const int ROOT_DEFAULT = LOG_WARNING;

static const struct {
    const char *name;
    int level;
} LEVELS[] = {
    {"NOTSET", LOG_NOTSET},   {"DEBUG", LOG_DEBUG}, {"INFO", LOG_INFO},
    {"WARNING", LOG_WARNING}, {"ERROR", LOG_ERROR}, {"CRITICAL", LOG_CRITICAL},
};

int log_level_parse(const char *s) {
    if (!s) return -1;
    for (size_t i = 1; i < sizeof(LEVELS) / sizeof(LEVELS[0]); i++)
        if (strcasecmp(s, LEVELS[i].name) == 0) return LEVELS[i].level;
    if (strcasecmp(s, "WARN") == 0) return LOG_WARNING;
    if (strcasecmp(s, "FATAL") == 0) return LOG_CRITICAL;
    return -1;
}

const char *log_level_name(int level) {
    for (size_t i = 0; i < sizeof(LEVELS) / sizeof(LEVELS[0]); i++)
        if (LEVELS[i].level == level) return LEVELS[i].name;
    return "UNKNOWN";
}

static struct logger *do_find(const char *name) {
    int n = atomic_load(&g_nloggers);
    for (int i = 0; i < n; i++)
        if (strcmp(g_loggers[i].name, name) == 0) return &g_loggers[i];
    return NULL;
}

struct logger *log_find(const char *name) {
    pthread_mutex_lock(&g_lock);
    struct logger *lg = do_find(name);
    pthread_mutex_unlock(&g_lock);
    return lg;
}

/* Effective level of a name: its own logger's level if set, else the nearest ancestor's.
 * Caller holds g_lock. */
static int do_effective_of(const char *name) {
    char buf[LOG_NAME_MAX];
    size_t len = strlen(name);
    if (len >= sizeof(buf)) len = sizeof(buf) - 1;
    memcpy(buf, name, len);
    buf[len] = 0;
    for (;;) {
        struct logger *lg = do_find(buf);
        if (lg && atomic_load(&lg->level) != LOG_NOTSET) return atomic_load(&lg->level);
        char *dot = strrchr(buf, '.');
        if (!dot) return ROOT_DEFAULT;
        *dot = 0;
    }
}

static void do_refresh_all(void) {
    int n = atomic_load(&g_nloggers);
    for (int i = 0; i < n; i++)
        atomic_store(&g_loggers[i].effective, do_effective_of(g_loggers[i].name));
}

struct logger *log_get(const char *name) {
    if (!name || !*name || strlen(name) >= LOG_NAME_MAX) return NULL;
    pthread_mutex_lock(&g_lock);
    struct logger *lg = do_find(name);
    if (!lg) {
        int n = atomic_load(&g_nloggers);
        if (n < LOG_MAX_LOGGERS) {
            lg = &g_loggers[n];
            snprintf(lg->name, sizeof(lg->name), "%s", name);
            atomic_store(&lg->level, LOG_NOTSET);
            atomic_store(&g_nloggers, n + 1);
            atomic_store(&lg->effective, do_effective_of(name));
        }
    }
    pthread_mutex_unlock(&g_lock);
    return lg;
}

const char *log_name(const struct logger *lg) { return lg->name; }

void log_set_level(struct logger *lg, int level) {
    pthread_mutex_lock(&g_lock);
    atomic_store(&lg->level, level);
    do_refresh_all();
    pthread_mutex_unlock(&g_lock);
}

int log_own_level(const struct logger *lg) { return atomic_load(&lg->level); }

int log_effective_level(const struct logger *lg) { return atomic_load(&lg->effective); }

int log_effective_level_of(const char *name) {
    pthread_mutex_lock(&g_lock);
    int l = do_effective_of(name);
    pthread_mutex_unlock(&g_lock);
    return l;
}

int log_enabled(const struct logger *lg, int level) {
    return lg ? level >= atomic_load(&lg->effective) : level >= ROOT_DEFAULT;
}

static int cmp_logger_ptr(const void *a, const void *b) {
    const struct logger *x = *(const struct logger *const *)a;
    const struct logger *y = *(const struct logger *const *)b;
    return strcmp(x->name, y->name);
}

void log_foreach(void (*fn)(const struct logger *lg, void *arg), void *arg) {
    const struct logger *sorted[LOG_MAX_LOGGERS];
    int n = atomic_load(&g_nloggers);
    for (int i = 0; i < n; i++) sorted[i] = &g_loggers[i];
    qsort(sorted, (size_t)n, sizeof(sorted[0]), cmp_logger_ptr);
    for (int i = 0; i < n; i++) fn(sorted[i], arg);
}

int log_init_from_env(void) {
    struct logger *root = log_get("lmcache");
    const char *env = getenv("LMCACHE_LOG_LEVEL");
    int lvl = LOG_INFO, rc = 0;
    if (env && *env) {
        int p = log_level_parse(env);
        if (p < 0)
            rc = -1;
        else
            lvl = p;
    }
    log_set_level(root, lvl);
    return rc;
}

void log_set_fd(int fd) { atomic_store(&g_fd, fd); }

void log_write(const struct logger *lg, int level, const char *file, int line, const char *func,
               const char *fmt, ...) {
    char buf[2048];
    struct timeval tv;
    struct tm tm;
    gettimeofday(&tv, NULL);
    localtime_r(&tv.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;
    int n = snprintf(buf, sizeof(buf),
                     "[%04d-%02d-%02d %02d:%02d:%02d,%03d] LMCache %s: ", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                     (int)(tv.tv_usec / 1000), log_level_name(level));
    va_list ap;
    va_start(ap, fmt);
    if (n >= 0 && (size_t)n < sizeof(buf))
        n += vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof(buf)) n = (int)sizeof(buf) - 1;
    n += snprintf(buf + n, sizeof(buf) - (size_t)n, " (%s:%d:%s) [%s]\n", base, line, func,
                  lg ? lg->name : "-");
    if ((size_t)n >= sizeof(buf)) {
        n = (int)sizeof(buf) - 1;
        buf[n - 1] = '\n';
    }
    /* One write per line so concurrent threads do not interleave. */
    ssize_t w = write(atomic_load(&g_fd), buf, (size_t)n);
    (void)w;
}
