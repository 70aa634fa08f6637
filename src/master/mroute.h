/* Routing policies of the master: which replica a RouteGet returns (tier priority) and
 * where a RoutePut should place a block (HBM then DRAM, never SSD). Pure functions:
 * randomness comes in as a callback so tests are deterministic. */
#ifndef LMCACHE_MASTER_MROUTE_H
#define LMCACHE_MASTER_MROUTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "master/mstore.h"

/* Rank of a tier for reads: HBM 0, DRAM 1, SSD 2, anything else 3. */
int mroute_get_rank(int tier);

/* Index of the chosen replica among locs[0..n) (n > 0): best rank; the requester's own
 * replica wins within the best rank; otherwise uniform random within it. */
size_t mroute_get_pick(const struct mstore_loc *locs, size_t n, const char *requester,
                       uint64_t (*rnd)(void));

enum mroute_algo { MROUTE_MOST_AVAILABLE, MROUTE_RANDOM };
enum mroute_affinity { MROUTE_AFF_NONE, MROUTE_AFF_SAME, MROUTE_AFF_LOCAL };

struct mroute_pick {
    int cand; /* index into the candidates, -1 = unroutable or already exists */
    int tier;
};

/* Plans a batch of puts. cands are the ALIVE clients (their caps are copied and debited
 * per pick; nothing is written back). exists[i] keys get cand -1 and consume nothing.
 * excl are node ids that must not be chosen. requester may be NULL. */
int mroute_put_plan(const struct mstore_alive *cands, size_t ncands, const uint64_t *sizes,
                    const bool *exists, size_t n, char *const *excl, size_t nexcl,
                    const char *requester, enum mroute_algo algo, enum mroute_affinity aff,
                    uint64_t (*rnd)(void), struct mroute_pick *out);

#endif
