/* Named loggers with levels changeable at runtime (Python logging semantics:
 * a logger without its own level inherits the nearest dotted ancestor's). */
#ifndef LMCACHE_BASE_LOG_H
#define LMCACHE_BASE_LOG_H

#include <stdarg.h>
#include <stddef.h>

enum log_level {
    LOG_NOTSET = 0,
    LOG_DEBUG = 10,
    LOG_INFO = 20,
    LOG_WARNING = 30,
    LOG_ERROR = 40,
    LOG_CRITICAL = 50,
};

#define LOG_MAX_LOGGERS 256
#define LOG_NAME_MAX    64

struct logger;

/* Returns the logger called name, creating it (level NOTSET) if needed.
 * NULL when the registry is full or the name is empty or too long. */
struct logger *log_get(const char *name);
/* Returns the logger if it exists, without creating it. */
struct logger *log_find(const char *name);
const char *log_name(const struct logger *lg);
void log_set_level(struct logger *lg, int level);
int log_own_level(const struct logger *lg);
int log_effective_level(const struct logger *lg);
/* Effective level of a name whether or not a logger of that name exists. */
int log_effective_level_of(const char *name);
int log_enabled(const struct logger *lg, int level);

/* "debug", "INFO", "Warn"... -> level; -1 when unknown. */
int log_level_parse(const char *s);
const char *log_level_name(int level);

/* Calls fn for every registered logger in name order. */
void log_foreach(void (*fn)(const struct logger *lg, void *arg), void *arg);

/* Reads LMCACHE_LOG_LEVEL into the root logger "lmcache" (default INFO).
 * Returns -1 and leaves the default when the variable holds an unknown level. */
int log_init_from_env(void);

/* Sends log lines to fd (default 2). */
void log_set_fd(int fd);

void log_write(const struct logger *lg, int level, const char *file, int line, const char *func,
               const char *fmt, ...) __attribute__((format(printf, 6, 7)));

#define LOG_AT(lg, lvl, ...)                                                                       \
    do {                                                                                           \
        if (log_enabled((lg), (lvl)))                                                              \
            log_write((lg), (lvl), __FILE__, __LINE__, __func__, __VA_ARGS__);                     \
    } while (0)
#define log_debug(lg, ...)    LOG_AT(lg, LOG_DEBUG, __VA_ARGS__)
#define log_info(lg, ...)     LOG_AT(lg, LOG_INFO, __VA_ARGS__)
#define log_warn(lg, ...)     LOG_AT(lg, LOG_WARNING, __VA_ARGS__)
#define log_error(lg, ...)    LOG_AT(lg, LOG_ERROR, __VA_ARGS__)
#define log_critical(lg, ...) LOG_AT(lg, LOG_CRITICAL, __VA_ARGS__)

#endif
