/* What the operation handlers share (ops.c: the table, the request's common fields, lookups and
 * sessions; ops_kv.c: registration and the KV moves, store and retrieve through shared memory
 * or in the message). Inside the data plane only. */
#ifndef LMCACHE_DATAPLANE_OPS_H
#define LMCACHE_DATAPLANE_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "server/dataplane/dataplane.h"
#include "server/dataplane/wire.h"
#include "server/engine.h"

/* One request being handled: its decoded fields, its reply and error, where it came from. */
struct op_ctx {
    struct engine *e;
    struct dp_map *m;
    struct dp_reply *r;
    struct dp_err *err;
    uint64_t now;
    const struct dp_peer *peer;   /* NULL: an anonymous tcp peer */
    uint32_t small_objects;       /* run only if the range has at most this many objects (0: any) */
    int deferred;                 /* set when the request is too big for small_objects */
    const struct dp_blob *frames; /* frames after the payload (store_bytes chunk frames) */
    uint32_t nframes;
    struct dp_park *park; /* may the reply wait for the write-through without this thread? */
};

/* The key sessions are bound to: the connection's (all zero for an anonymous peer). */
const uint8_t *op_owner(const struct op_ctx *o);
/* The reply code of an engine failure (its message is already in o->err); returns -1. */
int op_engine_fail(struct op_ctx *o, int rc);

/* The chunk fields (token_ids | chunk_hashes, start, end, cache_salt) into cr. ranks: objects
 * per chunk the operation touches (world_size for lookup, else 1). Every allocation is sized by
 * the chunks of the prompt up to `end` (what the client sent) and the range is held to
 * --max-request-objects before anything proportional to it is allocated. 0, or -1 with o->err
 * set and nothing left allocated. */
int op_parse_range(struct op_ctx *o, struct engine_prompt *cr, uint32_t ranks);
void op_range_free(struct engine_prompt *cr);
/* model_name, checked as keys.h says. */
int op_parse_model(struct op_ctx *o, char *model, size_t cap);

/* The handlers of ops_kv.c: 0, or -1 with o->err set. */
int dp_op_register(struct op_ctx *o);
int dp_op_unregister(struct op_ctx *o);
int dp_op_store(struct op_ctx *o);
int dp_op_retrieve(struct op_ctx *o);
int dp_op_store_bytes(struct op_ctx *o);
int dp_op_retrieve_bytes(struct op_ctx *o);

#endif
