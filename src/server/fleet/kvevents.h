/* KV-event publisher (`--kv-events-endpoint`): the node's placements as a vLLM KV-event stream on
 * a ZMQ PUB socket, for KV-aware routers and indexers that consume vLLM events. Every message is
 * three frames: topic (empty), sequence (8-byte big-endian, from 0), msgpack EventBatch
 * [ts, [events], data_parallel_rank 0]. Events are BlockStored / BlockRemoved / AllBlocksCleared,
 * as maps tagged "type" (current vLLM) or tagged positional arrays (`--kv-events-format
 * legacy`); block hashes are the 32-byte placement hashes (docs/fleet.md) or, with
 * `--kv-events-hash-format int64`, their last 8 bytes as a big-endian uint64; medium "CPU" (L1),
 * "FS" (fs and dax adapters) or "OBJ" (s3 adapters).
 *
 * A table of held hashes (a count per medium: the object groups of a chunk share its hash) turns
 * object changes into block changes: BlockStored when a hash joins a medium, BlockRemoved when it
 * leaves it. The data path only appends to a bounded queue (events beyond it are dropped and
 * counted); one thread (`kv-events`) publishes it in batches. AllBlocksCleared is sent first at
 * start, and after a clear that left the node holding nothing on any medium.
 *
 * With `--kv-events-replay-endpoint` the last 10000 batches (at most 64 MiB) stay in a ring and
 * a ROUTER socket served by one thread (`kv-replay`) answers [identity, "", start_seq] with every
 * buffered batch from start_seq, then the end marker (sequence -1, empty payload). See
 * docs/fleet.md. */
#ifndef LMCACHE_SERVER_FLEET_KVEVENTS_H
#define LMCACHE_SERVER_FLEET_KVEVENTS_H

#include <stddef.h>

#include "server/engine.h"

struct kvevents;

/* Before engine_start_caches: reads the kv-events options of e->cfg, binds (an address with '*',
 * '::', ipc:// or inproc://) or connects the PUB socket, binds the replay ROUTER when configured
 * and hooks into the engine. NULL with err on failure. */
struct kvevents *kvevents_create(struct engine *e, char *err, size_t errlen);
int kvevents_start(struct kvevents *k, char *err, size_t errlen);
/* Publishes what is queued and stops the threads. */
void kvevents_stop(struct kvevents *k);
/* After engine_destroy. */
void kvevents_free(struct kvevents *k);

#endif
