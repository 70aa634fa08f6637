/* C client of the UMBP master (`lmcache master`, `umbp_master`, or any UMBP master).
 *
 * Calls are synchronous. A client may be shared by threads only if the caller serialises
 * the calls; open one client per thread otherwise. Every call returns 0 on success, the
 * gRPC status code (> 0) when the master refused it, or -1 on a local failure; err (may be
 * NULL) then holds "<Rpc> failed: <message>" like the Python client's RuntimeError. */
#ifndef LMCACHE_UMBP_CLIENT_H
#define LMCACHE_UMBP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum umbp_tier { UMBP_TIER_UNKNOWN = 0, UMBP_TIER_HBM = 1, UMBP_TIER_DRAM = 2, UMBP_TIER_SSD = 3 };

struct umbp_client;

struct umbp_tier_capacity {
    enum umbp_tier tier;
    uint64_t total_bytes;
    uint64_t available_bytes;
};

struct umbp_tier_hashes {
    enum umbp_tier tier;
    size_t n;
    char **hashes;
};

struct umbp_node_match {
    char *node_id;
    char *peer_address;
    size_t ntiers; /* buckets in ascending tier order */
    struct umbp_tier_hashes *tiers;
};

struct umbp_match_result {
    size_t n;
    struct umbp_node_match *nodes;
};

struct umbp_hit_count {
    char *hash;
    uint64_t hit_count_total;
};

/* Never blocks: the channel connects on first use. NULL only when out of memory.
 * node_id / node_address may be NULL (a query-only client). Every client has a connection
 * of its own. */
struct umbp_client *umbp_client_new(const char *master_address, const char *node_id,
                                    const char *node_address);
void umbp_client_free(struct umbp_client *c);
/* Deadline of every later call; 0 (the default) means none. */
void umbp_client_set_timeout_ms(struct umbp_client *c, uint32_t ms);

int umbp_client_register(struct umbp_client *c, const struct umbp_tier_capacity *caps, size_t ncaps,
                         char *err, size_t errlen);
/* No RPC when this client has not registered. */
int umbp_client_unregister(struct umbp_client *c, char *err, size_t errlen);
bool umbp_client_is_registered(const struct umbp_client *c);
/* The peer_address later registrations send (MatchExternalKv answers it); none by default.
 * 0, or -1 when out of memory. */
int umbp_client_set_peer_address(struct umbp_client *c, const char *peer_address);
/* The heartbeat interval the master returned at the last successful registration (0 before). */
uint32_t umbp_client_heartbeat_interval_ms(const struct umbp_client *c);
/* A keepalive heartbeat (no events); *alive is false when the master does not know us. */
int umbp_client_keepalive(struct umbp_client *c, bool *alive, char *err, size_t errlen);
/* A heartbeat that carries capacities: a full sync without events (delta_seq_baseline 0), for a
 * node that keeps no block-index entries (it would drop them). Keepalives leave the master's
 * capacities as registered; this replaces them. *alive as for keepalive. */
int umbp_client_heartbeat_caps(struct umbp_client *c, const struct umbp_tier_capacity *caps,
                               size_t ncaps, bool *alive, char *err, size_t errlen);
/* request_full_sync of the last heartbeat the master answered: true after a sequence gap, and
 * when the heartbeat revived an expired node (whose external-KV placements the master wiped at
 * expiry: report them all again). */
bool umbp_client_full_sync_requested(const struct umbp_client *c);

int umbp_report_external_kv_blocks(struct umbp_client *c, const char *node_id,
                                   const char *const *hashes, size_t n, enum umbp_tier tier,
                                   char *err, size_t errlen);
int umbp_revoke_external_kv_blocks(struct umbp_client *c, const char *node_id,
                                   const char *const *hashes, size_t n, enum umbp_tier tier,
                                   char *err, size_t errlen);
int umbp_revoke_all_external_kv_blocks_at_tier(struct umbp_client *c, const char *node_id,
                                               enum umbp_tier tier, char *err, size_t errlen);
int umbp_revoke_all_external_kv_blocks_for_node(struct umbp_client *c, const char *node_id,
                                                char *err, size_t errlen);
/* UnregisterClient for any node id, whether or not this client registered it (a restarted
 * node replacing the record of its previous life); the client's own state is unchanged. */
int umbp_unregister_node(struct umbp_client *c, const char *node_id, char *err, size_t errlen);
/* One entry per node, buckets in ascending tier order. An empty query returns an empty
 * result without an RPC. The result is one allocation: free it with umbp_match_result_free. */
int umbp_match_external_kv(struct umbp_client *c, const char *const *hashes, size_t n,
                           bool count_as_hit, struct umbp_match_result *out, char *err,
                           size_t errlen);
void umbp_match_result_free(struct umbp_match_result *r);
/* Distinct hashes matched on one node (a hash on several tiers counts once). */
size_t umbp_node_match_count(const struct umbp_node_match *m);
/* Sparse: hashes without a counter are absent. Free with umbp_hit_counts_free. */
int umbp_get_external_kv_hit_counts(struct umbp_client *c, const char *const *hashes, size_t n,
                                    struct umbp_hit_count **out, size_t *nout, char *err,
                                    size_t errlen);
void umbp_hit_counts_free(struct umbp_hit_count *h, size_t n);

/* Load helper: sends nq MatchExternalKv queries (query i = qhashes[i][0..qlen[i])) with at
 * most depth in flight on this client's channel; lat_ns[i] (may be NULL) receives each
 * call's latency, *nmatched the total of matched node entries and *reply_bytes the total
 * size of the replies (both may be NULL). Replies are decoded. */
int umbp_match_external_kv_pipelined(struct umbp_client *c, const char *const *const *qhashes,
                                     const size_t *qlen, size_t nq, bool count_as_hit,
                                     unsigned depth, uint64_t *lat_ns, uint64_t *nmatched,
                                     uint64_t *reply_bytes, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
