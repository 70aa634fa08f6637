/* The master's environment knobs: one X-macro list gives the fields, the parser, the
 * defaults and the table printed in docs/master.md. Read once at start. */
#ifndef LMCACHE_MASTER_MCONFIG_H
#define LMCACHE_MASTER_MCONFIG_H

#include <stddef.h>
#include <stdint.h>

/* X(field, env name, default, minimum, maximum, help) */
#define MCFG_NUMERIC(X)                                                                            \
    X(heartbeat_ttl_sec, "UMBP_HEARTBEAT_TTL_SEC", 10, 1, UINT32_MAX,                              \
      "Heartbeat TTL; a node expires TTL x max_missed seconds after its last heartbeat")           \
    X(reaper_interval_sec, "UMBP_REAPER_INTERVAL_SEC", 5, 1, UINT32_MAX, "Reaper period")          \
    X(max_missed_heartbeats, "UMBP_MAX_MISSED_HEARTBEATS", 3, 1, UINT32_MAX,                       \
      "Multiplier for expiry and for RegisterClient's stale-after")                                \
    X(eviction_check_interval_sec, "UMBP_EVICTION_CHECK_INTERVAL_SEC", 5, 1, UINT32_MAX,           \
      "Eviction check period (accepted and printed; see docs/master.md)")                          \
    X(lease_duration_sec, "UMBP_LEASE_DURATION_SEC", 2, 1, UINT32_MAX,                             \
      "Read lease granted by RouteGet/BatchRouteGet")                                              \
    X(heartbeat_interval_divisor, "UMBP_HEARTBEAT_INTERVAL_DIVISOR", 2, 1, UINT32_MAX,             \
      "heartbeat_interval_ms = TTL*1000/divisor, returned by RegisterClient")                      \
    X(evictkey_deadline_ms, "UMBP_EVICTKEY_DEADLINE_MS", 1000, 1, UINT32_MAX,                      \
      "Deadline of the outbound EvictKey RPC")                                                     \
    X(grpc_shutdown_deadline_sec, "UMBP_GRPC_SHUTDOWN_DEADLINE_SEC", 3, 1, UINT32_MAX,             \
      "Grace period for in-flight RPCs at shutdown")                                               \
    X(hit_index_ttl_sec, "UMBP_HIT_INDEX_TTL_SEC", 7200, 1, UINT32_MAX,                            \
      "Hit-counter inactivity TTL")                                                                \
    X(hit_index_gc_interval_sec, "UMBP_HIT_INDEX_GC_INTERVAL_SEC", 60, 1, UINT32_MAX,              \
      "Hit-counter GC period")                                                                     \
    X(hit_query_max_batch, "UMBP_HIT_QUERY_MAX_BATCH", 4096, 1, UINT32_MAX,                        \
      "Maximum hashes in one GetExternalKvHitCounts request")                                      \
    X(index_shards, "UMBP_MASTER_INDEX_SHARDS", 32, 1, 4096,                                       \
      "Index shards (rounded up to a power of two)")                                               \
    X(min_pollers, "UMBP_MASTER_MIN_POLLERS", 8, 1, 1024, "Accepted for compatibility")            \
    X(max_pollers, "UMBP_MASTER_MAX_POLLERS", 64, 1, 1024, "Accepted for compatibility")           \
    X(threads, "LMCACHE_MASTER_THREADS", 0, 0, 256,                                                \
      "gRPC completion-queue threads (0 = one per CPU, at least 2)")                               \
    X(max_engine_desc_bytes, "LMCACHE_MASTER_MAX_ENGINE_DESC_BYTES", 1048576, 0, UINT32_MAX,       \
      "Largest engine_desc RegisterClient accepts")                                                \
    X(expired_retention_sec, "LMCACHE_MASTER_EXPIRED_RETENTION_SEC", 300, 0, UINT32_MAX,           \
      "How long the record of an expired node is kept (a heartbeat revives it)")                   \
    X(redis_connect_timeout_ms, "UMBP_REDIS_CONNECT_TIMEOUT_MS", 1000, 1, 600000,                  \
      "Redis connect timeout")                                                                     \
    X(redis_socket_timeout_ms, "UMBP_REDIS_SOCKET_TIMEOUT_MS", 1000, 1, 600000,                    \
      "Redis per-command socket timeout")                                                          \
    X(redis_pool_size, "UMBP_REDIS_POOL_SIZE", 0, 0, 1024,                                         \
      "Redis connections per endpoint (0 = min(32, max(4, 2 x CPUs)))")                            \
    X(redis_block_shards, "UMBP_REDIS_BLOCK_SHARDS", 1, 1, 4096,                                   \
      "Key shards (hash tags) of the Redis store; fixed for a deployment")                         \
    X(redis_cluster, "UMBP_REDIS_CLUSTER", 0, 0, 1, "1 selects Redis Cluster mode")                \
    X(redis_required, "UMBP_REDIS_REQUIRED", 1, 0, 1,                                              \
      "1: exit at start when Redis does not answer; 0: start degraded")                            \
    X(redis_cache_mb, "LMCACHE_MASTER_REDIS_CACHE_MB", 256, 0, 1048576,                            \
      "Read cache of MatchExternalKv over the Redis store, MiB (0 = off)")

/* X(field, env name, default, allowed values separated by '|', help) */
#define MCFG_ENUMS(X)                                                                              \
    X(route_put_select_algo, "UMBP_ROUTE_PUT_SELECT_ALGO", "most_available",                       \
      "most_available|random", "RoutePut base algorithm")                                          \
    X(route_put_node_affinity, "UMBP_ROUTE_PUT_NODE_AFFINITY", "none", "none|same|local",          \
      "RoutePut node affinity")                                                                    \
    X(metadata_backend, "UMBP_METADATA_BACKEND", "inmemory", "inmemory|redis",                     \
      "Metadata store backend")

/* X(field, env name, default, help): free-form strings, kept as given. */
#define MCFG_STRINGS(X)                                                                            \
    X(redis_uri, "UMBP_REDIS_URI", "tcp://127.0.0.1:6379", "Redis endpoint tcp://host[:port]")     \
    X(redis_namespace, "UMBP_REDIS_NAMESPACE", "default", "Namespace inside the Redis key tags")   \
    X(redis_password, "UMBP_REDIS_PASSWORD", "", "Redis AUTH password (never printed)")            \
    X(redis_shard_uris, "UMBP_REDIS_SHARD_URIS", "", "Comma-separated endpoints (multi mode)")

struct mcfg {
#define MCFG_FIELD(f, env, def, mn, mx, help) uint64_t f;
    MCFG_NUMERIC(MCFG_FIELD)
#undef MCFG_FIELD
#define MCFG_EFIELD(f, env, def, allowed, help) char f[32];
    MCFG_ENUMS(MCFG_EFIELD)
#undef MCFG_EFIELD
#define MCFG_SFIELD(f, env, def, help) char f[1024];
    MCFG_STRINGS(MCFG_SFIELD)
#undef MCFG_SFIELD
};

/* Reads every knob through getenv_fn (getenv in production). Invalid values fall back to
 * the default with one warning per variable written through warn. */
void mcfg_load(struct mcfg *c, const char *(*getenv_fn)(const char *),
               void (*warn)(const char *msg, void *arg), void *arg);

/* "heartbeat_ttl=10s reaper_interval=5s ..." (the "[Master] Resolved timing: " tail). */
int mcfg_timing_line(const struct mcfg *c, char *buf, size_t len);

/* "backend=redis uri=... namespace=... password=<redacted> ..." for the resolved-settings
 * line of the metadata store; the password is never printed. */
int mcfg_store_line(const struct mcfg *c, char *buf, size_t len);

#endif
