/* The master reporter: registers this node with the cluster master (`--master-address`),
 * heartbeats at the interval the master returns, and reports which placement hashes this node
 * holds on which tier (L1 as DRAM, fs and dax adapters as SSD). A client only: it opens no port.
 *
 * The engine's placement listener updates a table of hashes (reference counts per tier) and
 * queues each changed hash once; one thread (`master-reporter`) sends the net change of the
 * queued hashes in batched Report/RevokeExternalKvBlocks RPCs. Nothing on the data path waits
 * for the master: while it is down or slow the changes are applied to the table only, the
 * reporter is marked dirty, and once the master answers again it sends one full report
 * (RevokeAllExternalKvBlocksForNode, then every held hash), which is idempotent. See
 * docs/fleet.md. */
#ifndef LMCACHE_SERVER_FLEET_REPORTER_H
#define LMCACHE_SERVER_FLEET_REPORTER_H

#include <stddef.h>

#include "server/engine.h"

struct reporter;

/* Before engine_start_caches: hooks the reporter into the engine (placements, /status,
 * metrics). NULL with err on failure. */
struct reporter *reporter_create(struct engine *e, char *err, size_t errlen);
/* After engine_start_caches: starts the thread. Returns 0 or -1 with err. */
int reporter_start(struct reporter *r, char *err, size_t errlen);
/* Stops the thread and unregisters from the master (a clean shutdown). Placements may still be
 * told afterwards (the engine is destroyed later): they change the table only. */
void reporter_stop(struct reporter *r);
/* After engine_destroy. */
void reporter_free(struct reporter *r);

#endif
