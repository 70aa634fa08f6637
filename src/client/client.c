/* liblmcache-client: DEALER socket, pipelined request/reply matching, the request builders and
 * synchronous calls of the data plane (docs/protocol.md, docs/client.md). The shared-memory KV
 * context is client_kv.c, the msgpack codec client_codec.c. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "client/client_codec.h"
#include "client/client_internal.h"

#define DEFAULT_TIMEOUT_MS   30000
#define DEFAULT_CONNECT_MS   5000
#define MAX_ABANDONED        64
#define MAX_REQUEST_ID_BYTES 24
/* Request buffers kept for reuse (lmc_client_set_keep_bytes): only those of at least
 * KEEP_MIN_BYTES, at most KEEP_MAX_BUFFERS of them, KEEP_DEFAULT_BYTES in all by default. */
#define KEEP_MIN_BYTES     ((size_t)1 << 20)
#define KEEP_MAX_BUFFERS   8
#define KEEP_DEFAULT_BYTES ((size_t)1 << 30)

/* ---- replies ----------------------------------------------------------------------------- */

struct lmc_reply {
    lmc_reply *next; /* in the client's list of replies not asked for yet */
    uint64_t id;
    char op[64];
    zmq_msg_t body; /* the bytes `up` points into (bin fields are not copied) */
    msgpack_unpacked up;
    const msgpack_object *map;
    /* retrieve_bytes with chunk_frames: the frames after the map, one per chunk, as received */
    zmq_msg_t *frames;
    uint32_t nframes, cap;
    bool has_frames; /* the map says chunk_frames */
};

LMC_API void lmc_reply_free(lmc_reply *r) {
    if (!r) return;
    msgpack_unpacked_destroy(&r->up);
    zmq_msg_close(&r->body);
    for (uint32_t i = 0; i < r->nframes; i++) zmq_msg_close(&r->frames[i]);
    free(r->frames);
    free(r);
}

/* Keeps a chunk frame (moved out of m). false when out of memory. */
static bool reply_add_frame(lmc_reply *r, zmq_msg_t *m) {
    if (r->nframes == r->cap) {
        uint32_t cap = r->cap ? 2 * r->cap : 16;
        zmq_msg_t *f = cap > r->cap ? realloc(r->frames, (size_t)cap * sizeof(*f)) : NULL;
        if (!f) return false;
        r->frames = f;
        r->cap = cap;
    }
    zmq_msg_init(&r->frames[r->nframes]);
    zmq_msg_move(&r->frames[r->nframes++], m);
    return true;
}

const msgpack_object *lmcc_reply_field(const lmc_reply *r, const char *field) {
    return lmcc_map_get(r->map, field);
}

LMC_API uint64_t lmc_reply_id(const lmc_reply *r) { return r->id; }
LMC_API const char *lmc_reply_op(const lmc_reply *r) { return r->op; }
LMC_API lmc_status lmc_reply_status(const lmc_reply *r, lmc_error *err) {
    return lmcc_reply_error(r->map, err);
}

LMC_API bool lmc_reply_get_u64(const lmc_reply *r, const char *field, uint64_t *out) {
    const msgpack_object *o = lmcc_map_get(r->map, field);
    if (!o) return false;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        *out = o->via.u64;
        return true;
    }
    return false;
}

LMC_API bool lmc_reply_get_i64(const lmc_reply *r, const char *field, int64_t *out) {
    const msgpack_object *o = lmcc_map_get(r->map, field);
    if (!o) return false;
    if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= INT64_MAX) {
        *out = (int64_t)o->via.u64;
        return true;
    }
    if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = o->via.i64;
        return true;
    }
    return false;
}

LMC_API bool lmc_reply_get_bool(const lmc_reply *r, const char *field, bool *out) {
    const msgpack_object *o = lmcc_map_get(r->map, field);
    if (!o || o->type != MSGPACK_OBJECT_BOOLEAN) return false;
    *out = o->via.boolean;
    return true;
}

LMC_API bool lmc_reply_get_str(const lmc_reply *r, const char *field, const char **out,
                               size_t *len) {
    const msgpack_object *o = lmcc_map_get(r->map, field);
    if (!o || o->type != MSGPACK_OBJECT_STR) return false;
    *out = o->via.str.ptr;
    *len = o->via.str.size;
    return true;
}

static bool get_double(const lmc_reply *r, const char *field, double *out) {
    const msgpack_object *o = lmcc_map_get(r->map, field);
    if (!o) return false;
    switch (o->type) {
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        *out = o->via.f64;
        return true;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        *out = (double)o->via.u64;
        return true;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        *out = (double)o->via.i64;
        return true;
    default:
        return false;
    }
}

LMC_API bool lmc_reply_has_chunk_frames(const lmc_reply *r) { return r->has_frames; }

LMC_API size_t lmc_reply_num_chunks(const lmc_reply *r) {
    if (r->has_frames) return r->nframes;
    const msgpack_object *o = lmcc_map_get(r->map, "chunks");
    return o && o->type == MSGPACK_OBJECT_ARRAY ? o->via.array.size : 0;
}

LMC_API bool lmc_reply_chunk(const lmc_reply *r, size_t i, const void **data, size_t *len) {
    if (r->has_frames) {
        if (i >= r->nframes) return false;
        *data = zmq_msg_data(&r->frames[i]);
        *len = zmq_msg_size(&r->frames[i]);
        return true;
    }
    const msgpack_object *o = lmcc_map_get(r->map, "chunks");
    if (!o || o->type != MSGPACK_OBJECT_ARRAY || i >= o->via.array.size) return false;
    const msgpack_object *e = &o->via.array.ptr[i];
    if (e->type != MSGPACK_OBJECT_BIN) return false;
    *data = e->via.bin.ptr;
    *len = e->via.bin.size;
    return true;
}

/* ---- connection -------------------------------------------------------------------------- */

struct lmc_client {
    void *zctx;
    void *sock;
    int timeout_ms;
    uint64_t next_id;
    size_t in_flight;
    lmc_reply *pending; /* replies received while waiting for another id, newest first */
    uint64_t abandoned[MAX_ABANDONED]; /* ids of timed-out synchronous calls: replies dropped */
    size_t nabandoned;
    /* What a new socket needs (lmc_client_reset after a failed store with chunk frames). */
    char endpoint[300];
    int connect_ms;
    bool curve;
    char curve_keys[3 * 40]; /* server, public, secret: 40 Z85 characters each */
    /* Chunk frames and kept request buffers libzmq still holds: released by zc_release and
     * keep_release (libzmq's I/O thread), which the lock orders with the caller's thread. */
    pthread_mutex_t zc_lock;
    pthread_cond_t zc_cond;
    size_t zc_held;
    /* Freed large request buffers, kept for the next large request (under zc_lock): a fresh
     * allocation of that size is a fresh mmap under glibc's defaults, one page fault and a zeroed
     * page per 4 KiB (docs/client.md). */
    struct kept {
        char *p;
        size_t cap;
    } keep[KEEP_MAX_BUFFERS];
    size_t nkeep, kept_bytes, keep_limit;
};

/* libzmq's hint for a kept buffer: whose, and its capacity. */
struct keep_hint {
    lmc_client *c;
    size_t cap;
};

/* Opens c->sock and connects it to c->endpoint; 0, or -1 with zmq_errno set and no socket. */
static int open_socket(lmc_client *c) {
    int zero = 0;
    c->sock = zmq_socket(c->zctx, ZMQ_DEALER);
    if (!c->sock) return -1;
    /* Pipelining: no high-water mark, so a deep pipeline never blocks or drops. */
    if (zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero)) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_SNDHWM, &zero, sizeof(zero)) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_RCVHWM, &zero, sizeof(zero)) != 0 ||
        zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof(int)) != 0)
        goto fail;
#ifdef ZMQ_CONNECT_TIMEOUT
    if (zmq_setsockopt(c->sock, ZMQ_CONNECT_TIMEOUT, &c->connect_ms, sizeof(int)) != 0) goto fail;
#endif
    if (c->curve && (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, c->curve_keys, 40) != 0 ||
                     zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, c->curve_keys + 40, 40) != 0 ||
                     zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, c->curve_keys + 80, 40) != 0))
        goto fail;
    if (zmq_connect(c->sock, c->endpoint) != 0) goto fail;
    return 0;
fail:;
    int e = zmq_errno();
    zmq_close(c->sock);
    c->sock = NULL;
    errno = e;
    return -1;
}

LMC_API lmc_status lmc_client_connect_endpoint(const char *endpoint, const lmc_client_options *opts,
                                               lmc_client **out, lmc_error *err) {
    lmcc_clear_error(err);
    if (!endpoint || !out) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "endpoint and out are required");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    lmc_client *c = calloc(1, sizeof(*c));
    if (!c) {
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory");
        return LMC_ERR_NO_MEMORY;
    }
    c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
    c->next_id = 1;
    int connect_ms =
        opts && opts->connect_timeout_ms > 0 ? opts->connect_timeout_ms : DEFAULT_CONNECT_MS;
    c->zctx = zmq_ctx_new();
    if (!c->zctx) goto zfail;
    if (strlen(endpoint) >= sizeof(c->endpoint)) {
        zmq_ctx_term(c->zctx);
        free(c);
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "endpoint too long");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    snprintf(c->endpoint, sizeof(c->endpoint), "%s", endpoint);
    c->connect_ms = connect_ms;
    if (opts && (opts->curve_server_key || opts->curve_public_key || opts->curve_secret_key)) {
        const char *keys[3] = {opts->curve_server_key, opts->curve_public_key,
                               opts->curve_secret_key};
        for (int i = 0; i < 3; i++)
            if (!keys[i] || strlen(keys[i]) != 40) {
                zmq_ctx_term(c->zctx);
                free(c);
                lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT,
                               "CURVE needs the server key and the client key pair, 40 Z85 "
                               "characters each");
                return LMC_ERR_INVALID_ARGUMENT;
            }
        c->curve = true;
        for (int i = 0; i < 3; i++) memcpy(c->curve_keys + 40 * i, keys[i], 40);
    }
    if (open_socket(c) != 0) goto zfail;
    c->keep_limit = KEEP_DEFAULT_BYTES;
    pthread_mutex_init(&c->zc_lock, NULL);
    pthread_cond_init(&c->zc_cond, NULL);
    *out = c;
    return LMC_OK;
zfail:
    lmcc_set_error(err, LMC_ERR_TRANSPORT, "zmq (%s): %s", endpoint, zmq_strerror(zmq_errno()));
    if (c->zctx) zmq_ctx_term(c->zctx);
    explicit_bzero(c->curve_keys, sizeof(c->curve_keys));
    free(c);
    return LMC_ERR_TRANSPORT;
}

LMC_API lmc_status lmc_client_connect(const char *host, int port, const lmc_client_options *opts,
                                      lmc_client **out, lmc_error *err) {
    lmcc_clear_error(err);
    if (!host || port <= 0 || port > 65535) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "host and a port 1..65535 are required");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    char ep[300];
    int n = snprintf(ep, sizeof(ep), "tcp://%s:%d", host, port);
    if (n < 0 || (size_t)n >= sizeof(ep)) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "host name too long");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    return lmc_client_connect_endpoint(ep, opts, out, err);
}

LMC_API void lmc_client_close(lmc_client *c) {
    if (!c) return;
    while (c->pending) {
        lmc_reply *r = c->pending;
        c->pending = r->next;
        lmc_reply_free(r);
    }
    zmq_close(c->sock);
    zmq_ctx_term(c->zctx); /* every chunk frame and request buffer is released by now */
    for (size_t i = 0; i < c->nkeep; i++) free(c->keep[i].p);
    pthread_cond_destroy(&c->zc_cond);
    pthread_mutex_destroy(&c->zc_lock);
    explicit_bzero(c->curve_keys, sizeof(c->curve_keys));
    free(c);
}

LMC_API void lmc_client_set_timeout(lmc_client *c, int timeout_ms) {
    c->timeout_ms = timeout_ms > 0 ? timeout_ms : DEFAULT_TIMEOUT_MS;
    /* Failure leaves the previous send timeout, which is harmless. */
    (void)zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &c->timeout_ms, sizeof(int));
}

LMC_API size_t lmc_in_flight(const lmc_client *c) { return c->in_flight; }

static void free_cb(void *data, void *hint) {
    (void)hint;
    free(data);
}

/* Under zc_lock: takes kept buffer i out of the list. */
static struct kept keep_remove(lmc_client *c, size_t i) {
    struct kept k = c->keep[i];
    c->kept_bytes -= k.cap;
    c->keep[i] = c->keep[--c->nkeep];
    return k;
}

/* Under zc_lock: the kept buffer with the largest (largest set) or smallest capacity. */
static size_t keep_extreme(const lmc_client *c, bool largest) {
    size_t x = 0;
    for (size_t i = 1; i < c->nkeep; i++)
        if (largest ? c->keep[i].cap > c->keep[x].cap : c->keep[i].cap < c->keep[x].cap) x = i;
    return x;
}

/* Under zc_lock: a buffer of cap bytes may join the kept ones. */
static bool keep_fits(const lmc_client *c, size_t cap) {
    return c->nkeep < KEEP_MAX_BUFFERS && c->kept_bytes + cap <= c->keep_limit;
}

LMC_API void lmc_client_set_keep_bytes(lmc_client *c, size_t bytes) {
    if (!c) return;
    struct kept drop[KEEP_MAX_BUFFERS];
    size_t ndrop = 0;
    pthread_mutex_lock(&c->zc_lock);
    c->keep_limit = bytes;
    while (c->nkeep && c->kept_bytes > bytes) /* the largest go first */
        drop[ndrop++] = keep_remove(c, keep_extreme(c, true));
    pthread_mutex_unlock(&c->zc_lock);
    for (size_t i = 0; i < ndrop; i++) free(drop[i].p);
}

LMC_API size_t lmc_client_kept_bytes(lmc_client *c) {
    if (!c) return 0;
    pthread_mutex_lock(&c->zc_lock);
    size_t n = c->kept_bytes;
    pthread_mutex_unlock(&c->zc_lock);
    return n;
}

/* A kept buffer of at least `need` bytes (the smallest that fits), or NULL. */
static char *keep_take(lmc_client *c, size_t need, size_t *cap) {
    char *p = NULL;
    pthread_mutex_lock(&c->zc_lock);
    size_t best = c->nkeep;
    for (size_t i = 0; i < c->nkeep; i++)
        if (c->keep[i].cap >= need && (best == c->nkeep || c->keep[i].cap < c->keep[best].cap))
            best = i;
    if (best < c->nkeep) {
        struct kept k = keep_remove(c, best);
        p = k.p;
        *cap = k.cap;
    }
    pthread_mutex_unlock(&c->zc_lock);
    return p;
}

/* libzmq is done with a large request buffer: kept for the next one when it fits within the
 * limit (smaller kept buffers make room for it), freed otherwise. */
static void keep_release(void *data, void *hint) {
    struct keep_hint *h = hint;
    lmc_client *c = h->c;
    size_t cap = h->cap;
    free(h);
    struct kept drop[KEEP_MAX_BUFFERS + 1];
    size_t ndrop = 0;
    pthread_mutex_lock(&c->zc_lock);
    while (cap <= c->keep_limit && c->nkeep && !keep_fits(c, cap)) {
        size_t small = keep_extreme(c, false);
        if (c->keep[small].cap > cap) break;
        drop[ndrop++] = keep_remove(c, small);
    }
    if (keep_fits(c, cap)) {
        c->keep[c->nkeep++] = (struct kept){data, cap};
        c->kept_bytes += cap;
    } else {
        drop[ndrop++] = (struct kept){data, cap};
    }
    if (--c->zc_held == 0) pthread_cond_broadcast(&c->zc_cond);
    pthread_mutex_unlock(&c->zc_lock);
    for (size_t i = 0; i < ndrop; i++) free(drop[i].p);
}

/* Releases one chunk frame: libzmq is done with the caller's buffer. */
static void zc_release(void *data, void *hint) {
    (void)data;
    lmc_client *c = hint;
    pthread_mutex_lock(&c->zc_lock);
    if (--c->zc_held == 0) pthread_cond_broadcast(&c->zc_cond);
    pthread_mutex_unlock(&c->zc_lock);
}

/* Sends [id][op][payload][frame 0..nframes); takes ownership of `payload` (malloc'ed, `cap`
 * bytes; freed by ZMQ after sending, or here on failure; kept for reuse when large). The frames
 * are sent from the caller's buffers, which libzmq holds until zc_release. */
static lmc_status send_frames_ex(lmc_client *c, const char *op, char *payload, size_t len,
                                 size_t cap, const void *const *frames, const size_t *lens,
                                 size_t nframes, lmc_req_id *id, lmc_error *err) {
    char idbuf[MAX_REQUEST_ID_BYTES];
    uint64_t rid = c->next_id++;
    int idn = snprintf(idbuf, sizeof(idbuf), "%llu", (unsigned long long)rid);
    zmq_msg_t body;
    int rc;
    if (!c->sock) {
        free(payload);
        lmcc_set_error(err, LMC_ERR_TRANSPORT, "send %s: the connection could not be reopened", op);
        return LMC_ERR_TRANSPORT;
    }
    struct keep_hint *kh = NULL;
    if (payload && len >= KEEP_MIN_BYTES && cap >= len && (kh = malloc(sizeof(*kh)))) {
        *kh = (struct keep_hint){c, cap};
        pthread_mutex_lock(&c->zc_lock);
        c->zc_held++;
        pthread_mutex_unlock(&c->zc_lock);
        rc = zmq_msg_init_data(&body, payload, len, keep_release, kh);
        if (rc != 0) {
            free(kh);
            zc_release(NULL, c); /* not taken: libzmq never calls keep_release */
        }
    } else if (payload && len) {
        rc = zmq_msg_init_data(&body, payload, len, free_cb, NULL);
    } else {
        free(payload);
        rc = zmq_msg_init(&body);
    }
    if (rc != 0) {
        if (payload && len) free(payload);
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "zmq_msg_init: %s", zmq_strerror(zmq_errno()));
        return LMC_ERR_NO_MEMORY;
    }
    int more = nframes ? ZMQ_SNDMORE : 0, e = 0;
    if (zmq_send(c->sock, idbuf, (size_t)idn, ZMQ_SNDMORE) < 0 ||
        zmq_send(c->sock, op, strlen(op), ZMQ_SNDMORE) < 0 ||
        zmq_msg_send(&body, c->sock, more) < 0)
        e = zmq_errno();
    for (size_t i = 0; i < nframes && !e; i++) {
        zmq_msg_t f;
        pthread_mutex_lock(&c->zc_lock);
        c->zc_held++;
        pthread_mutex_unlock(&c->zc_lock);
        if (zmq_msg_init_data(&f, (void *)frames[i], lens[i], zc_release, c) != 0) {
            zc_release(NULL, c); /* not taken: libzmq never calls it */
            e = ENOMEM;
            break;
        }
        if (zmq_msg_send(&f, c->sock, i + 1 < nframes ? ZMQ_SNDMORE : 0) < 0) e = zmq_errno();
        if (e) zmq_msg_close(&f); /* releases the frame */
    }
    if (e) {
        zmq_msg_close(&body);
        lmc_status s = e == EAGAIN   ? LMC_ERR_TIMEOUT
                       : e == ENOMEM ? LMC_ERR_NO_MEMORY
                                     : LMC_ERR_TRANSPORT;
        lmcc_set_error(err, s, "send %s: %s", op,
                       e == EAGAIN ? "no server accepted the request in time" : zmq_strerror(e));
        return s;
    }
    c->in_flight++;
    if (id) *id = rid;
    return LMC_OK;
}

static lmc_status send_frames(lmc_client *c, const char *op, char *payload, size_t len,
                              lmc_req_id *id, lmc_error *err) {
    return send_frames_ex(c, op, payload, len, len, NULL, NULL, 0, id, err);
}

/* Gets the caller's buffers back from libzmq after a store with chunk frames failed without a
 * reply: closes the socket (libzmq then drops the frames it still holds, and releases them),
 * waits for the release, and opens a new connection. Replies still in flight are lost. */
static void reset_connection(lmc_client *c) {
    if (c->sock) zmq_close(c->sock);
    c->sock = NULL;
    pthread_mutex_lock(&c->zc_lock);
    while (c->zc_held) pthread_cond_wait(&c->zc_cond, &c->zc_lock);
    pthread_mutex_unlock(&c->zc_lock);
    c->in_flight = 0;
    c->nabandoned = 0;
    (void)open_socket(c); /* on failure c->sock stays NULL: later sends fail */
}

/* Finishes `m` and sends it as the payload of `op`. Destroys `m` in every case. */
static lmc_status send_map_frames(lmc_client *c, const char *op, struct lmcc_map *m,
                                  const void *const *frames, const size_t *lens, size_t nframes,
                                  lmc_req_id *id, lmc_error *err) {
    if (lmcc_map_finish(m) != 0) {
        lmcc_map_destroy(m);
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory encoding %s", op);
        return LMC_ERR_NO_MEMORY;
    }
    size_t len = m->buf.size, cap = m->buf.alloc;
    char *data = msgpack_sbuffer_release(&m->buf);
    lmcc_map_destroy(m);
    return send_frames_ex(c, op, data, len, cap, frames, lens, nframes, id, err);
}

lmc_status lmcc_send_map(lmc_client *c, const char *op, struct lmcc_map *m, lmc_req_id *id,
                         lmc_error *err) {
    return send_map_frames(c, op, m, NULL, NULL, 0, id, err);
}

LMC_API lmc_status lmc_send_raw(lmc_client *c, const char *op, const void *payload, size_t len,
                                lmc_req_id *id, lmc_error *err) {
    lmcc_clear_error(err);
    if (!c || !op) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "client and op are required");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    char *copy = NULL;
    if (len) {
        copy = malloc(len);
        if (!copy) {
            lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory");
            return LMC_ERR_NO_MEMORY;
        }
        memcpy(copy, payload, len);
    }
    return send_frames(c, op, copy, len, id, err);
}

static bool is_abandoned(lmc_client *c, uint64_t id) {
    for (size_t i = 0; i < c->nabandoned; i++)
        if (c->abandoned[i] == id) {
            c->abandoned[i] = c->abandoned[--c->nabandoned];
            return true;
        }
    return false;
}

static void abandon(lmc_client *c, uint64_t id) {
    if (c->nabandoned == MAX_ABANDONED) { /* forget the oldest: its reply, if any, is kept */
        memmove(c->abandoned, c->abandoned + 1, (MAX_ABANDONED - 1) * sizeof(uint64_t));
        c->nabandoned--;
    }
    c->abandoned[c->nabandoned++] = id;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Receives one whole message (waiting until `deadline`, a now_ms() value) and decodes it. */
static lmc_status recv_one(lmc_client *c, int64_t deadline, lmc_reply **out, lmc_error *err) {
    for (;;) {
        int64_t left = deadline - now_ms();
        if (left < 0) left = 0;
        zmq_pollitem_t it = {.socket = c->sock, .events = ZMQ_POLLIN};
        int n = zmq_poll(&it, 1, (long)left);
        if (n < 0) {
            if (zmq_errno() == EINTR) continue;
            lmcc_set_error(err, LMC_ERR_TRANSPORT, "zmq_poll: %s", zmq_strerror(zmq_errno()));
            return LMC_ERR_TRANSPORT;
        }
        if (n == 0) {
            lmcc_set_error(err, LMC_ERR_TIMEOUT, "no reply within %d ms", c->timeout_ms);
            return LMC_ERR_TIMEOUT;
        }
        break;
    }
    lmc_reply *r = calloc(1, sizeof(*r));
    if (!r) {
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory");
        return LMC_ERR_NO_MEMORY;
    }
    msgpack_unpacked_init(&r->up);
    zmq_msg_init(&r->body);
    zmq_msg_t part;
    int nframes = 0, more = 1;
    lmc_status s = LMC_OK;
    while (more) {
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, c->sock, 0) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&part);
            if (e == EINTR) continue;
            lmcc_set_error(err, LMC_ERR_TRANSPORT, "receive: %s", zmq_strerror(e));
            s = LMC_ERR_TRANSPORT;
            break;
        }
        more = zmq_msg_more(&part);
        const char *d = zmq_msg_data(&part);
        size_t l = zmq_msg_size(&part);
        if (nframes == 0) {
            r->id = lmcc_parse_id(d, l);
        } else if (nframes == 1) {
            snprintf(r->op, sizeof(r->op), "%.*s", l > 63 ? 63 : (int)l, d);
        } else if (nframes == 2) {
            zmq_msg_move(&r->body, &part);
        } else if (s == LMC_OK && !reply_add_frame(r, &part)) {
            lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory for a reply's chunk frames");
            s = LMC_ERR_NO_MEMORY; /* the rest of the reply is still read */
        }
        zmq_msg_close(&part);
        if (nframes < INT_MAX) nframes++;
    }
    if (s == LMC_OK && nframes < 3) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "reply has %d frames, not 3", nframes);
        s = LMC_ERR_PROTOCOL;
    }
    if (s == LMC_OK)
        s = lmcc_decode_reply(zmq_msg_data(&r->body), zmq_msg_size(&r->body), &r->up, &r->map, err);
    if (s == LMC_OK) {
        /* Frames after the map only as many as its chunk_frames announces (docs/protocol.md). */
        const msgpack_object *cf = lmcc_map_get(r->map, "chunk_frames");
        r->has_frames = cf != NULL;
        if (cf ? cf->type != MSGPACK_OBJECT_POSITIVE_INTEGER || cf->via.u64 != r->nframes
               : r->nframes != 0) {
            lmcc_set_error(err, LMC_ERR_PROTOCOL, "reply has %d frames, not %llu", nframes,
                           3 + (cf && cf->type == MSGPACK_OBJECT_POSITIVE_INTEGER
                                    ? (unsigned long long)cf->via.u64
                                    : 0ull));
            s = LMC_ERR_PROTOCOL;
        }
    }
    if (s != LMC_OK) {
        /* The reply still answers one request, whatever its shape. */
        if (nframes >= 1 && c->in_flight) c->in_flight--;
        lmc_reply_free(r);
        return s;
    }
    *out = r;
    return LMC_OK;
}

static lmc_status wait_until(lmc_client *c, bool any, lmc_req_id id, lmc_reply **out,
                             lmc_error *err) {
    lmcc_clear_error(err);
    /* Replies already received: for `any`, the oldest one (the tail of the list). */
    lmc_reply **pp = &c->pending, **hit = NULL;
    for (; *pp; pp = &(*pp)->next)
        if (any || (*pp)->id == id) hit = pp;
    if (hit) {
        lmc_reply *r = *hit;
        *hit = r->next;
        r->next = NULL;
        c->in_flight--;
        *out = r;
        return LMC_OK;
    }
    int64_t deadline = now_ms() + c->timeout_ms;
    for (;;) {
        lmc_reply *r;
        lmc_status s = recv_one(c, deadline, &r, err);
        if (s != LMC_OK) return s;
        if (is_abandoned(c, r->id)) {
            c->in_flight--;
            lmc_reply_free(r);
            continue;
        }
        if (any || r->id == id) {
            c->in_flight--;
            *out = r;
            return LMC_OK;
        }
        r->next = c->pending;
        c->pending = r;
    }
}

LMC_API lmc_status lmc_wait(lmc_client *c, lmc_req_id id, lmc_reply **out, lmc_error *err) {
    return wait_until(c, false, id, out, err);
}

LMC_API lmc_status lmc_recv(lmc_client *c, lmc_reply **out, lmc_error *err) {
    return wait_until(c, true, 0, out, err);
}

/* ---- request builders -------------------------------------------------------------------- */

lmc_status lmcc_bad_arg(lmc_error *err, const char *what) {
    lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "%s", what);
    return LMC_ERR_INVALID_ARGUMENT;
}

/* reply_status: the reply carries the session's first status (ready, hit_chunks). */
static lmc_status send_lookup(lmc_client *c, const char *request_id, const char *model_name,
                              int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                              bool reply_status, lmc_req_id *id, lmc_error *err) {
    lmcc_clear_error(err);
    if (!request_id || !model_name)
        return lmcc_bad_arg(err, "request_id and model_name are required");
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_str(&m, "request_id", request_id);
    lmcc_put_str(&m, "model_name", model_name);
    lmcc_put_int(&m, "world_size", world_size > 0 ? world_size : 1);
    lmcc_put_int(&m, "num_kv_readers", num_kv_readers > 0 ? num_kv_readers : 1);
    if (reply_status) lmcc_put_bool(&m, "reply_status", true);
    lmc_status s = lmcc_put_chunks(&m, ch, err);
    if (s != LMC_OK) {
        lmcc_map_destroy(&m);
        return s;
    }
    return lmcc_send_map(c, "lookup", &m, id, err);
}

LMC_API lmc_status lmc_send_lookup(lmc_client *c, const char *request_id, const char *model_name,
                                   int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                                   lmc_req_id *id, lmc_error *err) {
    return send_lookup(c, request_id, model_name, world_size, ch, num_kv_readers, false, id, err);
}

static lmc_status send_request_id_only(lmc_client *c, const char *op, const char *request_id,
                                       lmc_req_id *id, lmc_error *err) {
    lmcc_clear_error(err);
    if (!request_id) return lmcc_bad_arg(err, "request_id is required");
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_str(&m, "request_id", request_id);
    return lmcc_send_map(c, op, &m, id, err);
}

LMC_API lmc_status lmc_send_query_prefetch_status(lmc_client *c, const char *request_id,
                                                  lmc_req_id *id, lmc_error *err) {
    return send_request_id_only(c, "query_prefetch_status", request_id, id, err);
}

LMC_API lmc_status lmc_send_end_session(lmc_client *c, const char *request_id, lmc_req_id *id,
                                        lmc_error *err) {
    return send_request_id_only(c, "end_session", request_id, id, err);
}

LMC_API lmc_status lmc_send_retrieve(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                     const int64_t *block_ids, size_t num_block_ids,
                                     const char *request_id, int64_t skip_first_n_tokens,
                                     lmc_req_id *id, lmc_error *err) {
    lmcc_clear_error(err);
    if (!block_ids && num_block_ids) return lmcc_bad_arg(err, "block_ids is NULL");
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_int(&m, "instance_id", instance_id);
    lmcc_put_i64_array(&m, "block_ids", block_ids, num_block_ids);
    if (request_id) lmcc_put_str(&m, "request_id", request_id);
    if (skip_first_n_tokens) lmcc_put_int(&m, "skip_first_n_tokens", skip_first_n_tokens);
    lmc_status s = lmcc_put_chunks(&m, ch, err);
    if (s != LMC_OK) {
        lmcc_map_destroy(&m);
        return s;
    }
    return lmcc_send_map(c, "retrieve", &m, id, err);
}

LMC_API lmc_status lmc_send_store(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                  const int64_t *block_ids, size_t num_block_ids, lmc_req_id *id,
                                  lmc_error *err) {
    return lmc_send_store_ex(c, instance_id, ch, block_ids, num_block_ids, NULL, id, err);
}

LMC_API lmc_status lmc_send_store_ex(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                     const int64_t *block_ids, size_t num_block_ids,
                                     const lmc_store_options *opts, lmc_req_id *id,
                                     lmc_error *err) {
    lmcc_clear_error(err);
    if (!block_ids && num_block_ids) return lmcc_bad_arg(err, "block_ids is NULL");
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_int(&m, "instance_id", instance_id);
    lmcc_put_i64_array(&m, "block_ids", block_ids, num_block_ids);
    if (opts && opts->wait_l2) lmcc_put_bool(&m, "wait_l2", true);
    lmc_status s = lmcc_put_chunks(&m, ch, err);
    if (s != LMC_OK) {
        lmcc_map_destroy(&m);
        return s;
    }
    return lmcc_send_map(c, "store", &m, id, err);
}

static void put_rank(struct lmcc_map *m, const char *model_name, int64_t world_size,
                     int64_t worker_id) {
    lmcc_put_str(m, "model_name", model_name);
    lmcc_put_int(m, "world_size", world_size > 0 ? world_size : 1);
    lmcc_put_int(m, "worker_id", worker_id > 0 ? worker_id : 0);
}

LMC_API lmc_status lmc_send_store_bytes(lmc_client *c, const char *model_name, int64_t world_size,
                                        int64_t worker_id, const lmc_chunks *ch,
                                        const void *const *chunks, const size_t *chunk_lens,
                                        size_t num_chunks, lmc_req_id *id, lmc_error *err) {
    return lmc_send_store_bytes_ex(c, model_name, world_size, worker_id, ch, chunks, chunk_lens,
                                   num_chunks, NULL, id, err);
}

LMC_API lmc_status lmc_send_store_bytes_ex(lmc_client *c, const char *model_name,
                                           int64_t world_size, int64_t worker_id,
                                           const lmc_chunks *ch, const void *const *chunks,
                                           const size_t *chunk_lens, size_t num_chunks,
                                           const lmc_store_options *opts, lmc_req_id *id,
                                           lmc_error *err) {
    lmcc_clear_error(err);
    if (!model_name) return lmcc_bad_arg(err, "model_name is required");
    if (num_chunks && (!chunks || !chunk_lens)) return lmcc_bad_arg(err, "chunks is NULL");
    if (num_chunks > UINT32_MAX) return lmcc_bad_arg(err, "too many chunks");
    bool frames = opts && opts->chunk_frames;
    size_t total = 0;
    for (size_t i = 0; i < num_chunks; i++) {
        if (chunk_lens[i] > UINT32_MAX) return lmcc_bad_arg(err, "a chunk is larger than 4 GiB");
        if (frames && !chunk_lens[i]) return lmcc_bad_arg(err, "a chunk is empty");
        if (total + chunk_lens[i] + 5 < total) return lmcc_bad_arg(err, "chunks too large");
        if (!frames) total += chunk_lens[i] + 5; /* bin32 header */
    }
    struct lmcc_map m;
    lmcc_map_init(&m);
    /* One allocation for the whole payload: no regrowth copies of large chunks. */
    size_t fields = 1024 + strlen(model_name);
    if (ch) {
        fields += ch->num_tokens * 5 + ch->num_chunk_hashes * (ch->hash_len + 2);
        if (ch->cache_salt) fields += strlen(ch->cache_salt);
    }
    size_t cap = 0;
    char *kept = total + fields >= total && total + fields >= KEEP_MIN_BYTES
                     ? keep_take(c, m.buf.size + total + fields, &cap)
                     : NULL;
    if (kept) lmcc_map_adopt(&m, kept, cap); /* a freed request buffer of this size, reused */
    if (total + fields < total || lmcc_map_reserve(&m, total + fields) != 0) {
        lmcc_map_destroy(&m);
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory for a %zu-byte payload", total);
        return LMC_ERR_NO_MEMORY;
    }
    put_rank(&m, model_name, world_size, worker_id);
    if (opts && opts->wait_l2) lmcc_put_bool(&m, "wait_l2", true);
    lmc_status s = lmcc_put_chunks(&m, ch, err);
    if (s != LMC_OK) {
        lmcc_map_destroy(&m);
        return s;
    }
    if (frames) { /* the chunks follow the payload, sent from the caller's buffers */
        lmcc_put_int(&m, "chunk_frames", (int64_t)num_chunks);
        return send_map_frames(c, "store_bytes", &m, chunks, chunk_lens, num_chunks, id, err);
    }
    lmcc_put_key(&m, "chunks");
    if (msgpack_pack_array(&m.pk, num_chunks) != 0) m.failed = 1;
    for (size_t i = 0; i < num_chunks && !m.failed; i++)
        if (msgpack_pack_bin(&m.pk, chunk_lens[i]) != 0 ||
            msgpack_pack_bin_body(&m.pk, chunks[i], chunk_lens[i]) != 0)
            m.failed = 1;
    return lmcc_send_map(c, "store_bytes", &m, id, err);
}

LMC_API lmc_status lmc_send_retrieve_bytes(lmc_client *c, const char *model_name,
                                           int64_t world_size, int64_t worker_id,
                                           const lmc_chunks *ch, const char *request_id,
                                           lmc_req_id *id, lmc_error *err) {
    return lmc_send_retrieve_bytes_ex(c, model_name, world_size, worker_id, ch, request_id, NULL,
                                      id, err);
}

LMC_API lmc_status lmc_send_retrieve_bytes_ex(lmc_client *c, const char *model_name,
                                              int64_t world_size, int64_t worker_id,
                                              const lmc_chunks *ch, const char *request_id,
                                              const lmc_retrieve_bytes_options *opts,
                                              lmc_req_id *id, lmc_error *err) {
    lmcc_clear_error(err);
    if (!model_name) return lmcc_bad_arg(err, "model_name is required");
    struct lmcc_map m;
    lmcc_map_init(&m);
    put_rank(&m, model_name, world_size, worker_id);
    if (request_id) lmcc_put_str(&m, "request_id", request_id);
    if (opts && opts->chunk_frames) lmcc_put_bool(&m, "chunk_frames", true);
    lmc_status s = lmcc_put_chunks(&m, ch, err);
    if (s != LMC_OK) {
        lmcc_map_destroy(&m);
        return s;
    }
    return lmcc_send_map(c, "retrieve_bytes", &m, id, err);
}

LMC_API lmc_status lmc_send_free_lookup_locks(lmc_client *c, const char *request_id, int64_t start,
                                              int64_t end, int64_t worker_id, lmc_req_id *id,
                                              lmc_error *err) {
    lmcc_clear_error(err);
    if (!request_id) return lmcc_bad_arg(err, "request_id is required");
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_str(&m, "request_id", request_id);
    if (start >= 0) lmcc_put_int(&m, "start", start);
    if (end >= 0) lmcc_put_int(&m, "end", end);
    if (worker_id >= 0) lmcc_put_int(&m, "worker_id", worker_id);
    return lmcc_send_map(c, "free_lookup_locks", &m, id, err);
}

LMC_API lmc_status lmc_send_ping(lmc_client *c, int64_t instance_id, lmc_req_id *id,
                                 lmc_error *err) {
    lmcc_clear_error(err);
    struct lmcc_map m;
    lmcc_map_init(&m);
    if (instance_id >= 0) lmcc_put_int(&m, "instance_id", instance_id);
    return lmcc_send_map(c, "ping", &m, id, err);
}

static lmc_status send_empty(lmc_client *c, const char *op, lmc_req_id *id, lmc_error *err) {
    lmcc_clear_error(err);
    struct lmcc_map m;
    lmcc_map_init(&m);
    return lmcc_send_map(c, op, &m, id, err);
}

LMC_API lmc_status lmc_send_noop(lmc_client *c, lmc_req_id *id, lmc_error *err) {
    return send_empty(c, "noop", id, err);
}
LMC_API lmc_status lmc_send_clear(lmc_client *c, lmc_req_id *id, lmc_error *err) {
    return send_empty(c, "clear", id, err);
}
LMC_API lmc_status lmc_send_get_chunk_size(lmc_client *c, lmc_req_id *id, lmc_error *err) {
    return send_empty(c, "get_chunk_size", id, err);
}

/* ---- synchronous calls ------------------------------------------------------------------- */

/* Waits for the reply of a request just sent (`sent` is the send's status; `id` is a pointer
 * because the send that fills it is another argument of the same call). On LMC_OK or a server error
 * *out holds the reply (free it); on a client-side failure *out is NULL. */
lmc_status lmcc_finish(lmc_client *c, lmc_status sent, const lmc_req_id *id, lmc_reply **out,
                       lmc_error *err) {
    *out = NULL;
    if (sent != LMC_OK) return sent;
    lmc_status s = lmc_wait(c, *id, out, err);
    if (s != LMC_OK) {
        if (s == LMC_ERR_TIMEOUT) abandon(c, *id);
        return s;
    }
    return lmc_reply_status(*out, err);
}

static void out_u64(const lmc_reply *r, const char *field, uint64_t *out) {
    if (out && r && !lmc_reply_get_u64(r, field, out)) *out = 0;
}

/* A reply that says ok but lacks a field the protocol promises. */
static lmc_status need_u64(lmc_reply *r, const char *field, uint64_t *out, lmc_error *err) {
    uint64_t v;
    if (!lmc_reply_get_u64(r, field, &v)) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "%s reply lacks an unsigned integer '%s'",
                       lmc_reply_op(r), field);
        return LMC_ERR_PROTOCOL;
    }
    if (out) *out = v;
    return LMC_OK;
}

LMC_API lmc_status lmc_noop(lmc_client *c, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(c, lmc_send_noop(c, &id, err), &id, &r, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_ping(lmc_client *c, int64_t instance_id, double *server_time,
                            lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(c, lmc_send_ping(c, instance_id, &id, err), &id, &r, err);
    if (s == LMC_OK && server_time && !get_double(r, "server_time", server_time)) *server_time = 0;
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_get_chunk_size(lmc_client *c, uint64_t *chunk_size, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(c, lmc_send_get_chunk_size(c, &id, err), &id, &r, err);
    if (s == LMC_OK) s = need_u64(r, "chunk_size", chunk_size, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_clear(lmc_client *c, uint64_t *cleared, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(c, lmc_send_clear(c, &id, err), &id, &r, err);
    out_u64(r, "cleared", cleared);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_lookup(lmc_client *c, const char *request_id, const char *model_name,
                              int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                              lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(
        c, lmc_send_lookup(c, request_id, model_name, world_size, ch, num_kv_readers, &id, err),
        &id, &r, err);
    lmc_reply_free(r);
    return s;
}

/* The ready/hit_chunks of a query_prefetch_status reply (the reply's own error otherwise). */
static lmc_status query_result(lmc_status s, lmc_reply *r, bool *ready, uint64_t *hit_chunks,
                               lmc_error *err) {
    if (s != LMC_OK) return s;
    bool rd;
    if (!lmc_reply_get_bool(r, "ready", &rd)) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "query_prefetch_status reply lacks 'ready'");
        return LMC_ERR_PROTOCOL;
    }
    if (ready) *ready = rd;
    if (rd) return need_u64(r, "hit_chunks", hit_chunks, err);
    if (hit_chunks) *hit_chunks = 0;
    return LMC_OK;
}

LMC_API lmc_status lmc_query_prefetch_status(lmc_client *c, const char *request_id, bool *ready,
                                             uint64_t *hit_chunks, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s =
        lmcc_finish(c, lmc_send_query_prefetch_status(c, request_id, &id, err), &id, &r, err);
    s = query_result(s, r, ready, hit_chunks, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_lookup_wait(lmc_client *c, const char *request_id, const char *model_name,
                                   int64_t world_size, const lmc_chunks *ch, int64_t num_kv_readers,
                                   unsigned poll_us, uint64_t *hit_chunks, lmc_error *err) {
    lmc_req_id lid = 0;
    lmc_reply *r = NULL;
    /* The lookup's reply carries the session's first status (reply_status): a lookup answered
     * from L1 costs one request and one reply. */
    lmc_status s = lmcc_finish(
        c, send_lookup(c, request_id, model_name, world_size, ch, num_kv_readers, true, &lid, err),
        &lid, &r, err);
    bool ready = false, has_status = false;
    if (s == LMC_OK && lmc_reply_get_bool(r, "ready", &ready)) {
        has_status = true;
        s = query_result(s, r, &ready, hit_chunks, err);
    }
    lmc_reply_free(r);
    if (s != LMC_OK || ready) return s;
    /* Still prefetching from L2, or a server that predates reply_status: query. */
    int64_t deadline = now_ms() + c->timeout_ms;
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)(poll_us ? poll_us : 100) * 1000};
    for (bool first = !has_status;; first = false) {
        if (!first) nanosleep(&ts, NULL);
        s = lmc_query_prefetch_status(c, request_id, &ready, hit_chunks, err);
        if (s != LMC_OK || ready) return s;
        if (now_ms() > deadline) {
            lmcc_set_error(err, LMC_ERR_TIMEOUT, "lookup %s not ready within %d ms", request_id,
                           c->timeout_ms);
            return LMC_ERR_TIMEOUT;
        }
    }
}

LMC_API lmc_status lmc_retrieve(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                const int64_t *block_ids, size_t num_block_ids,
                                const char *request_id, int64_t skip_first_n_tokens,
                                uint64_t *retrieved_chunks, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(c,
                               lmc_send_retrieve(c, instance_id, ch, block_ids, num_block_ids,
                                                 request_id, skip_first_n_tokens, &id, err),
                               &id, &r, err);
    if (s == LMC_OK)
        s = need_u64(r, "retrieved_chunks", retrieved_chunks, err);
    else
        out_u64(r, "retrieved_chunks", retrieved_chunks);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_reply_store_result(const lmc_reply *r, lmc_store_result *out,
                                          lmc_error *err) {
    lmc_store_result res;
    memset(&res, 0, sizeof(res));
    lmcc_clear_error(err);
    lmc_status s = lmc_reply_status(r, err);
    bool have = lmc_reply_get_u64(r, "stored_chunks", &res.stored_chunks);
    have = lmc_reply_get_u64(r, "skipped_chunks", &res.skipped_chunks) && have;
    (void)lmc_reply_get_u64(r, "pending_chunks", &res.pending_chunks);
    res.has_l2_stored = lmc_reply_get_u64(r, "l2_stored_chunks", &res.l2_stored_chunks);
    if (s == LMC_OK && !have) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL,
                       "%s reply lacks unsigned integers 'stored_chunks' and 'skipped_chunks'",
                       lmc_reply_op(r));
        s = LMC_ERR_PROTOCOL;
    }
    if (out) *out = res;
    return s;
}

/* The counts of a finished store call: from the reply when there is one (ok or an error reply),
 * zeros after a client-side failure. */
static lmc_status store_result(lmc_status s, lmc_reply *r, lmc_store_result *res, lmc_error *err) {
    if (!r) {
        if (res) memset(res, 0, sizeof(*res));
        return s;
    }
    lmc_error e2;
    lmc_status s2 = lmc_reply_store_result(r, res, &e2);
    if (s == LMC_OK && s2 != LMC_OK) {
        if (err) *err = e2;
        return s2;
    }
    return s;
}

LMC_API lmc_status lmc_store_ex(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                                const int64_t *block_ids, size_t num_block_ids,
                                const lmc_store_options *opts, lmc_store_result *res,
                                lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(
        c, lmc_send_store_ex(c, instance_id, ch, block_ids, num_block_ids, opts, &id, err), &id, &r,
        err);
    s = store_result(s, r, res, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_store_bytes_ex(lmc_client *c, const char *model_name, int64_t world_size,
                                      int64_t worker_id, const lmc_chunks *ch,
                                      const void *const *chunks, const size_t *chunk_lens,
                                      size_t num_chunks, const lmc_store_options *opts,
                                      lmc_store_result *res, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s =
        lmcc_finish(c,
                    lmc_send_store_bytes_ex(c, model_name, world_size, worker_id, ch, chunks,
                                            chunk_lens, num_chunks, opts, &id, err),
                    &id, &r, err);
    /* Without a reply, libzmq may still hold the caller's chunk frames: take them back. */
    if (!r && opts && opts->chunk_frames) {
        pthread_mutex_lock(&c->zc_lock);
        bool held = c->zc_held != 0;
        pthread_mutex_unlock(&c->zc_lock);
        if (held) reset_connection(c);
    }
    s = store_result(s, r, res, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_store(lmc_client *c, int64_t instance_id, const lmc_chunks *ch,
                             const int64_t *block_ids, size_t num_block_ids,
                             uint64_t *stored_chunks, uint64_t *skipped_chunks, lmc_error *err) {
    lmc_store_result res;
    lmc_status s = lmc_store_ex(c, instance_id, ch, block_ids, num_block_ids, NULL, &res, err);
    if (stored_chunks) *stored_chunks = res.stored_chunks;
    if (skipped_chunks) *skipped_chunks = res.skipped_chunks;
    return s;
}

LMC_API lmc_status lmc_store_bytes(lmc_client *c, const char *model_name, int64_t world_size,
                                   int64_t worker_id, const lmc_chunks *ch,
                                   const void *const *chunks, const size_t *chunk_lens,
                                   size_t num_chunks, uint64_t *stored_chunks,
                                   uint64_t *skipped_chunks, lmc_error *err) {
    lmc_store_result res;
    lmc_status s = lmc_store_bytes_ex(c, model_name, world_size, worker_id, ch, chunks, chunk_lens,
                                      num_chunks, NULL, &res, err);
    if (stored_chunks) *stored_chunks = res.stored_chunks;
    if (skipped_chunks) *skipped_chunks = res.skipped_chunks;
    return s;
}

LMC_API lmc_status lmc_retrieve_bytes(lmc_client *c, const char *model_name, int64_t world_size,
                                      int64_t worker_id, const lmc_chunks *ch,
                                      const char *request_id, lmc_reply **out, lmc_error *err) {
    return lmc_retrieve_bytes_ex(c, model_name, world_size, worker_id, ch, request_id, NULL, out,
                                 err);
}

LMC_API lmc_status lmc_retrieve_bytes_ex(lmc_client *c, const char *model_name, int64_t world_size,
                                         int64_t worker_id, const lmc_chunks *ch,
                                         const char *request_id,
                                         const lmc_retrieve_bytes_options *opts, lmc_reply **out,
                                         lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    *out = NULL;
    lmc_status s = lmcc_finish(c,
                               lmc_send_retrieve_bytes_ex(c, model_name, world_size, worker_id, ch,
                                                          request_id, opts, &id, err),
                               &id, &r, err);
    if (s == LMC_OK && !r->has_frames) {
        const msgpack_object *o = lmcc_map_get(r->map, "chunks");
        bool good = o && o->type == MSGPACK_OBJECT_ARRAY;
        for (uint32_t i = 0; good && i < o->via.array.size; i++)
            good = o->via.array.ptr[i].type == MSGPACK_OBJECT_BIN;
        if (!good) {
            lmcc_set_error(err, LMC_ERR_PROTOCOL,
                           "retrieve_bytes reply lacks an array of bin "
                           "'chunks'");
            s = LMC_ERR_PROTOCOL;
        }
    }
    if (s == LMC_OK)
        *out = r;
    else
        lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_free_lookup_locks(lmc_client *c, const char *request_id, int64_t start,
                                         int64_t end, int64_t worker_id, uint64_t *released,
                                         lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s =
        lmcc_finish(c, lmc_send_free_lookup_locks(c, request_id, start, end, worker_id, &id, err),
                    &id, &r, err);
    if (s == LMC_OK) s = need_u64(r, "released", released, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_end_session(lmc_client *c, const char *request_id, lmc_error *err) {
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s = lmcc_finish(c, lmc_send_end_session(c, request_id, &id, err), &id, &r, err);
    lmc_reply_free(r);
    return s;
}
