/* A bounded, striped cache of reads for the Redis store: (kind, key) -> an opaque value,
 * with CLOCK eviction per stripe and fill tickets that make a stale fill impossible. It knows
 * nothing of Redis: mstore_redis_track.c keeps it coherent (invalidations, flushes). */
#ifndef LMCACHE_MASTER_MCACHE_H
#define LMCACHE_MASTER_MCACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct mcache;

/* What a cached entry costs beyond its key and value bytes (header, allocator, bucket). */
#define MCACHE_ENTRY_OVERHEAD 80

/* A growable byte buffer lookups append values to. */
struct mcache_buf {
    uint8_t *p;
    size_t n, cap;
};

struct mcache_stats {
    uint64_t hits, misses, invalidations, flushes, evictions, fills_dropped;
    uint64_t entries, bytes;
};

/* max_bytes (> 0) bounds the sum of the entries' costs (key + value + overhead). NULL on no
 * memory. The cache starts off: lookups miss and fills are dropped until mcache_enable. */
struct mcache *mcache_new(size_t max_bytes);
void mcache_free(struct mcache *c);

/* The key's hash (fnv1a64 over kind and key), computed once per key by the caller. */
uint64_t mcache_hash(uint8_t kind, const void *key, size_t klen);

/* Lookup. 1: a hit, the value appended to out (-1 when out could not grow: treat as a miss).
 * 0: a miss, *ticket set for mcache_fill. -1: the cache is off (no ticket; do not fill). */
int mcache_get(struct mcache *c, uint8_t kind, const void *key, size_t klen, uint64_t hv,
               struct mcache_buf *out, uint64_t *ticket);

/* A hint before n lookups (hv[i] 0: skip): stage 0 prefetches their bucket slots, stage 1
 * (after some other work) the entries the slots point to. Takes no lock. */
void mcache_prefetch(struct mcache *c, const uint64_t *hv, size_t n, int stage);

/* Inserts (or replaces) the value read after the miss that gave ticket, unless the key's
 * stripe saw an invalidation or a flush since: then the value may predate a write and is
 * dropped. A value larger than a stripe's share of the budget is not cached. */
void mcache_fill(struct mcache *c, uint8_t kind, const void *key, size_t klen, uint64_t hv,
                 uint64_t ticket, const void *val, size_t vlen);

/* A key changed: its entry (if any) is dropped and its stripe's pending fills are voided. */
void mcache_invalidate(struct mcache *c, uint8_t kind, const void *key, size_t klen);

/* Drops every entry and voids every pending fill; mcache_disable also turns the cache off
 * (lookups answer -1) until mcache_enable. */
void mcache_flush(struct mcache *c);
void mcache_disable(struct mcache *c);
void mcache_enable(struct mcache *c);
bool mcache_enabled(const struct mcache *c);

void mcache_stats(struct mcache *c, struct mcache_stats *st);

/* Appends n bytes to b (false on no memory). */
bool mcache_buf_put(struct mcache_buf *b, const void *p, size_t n);

#endif
