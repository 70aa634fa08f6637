/* liblmcache-client: the engine-side library for the data socket of `lmcache server`
 * (docs/protocol.md). Every operation of the protocol, synchronous and pipelined, errors as
 * values, and the shared-memory KV cache an engine registers.
 *
 * Thread-safety: a client handle (`lmc_client`) is NOT internally locked. Use it from one thread
 * at a time; the usual pattern is one handle per thread (handles are cheap: one ZMQ context and
 * one DEALER socket each). Different handles may be used concurrently without any locking. A KV
 * context (`lmc_kv_context`) is plain memory once registered: any thread may read and write its
 * blocks, but the caller must not write blocks that a `store` in flight is reading, nor read
 * blocks a `retrieve` in flight is writing. Replies (`lmc_reply`) belong to the caller and may be
 * read from any thread.
 *
 * Errors: every function returns an `lmc_status` (LMC_OK = 0) and, when `err` is not NULL, fills
 * it with the server's `code` and `message` (or a description of the client-side failure). */
#ifndef LMCACHE_CLIENT_H
#define LMCACHE_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define LMC_API __attribute__((visibility("default")))
#else
#define LMC_API
#endif

/* ---- errors ---------------------------------------------------------------------------- */

typedef enum lmc_status {
    LMC_OK = 0,
    /* Error codes the server sends (docs/protocol.md, "Error codes"). */
    LMC_ERR_BAD_REQUEST,
    LMC_ERR_UNKNOWN_OPERATION,
    LMC_ERR_TOO_LARGE,
    LMC_ERR_NOT_REGISTERED,
    LMC_ERR_INVALID_BLOCKS,
    LMC_ERR_NOT_FOUND,
    LMC_ERR_OUT_OF_MEMORY,
    LMC_ERR_SHM_ERROR,
    LMC_ERR_INTERNAL,
    LMC_ERR_SERVER_OTHER, /* a code this library does not know; see lmc_error.code */
    /* Client-side failures. */
    LMC_ERR_TIMEOUT,   /* no reply within the configured timeout */
    LMC_ERR_TRANSPORT, /* ZMQ failed (connect, send, receive) */
    LMC_ERR_PROTOCOL,  /* the reply is not a well-formed reply (frames, msgpack, fields) */
    LMC_ERR_INVALID_ARGUMENT,
    LMC_ERR_NO_MEMORY,
    LMC_ERR_SYSTEM, /* a system call failed (shm_open, ftruncate, mmap); errno in the message */
    /* A server code added later (kept last so the values above stay stable): register_kv_cache
     * wants the proof of access (docs/protocol.md). lmc_register_kv_cache answers it itself. */
    LMC_ERR_PROOF_REQUIRED,
} lmc_status;

typedef struct lmc_error {
    lmc_status status;
    char code[32];     /* the server's code ("not_found", ...) or the client-side name */
    char message[256]; /* human-readable, NUL-terminated, possibly truncated */
} lmc_error;

/* Stable name of a status: the protocol's code for server errors ("invalid_blocks"), else
 * "ok", "timeout", "transport", "protocol", "invalid_argument", "no_memory", "system". */
LMC_API const char *lmc_status_name(lmc_status s);
/* Maps a protocol error code to a status (LMC_ERR_SERVER_OTHER when unknown). */
LMC_API lmc_status lmc_status_from_code(const char *code, size_t len);

/* ---- connection ------------------------------------------------------------------------ */

typedef struct lmc_client lmc_client;

typedef struct lmc_client_options {
    int timeout_ms;         /* per synchronous call and per lmc_wait; <= 0: 30000 */
    int connect_timeout_ms; /* ZMQ_CONNECT_TIMEOUT; <= 0: 5000 */
    /* CURVE (docs/security.md): the server's public key and this client's key pair, each 40
     * Z85 characters (the key lines `lmcache curve-keygen` writes). All three or none; NULL:
     * plaintext. The client's public key must be in the server's --curve-allowed-clients. */
    const char *curve_server_key;
    const char *curve_public_key;
    const char *curve_secret_key;
} lmc_client_options;

/* Connects a DEALER socket to tcp://host:port. `opts` may be NULL. ZMQ connects lazily, so a
 * server that is not there shows up as LMC_ERR_TIMEOUT on the first call (use lmc_noop). */
LMC_API lmc_status lmc_client_connect(const char *host, int port, const lmc_client_options *opts,
                                      lmc_client **out, lmc_error *err);
/* Same with a full ZMQ endpoint ("tcp://127.0.0.1:5555", "ipc:///run/lmcache.sock"). */
LMC_API lmc_status lmc_client_connect_endpoint(const char *endpoint, const lmc_client_options *opts,
                                               lmc_client **out, lmc_error *err);
/* Closes the socket; replies still in flight are dropped. NULL is a no-op. */
LMC_API void lmc_client_close(lmc_client *c);
LMC_API void lmc_client_set_timeout(lmc_client *c, int timeout_ms);
/* Request buffers of 1 MiB and more (a store_bytes request without chunk frames) are kept once
 * libzmq has sent them, and reused by the next request that fits: under glibc's default malloc a
 * fresh buffer of that size is a fresh mmap, a page fault per 4 KiB (docs/client.md). At most 8
 * buffers and `bytes` in all (default 1 GiB) are kept; 0 keeps none and frees those kept. */
LMC_API void lmc_client_set_keep_bytes(lmc_client *c, size_t bytes);
/* Bytes of request buffers kept now. */
LMC_API size_t lmc_client_kept_bytes(lmc_client *c);

/* ---- naming chunks ---------------------------------------------------------------------- */

/* The chunk fields shared by lookup, store, retrieve, store_bytes, retrieve_bytes. Exactly one of
 * token_ids (the whole prompt from position 0) or chunk_hashes (num_chunk_hashes hashes of
 * hash_len bytes each, 1..32, laid end to end) must be set. start/end count tokens; end < 0 means
 * "all full chunks". cache_salt NULL means "". */
typedef struct lmc_chunks {
    const uint32_t *token_ids;
    size_t num_tokens;
    const uint8_t *chunk_hashes;
    size_t num_chunk_hashes;
    size_t hash_len;
    int64_t start;
    int64_t end;
    const char *cache_salt;
} lmc_chunks;

/* ---- registered KV caches (shared memory) ---------------------------------------------- */

typedef enum lmc_block_order {
    LMC_LAYER_MAJOR = 0, /* ((l*kv_count + k)*num_blocks + b)*block_bytes */
    LMC_BLOCK_MAJOR = 1, /* ((b*num_layers + l)*kv_count + k)*block_bytes */
} lmc_block_order;

typedef struct lmc_kv_layout {
    uint32_t num_layers;
    uint32_t num_blocks;
    uint32_t tokens_per_block;
    uint64_t bytes_per_token; /* K (or V) of one token of one layer: kv_heads*head_dim*dtype */
    uint32_t kv_count;        /* 2 (K and V) or 1 (MLA); 0 means 2 */
    lmc_block_order block_order;
    const char *dtype; /* informational, may be NULL */
} lmc_kv_layout;

/* Bytes of one block of one layer for K (or V): tokens_per_block * bytes_per_token. */
LMC_API uint64_t lmc_kv_block_bytes(const lmc_kv_layout *l);
/* Size the shared-memory object must have. 0 on overflow or an invalid layout. */
LMC_API uint64_t lmc_kv_total_bytes(const lmc_kv_layout *l);
/* Byte offset of (layer, k, block, token) in the object (docs/protocol.md formulas). */
LMC_API uint64_t lmc_kv_offset(const lmc_kv_layout *l, uint32_t layer, uint32_t k, uint32_t block,
                               uint32_t token);

typedef struct lmc_register_args {
    int64_t instance_id;    /* >= 0, unique per server */
    const char *model_name; /* no '@' */
    int64_t world_size;     /* 0 means 1 */
    int64_t worker_id;      /* the rank */
    const char *shm_name;   /* "/name"; NULL: "/lmcache-kv-<pid>-<instance_id>" */
    lmc_kv_layout layout;
} lmc_register_args;

typedef struct lmc_kv_context lmc_kv_context;

/* Creates (or reuses) the POSIX shared-memory object (mode 0600), sizes it with ftruncate to
 * lmc_kv_total_bytes + LMC_KV_PROOF_PAGE, maps the layout, and sends register_kv_cache,
 * answering the server's proof-of-access challenge (it writes the nonce into the proof page,
 * the object's last 4096 bytes, and registers again). On success *out owns the mapping; the caller
 * writes and reads engine blocks through lmc_kv_base(). On failure nothing is left behind (an
 * object this call created is unlinked). */
#define LMC_KV_PROOF_PAGE 4096u
LMC_API lmc_status lmc_register_kv_cache(lmc_client *c, const lmc_register_args *a,
                                         lmc_kv_context **out, lmc_error *err);
/* Sends register_kv_cache only (no shared memory is created): for an object that already exists
 * or was created by someone else. A proof-of-access challenge is answered by opening the object
 * (shm_open O_RDWR) and writing the nonce; the object must then hold the proof page. */
LMC_API lmc_status lmc_register_kv_cache_raw(lmc_client *c, const lmc_register_args *a,
                                             lmc_error *err);
/* The server faults a registered object in on a thread of its own after answering the
 * registration (only the pages the object holds: lmc_register_kv_cache allocates the whole
 * object). Copies work meanwhile but may pay per page; this waits (pinging every 5 ms) until it is
 * done: LMC_OK, LMC_ERR_TIMEOUT after timeout_ms (< 0: no limit), LMC_ERR_NOT_REGISTERED. */
LMC_API lmc_status lmc_kv_wait_warm(lmc_client *c, int64_t instance_id, int timeout_ms,
                                    lmc_error *err);
LMC_API void *lmc_kv_base(const lmc_kv_context *ctx);
LMC_API uint64_t lmc_kv_size(const lmc_kv_context *ctx);
LMC_API const char *lmc_kv_shm_name(const lmc_kv_context *ctx);
LMC_API int64_t lmc_kv_instance_id(const lmc_kv_context *ctx);
LMC_API const lmc_kv_layout *lmc_kv_layout_of(const lmc_kv_context *ctx);
/* Sends unregister_kv_cache for ctx's instance (c may be NULL to skip it), then unmaps and
 * unlinks the object and frees ctx. The local teardown happens even when the request fails; the
 * status reports the request. NULL ctx is a no-op returning LMC_OK. */
LMC_API lmc_status lmc_unregister_kv_cache(lmc_client *c, lmc_kv_context *ctx, lmc_error *err);
/* unregister_kv_cache by id only. */
LMC_API lmc_status lmc_unregister_instance(lmc_client *c, int64_t instance_id, lmc_error *err);

/* ---- replies ---------------------------------------------------------------------------- */

typedef struct lmc_reply lmc_reply;

LMC_API void lmc_reply_free(lmc_reply *r);
LMC_API uint64_t lmc_reply_id(const lmc_reply *r);
LMC_API const char *lmc_reply_op(const lmc_reply *r);
/* LMC_OK when the reply has ok=true, else the error it carries (filled into err). */
LMC_API lmc_status lmc_reply_status(const lmc_reply *r, lmc_error *err);
/* Field accessors; false when the field is absent or of another type. Negative integers are
 * rejected by get_u64. */
LMC_API bool lmc_reply_get_u64(const lmc_reply *r, const char *field, uint64_t *out);
LMC_API bool lmc_reply_get_i64(const lmc_reply *r, const char *field, int64_t *out);
LMC_API bool lmc_reply_get_bool(const lmc_reply *r, const char *field, bool *out);
/* A str field; *out points into the reply (not NUL-terminated), valid until lmc_reply_free. */
LMC_API bool lmc_reply_get_str(const lmc_reply *r, const char *field, const char **out,
                               size_t *len);
/* The chunks of a retrieve_bytes reply, in either shape (the `chunks` array of the map, or the
 * chunk frames after it): count, and chunk i (pointer into the reply, valid until
 * lmc_reply_free; no copy). */
LMC_API size_t lmc_reply_num_chunks(const lmc_reply *r);
LMC_API bool lmc_reply_chunk(const lmc_reply *r, size_t i, const void **data, size_t *len);
/* Whether the reply came as chunk frames (the server knows `chunk_frames`; docs/protocol.md). */
LMC_API bool lmc_reply_has_chunk_frames(const lmc_reply *r);

/* ---- pipelined API ----------------------------------------------------------------------- */

/* Each lmc_send_* queues one request and returns its id in *id without waiting. Replies are
 * collected with lmc_wait (a given id) or lmc_recv (whichever comes next); replies that arrive
 * while waiting for another id are kept until asked for. The server runs one client's requests in
 * the order sent. */
typedef uint64_t lmc_req_id;

LMC_API lmc_status lmc_wait(lmc_client *c, lmc_req_id id, lmc_reply **out, lmc_error *err);
LMC_API lmc_status lmc_recv(lmc_client *c, lmc_reply **out, lmc_error *err);
/* Requests sent whose replies have not been handed out yet. */
LMC_API size_t lmc_in_flight(const lmc_client *c);

/* Any operation with a payload given as a raw msgpack map (or anything else: the bytes are sent
 * as frame 2 verbatim). For operations this library does not know and for tests. */
LMC_API lmc_status lmc_send_raw(lmc_client *c, const char *op, const void *payload, size_t len,
                                lmc_req_id *id, lmc_error *err);

LMC_API lmc_status lmc_send_lookup(lmc_client *c, const char *request_id, const char *model_name,
                                   int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                                   lmc_req_id *id, lmc_error *err);
LMC_API lmc_status lmc_send_query_prefetch_status(lmc_client *c, const char *request_id,
                                                  lmc_req_id *id, lmc_error *err);
/* request_id may be NULL (the server takes its own lock per chunk). */
LMC_API lmc_status lmc_send_retrieve(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                     const int64_t *block_ids, size_t num_block_ids,
                                     const char *request_id, int64_t skip_first_n_tokens,
                                     lmc_req_id *id, lmc_error *err);
LMC_API lmc_status lmc_send_store(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                  const int64_t *block_ids, size_t num_block_ids, lmc_req_id *id,
                                  lmc_error *err);
LMC_API lmc_status lmc_send_store_bytes(lmc_client *c, const char *model_name, int64_t world_size,
                                        int64_t worker_id, const lmc_chunks *ch,
                                        const void *const *chunks, const size_t *chunk_lens,
                                        size_t num_chunks, lmc_req_id *id, lmc_error *err);

/* Options of a store (either path). NULL means all defaults. */
typedef struct lmc_store_options {
    /* Reply only once every chunk this request stored is in every L2 tier, failed to be written
     * there, or 30 s passed (docs/protocol.md, `wait_l2`); the reply then carries
     * l2_stored_chunks. Holds the server worker meanwhile: for tests, checkpoints and tools. */
    bool wait_l2;
    /* store_bytes only: send each chunk as a frame of its own after the payload, straight from
     * the caller's buffers (docs/protocol.md, `store_bytes` "Chunk frames"): no copy into the
     * request. The buffers are read by the client's I/O thread after the send returns: with
     * lmc_store_bytes_ex they are free again when it returns (a call that fails or times out
     * after sending resets the connection to get them back: the connection's lookup sessions,
     * registrations and the replies of other requests in flight are lost); with
     * lmc_send_store_bytes_ex they must stay unchanged until this request's reply has been
     * received, or until lmc_client_close returns. Servers before chunk frames answer
     * bad_request. */
    bool chunk_frames;
} lmc_store_options;

/* What a store reply says (docs/protocol.md, "What a store reply means"). */
typedef struct lmc_store_result {
    uint64_t stored_chunks;    /* written by this request, resident */
    uint64_t skipped_chunks;   /* already resident */
    uint64_t pending_chunks;   /* another request was still writing it: not stored by this one */
    uint64_t l2_stored_chunks; /* with wait_l2: of stored_chunks, those every L2 tier holds */
    bool has_l2_stored;        /* the reply carried l2_stored_chunks (wait_l2 was asked) */
} lmc_store_result;

LMC_API lmc_status lmc_send_store_ex(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                     const int64_t *block_ids, size_t num_block_ids,
                                     const lmc_store_options *opts, lmc_req_id *id, lmc_error *err);
LMC_API lmc_status lmc_send_store_bytes_ex(lmc_client *c, const char *model_name,
                                           int64_t world_size, int64_t worker_id,
                                           const lmc_chunks *ch, const void *const *chunks,
                                           const size_t *chunk_lens, size_t num_chunks,
                                           const lmc_store_options *opts, lmc_req_id *id,
                                           lmc_error *err);
/* The counts of a store or store_bytes reply (`r` from lmc_wait/lmc_recv). LMC_OK, or the
 * reply's error (the counts it carries are still filled), or LMC_ERR_PROTOCOL when an ok reply
 * lacks stored_chunks/skipped_chunks. A reply without pending_chunks (an older server) gives 0. */
LMC_API lmc_status lmc_reply_store_result(const lmc_reply *r, lmc_store_result *out,
                                          lmc_error *err);
LMC_API lmc_status lmc_send_retrieve_bytes(lmc_client *c, const char *model_name,
                                           int64_t world_size, int64_t worker_id,
                                           const lmc_chunks *ch, const char *request_id,
                                           lmc_req_id *id, lmc_error *err);
/* Options of a retrieve_bytes. NULL means all defaults. */
typedef struct lmc_retrieve_bytes_options {
    /* Ask for the chunks as frames after the reply map (docs/protocol.md, `chunk_frames`): the
     * server sends them from its cache memory instead of copying them into one reply, and the
     * reply keeps each frame as libzmq received it, so lmc_reply_chunk points into it with no
     * copy on either side. A server that predates the field answers with the `chunks` array,
     * which the same accessors read. */
    bool chunk_frames;
} lmc_retrieve_bytes_options;

LMC_API lmc_status lmc_send_retrieve_bytes_ex(lmc_client *c, const char *model_name,
                                              int64_t world_size, int64_t worker_id,
                                              const lmc_chunks *ch, const char *request_id,
                                              const lmc_retrieve_bytes_options *opts,
                                              lmc_req_id *id, lmc_error *err);
/* start/end < 0: the whole lookup range; worker_id < 0: every rank. */
LMC_API lmc_status lmc_send_free_lookup_locks(lmc_client *c, const char *request_id, int64_t start,
                                              int64_t end, int64_t worker_id, lmc_req_id *id,
                                              lmc_error *err);
LMC_API lmc_status lmc_send_end_session(lmc_client *c, const char *request_id, lmc_req_id *id,
                                        lmc_error *err);
/* instance_id < 0: no instance_id field. */
LMC_API lmc_status lmc_send_ping(lmc_client *c, int64_t instance_id, lmc_req_id *id,
                                 lmc_error *err);
LMC_API lmc_status lmc_send_noop(lmc_client *c, lmc_req_id *id, lmc_error *err);
LMC_API lmc_status lmc_send_clear(lmc_client *c, lmc_req_id *id, lmc_error *err);
LMC_API lmc_status lmc_send_get_chunk_size(lmc_client *c, lmc_req_id *id, lmc_error *err);

/* ---- synchronous API --------------------------------------------------------------------- */

/* Output pointers may be NULL when the caller does not need the value. On an error reply the
 * counts the server reports (retrieved_chunks of a not_found retrieve, stored/skipped of an
 * out_of_memory store) are still written. */
LMC_API lmc_status lmc_noop(lmc_client *c, lmc_error *err);
LMC_API lmc_status lmc_ping(lmc_client *c, int64_t instance_id, double *server_time,
                            lmc_error *err);
LMC_API lmc_status lmc_get_chunk_size(lmc_client *c, uint64_t *chunk_size, lmc_error *err);
LMC_API lmc_status lmc_clear(lmc_client *c, uint64_t *cleared, lmc_error *err);
LMC_API lmc_status lmc_lookup(lmc_client *c, const char *request_id, const char *model_name,
                              int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                              lmc_error *err);
LMC_API lmc_status lmc_query_prefetch_status(lmc_client *c, const char *request_id, bool *ready,
                                             uint64_t *hit_chunks, lmc_error *err);
/* lookup, then query_prefetch_status every poll_us microseconds (0: 100) until ready. The lookup
 * asks for its session's first status in its reply (`reply_status`, docs/protocol.md), so a
 * lookup answered from L1 costs one request and one reply; a server that predates it gets the
 * first query right after the lookup's reply. */
LMC_API lmc_status lmc_lookup_wait(lmc_client *c, const char *request_id, const char *model_name,
                                   int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                                   unsigned poll_us, uint64_t *hit_chunks, lmc_error *err);
LMC_API lmc_status lmc_retrieve(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                const int64_t *block_ids, size_t num_block_ids,
                                const char *request_id, int64_t skip_first_n_tokens,
                                uint64_t *retrieved_chunks, lmc_error *err);
LMC_API lmc_status lmc_store(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                             const int64_t *block_ids, size_t num_block_ids,
                             uint64_t *stored_chunks, uint64_t *skipped_chunks, lmc_error *err);
LMC_API lmc_status lmc_store_bytes(lmc_client *c, const char *model_name, int64_t world_size,
                                   int64_t worker_id, const lmc_chunks *ch,
                                   const void *const *chunks, const size_t *chunk_lens,
                                   size_t num_chunks, uint64_t *stored_chunks,
                                   uint64_t *skipped_chunks, lmc_error *err);
/* store / store_bytes with options and every count of the reply. `opts` may be NULL; `res` may
 * be NULL. On an error reply the counts it carries are still written. */
LMC_API lmc_status lmc_store_ex(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                const int64_t *block_ids, size_t num_block_ids,
                                const lmc_store_options *opts, lmc_store_result *res,
                                lmc_error *err);
LMC_API lmc_status lmc_store_bytes_ex(lmc_client *c, const char *model_name, int64_t world_size,
                                      int64_t worker_id, const lmc_chunks *ch,
                                      const void *const *chunks, const size_t *chunk_lens,
                                      size_t num_chunks, const lmc_store_options *opts,
                                      lmc_store_result *res, lmc_error *err);
/* On success *out holds the reply; read it with lmc_reply_num_chunks/lmc_reply_chunk and free it
 * with lmc_reply_free. */
LMC_API lmc_status lmc_retrieve_bytes(lmc_client *c, const char *model_name, int64_t world_size,
                                      int64_t worker_id, const lmc_chunks *ch,
                                      const char *request_id, lmc_reply **out, lmc_error *err);
/* retrieve_bytes with options (`opts` may be NULL); read the reply the same way. */
LMC_API lmc_status lmc_retrieve_bytes_ex(lmc_client *c, const char *model_name, int64_t world_size,
                                         int64_t worker_id, const lmc_chunks *ch,
                                         const char *request_id,
                                         const lmc_retrieve_bytes_options *opts, lmc_reply **out,
                                         lmc_error *err);
LMC_API lmc_status lmc_free_lookup_locks(lmc_client *c, const char *request_id, int64_t start,
                                         int64_t end, int64_t worker_id, uint64_t *released,
                                         lmc_error *err);
LMC_API lmc_status lmc_end_session(lmc_client *c, const char *request_id, lmc_error *err);

#ifdef __cplusplus
}
#endif

#endif
