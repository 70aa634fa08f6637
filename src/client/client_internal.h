/* liblmcache-client internals shared by client.c (the connection, requests and replies) and
 * client_kv.c (the shared-memory KV context). Not installed; hidden in the shared library. */
#ifndef LMCACHE_CLIENT_CLIENT_INTERNAL_H
#define LMCACHE_CLIENT_CLIENT_INTERNAL_H

#include "client/client_codec.h"
#include "lmcache/client.h"

/* Sends the finished map m as op's payload (m is consumed); *id is the request's id. */
lmc_status lmcc_send_map(lmc_client *c, const char *op, struct lmcc_map *m, lmc_req_id *id,
                         lmc_error *err);
/* The synchronous half of a call: when sent is LMC_OK, waits for id's reply (*out, freed by
 * the caller) and returns its status; a timed-out id's late reply is dropped. */
lmc_status lmcc_finish(lmc_client *c, lmc_status sent, const lmc_req_id *id, lmc_reply **out,
                       lmc_error *err);
/* The reply's field (any type), or NULL. */
const msgpack_object *lmcc_reply_field(const lmc_reply *r, const char *field);
/* LMC_ERR_INVALID_ARGUMENT with `what` as the message. */
lmc_status lmcc_bad_arg(lmc_error *err, const char *what);

#endif
