/* The engine's data socket: a ZMQ ROUTER owned by one loop thread, a worker pool with
 * affinity by client identity, and the operation table of docs/protocol.md. */
#ifndef LMCACHE_DATAPLANE_DATAPLANE_H
#define LMCACHE_DATAPLANE_DATAPLANE_H

#include <stddef.h>
#include <stdint.h>

struct engine;
struct server_config;
struct dp_reply;
struct dataplane;

/* Binds tcp://host:port and starts the loop and `workers` worker threads. NULL with errbuf
 * filled when the socket cannot be bound. */
struct dataplane *dataplane_start(struct engine *e, const char *host, int port, int workers,
                                  size_t max_message_bytes, char *errbuf, size_t errlen);
/* Stops accepting, finishes requests in flight, closes the socket, joins the threads. */
void dataplane_stop(struct dataplane *dp);

/* Executes one request (decode, dispatch, reply map) without the socket: the workers call it,
 * and so do the fuzz driver and unit tests. The reply is always complete. */
void dataplane_handle(struct engine *e, const char *op, size_t oplen, const void *payload,
                      size_t len, struct dp_reply *reply);

/* Largest reply a request may build: --max-reply-mb, or --max-message-mb when that is 0. */
uint64_t dp_max_reply_bytes(const struct server_config *cfg);

#endif
