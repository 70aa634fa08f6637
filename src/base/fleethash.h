/* Placement hashes: the strings this server reports to the cluster master for the objects it
 * holds, and that a router computes from token ids to ask where a prompt's prefix lives
 * (docs/fleet.md, "Placement hashes"; python/lmcache_fleet/hashes.py is the same recipe).
 * Shared by the server (what it reports) and the master (its routing query).
 *
 *   placement = lowercase hex of SHA-256("lmcache-fleet-v1" ‖ 0x00 ‖ model_name ‖ 0x00 ‖
 *                                        cache_salt ‖ 0x00 ‖ kv_rank (uint32 big-endian) ‖
 *                                        chunk hash bytes)
 *
 * model_name and cache_salt are part of the digest, so two tenants (salts) or two models with
 * the same prompt never share a placement. The object group id is not: every group of a chunk
 * maps to the chunk's one placement. */
#ifndef LMCACHE_BASE_FLEETHASH_H
#define LMCACHE_BASE_FLEETHASH_H

#include <stddef.h>
#include <stdint.h>

#define FLEETHASH_LEN     32 /* digest bytes */
#define FLEETHASH_HEX_LEN 64 /* characters, without the NUL */
#define FLEETHASH_DOMAIN  "lmcache-fleet-v1"

/* The server's chunk-hash chain (server/keys.h, docs/protocol.md) for routers that hold token
 * ids: out[i] = h_i for the first min(ntokens / chunk_size, max_out) full chunks, seed =
 * SHA-256(seed_string). Returns the count, or -1 when chunk_size is 0 or OpenSSL fails. */
long fleethash_chunks(const char *seed_string, const uint32_t *tokens, size_t ntokens,
                      size_t chunk_size, uint8_t (*out)[FLEETHASH_LEN], size_t max_out);

/* out = the digest above. Returns 0, or -1 if OpenSSL fails. */
int fleethash_compute(const char *model_name, const char *cache_salt, uint32_t kv_rank,
                      const uint8_t *chunk_hash, size_t chunk_hash_len, uint8_t out[FLEETHASH_LEN]);

#endif
