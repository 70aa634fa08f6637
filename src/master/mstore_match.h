/* The part of MatchExternalKv every metadata store shares (mstore_xkv.c): marking request
 * duplicates, and grouping the placements found into the result's per-node, per-tier index
 * pool the way the RPC answers. A store finds the placements; these build the answer. */
#ifndef LMCACHE_MASTER_MSTORE_MATCH_H
#define LMCACHE_MASTER_MSTORE_MATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "master/mstore.h"

/* One placement a match found: request index, node index, tier bitmask. */
struct mstore_hitrec {
    uint32_t idx, node;
    uint8_t tiers;
};

/* first[i] is true for the first occurrence of each distinct key; hv[i] is the key's hash
 * (the in-memory store's, over the whole key, as its report computes it). -1 on no memory. */
int mstore_match_dedup(const struct mstore_key *k, size_t n, uint64_t *hv, bool *first);

/* Groups placements given in request order: nodes in order of first appearance, per node
 * and tier the request indices in one pool. Node ids and peers are the caller's to fill
 * (node_id, peer_address), then mstore_match_compact. 0, or -1 on no memory (mt freed). */
int mstore_match_group(const struct mstore_hitrec *h, size_t nh, struct mstore_match *mt);

/* Drops a node's empty tier buckets, the others ascending. */
void mstore_match_compact(struct mstore_match_node *mn);

#endif
