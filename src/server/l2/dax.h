/* The Device-DAX L2 adapter ("type":"dax"): arenas of fixed slots on Device-DAX character devices
 * (/dev/daxX.Y) or on regular files, an in-memory slot index, per-device states and runtime
 * add/remove/resize (POST /reconfigure/dax/...). docs/l2-dax.md describes the behaviour. */
#ifndef LMCACHE_SERVER_L2_DAX_H
#define LMCACHE_SERVER_L2_DAX_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "server/l2/adapter.h"

#define DAX_MAX_DEVICES    64
#define DAX_DEFAULT_SLOT   (4ull << 20) /* slot_size when the config names none */
#define DAX_SLOT_ALIGN     4096ull      /* slot sizes are rounded up to this */
#define DAX_FILE_HEADER    4096ull      /* a file arena starts with one header page */
#define DAX_DEFAULT_ALIGN  (2ull << 20) /* Device-DAX alignment when sysfs does not say */
#define DAX_DEFAULT_WORKER 2

/* The l2_adapter factory (one row of the table in adapter.c). */
int dax_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen);

#endif
