/* The `fs` L2 adapter: one file per object under base_path, written with io_uring (or ordinary
 * I/O threads when io_uring is unavailable) to a temporary name and renamed into place, with a
 * CRC32C trailer verified on every load. Rescans base_path at start. File format and name mapping:
 * docs/architecture.md, "## L2".
 *
 * Config (one --l2-adapter JSON object):
 *   type "fs", base_path (required; created if missing), max_capacity_gb (0 = unlimited),
 *   o_direct (false), queue_depth (io_uring entries, 64), io_threads (fallback threads, 4),
 *   io_uring (true; false forces the thread fallback, as does LMCACHE_L2_FS_NO_IO_URING=1),
 *   eviction {...} (read by the controller). */
#ifndef LMCACHE_SERVER_L2_FS_H
#define LMCACHE_SERVER_L2_FS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "server/l2/adapter.h"

#define FS_TYPE_NAME "fs"

int fs_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen);

/* True when the adapter runs on io_uring, false on the thread fallback. */
bool fs_adapter_uses_io_uring(struct l2_adapter *a);

/* Test hooks. fs_adapter_inject_error: the next `count` store (op = L2_OP_STORE) or load
 * (L2_OP_LOAD) I/O results become -err (e.g. ENOSPC). fs_adapter_object_path: the file of key k
 * (whether or not it exists) into out; returns 0 or -1 when outlen is too small. */
void fs_adapter_inject_error(struct l2_adapter *a, int op, int err, int count);
int fs_adapter_object_path(struct l2_adapter *a, const struct keys_object_key *k, char *out,
                           size_t outlen);

#endif
