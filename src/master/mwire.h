/* Hand-written protobuf wire code for the hot MatchExternalKv path: the request is read in
 * place (hash views into the received bytes) and the reply is written straight from the
 * store's match result, with no per-hash allocation. The bytes are those protobuf-c
 * produces for umbp.proto; the fuzz driver checks the decoder against protobuf-c. */
#ifndef LMCACHE_MASTER_MWIRE_H
#define LMCACHE_MASTER_MWIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "master/mstore.h"

enum { MWIRE_OK = 0, MWIRE_MALFORMED = -1, MWIRE_NOMEM = -2 };

/* Decodes a MatchExternalKvRequest. *keys (malloc'd, free it; NULL when *nkeys is 0) point
 * into d, each cut at its first NUL as a C string would be. */
int mwire_match_request(const uint8_t *d, size_t n, struct mstore_key **keys, size_t *nkeys,
                        bool *count_as_hit);

/* Encodes the MatchExternalKvResponse of mt (bucket indices refer to keys) into a malloc'd
 * buffer. */
int mwire_match_reply(const struct mstore_match *mt, const struct mstore_key *keys, uint8_t **buf,
                      size_t *len);

#endif
