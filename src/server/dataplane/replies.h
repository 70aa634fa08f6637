/* What each data-plane client has not read: the bytes of its replies that the server built and
 * libzmq still holds (a reply is freed once libzmq has written it to the connection). A client
 * is a routing identity on one socket; its record lives while it has a request in flight or a
 * reply unsent, so the table holds the clients of the moment, not every client ever seen.
 *
 * A client that sends requests and never reads would otherwise make the server build and keep
 * replies without end (40 requests of 76 bytes for 1.2 GiB of retrieve_bytes replies): a
 * worker refuses the requests of a client over --max-unread-reply-mb, and the heap bound
 * (connguard.c) counts unsent replies when it chooses the connection to cut.
 *
 * Thread use: dpc_get on dp-loop; dpc_unsent and dpc_hold_new on any thread; dpc_release on
 * libzmq's I/O thread (the free callback of a reply) or any other; one mutex guards the table. */
#ifndef LMCACHE_DATAPLANE_REPLIES_H
#define LMCACHE_DATAPLANE_REPLIES_H

#include <stddef.h>
#include <stdint.h>

struct dp_clients;
struct dp_client;
/* One reply's charge, handed to libzmq as the hint of its free callback. */
struct dpc_hold;

struct dp_clients *dpc_new(void);
/* Call once no reply can be freed any more (after zmq_ctx_term). */
void dpc_free(struct dp_clients *t);

/* The client (sock, id), created when new, with one more reference (the caller's request). fd:
 * the tcp connection it came from (ZMQ_SRCFD), negative when unknown. NULL when out of memory. */
struct dp_client *dpc_get(struct dp_clients *t, const void *sock, const void *id, size_t idlen,
                          int fd);
/* Drops one reference; the record goes with the last one. */
void dpc_put(struct dp_clients *t, struct dp_client *c);
/* Bytes of the client's replies built and not yet freed by libzmq. */
size_t dpc_unsent(const struct dp_client *c);
/* Charges the client a reply of n bytes; the hold owns one reference (the request's), and
 * dpc_release ends both. NULL when out of memory (nothing charged, the reference dropped). */
struct dpc_hold *dpc_hold_new(struct dp_clients *t, struct dp_client *c, size_t n);
void dpc_release(struct dpc_hold *h);

/* The client with the most unsent bytes that came over tcp: returns them with *fd its
 * connection (-1, 0 when none); *total: the unsent bytes of all clients. */
size_t dpc_largest(struct dp_clients *t, int *fd, size_t *total);

#endif
