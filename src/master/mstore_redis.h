/* The Redis-backed metadata store (UMBP_METADATA_BACKEND=redis): the state of mstore.h kept
 * in one Redis (the reference's key schema, docs/master.md "Redis store"), so that several
 * master replicas serve one fleet and a master restart loses nothing. */
#ifndef LMCACHE_MASTER_MSTORE_REDIS_H
#define LMCACHE_MASTER_MSTORE_REDIS_H

#include <stddef.h>
#include <stdint.h>

struct mstore;
struct metrics;
struct logger;

struct mstore_redis_cfg {
    const char *uri;        /* tcp://host[:port] */
    const char *shard_uris; /* NULL or "": one endpoint; else comma-separated (multi mode) */
    const char *ns;         /* namespace inside the key tags */
    const char *password;   /* "" = no AUTH */
    uint32_t connect_timeout_ms, socket_timeout_ms;
    uint32_t pool_size;      /* connections */
    uint32_t shards;         /* key shards (hash tags), 1..4096; cluster: 1 = one per master */
    int required;            /* PING at start; fail when it does not answer */
    int cluster;             /* Redis Cluster: uri is a comma-separated seed list */
    uint32_t cache_mb;       /* read cache of MatchExternalKv (0: off; docs/master.md) */
    struct metrics *metrics; /* NULL: no store metrics */
    struct logger *lg;
};

/* NULL with a one-line reason in err. */
struct mstore *mstore_redis_create(const struct mstore_redis_cfg *cfg, char *err, size_t errlen);

/* Events per script call of a heartbeat, entries per step of a wipe or GC: the bound on how
 * long one script holds Redis (documented in docs/master.md). */
#define MSTORE_REDIS_CHUNK 2048

#endif
