/* What engine.c (life cycle, metrics, status, administration) and engine_data.c (the request
 * path) share beyond engine.h. Not for other files. */
#ifndef LMCACHE_SERVER_ENGINE_INTERNAL_H
#define LMCACHE_SERVER_ENGINE_INTERNAL_H

#include "server/engine.h"

struct l1_key;
struct session;

/* Releases what a lookup session still holds and frees it. touch: end_session marks its
 * objects as recently used. */
void engine_session_release(struct engine *e, struct session *s, int touch);
/* The L2 controller's store_done: wakes stores waiting for their write-through. */
void engine_l2_store_done(void *arg, const struct l1_key *key, int ok);

#endif
