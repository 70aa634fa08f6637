/* The routing query of the master (`POST /route` on its HTTP port; docs/master.md): for a
 * prompt (token ids, or precomputed placement hashes) it returns, per node, the longest
 * contiguous prefix the node holds and its split over tiers, and recommends a node: longest
 * prefix, then more of it in HBM/DRAM, then the most available capacity. A read of the
 * external-KV index (no hit counting); work is bounded by MQUERY_MAX_*. */
#ifndef LMCACHE_MASTER_MQUERY_H
#define LMCACHE_MASTER_MQUERY_H

#include <stddef.h>

#include "master/mstore.h"

#define MQUERY_MAX_BODY      (1u << 20) /* bytes of a request body */
#define MQUERY_MAX_TOKENS    131072     /* token_ids per query */
#define MQUERY_MAX_HASHES    4096       /* chunks (hashes) per query */
#define MQUERY_MAX_CHUNK     65536      /* chunk_size */
#define MQUERY_DEFAULT_CHUNK 256
#define MQUERY_MAX_DEPTH     32 /* nesting of the body's containers */

struct strbuf;

/* Answers one query: body is the JSON request (len bytes, not NUL-terminated). Appends the
 * JSON reply ({"error": ...} on failure) to out and returns the HTTP status (200, 400, 413,
 * 500). */
int mquery_route(struct mstore *s, const char *body, size_t len, struct strbuf *out);

#endif
