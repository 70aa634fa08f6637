/* The L1 arena: one anonymous mapping carved into page-aligned objects by a TLSF allocator whose
 * metadata lives outside the mapping (see the block comment in arena.c for the design, its
 * costs and its worst case).
 *
 * Thread-safety: every function takes the arena's mutex (the innermost lock of L1: stripe ->
 * LRU -> arena) except arena_base/arena_ptr/arena_total_bytes/arena_unit, which read immutable
 * fields. */
#ifndef LMCACHE_SERVER_L1_ARENA_H
#define LMCACHE_SERVER_L1_ARENA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define ARENA_DEFAULT_UNIT 4096u

struct arena_config {
    uint64_t size_bytes; /* rounded down to a whole number of units (up to 2 MiB with huge pages) */
    uint32_t unit;       /* allocation unit and alignment: a power of two >= 4096; 0 = 4096 */
    bool use_hugepages;  /* try MAP_HUGETLB, fall back to THP-advised normal pages */
    bool lock_memory;    /* mlock the mapping; failure is logged and ignored */
};

struct arena_stats {
    uint64_t total_bytes;
    uint64_t used_bytes; /* in whole units, including the rounding of each object */
    uint64_t free_bytes;
    uint64_t largest_free_bytes;
    uint64_t allocated_objects;
    uint64_t free_blocks;
    uint64_t metadata_bytes; /* out-of-band allocator metadata */
    bool hugetlb;            /* MAP_HUGETLB mapping in effect */
};

struct arena;

/* Maps the arena. Returns 0, or -1 with a message in err (bad size/unit, mmap failure). */
int arena_create(const struct arena_config *cfg, struct arena **out, char *err, size_t errlen);
/* Unmaps. Every pointer into the arena becomes invalid. */
void arena_destroy(struct arena *a);

/* Allocates bytes (rounded up to the unit). Returns 0 and the byte offset of the object, or -1
 * when no free block is large enough (or bytes is 0 or larger than the arena). O(1). */
int arena_alloc(struct arena *a, uint64_t bytes, uint64_t *off);
/* Frees the object at off that was allocated with the same byte count. Returns 0, or -1 (and
 * changes nothing) when off/bytes do not name an allocated object: double free, wrong size. */
int arena_free(struct arena *a, uint64_t off, uint64_t bytes);
/* Frees every object at once. */
void arena_reset(struct arena *a);

void *arena_base(const struct arena *a);
/* The address of the object at off. */
void *arena_ptr(const struct arena *a, uint64_t off);
uint64_t arena_total_bytes(const struct arena *a);
uint64_t arena_used_bytes(struct arena *a);
uint32_t arena_unit(const struct arena *a);
/* Bytes an allocation of this size really takes. */
uint64_t arena_rounded(const struct arena *a, uint64_t bytes);
void arena_get_stats(struct arena *a, struct arena_stats *st);

/* Walks all blocks and checks the allocator invariants (blocks tile the arena, tags agree at
 * both ends, free blocks are coalesced and listed in the right class, counters add up).
 * O(blocks). Returns 0, or -1 with a message. For tests and debugging. */
int arena_check(struct arena *a, char *err, size_t errlen);

#endif
