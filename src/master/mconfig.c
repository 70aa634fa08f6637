/* Environment knobs of the master: parsing with the UMBP rules (base 10, leading blanks
 * and '+' accepted, anything else falls back to the default with one warning). */
#include "master/mconfig.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void warnf(void (*warn)(const char *, void *), void *arg, const char *name, const char *why,
                  const char *val) {
    char msg[256];
    snprintf(msg, sizeof(msg), "env %s: %s (value='%.64s'); using default", name, why, val);
    if (warn) warn(msg, arg);
}

static uint64_t parse_num(const char *name, const char *v, uint64_t def, uint64_t mn, uint64_t mx,
                          void (*warn)(const char *, void *), void *arg) {
    if (!v || !*v) return def;
    const char *p = v;
    while (isspace((unsigned char)*p)) p++;
    if (*p == '-') {
        warnf(warn, arg, name, "negative", v);
        return def;
    }
    if (!isdigit((unsigned char)(*p == '+' ? p[1] : *p))) {
        warnf(warn, arg, name, "not a number", v);
        return def;
    }
    errno = 0;
    char *end;
    unsigned long long x = strtoull(p, &end, 10);
    if (errno || *end) {
        warnf(warn, arg, name, errno ? "out of range" : "trailing characters", v);
        return def;
    }
    if (x < mn) {
        warnf(warn, arg, name, "below the minimum", v);
        return def;
    }
    if (x > mx) {
        /* The shard count clamps like the reference; every other knob falls back. */
        if (mx == 4096) return mx;
        warnf(warn, arg, name, "out of range", v);
        return def;
    }
    return x;
}

static void parse_enum(char *out, size_t outlen, const char *name, const char *v, const char *def,
                       const char *allowed, void (*warn)(const char *, void *), void *arg) {
    snprintf(out, outlen, "%s", def);
    if (!v || !*v) return;
    char buf[64];
    while (isspace((unsigned char)*v)) v++;
    snprintf(buf, sizeof(buf), "%s", v);
    size_t n = strlen(buf);
    while (n && isspace((unsigned char)buf[n - 1])) buf[--n] = 0;
    for (const char *a = allowed; *a;) {
        const char *bar = strchr(a, '|');
        size_t al = bar ? (size_t)(bar - a) : strlen(a);
        if (al == n && strncmp(a, buf, n) == 0) {
            snprintf(out, outlen, "%s", buf);
            return;
        }
        a += al + (bar ? 1 : 0);
    }
    warnf(warn, arg, name, "unknown value", v);
}

void mcfg_load(struct mcfg *c, const char *(*getenv_fn)(const char *),
               void (*warn)(const char *msg, void *arg), void *arg) {
    memset(c, 0, sizeof(*c));
#define MCFG_PARSE(f, env, def, mn, mx, help)                                                      \
    c->f = parse_num(env, getenv_fn(env), def, mn, mx, warn, arg);
    MCFG_NUMERIC(MCFG_PARSE)
#undef MCFG_PARSE
#define MCFG_EPARSE(f, env, def, allowed, help)                                                    \
    parse_enum(c->f, sizeof(c->f), env, getenv_fn(env), def, allowed, warn, arg);
    MCFG_ENUMS(MCFG_EPARSE)
#undef MCFG_EPARSE
#define MCFG_SPARSE(f, env, def, help)                                                             \
    do {                                                                                           \
        const char *v = getenv_fn(env);                                                            \
        if (v && strlen(v) >= sizeof(c->f)) {                                                      \
            warnf(warn, arg, env, "too long", v);                                                  \
            v = NULL;                                                                              \
        }                                                                                          \
        snprintf(c->f, sizeof(c->f), "%s", v &&*v ? v : def);                                      \
    } while (0);
    MCFG_STRINGS(MCFG_SPARSE)
#undef MCFG_SPARSE
    if (c->max_pollers < c->min_pollers) c->max_pollers = c->min_pollers;
}

int mcfg_timing_line(const struct mcfg *c, char *buf, size_t len) {
    return snprintf(
        buf, len,
        "heartbeat_ttl=%llus reaper_interval=%llus max_missed=%llu "
        "eviction.check_interval=%llus lease_duration=%llus hit_index_ttl=%llus "
        "hit_index_gc_interval=%llus hit_query_max_batch=%llu",
        (unsigned long long)c->heartbeat_ttl_sec, (unsigned long long)c->reaper_interval_sec,
        (unsigned long long)c->max_missed_heartbeats,
        (unsigned long long)c->eviction_check_interval_sec,
        (unsigned long long)c->lease_duration_sec, (unsigned long long)c->hit_index_ttl_sec,
        (unsigned long long)c->hit_index_gc_interval_sec,
        (unsigned long long)c->hit_query_max_batch);
}

int mcfg_store_line(const struct mcfg *c, char *buf, size_t len) {
    if (strcmp(c->metadata_backend, "redis") != 0)
        return snprintf(buf, len, "backend=%s", c->metadata_backend);
    return snprintf(buf, len,
                    "backend=redis uri=%s namespace=%s password=%s shard_uris=%s cluster=%llu "
                    "block_shards=%llu pool_size=%llu connect_timeout=%llums socket_timeout=%llums "
                    "required=%llu cache_mb=%llu",
                    c->redis_uri, c->redis_namespace, *c->redis_password ? "<redacted>" : "<none>",
                    *c->redis_shard_uris ? c->redis_shard_uris : "<none>",
                    (unsigned long long)c->redis_cluster, (unsigned long long)c->redis_block_shards,
                    (unsigned long long)c->redis_pool_size,
                    (unsigned long long)c->redis_connect_timeout_ms,
                    (unsigned long long)c->redis_socket_timeout_ms,
                    (unsigned long long)c->redis_required, (unsigned long long)c->redis_cache_mb);
}
