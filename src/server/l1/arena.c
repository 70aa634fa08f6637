/* The L1 arena: one mapping, a TLSF allocator over allocation units, metadata kept outside it.
 *
 * Design. The arena is an array of npages units (4 KiB by default; every object starts on a
 * unit boundary, so objects are 4 KiB aligned). Blocks -- allocated or free -- tile the arena.
 * Three out-of-band uint32 arrays indexed by unit describe them:
 *   tag[u]    at the first and at the last unit of every block: its size in units, with
 *             TAG_FREE set when the block is free (boundary tags, so a freed block finds its
 *             physical neighbours in O(1) and merges with them);
 *   fnext[u], fprev[u]  at the first unit of a free block: the doubly linked free list of its
 *             size class.
 * Keeping the metadata out of the mapping means KV bytes never share a page with allocator
 * state: a late or forced write into a freed object (a writer whose lease expired, a forced
 * /cache/clear during a copy) may corrupt cached data but never the allocator. The cost is 12
 * bytes per unit (0.3% of the arena at 4 KiB units; a larger unit cuts it proportionally).
 *
 * Free blocks are kept in TLSF size classes (Masmano et al., "TLSF: a new dynamic memory
 * allocator for real-time systems"): the first level is floor(log2(size)), the second splits
 * each power-of-two range into 16 linear classes; sizes below 16 units get one class each.
 * Two bitmap levels record which classes are non-empty, so alloc is: round the request up to the
 * next class boundary, find the first non-empty class at or above it with two ctz, pop its head,
 * split off the remainder. Free is: merge with free neighbours via the boundary tags, push on the
 * class list. Both are O(1). When the rounded search finds nothing, the request's own class is
 * scanned for a block that fits (at most 16 blocks) before giving up.
 *
 * Worst case. Internal waste is below one unit per object (rounding). Rounding the search up to
 * a class boundary can refuse a request that a block in its own class would satisfy (mitigated
 * by the bounded scan) and splits a block at most 1/16 larger than needed. External
 * fragmentation has no useful bound for arbitrary size mixes (Robson: any non-moving allocator
 * may need M*log2(n) memory), but for L1's real load -- objects of one or a few layouts per
 * model -- a freed block is exactly the size of the next request of that layout, so the arena
 * can be filled completely. The soak test in tests/unit/test_l1_arena.c measures the largest
 * free block against free memory for a random mix. */
#include "base/errbuf.h"
#include "server/l1/arena.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/log.h"
#include "base/prefault.h"

#define TAG_FREE 0x80000000u
#define TAG_SIZE 0x7fffffffu
#define NIL      UINT32_MAX
#define SL_LOG2  4
#define SL_COUNT (1u << SL_LOG2)
#define FL_COUNT 29 /* sizes < 2^31 units: floor(log2) <= 30 -> fl <= 27, plus fl 0 */
#define SCAN_MAX 16
#define HUGE_2M  (2u << 20)

struct arena {
    pthread_mutex_t mu;
    char *base;
    size_t map_len;
    uint64_t total;
    uint32_t unit;
    uint32_t unit_shift;
    uint32_t npages;
    bool hugetlb;
    /* guarded by mu */
    uint32_t *tag;
    uint32_t *fnext;
    uint32_t *fprev;
    uint32_t fl_bitmap;
    uint32_t sl_bitmap[FL_COUNT];
    uint32_t head[FL_COUNT][SL_COUNT];
    uint64_t used_pages;
    uint64_t nalloc;
    uint64_t nfree_blocks;
};

#define set_err errbuf_set

static inline uint32_t flog2(uint32_t x) { return 31u - (uint32_t)__builtin_clz(x); }

/* The class a free block of size s is listed in. */
static inline void mapping_insert(uint32_t s, uint32_t *fl, uint32_t *sl) {
    if (s < SL_COUNT) {
        *fl = 0;
        *sl = s;
    } else {
        uint32_t f = flog2(s);
        *fl = f - (SL_LOG2 - 1);
        *sl = (s >> (f - SL_LOG2)) - SL_COUNT;
    }
}

/* The first class whose every block is >= s. */
static inline void mapping_search(uint32_t s, uint32_t *fl, uint32_t *sl) {
    uint64_t r = s;
    if (s >= SL_COUNT) r += (1ull << (flog2(s) - SL_LOG2)) - 1;
    if (r > TAG_SIZE) r = TAG_SIZE;
    mapping_insert((uint32_t)r, fl, sl);
}

static void do_list_insert(struct arena *a, uint32_t u, uint32_t size) {
    uint32_t fl, sl;
    mapping_insert(size, &fl, &sl);
    a->tag[u] = a->tag[u + size - 1] = size | TAG_FREE;
    uint32_t h = a->head[fl][sl];
    a->fnext[u] = h;
    a->fprev[u] = NIL;
    if (h != NIL) a->fprev[h] = u;
    a->head[fl][sl] = u;
    a->sl_bitmap[fl] |= 1u << sl;
    a->fl_bitmap |= 1u << fl;
    a->nfree_blocks++;
}

static void do_list_remove(struct arena *a, uint32_t u, uint32_t size) {
    uint32_t fl, sl;
    mapping_insert(size, &fl, &sl);
    uint32_t n = a->fnext[u], p = a->fprev[u];
    if (n != NIL) a->fprev[n] = p;
    if (p != NIL)
        a->fnext[p] = n;
    else
        a->head[fl][sl] = n;
    if (a->head[fl][sl] == NIL) {
        a->sl_bitmap[fl] &= ~(1u << sl);
        if (a->sl_bitmap[fl] == 0) a->fl_bitmap &= ~(1u << fl);
    }
    a->nfree_blocks--;
}

/* Returns the first unit of a free block of at least n units, or NIL. */
static uint32_t do_find(struct arena *a, uint32_t n) {
    uint32_t fl, sl;
    mapping_search(n, &fl, &sl);
    if (fl < FL_COUNT) {
        uint32_t sl_map = sl < 32 ? a->sl_bitmap[fl] & (~0u << sl) : 0;
        if (!sl_map) {
            uint32_t fl_map = fl + 1 < 32 ? a->fl_bitmap & (~0u << (fl + 1)) : 0;
            if (fl_map) {
                fl = (uint32_t)__builtin_ctz(fl_map);
                sl_map = a->sl_bitmap[fl];
            }
        }
        if (sl_map) return a->head[fl][__builtin_ctz(sl_map)];
    }
    /* Good-fit fallback: the request's own class may hold a block that fits. */
    mapping_insert(n, &fl, &sl);
    uint32_t u = a->head[fl][sl];
    for (int i = 0; i < SCAN_MAX && u != NIL; i++, u = a->fnext[u])
        if ((a->tag[u] & TAG_SIZE) >= n) return u;
    return NIL;
}

int arena_create(const struct arena_config *cfg, struct arena **out, char *err, size_t errlen) {
    struct logger *lg = log_get("lmcache.l1");
    uint32_t unit = cfg->unit ? cfg->unit : ARENA_DEFAULT_UNIT;
    if (unit < 4096 || (unit & (unit - 1)) != 0) {
        set_err(err, errlen, "allocation unit must be a power of two >= 4096 (got %u)", unit);
        return -1;
    }
    uint64_t size = cfg->size_bytes / unit * unit;
    if (size == 0) {
        set_err(err, errlen, "L1 size must be at least one allocation unit (%u bytes)", unit);
        return -1;
    }
    if (size / unit > TAG_SIZE) {
        set_err(err, errlen, "L1 size %llu bytes exceeds %llu units of %u bytes",
                (unsigned long long)size, (unsigned long long)TAG_SIZE, unit);
        return -1;
    }
    struct arena *a = calloc(1, sizeof(*a));
    if (!a) {
        set_err(err, errlen, "out of memory");
        return -1;
    }
    a->unit = unit;
    a->unit_shift = (uint32_t)__builtin_ctz(unit);
    void *p = MAP_FAILED;
    if (cfg->use_hugepages) {
        size_t hlen = (size + HUGE_2M - 1) / HUGE_2M * HUGE_2M;
        p = mmap(NULL, hlen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1,
                 0);
        if (p != MAP_FAILED) {
            a->hugetlb = true;
            a->map_len = hlen;
        } else {
            if (lg)
                log_warn(lg,
                         "huge pages unavailable for %zu bytes (%s); using normal pages advised "
                         "for transparent huge pages",
                         hlen, strerror(errno));
        }
    }
    if (p == MAP_FAILED) {
        a->map_len = size;
        p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
        if (p == MAP_FAILED) {
            set_err(err, errlen, "mmap of %llu bytes failed: %s", (unsigned long long)size,
                    strerror(errno));
            free(a);
            return -1;
        }
        if (cfg->use_hugepages && madvise(p, size, MADV_HUGEPAGE) != 0 && lg)
            log_warn(lg, "madvise(MADV_HUGEPAGE) failed: %s", strerror(errno));
    }
    a->base = p;
    if (cfg->lock_memory && mlock(p, a->map_len) != 0 && lg)
        log_warn(lg, "mlock of the L1 arena failed (%s); it may be swapped out", strerror(errno));
    a->total = size;
    a->npages = (uint32_t)(size >> a->unit_shift);
    a->tag = calloc(a->npages, sizeof(uint32_t));
    a->fnext = calloc(a->npages, sizeof(uint32_t));
    a->fprev = calloc(a->npages, sizeof(uint32_t));
    int prc = pthread_mutex_init(&a->mu, NULL);
    if (!a->tag || !a->fnext || !a->fprev || prc != 0) {
        set_err(err, errlen, "out of memory for %u units of allocator metadata", a->npages);
        free(a->tag);
        free(a->fnext);
        free(a->fprev);
        if (prc == 0) pthread_mutex_destroy(&a->mu);
        munmap(a->base, a->map_len);
        free(a);
        return -1;
    }
    /* The metadata is touched unit by unit as the arena fills: faulted in now, the first
     * allocations pay no page faults (a fault per new page of each array, ~250 in the first
     * 0.5 GiB of 2 MiB objects, was most of a fresh server's first-store faults). */
    (void)prefault_range(a->tag, a->npages * sizeof(uint32_t), 1);
    (void)prefault_range(a->fnext, a->npages * sizeof(uint32_t), 1);
    (void)prefault_range(a->fprev, a->npages * sizeof(uint32_t), 1);
    arena_reset(a);
    *out = a;
    return 0;
}

void arena_destroy(struct arena *a) {
    if (!a) return;
    munmap(a->base, a->map_len);
    free(a->tag);
    free(a->fnext);
    free(a->fprev);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

void arena_reset(struct arena *a) {
    pthread_mutex_lock(&a->mu);
    a->fl_bitmap = 0;
    memset(a->sl_bitmap, 0, sizeof(a->sl_bitmap));
    for (uint32_t i = 0; i < FL_COUNT; i++)
        for (uint32_t j = 0; j < SL_COUNT; j++) a->head[i][j] = NIL;
    a->used_pages = 0;
    a->nalloc = 0;
    a->nfree_blocks = 0;
    do_list_insert(a, 0, a->npages);
    pthread_mutex_unlock(&a->mu);
}

static inline uint64_t pages_of(const struct arena *a, uint64_t bytes) {
    return (bytes + a->unit - 1) >> a->unit_shift;
}

int arena_alloc(struct arena *a, uint64_t bytes, uint64_t *off) {
    if (bytes == 0 || bytes > a->total) return -1;
    uint32_t n = (uint32_t)pages_of(a, bytes);
    pthread_mutex_lock(&a->mu);
    uint32_t u = do_find(a, n);
    if (u == NIL) {
        pthread_mutex_unlock(&a->mu);
        return -1;
    }
    uint32_t size = a->tag[u] & TAG_SIZE;
    do_list_remove(a, u, size);
    if (size > n) do_list_insert(a, u + n, size - n);
    a->tag[u] = a->tag[u + n - 1] = n;
    a->used_pages += n;
    a->nalloc++;
    pthread_mutex_unlock(&a->mu);
    *off = (uint64_t)u << a->unit_shift;
    return 0;
}

int arena_free(struct arena *a, uint64_t off, uint64_t bytes) {
    if (bytes == 0 || bytes > a->total || (off & (a->unit - 1)) != 0 || off >= a->total) return -1;
    uint32_t u = (uint32_t)(off >> a->unit_shift);
    uint32_t n = (uint32_t)pages_of(a, bytes);
    if ((uint64_t)u + n > a->npages) return -1;
    pthread_mutex_lock(&a->mu);
    if (a->tag[u] != n || a->tag[u + n - 1] != n) {
        pthread_mutex_unlock(&a->mu);
        return -1;
    }
    a->used_pages -= n;
    a->nalloc--;
    uint32_t start = u, size = n;
    if (u + n < a->npages && (a->tag[u + n] & TAG_FREE)) {
        uint32_t s2 = a->tag[u + n] & TAG_SIZE;
        do_list_remove(a, u + n, s2);
        size += s2;
    }
    if (u > 0 && (a->tag[u - 1] & TAG_FREE)) {
        uint32_t s2 = a->tag[u - 1] & TAG_SIZE;
        do_list_remove(a, u - s2, s2);
        start = u - s2;
        size += s2;
    }
    do_list_insert(a, start, size);
    pthread_mutex_unlock(&a->mu);
    return 0;
}

void *arena_base(const struct arena *a) { return a->base; }
void *arena_ptr(const struct arena *a, uint64_t off) { return a->base + off; }
uint64_t arena_total_bytes(const struct arena *a) { return a->total; }
uint32_t arena_unit(const struct arena *a) { return a->unit; }
uint64_t arena_rounded(const struct arena *a, uint64_t bytes) {
    return pages_of(a, bytes) << a->unit_shift;
}

uint64_t arena_used_bytes(struct arena *a) {
    pthread_mutex_lock(&a->mu);
    uint64_t u = a->used_pages << a->unit_shift;
    pthread_mutex_unlock(&a->mu);
    return u;
}

void arena_get_stats(struct arena *a, struct arena_stats *st) {
    memset(st, 0, sizeof(*st));
    pthread_mutex_lock(&a->mu);
    st->total_bytes = a->total;
    st->used_bytes = a->used_pages << a->unit_shift;
    st->free_bytes = a->total - st->used_bytes;
    st->allocated_objects = a->nalloc;
    st->free_blocks = a->nfree_blocks;
    if (a->fl_bitmap) {
        /* The largest block lives in the highest non-empty first-level class. */
        uint32_t fl = flog2(a->fl_bitmap);
        uint32_t largest = 0;
        for (uint32_t sl = 0; sl < SL_COUNT; sl++)
            for (uint32_t u = a->head[fl][sl]; u != NIL; u = a->fnext[u])
                if ((a->tag[u] & TAG_SIZE) > largest) largest = a->tag[u] & TAG_SIZE;
        st->largest_free_bytes = (uint64_t)largest << a->unit_shift;
    }
    pthread_mutex_unlock(&a->mu);
    st->metadata_bytes = (uint64_t)a->npages * 3 * sizeof(uint32_t) + sizeof(*a);
    st->hugetlb = a->hugetlb;
}

int arena_check(struct arena *a, char *err, size_t errlen) {
    int rc = -1;
    pthread_mutex_lock(&a->mu);
    uint64_t used = 0, nalloc = 0, nfree = 0;
    bool prev_free = false;
    for (uint32_t u = 0; u < a->npages;) {
        uint32_t t = a->tag[u], size = t & TAG_SIZE;
        if (size == 0 || (uint64_t)u + size > a->npages) {
            set_err(err, errlen, "block at unit %u has bad size %u", u, size);
            goto out;
        }
        if (a->tag[u + size - 1] != t) {
            set_err(err, errlen, "block at unit %u: end tag %#x != start tag %#x", u,
                    a->tag[u + size - 1], t);
            goto out;
        }
        bool is_free = (t & TAG_FREE) != 0;
        if (is_free && prev_free) {
            set_err(err, errlen, "free block at unit %u follows a free block (not coalesced)", u);
            goto out;
        }
        if (is_free)
            nfree++;
        else {
            used += size;
            nalloc++;
        }
        prev_free = is_free;
        u += size;
    }
    if (used != a->used_pages || nalloc != a->nalloc || nfree != a->nfree_blocks) {
        set_err(err, errlen,
                "counters disagree: used %llu/%llu units, objects %llu/%llu, free blocks "
                "%llu/%llu",
                (unsigned long long)used, (unsigned long long)a->used_pages,
                (unsigned long long)nalloc, (unsigned long long)a->nalloc,
                (unsigned long long)nfree, (unsigned long long)a->nfree_blocks);
        goto out;
    }
    uint64_t listed = 0;
    for (uint32_t fl = 0; fl < FL_COUNT; fl++) {
        for (uint32_t sl = 0; sl < SL_COUNT; sl++) {
            uint32_t prev = NIL;
            bool nonempty = a->head[fl][sl] != NIL;
            if (nonempty != ((a->sl_bitmap[fl] >> sl) & 1)) {
                set_err(err, errlen, "class %u/%u: bitmap disagrees with the list", fl, sl);
                goto out;
            }
            for (uint32_t u = a->head[fl][sl]; u != NIL; u = a->fnext[u]) {
                uint32_t f2, s2;
                if (!(a->tag[u] & TAG_FREE)) {
                    set_err(err, errlen, "class %u/%u lists allocated unit %u", fl, sl, u);
                    goto out;
                }
                mapping_insert(a->tag[u] & TAG_SIZE, &f2, &s2);
                if (f2 != fl || s2 != sl || a->fprev[u] != prev) {
                    set_err(err, errlen, "free block at unit %u is misfiled or mislinked", u);
                    goto out;
                }
                prev = u;
                if (++listed > nfree) {
                    set_err(err, errlen, "free lists hold more blocks than the arena");
                    goto out;
                }
            }
        }
        if (((a->fl_bitmap >> fl) & 1) != (a->sl_bitmap[fl] != 0)) {
            set_err(err, errlen, "first-level bitmap disagrees at %u", fl);
            goto out;
        }
    }
    if (listed != nfree) {
        set_err(err, errlen, "free lists hold %llu blocks, arena has %llu",
                (unsigned long long)listed, (unsigned long long)nfree);
        goto out;
    }
    rc = 0;
out:
    pthread_mutex_unlock(&a->mu);
    return rc;
}
