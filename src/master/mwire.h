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
 * into d with their wire lengths (an embedded NUL is kept: check with mwire_text_check). */
int mwire_match_request(const uint8_t *d, size_t n, struct mstore_key **keys, size_t *nkeys,
                        bool *count_as_hit);

/* Text that arrives in a protobuf string field: well-formed UTF-8 (as proto3 requires and
 * the reference's C++ parser enforces) and no NUL byte (C strings would be cut there, so
 * "victim\0x" would act as "victim"). */
enum { MWIRE_TEXT_OK = 0, MWIRE_TEXT_NUL = 1, MWIRE_TEXT_UTF8 = 2, MWIRE_TEXT_LONG = 3 };
int mwire_text_check(const char *s, size_t n);

/* Checks every string field of a message (sub-messages included) on the wire, with the
 * wire lengths; a field named node_id is also at most MWIRE_MAX_NODE_ID bytes (MWIRE_TEXT_LONG:
 * no node can have a longer id, and ids become metric label values). Call it on bytes
 * protobuf-c has already accepted. MWIRE_TEXT_OK, or the failure with *field naming the
 * offending field. */
#define MWIRE_MAX_NODE_ID 1024
struct ProtobufCMessageDescriptor;
int mwire_check_strings(const struct ProtobufCMessageDescriptor *desc, const uint8_t *d, size_t n,
                        const char **field);

/* Encodes the MatchExternalKvResponse of mt (bucket indices refer to keys) into a malloc'd
 * buffer. */
int mwire_match_reply(const struct mstore_match *mt, const struct mstore_key *keys, uint8_t **buf,
                      size_t *len);

#endif
