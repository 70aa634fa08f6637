/* The master's Prometheus endpoint: GET /metrics -> 200 with the exposition, any other
 * GET -> 404, anything else -> 400. One request per connection, one accept thread. */
#ifndef LMCACHE_MASTER_MHTTP_H
#define LMCACHE_MASTER_MHTTP_H

#include <stddef.h>

struct strbuf;
struct mhttp;

/* render appends the exposition; returns 0 or -1. */
typedef int (*mhttp_render_fn)(void *arg, struct strbuf *out);

/* Binds host:port (SO_REUSEADDR). NULL with err filled on failure. */
struct mhttp *mhttp_start(const char *host, int port, mhttp_render_fn render, void *arg, char *err,
                          size_t errlen);
void mhttp_stop(struct mhttp *h);

#endif
