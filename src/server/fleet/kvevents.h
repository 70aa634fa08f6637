/* KV-event publisher (`--kv-events-endpoint`): the node's placements as a vLLM-style KV-event
 * stream on a ZMQ PUB socket, for KV-aware routers and indexers that consume vLLM events.
 * Every message is three frames: topic (empty), sequence (8-byte big-endian, from 0), msgpack
 * EventBatch [ts, [events], data_parallel_rank 0]; events are maps tagged "type":
 * BlockStored / BlockRemoved, block hashes = the 32-byte placement hashes (docs/fleet.md),
 * medium "CPU" (L1) or "FS" (fs and dax adapters). The data path only appends to a bounded
 * queue (events beyond it are dropped and counted); one thread (`kv-events`) publishes it in
 * batches. See docs/fleet.md. */
#ifndef LMCACHE_SERVER_FLEET_KVEVENTS_H
#define LMCACHE_SERVER_FLEET_KVEVENTS_H

#include <stddef.h>

#include "server/engine.h"

struct kvevents;

/* Before engine_start_caches: binds (an address with '*', ipc:// or inproc://) or connects the
 * PUB socket and hooks into the engine. NULL with err on failure. */
struct kvevents *kvevents_create(struct engine *e, const char *endpoint, char *err, size_t errlen);
int kvevents_start(struct kvevents *k, char *err, size_t errlen);
/* Publishes what is queued and stops the thread. */
void kvevents_stop(struct kvevents *k);
/* After engine_destroy. */
void kvevents_free(struct kvevents *k);

#endif
