/* The engine's data socket: a ZMQ ROUTER owned by one loop thread, a worker pool with
 * affinity by client identity, and the operation table of docs/protocol.md. */
#ifndef LMCACHE_DATAPLANE_DATAPLANE_H
#define LMCACHE_DATAPLANE_DATAPLANE_H

#include <stddef.h>
#include <stdint.h>

#include "server/dataplane/wire.h"

struct engine;
struct server_config;
struct dp_reply;
struct dataplane;
struct server_config;

/* Binds tcp://host:port (with CURVE when --curve-secret-key-file is set) and --ipc-path when
 * set, and starts the loop and `workers` worker threads. NULL with errbuf filled when a socket
 * cannot be bound or a key file cannot be read. */
struct dataplane *dataplane_start(struct engine *e, const char *host, int port, int workers,
                                  size_t max_message_bytes, char *err, size_t errlen);
/* Sets the process's malloc up for large data-plane messages (one arena, no per-message mmap,
 * up to --worker-queue-mb of freed memory kept for reuse). Call before any thread starts: an
 * arena limit does not move threads that already have one. */
void dataplane_tune_malloc(const struct server_config *cfg);
/* Checks the shared-memory options (--shm-allowed-uids, --shm-name-prefixes); 0, or -1 with a
 * message. dataplane_start calls it. */
int dataplane_check_shm_options(const struct server_config *cfg, char *err, size_t errlen);
/* Stops accepting, finishes requests in flight, closes the socket, joins the threads. */
void dataplane_stop(struct dataplane *dp);

/* Who sent a request: the key of its connection (SHA-256 over the ZMQ routing identity, the
 * endpoint, libzmq's Peer-Address and, with CURVE, the client's public key), and on the ipc
 * endpoint the peer's SO_PEERCRED. Sessions and proof nonces are bound to the key. */
struct dp_peer {
    uint8_t key[32];
    int has_cred;
    uint32_t uid, gid;
    int32_t pid;
};

/* Parses the ":uid:gid:pid" that libzmq appends (SO_PEERCRED) to the Peer-Address of a Unix
 * socket's connection. 0, or -1 when addr does not end that way. */
int dataplane_parse_peercred(const char *addr, uint32_t *uid, uint32_t *gid, int32_t *pid);

/* Executes one request (decode, dispatch, reply map) without the socket: the workers call it,
 * and so do the fuzz driver and unit tests. The reply is always complete. */
void dataplane_handle(struct engine *e, const char *op, size_t oplen, const void *payload,
                      size_t len, struct dp_reply *reply);
/* A frame of a request after its payload: the chunks of a store_bytes sent as frames. */
struct dp_blob {
    const void *data;
    size_t len;
};

/* The same for a given peer (NULL: an anonymous tcp peer, as dataplane_handle) and the
 * nframes frames that followed the payload (NULL, 0: none). */
void dataplane_handle_peer(struct engine *e, const struct dp_peer *peer, const char *op,
                           size_t oplen, const void *payload, size_t len,
                           const struct dp_blob *frames, uint32_t nframes, struct dp_reply *reply);

/* A store that waits without holding its thread: for its write-through (store and store_bytes
 * with wait_l2), or for another request writing one of its chunks. The caller hands over a
 * notify callback, and a request that would wait comes back unfinished:
 * - with `wait` set (its reply waits for the write-through): notify(notify_arg) runs once, from
 *   another thread holding the engine's write-through mutex (take only leaf locks), when every
 *   chunk is written or failed;
 * - with `store` set (parked by the engine, engine_source.resume): the same request is to be
 *   handled again, with the same park, from engine_store_retry_at(store) on. */
struct engine_l2_wait;
struct engine_store_state;
struct dp_park {
    void (*notify)(void *arg);
    void *notify_arg;
    struct engine_l2_wait *wait;      /* set by the call: the reply waits for it */
    struct engine_store_state *store; /* set by the call: the request is to run again */
    int again;                        /* the last call parked the store (ops_kv.c) */
    /* the request's outcome so far, for dataplane_finish_parked */
    int ok;
    struct dp_err err;
    const char *op;
    uint64_t t0; /* when the request first ran */
};
#define DP_DONE      1 /* the reply is complete */
#define DP_WAIT_L2   2 /* park->wait: finish with dataplane_finish_parked */
#define DP_RUN_AGAIN 3 /* park->store: handle the request again (dataplane_handle_parkable) */
/* dataplane_handle_peer that may park: DP_DONE, DP_WAIT_L2 (then the caller calls
 * dataplane_finish_parked once notify ran or the wait's deadline, engine_l2_wait_deadline,
 * passed, whichever comes first) or DP_RUN_AGAIN (then the caller calls this again with the same
 * request, park and a fresh reply; engine_store_stop_waiting(park->store) first makes that call
 * complete). A park starts zeroed but for notify and notify_arg. */
int dataplane_handle_parkable(struct engine *e, const struct dp_peer *peer, const char *op,
                              size_t oplen, const void *payload, size_t len,
                              const struct dp_blob *frames, uint32_t nframes, struct dp_park *park,
                              struct dp_reply *reply);
/* Ends the wait (l2_stored_chunks: what was written by now) and completes the reply. */
void dataplane_finish_parked(struct engine *e, struct dp_park *park, struct dp_reply *reply);

/* Largest payload of a request the loop thread may run itself (dataplane_handle_small). */
#define DP_SMALL_MAX_BYTES 8192u

/* 1 when the operation named op may run as a small request (the cheap first check). */
int dataplane_op_small(const char *op, size_t oplen);
/* Runs a request only if it is small: an operation whose work is bounded (lookup,
 * query_prefetch_status, free_lookup_locks, end_session, get_chunk_size, ping, noop), a payload
 * of at most DP_SMALL_MAX_BYTES, for a lookup at most max_objects objects (chunks x world_size),
 * and a session to release (end_session, free_lookup_locks, the one a lookup replaces) of at
 * most max_objects. 1 with the reply complete, or 0 with nothing done and the reply untouched:
 * the request then goes to a worker (dataplane_handle_peer). */
int dataplane_handle_small(struct engine *e, const struct dp_peer *peer, const char *op,
                           size_t oplen, const void *payload, size_t len, uint32_t max_objects,
                           struct dp_reply *reply);

/* Largest reply a request may build: --max-reply-mb, or --max-message-mb when that is 0. */
uint64_t dp_max_reply_bytes(const struct server_config *cfg);

#endif
