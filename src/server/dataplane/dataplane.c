/* The data socket. One loop thread owns the ROUTER socket (ZMQ sockets are not thread-safe):
 * it receives [identity][request id][operation][payload], hands the request to the worker
 * chosen by the identity (so one client's requests run in order), and sends the replies the
 * workers queue, woken by an eventfd.
 *
 * Small requests (dataplane_handle_small: lookups of a few objects, query_prefetch_status,
 * end_session, ping...) run on the loop thread itself when the client's worker holds no request
 * at all: the two thread hand-offs to and from the worker cost more than the operation. The
 * worker being idle means every earlier request of the client has run and its reply is in the
 * reply queue; the loop sends that queue before the small request's reply, so a client's
 * replies keep the order of its requests.
 *
 * Backpressure: each worker is charged the bytes of the requests it holds (queued or running)
 * and of its replies not yet handed to libzmq. While any worker is at or over
 * --worker-queue-mb the loop stops reading the socket (it still sends replies); libzmq then
 * buffers at most --zmq-rcvhwm requests per client and stops reading their connections, so
 * TCP pushes back on the clients instead of the server's memory growing.
 *
 * libzmq counts that high-water mark in whole messages, so a message whose frames never end
 * would still grow without bound: the connection guard (connguard.c) measures what libzmq holds
 * for each tcp connection and cuts a connection holding more than --zmq-rcvhwm + 1 messages. */
#include "server/dataplane/dataplane.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <malloc.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <unistd.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/metrics.h"
#include "server/kvctx.h"
#include "server/dataplane/connguard.h"
#include "server/dataplane/curve.h"
#include "server/dataplane/replies.h"
#include "server/dataplane/wire.h"
#include "server/engine.h"

#define MAX_RID 64
/* Most objects (chunks x world_size) a lookup run by the loop thread may touch, and most a
 * session may span for the loop thread to release it (end_session, free_lookup_locks). */
#define DP_SMALL_MAX_OBJECTS 128u

struct worker;

struct dp_req {
    zmq_msg_t id, rid, op, payload;
    zmq_msg_t *extra;      /* frames after the payload (store_bytes chunk frames), or NULL */
    struct dp_blob *blobs; /* their data and sizes */
    uint32_t nextra;
    struct worker *w; /* charged with cost; NULL for a request rejected by the loop */
    size_t cost;
    void *sock;   /* the socket it came from (tcp or ipc); the reply goes back there */
    char *answer; /* a reply made by the loop (a rejected request), queued in turn by the worker */
    size_t answer_len;
    struct dp_client *cl; /* its client's unread replies (one reference), or NULL */
    struct dp_req *next;
};

struct dp_out {
    zmq_msg_t id, rid, op;
    void *sock;
    char *body;
    size_t len;
    struct dp_frame *frames; /* sent after body (retrieve_bytes chunk frames), or NULL */
    uint32_t nframes;
    struct worker *w; /* charged with cost until the reply is handed to libzmq */
    size_t cost;
    /* The client's charge for the whole reply, frames included, until libzmq frees the body:
     * the frames follow it on the same connection (off by at most one reply's frames). */
    struct dpc_hold *hold;
    struct dp_out *next;
};

/* A store that waits while the worker serves other clients: its reply waits for its
 * write-through (wait_l2, park.wait), or the store waits for another request writing one of its
 * chunks and runs again later (park.store). The client's later requests wait in the queue
 * behind it, so its replies keep their order. */
struct dp_parked {
    struct worker *w;
    struct dp_req *req;
    struct dp_reply reply; /* filled so far; finished by dataplane_finish_parked */
    struct dp_park park;
    int settled;  /* every chunk written or failed (under the worker's lock) */
    int stopping; /* taken while the worker stops: a parked store waits no more */
    struct dp_parked *next;
};

/* Parked requests one worker keeps at most; a store beyond them waits on the worker, as every
 * store did before. */
#define DP_MAX_PARKED 64u

struct worker {
    struct dataplane *dp;
    pthread_t tid;
    pthread_mutex_t lock;
    pthread_cond_t cond; /* CLOCK_MONOTONIC */
    struct dp_req *head, *tail;
    struct dp_parked *parked; /* under lock */
    unsigned nparked;
    int stop;
    _Atomic size_t charged; /* bytes of held requests and unsent replies (backpressure) */
    /* Requests dispatched to it and not yet answered (queued or running). Raised by the loop,
     * lowered by queue_reply under out_lock as the reply enters the reply queue: 0 seen by the
     * loop means every reply of the worker's clients is queued or sent, and a reply the loop
     * has sent was counted down before the loop could read it. */
    _Atomic uint32_t held;
};

struct dataplane {
    struct engine *e;
    void *zctx, *sock;
    void *isock;                /* the --ipc-path socket, or NULL */
    struct dp_zap *zap;         /* the CURVE allow-list handler, or NULL */
    struct connguard *guard;    /* bounds what libzmq holds per tcp connection */
    struct dp_clients *clients; /* unread replies per client */
    size_t max_unread;          /* --max-unread-reply-mb in bytes; 0: no limit */
    int efd;
    size_t max_msg;
    size_t budget; /* --worker-queue-mb in bytes */
    pthread_t loop;
    _Atomic int stop;
    _Atomic int draining; /* no new requests are read once set */
    int nworkers;
    struct worker *workers;
    pthread_mutex_t out_lock;
    struct dp_out *out_head, *out_tail;
    struct logger *lg;
};

static void malloc_keep_for(size_t n);
static char *error_body(const char *code, const char *why, size_t *len);
static int run_small(struct dataplane *dp, struct dp_req *req);

/* Replaces a frame by an empty one (for an unusable request id). */
static void msg_clear(zmq_msg_t *m) {
    zmq_msg_close(m);
    zmq_msg_init(m);
}

/* libzmq is done with a reply body: freed, and its client's charge (hint, may be NULL) ends. */
static void free_body(void *data, void *hint) {
    free(data);
    dpc_release(hint);
}

static size_t frames_size(zmq_msg_t *id, zmq_msg_t *rid, zmq_msg_t *op) {
    return zmq_msg_size(id) + zmq_msg_size(rid) + zmq_msg_size(op);
}

/* Closes a request's payload and the frames after it (the routing frames stay). */
static void close_payload(struct dp_req *req) {
    zmq_msg_close(&req->payload);
    for (uint32_t i = 0; i < req->nextra; i++) zmq_msg_close(&req->extra[i]);
    free(req->extra);
    free(req->blobs);
    req->extra = NULL;
    req->blobs = NULL;
    req->nextra = 0;
}

/* Bytes of the payload and of the frames after it. */
static size_t payload_size(struct dp_req *req) {
    size_t n = zmq_msg_size(&req->payload);
    for (uint32_t i = 0; i < req->nextra; i++) n += zmq_msg_size(&req->extra[i]);
    return n;
}

/* Queues a reply for the loop thread. Takes ownership of the frames in req (closing payload),
 * of body and of the chunk frames fr[0..nfr) (NULL: none). The worker's charge for the request
 * becomes a charge for the reply: chunk frames count with their whole size, pinned L1 memory
 * included, until libzmq has them (from then on the pin cap bounds them). */
static void queue_reply(struct dataplane *dp, struct dp_req *req, char *body, size_t len,
                        struct dp_frame *fr, uint32_t nfr) {
    struct dp_out *o = calloc(1, sizeof(*o));
    struct worker *w = req->w;
    if (!o && w) atomic_fetch_sub_explicit(&w->held, 1, memory_order_release);
    if (!o) dpc_put(dp->clients, req->cl);
    if (w && o) {
        o->w = w;
        o->cost = sizeof(*o) + len + frames_size(&req->id, &req->rid, &req->op);
        for (uint32_t i = 0; i < nfr; i++) o->cost += sizeof(fr[i]) + fr[i].len;
        atomic_fetch_add(&w->charged, o->cost);
    }
    if (w) atomic_fetch_sub(&w->charged, req->cost);
    if (!o) { /* the client times out; nothing else can be done without memory */
        free(body);
        dp_frames_release(fr, nfr);
        zmq_msg_close(&req->id);
        zmq_msg_close(&req->rid);
        zmq_msg_close(&req->op);
        close_payload(req);
        free(req);
        return;
    }
    zmq_msg_init(&o->id);
    zmq_msg_init(&o->rid);
    zmq_msg_init(&o->op);
    zmq_msg_move(&o->id, &req->id);
    zmq_msg_move(&o->rid, &req->rid);
    zmq_msg_move(&o->op, &req->op);
    o->sock = req->sock;
    if (req->cl) { /* the request's reference goes to the hold */
        size_t unread = len;
        for (uint32_t i = 0; i < nfr; i++) unread += fr[i].len;
        o->hold = dpc_hold_new(dp->clients, req->cl, unread);
    }
    zmq_msg_close(&req->id);
    zmq_msg_close(&req->rid);
    zmq_msg_close(&req->op);
    close_payload(req);
    free(req);
    o->body = body;
    o->len = len;
    o->frames = fr;
    o->nframes = nfr;
    malloc_keep_for(len);
    pthread_mutex_lock(&dp->out_lock);
    if (dp->out_tail)
        dp->out_tail->next = o;
    else
        dp->out_head = o;
    dp->out_tail = o;
    /* The worker holds one request less in the same step as its reply is queued: once the loop
     * has sent that reply (it takes the queue under this lock), the worker's count is down, so
     * the client's next small request finds it idle and runs on the loop. */
    if (w) atomic_fetch_sub_explicit(&w->held, 1, memory_order_release);
    pthread_mutex_unlock(&dp->out_lock);
    uint64_t one = 1;
    ssize_t wr = write(dp->efd, &one, sizeof(one));
    (void)wr;
}

/* One decimal field of at most 10 digits in [s, e), below 2^32. */
static int dec_field(const char *s, const char *e, uint64_t *out) {
    if (e <= s || e - s > 10) return -1;
    uint64_t v = 0;
    for (; s < e; s++) {
        if (*s < '0' || *s > '9') return -1;
        v = v * 10 + (uint64_t)(*s - '0');
    }
    if (v > UINT32_MAX) return -1;
    *out = v;
    return 0;
}

int dataplane_parse_peercred(const char *addr, uint32_t *uid, uint32_t *gid, int32_t *pid) {
    size_t n = strlen(addr), colon[3];
    int found = 0;
    for (size_t i = n; i > 0 && found < 3; i--)
        if (addr[i - 1] == ':') colon[found++] = i - 1;
    if (found < 3) return -1; /* colon[0] is the last one */
    uint64_t u, g, p;
    if (dec_field(addr + colon[2] + 1, addr + colon[1], &u) < 0 ||
        dec_field(addr + colon[1] + 1, addr + colon[0], &g) < 0 ||
        dec_field(addr + colon[0] + 1, addr + n, &p) < 0 || p > INT32_MAX)
        return -1;
    *uid = (uint32_t)u;
    *gid = (uint32_t)g;
    *pid = (int32_t)p;
    return 0;
}

/* The peer of a request, from the properties libzmq attaches to its frames. */
static void peer_of(struct dataplane *dp, struct dp_req *req, struct dp_peer *p) {
    memset(p, 0, sizeof(*p));
    int ipc = req->sock == dp->isock;
    const char *addr = zmq_msg_gets(&req->rid, "Peer-Address");
    const char *user = zmq_msg_gets(&req->rid, "User-Id");
    if (ipc && addr && dataplane_parse_peercred(addr, &p->uid, &p->gid, &p->pid) == 0)
        p->has_cred = 1;
    EVP_MD_CTX *h = EVP_MD_CTX_new();
    uint32_t n = (uint32_t)zmq_msg_size(&req->id);
    unsigned char kind = ipc ? 'u' : 't';
    int ok = h && EVP_DigestInit_ex(h, EVP_sha256(), NULL) && EVP_DigestUpdate(h, &kind, 1) &&
             EVP_DigestUpdate(h, &n, sizeof(n)) && EVP_DigestUpdate(h, zmq_msg_data(&req->id), n);
    n = addr ? (uint32_t)strlen(addr) : 0;
    ok = ok && EVP_DigestUpdate(h, &n, sizeof(n)) && (!n || EVP_DigestUpdate(h, addr, n));
    n = user ? (uint32_t)strlen(user) : 0;
    ok = ok && EVP_DigestUpdate(h, &n, sizeof(n)) && (!n || EVP_DigestUpdate(h, user, n));
    unsigned int len = 0;
    if (!ok || !EVP_DigestFinal_ex(h, p->key, &len) || len != sizeof(p->key)) {
        /* Without a key the peer cannot be told apart: a random one isolates its sessions. */
        (void)RAND_bytes(p->key, sizeof(p->key));
    }
    EVP_MD_CTX_free(h);
}

/* A reply body (msgpack's buffer, handed over) and its frames, queued. */
static void reply_done(struct dataplane *dp, struct dp_req *req, struct dp_reply *r) {
    size_t len = r->buf.size;
    char *body = msgpack_sbuffer_release(&r->buf);
    struct dp_frame *fr = r->frames;
    uint32_t nfr = r->nframes;
    r->frames = NULL;
    r->nframes = 0;
    dp_reply_free(r);
    queue_reply(dp, req, body, len, fr, nfr);
}

/* The write-through of a parked request settled (engine's notify, on the L2 controller). */
static void parked_settled(void *arg) {
    struct dp_parked *p = arg;
    pthread_mutex_lock(&p->w->lock);
    p->settled = 1;
    pthread_cond_signal(&p->w->cond);
    pthread_mutex_unlock(&p->w->lock);
}

static int may_park(struct worker *w, struct dp_req *req) {
    size_t n = zmq_msg_size(&req->op);
    const char *op = zmq_msg_data(&req->op);
    if (!((n == 5 && !memcmp(op, "store", 5)) || (n == 11 && !memcmp(op, "store_bytes", 11))))
        return 0;
    pthread_mutex_lock(&w->lock);
    int room = w->nparked < DP_MAX_PARKED && !w->stop;
    pthread_mutex_unlock(&w->lock);
    return room;
}

static void park(struct worker *w, struct dp_parked *pk) {
    pthread_mutex_lock(&w->lock);
    pk->next = w->parked;
    w->parked = pk;
    w->nparked++;
    pthread_mutex_unlock(&w->lock);
}

/* Runs a parkable request (again, for a store parked by the engine) and queues its reply, or
 * parks it. */
static void run_parkable(struct dataplane *dp, struct dp_parked *pk) {
    struct dp_req *req = pk->req;
    struct dp_peer peer;
    peer_of(dp, req, &peer);
    if (dataplane_handle_parkable(dp->e, &peer, zmq_msg_data(&req->op), zmq_msg_size(&req->op),
                                  zmq_msg_data(&req->payload), zmq_msg_size(&req->payload),
                                  req->blobs, req->nextra, &pk->park, &pk->reply) == DP_DONE) {
        reply_done(dp, req, &pk->reply);
        free(pk);
        return;
    }
    park(pk->w, pk); /* the request stays whole (and charged): a parked store runs it again */
}

/* The client of req has more replies unread than --max-unread-reply-mb allows. */
static int unread_over(const struct dataplane *dp, const struct dp_req *req) {
    return dp->max_unread && dpc_unsent(req->cl) > dp->max_unread;
}

/* Runs a request and queues its reply, or parks it (a store waiting). A client over its unread
 * replies' bound gets too_large instead, built without running anything. */
static void run(struct dataplane *dp, struct worker *w, struct dp_req *req) {
    if (req->answer) {
        queue_reply(dp, req, req->answer, req->answer_len, NULL, 0);
        return;
    }
    if (unread_over(dp, req)) {
        char why[200];
        snprintf(why, sizeof(why),
                 "this client has %zu MiB of replies it has not read, over "
                 "--max-unread-reply-mb (%zu): read replies before sending more requests",
                 dpc_unsent(req->cl) >> 20, dp->max_unread >> 20);
        size_t len;
        char *body = error_body(DP_TOO_LARGE, why, &len);
        if (dp->e->dpm.unread_refusals) metric_inc(dp->e->dpm.unread_refusals, 1);
        close_payload(req);
        zmq_msg_init(&req->payload);
        queue_reply(dp, req, body, body ? len : 0, NULL, 0);
        return;
    }
    struct dp_parked *pk = w && may_park(w, req) ? calloc(1, sizeof(*pk)) : NULL;
    if (pk) {
        pk->w = w;
        pk->req = req;
        pk->park.notify = parked_settled;
        pk->park.notify_arg = pk;
        dp_reply_init(&pk->reply);
        run_parkable(dp, pk);
        return;
    }
    struct dp_peer peer;
    struct dp_reply r;
    peer_of(dp, req, &peer);
    dp_reply_init(&r);
    dataplane_handle_peer(dp->e, &peer, zmq_msg_data(&req->op), zmq_msg_size(&req->op),
                          zmq_msg_data(&req->payload), zmq_msg_size(&req->payload), req->blobs,
                          req->nextra, &r);
    reply_done(dp, req, &r);
}

/* A parked request whose turn came: its reply finished (write-through), or its store run again
 * with a fresh reply (a stopping server waits for no other writer). */
static void finish_parked(struct dataplane *dp, struct dp_parked *pk) {
    if (pk->park.store) {
        if (pk->stopping) engine_store_stop_waiting(pk->park.store);
        dp_reply_free(&pk->reply);
        dp_reply_init(&pk->reply);
        run_parkable(dp, pk);
        return;
    }
    dataplane_finish_parked(dp->e, &pk->park, &pk->reply);
    reply_done(dp, pk->req, &pk->reply);
    free(pk);
}

static int same_client(const struct dp_req *a, const struct dp_req *b) {
    return a->sock == b->sock && zmq_msg_size(&a->id) == zmq_msg_size(&b->id) &&
           !memcmp(zmq_msg_data((zmq_msg_t *)&a->id), zmq_msg_data((zmq_msg_t *)&b->id),
                   zmq_msg_size(&a->id));
}

/* Under w->lock: the first queued request whose client has no parked request. */
static struct dp_req *take_runnable(struct worker *w) {
    struct dp_req *prev = NULL;
    for (struct dp_req *r = w->head; r; prev = r, r = r->next) {
        int blocked = 0;
        for (struct dp_parked *p = w->parked; p && !blocked; p = p->next)
            blocked = same_client(p->req, r);
        if (blocked) continue;
        if (prev)
            prev->next = r->next;
        else
            w->head = r->next;
        if (w->tail == r) w->tail = prev;
        r->next = NULL;
        return r;
    }
    return NULL;
}

/* Under w->lock: a parked request whose write-through settled or whose wait ran out, or a
 * parked store due to run again (any, once stopping); else NULL with *next the earliest
 * deadline. */
static struct dp_parked *take_settled(struct worker *w, uint64_t now, uint64_t *next) {
    *next = UINT64_MAX;
    for (struct dp_parked **pp = &w->parked; *pp; pp = &(*pp)->next) {
        struct dp_parked *p = *pp;
        uint64_t dl = p->park.store ? engine_store_retry_at(p->park.store)
                                    : engine_l2_wait_deadline(p->park.wait);
        if (p->settled || w->stop || now >= dl) {
            p->stopping = w->stop;
            *pp = p->next;
            w->nparked--;
            return p;
        }
        if (dl < *next) *next = dl;
    }
    return NULL;
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    char name[16];
    snprintf(name, sizeof(name), "dp-worker-%d", (int)(w - w->dp->workers));
    pthread_setname_np(pthread_self(), name);
    for (;;) {
        struct dp_parked *pk = NULL;
        struct dp_req *req = NULL;
        pthread_mutex_lock(&w->lock);
        for (;;) {
            uint64_t next;
            if ((pk = take_settled(w, clock_mono_ns(), &next)) || (req = take_runnable(w))) break;
            if (w->stop && !w->head && !w->parked) break;
            if (next == UINT64_MAX) {
                pthread_cond_wait(&w->cond, &w->lock);
            } else {
                struct timespec ts = {(time_t)(next / 1000000000u), (long)(next % 1000000000u)};
                pthread_cond_timedwait(&w->cond, &w->lock, &ts);
            }
        }
        pthread_mutex_unlock(&w->lock);
        if (pk)
            finish_parked(w->dp, pk);
        else if (req)
            run(w->dp, w, req); /* queue_reply lowers w->held */
        else
            break;
    }
    return NULL;
}

static struct worker *worker_of(struct dataplane *dp, struct dp_req *req) {
    return &dp->workers[fnv1a32(zmq_msg_data(&req->id), zmq_msg_size(&req->id)) % dp->nworkers];
}

static void dispatch(struct dataplane *dp, struct dp_req *req) {
    struct worker *w = worker_of(dp, req);
    atomic_fetch_add_explicit(&w->held, 1, memory_order_relaxed);
    req->next = NULL;
    req->w = w;
    req->cost = sizeof(*req) + payload_size(req) + frames_size(&req->id, &req->rid, &req->op);
    atomic_fetch_add(&w->charged, req->cost);
    pthread_mutex_lock(&w->lock);
    if (w->tail)
        w->tail->next = req;
    else
        w->head = req;
    w->tail = req;
    pthread_cond_signal(&w->cond);
    pthread_mutex_unlock(&w->lock);
}

/* True while some worker holds its whole budget: the loop then reads no request. */
static int over_budget(struct dataplane *dp) {
    for (int i = 0; i < dp->nworkers; i++)
        if (atomic_load(&dp->workers[i].charged) >= dp->budget) return 1;
    return 0;
}

/* Replies to a malformed or oversized request from the loop thread (its payload is freed here,
 * never queued). While the client's worker holds requests the reply goes through that worker's
 * queue, behind the client's earlier requests, so the client's replies stay in order. */
static char *error_body(const char *code, const char *why, size_t *len) {
    struct dp_reply r;
    struct dp_err err;
    dp_reply_init(&r);
    dp_fail(&err, code, "%s", why);
    size_t n;
    dp_finish(&r, 0, &err, &n);
    *len = r.buf.size;
    char *body = msgpack_sbuffer_release(&r.buf);
    dp_reply_free(&r);
    return body;
}

static void reject(struct dataplane *dp, struct dp_req *req, const char *code, const char *why) {
    size_t len;
    char *body = error_body(code, why, &len);
    if (body && atomic_load_explicit(&worker_of(dp, req)->held, memory_order_acquire) != 0) {
        close_payload(req);
        zmq_msg_init(&req->payload);
        req->answer = body;
        req->answer_len = len;
        dispatch(dp, req);
        return;
    }
    queue_reply(dp, req, body, len, NULL, 0);
}

/* A frame was delivered: the connection guard counts it as no longer held by libzmq. */
static void credit(struct dataplane *dp, void *sock, zmq_msg_t *m) {
    if (sock == dp->sock) connguard_credit(dp->guard, m);
}

/* Receives one whole multipart message. */
static void receive_one(struct dataplane *dp, void *sock) {
    struct dp_req *req = calloc(1, sizeof(*req));
    if (!req) { /* out of memory: drop the message rather than spin on it; the client times out */
        int more = 1;
        for (int i = 0; more && i < 64; i++) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
                more = 0;
            } else {
                more = zmq_msg_more(&m);
                credit(dp, sock, &m);
            }
            zmq_msg_close(&m);
        }
        return;
    }
    req->sock = sock;
    zmq_msg_t *slots[4] = {&req->id, &req->rid, &req->op, &req->payload};
    for (int i = 0; i < 4; i++) zmq_msg_init(slots[i]);
    /* Frames after the payload (store_bytes chunk frames) are kept up to --max-request-objects
     * of them (no range holds more chunks); a request with more is answered too_large. */
    uint32_t cap = 0, max_extra = (uint32_t)dp->e->cfg->max_request_objects;
    int nframes = 0, more = 1, overflow = 0;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, nframes ? 0 : ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            if (nframes == 0) {
                for (int i = 0; i < 4; i++) zmq_msg_close(slots[i]);
                free(req);
                return;
            }
            break;
        }
        more = zmq_msg_more(&m);
        credit(dp, sock, &m);
        if (nframes < 4) {
            zmq_msg_move(slots[nframes], &m);
        } else if (!overflow && req->nextra < max_extra) {
            if (req->nextra == cap) {
                uint32_t ncap = cap ? (cap > max_extra / 2 ? max_extra : cap * 2) : 8;
                zmq_msg_t *x = realloc(req->extra, (size_t)ncap * sizeof(*x));
                if (x) req->extra = x;
                if (x) cap = ncap;
            }
            if (req->nextra < cap) {
                zmq_msg_init(&req->extra[req->nextra]);
                zmq_msg_move(&req->extra[req->nextra++], &m);
            } else {
                overflow = 1; /* out of memory */
            }
        } else {
            overflow = 1;
        }
        zmq_msg_close(&m);
        nframes++;
    }
    if (nframes >= 2) {
        int fd = sock == dp->sock ? zmq_msg_get(&req->rid, ZMQ_SRCFD) : -1;
        req->cl = dpc_get(dp->clients, sock, zmq_msg_data(&req->id), zmq_msg_size(&req->id), fd);
    }
    if (nframes < 4) {
        char why[96];
        snprintf(why, sizeof(why),
                 "a request has 3 frames (request id, operation, payload), got %d", nframes - 1);
        if (zmq_msg_size(&req->rid) > MAX_RID) msg_clear(&req->rid);
        reject(dp, req, DP_BAD_REQUEST, why);
        return;
    }
    if (zmq_msg_size(&req->rid) == 0 || zmq_msg_size(&req->rid) > MAX_RID) {
        msg_clear(&req->rid);
        reject(dp, req, DP_BAD_REQUEST, "the request id must be 1 to 64 bytes");
        return;
    }
    if (overflow) {
        char why[128];
        snprintf(why, sizeof(why),
                 "%d frames after the payload: more than --max-request-objects (%u)", nframes - 4,
                 max_extra);
        reject(dp, req, DP_TOO_LARGE, why);
        return;
    }
    if (payload_size(req) > dp->max_msg) {
        char why[96];
        snprintf(why, sizeof(why), "payload of %zu bytes exceeds --max-message-mb",
                 payload_size(req));
        reject(dp, req, DP_TOO_LARGE, why);
        return;
    }
    if (req->nextra) {
        req->blobs = malloc((size_t)req->nextra * sizeof(*req->blobs));
        if (!req->blobs) {
            reject(dp, req, DP_OUT_OF_MEMORY, "out of memory for the request's frames");
            return;
        }
        for (uint32_t i = 0; i < req->nextra; i++)
            req->blobs[i] =
                (struct dp_blob){zmq_msg_data(&req->extra[i]), zmq_msg_size(&req->extra[i])};
    }
    malloc_keep_for(payload_size(req));
    if (run_small(dp, req)) return;
    dispatch(dp, req);
}

/* Sends [id][rid][op][body] and the chunk frames after it (NULL: none), then closes the frames;
 * body (malloc'd) and each chunk frame are handed to libzmq, the frames array is freed. */
static void send_reply(void *sock, zmq_msg_t *id, zmq_msg_t *rid, zmq_msg_t *op, char *data,
                       size_t len, struct dp_frame *frames, uint32_t nframes,
                       struct dpc_hold *hold) {
    zmq_msg_t body;
    int have = zmq_msg_init_data(&body, data, len, free_body, hold) == 0;
    if (!have) {
        free_body(data, hold); /* out of memory: the client times out */
        zmq_msg_init(&body);
    }
    /* Chunk frames: each message owns its frame from here (closing it releases it). */
    zmq_msg_t *cf = NULL;
    uint32_t ncf = 0;
    if (nframes) {
        cf = calloc(nframes, sizeof(*cf));
        for (; cf && ncf < nframes; ncf++) {
            struct dp_frame *f = &frames[ncf];
            if (zmq_msg_init_data(&cf[ncf], f->data, f->len, f->release, f->hint) != 0) break;
        }
        if (ncf < nframes) { /* out of memory: drop the reply, the client times out */
            have = 0;
            for (uint32_t i = ncf; i < nframes; i++)
                frames[i].release(frames[i].data, frames[i].hint);
        }
    }
    free(frames);
    /* A vanished peer makes the send fail; the reply is then dropped. */
    if (have && zmq_msg_send(id, sock, ZMQ_SNDMORE) >= 0 &&
        zmq_msg_send(rid, sock, ZMQ_SNDMORE) >= 0 && zmq_msg_send(op, sock, ZMQ_SNDMORE) >= 0 &&
        zmq_msg_send(&body, sock, ncf ? ZMQ_SNDMORE : 0) >= 0)
        for (uint32_t i = 0; i < ncf; i++)
            if (zmq_msg_send(&cf[i], sock, i + 1 < ncf ? ZMQ_SNDMORE : 0) < 0) break;
    for (uint32_t i = 0; i < ncf; i++) zmq_msg_close(&cf[i]);
    free(cf);
    zmq_msg_close(&body);
    zmq_msg_close(id);
    zmq_msg_close(rid);
    zmq_msg_close(op);
}

static void send_replies(struct dataplane *dp) {
    uint64_t v;
    ssize_t r = read(dp->efd, &v, sizeof(v));
    (void)r;
    pthread_mutex_lock(&dp->out_lock);
    struct dp_out *o = dp->out_head;
    dp->out_head = dp->out_tail = NULL;
    pthread_mutex_unlock(&dp->out_lock);
    while (o) {
        struct dp_out *next = o->next;
        send_reply(o->sock, &o->id, &o->rid, &o->op, o->body, o->len, o->frames, o->nframes,
                   o->hold);
        if (o->w) atomic_fetch_sub(&o->w->charged, o->cost);
        free(o);
        o = next;
    }
}

/* Runs a small request on the loop thread when the client's worker holds nothing (see the top
 * of the file). 1 when it was answered, 0 when it must go to the worker. */
static int run_small(struct dataplane *dp, struct dp_req *req) {
    struct worker *w = worker_of(dp, req);
    if (req->nextra || zmq_msg_size(&req->payload) > DP_SMALL_MAX_BYTES || unread_over(dp, req) ||
        !dataplane_op_small(zmq_msg_data(&req->op), zmq_msg_size(&req->op)) ||
        atomic_load_explicit(&w->held, memory_order_acquire) != 0)
        return 0;
    struct dp_reply r;
    struct dp_peer peer;
    dp_reply_init(&r);
    peer_of(dp, req, &peer);
    if (!dataplane_handle_small(dp->e, &peer, zmq_msg_data(&req->op), zmq_msg_size(&req->op),
                                zmq_msg_data(&req->payload), zmq_msg_size(&req->payload),
                                DP_SMALL_MAX_OBJECTS, &r)) {
        dp_reply_free(&r);
        return 0;
    }
    size_t len = r.buf.size;
    char *body = msgpack_sbuffer_release(&r.buf);
    dp_reply_free(&r);
    if (dp->e->dpm.loop_requests) metric_inc(dp->e->dpm.loop_requests, 1);
    send_replies(dp); /* the client's earlier replies first */
    close_payload(req);
    struct dpc_hold *hold = req->cl ? dpc_hold_new(dp->clients, req->cl, len) : NULL;
    send_reply(req->sock, &req->id, &req->rid, &req->op, body, len, NULL, 0, hold);
    free(req);
    return 1;
}

static void *loop_main(void *arg) {
    struct dataplane *dp = arg;
    pthread_setname_np(pthread_self(), "dp-loop");
    /* The eventfd and the connection guard's monitor first: while over budget only they are
     * polled, and no socket is read (the guard keeps checking: a connection may grow while
     * nothing is read). */
    zmq_pollitem_t items[4] = {{NULL, dp->efd, ZMQ_POLLIN, 0},
                               {connguard_socket(dp->guard), 0, ZMQ_POLLIN, 0},
                               {dp->sock, 0, ZMQ_POLLIN, 0},
                               {dp->isock, 0, ZMQ_POLLIN, 0}};
    int nsocks = dp->isock ? 2 : 1;
    int paused = 0;
    while (!atomic_load(&dp->stop)) {
        int over = over_budget(dp);
        if (over && !paused && dp->e->dpm.read_pauses) metric_inc(dp->e->dpm.read_pauses, 1);
        paused = over;
        int reading = !atomic_load(&dp->draining) && !over;
        /* Checked on every pass, so also while requests keep the poll from timing out. */
        long wait_ms = connguard_tick(dp->guard, clock_mono_ns(), 100);
        items[2].revents = items[3].revents = 0;
        int n = zmq_poll(items, reading ? 2 + nsocks : 2, wait_ms);
        if (n < 0) {
            if (errno == EINTR) continue;
            log_error(dp->lg, "zmq_poll: %s", zmq_strerror(errno));
            break;
        }
        if (items[0].revents & ZMQ_POLLIN) send_replies(dp);
        /* before the sockets, so a connection is known before its first frame is credited */
        if (items[1].revents & ZMQ_POLLIN) connguard_events(dp->guard, clock_mono_ns());
        for (int k = 2; reading && k < 2 + nsocks; k++) {
            if (!(items[k].revents & ZMQ_POLLIN)) continue;
            for (int i = 0; i < 64 && !over_budget(dp); i++) {
                int ev = 0;
                size_t len = sizeof(ev);
                if (zmq_getsockopt(items[k].socket, ZMQ_EVENTS, &ev, &len) < 0 ||
                    !(ev & ZMQ_POLLIN))
                    break;
                receive_one(dp, items[k].socket);
            }
        }
    }
    send_replies(dp);
    return NULL;
}

/* Bytes of freed memory malloc keeps at the top of its heap (M_TRIM_THRESHOLD); 0 while the
 * malloc set-up is off (another libc, or dataplane_tune_malloc not called). Only grows. */
static _Atomic size_t malloc_keep;

void dataplane_tune_malloc(const struct server_config *cfg) {
#ifdef __GLIBC__
    /* Every large message is one malloc: libzmq's receive buffer of a request, the reply the
     * worker builds. glibc serves allocations over 32 MiB (and those of a thread arena over
     * 64 MiB) with a fresh mmap and unmaps them on free, so every byte of every large message
     * was a page fault plus zeroing by the kernel, which took most of the bytes path's time on
     * virtual machines (docs/benchmarks.md). One arena that grows with brk and keeps freed
     * memory at its top (--worker-queue-mb, raised to three times the largest message seen) lets
     * the next message reuse the pages. */
    long mb = cfg->worker_queue_mb > 0 ? cfg->worker_queue_mb : 1;
    size_t keep = mb >= (long)(INT_MAX >> 20) ? (size_t)INT_MAX : (size_t)mb << 20;
    (void)mallopt(M_ARENA_MAX, 1);
    (void)mallopt(M_MMAP_MAX, 0);
    if (mallopt(M_TRIM_THRESHOLD, (int)keep) == 1) atomic_store(&malloc_keep, keep);
#else
    (void)cfg;
#endif
}

/* A message of n bytes was received or built: keep room for it and the one before it (libzmq
 * allocates a request's buffer before the previous request's is freed; a reply is built while
 * the previous one may still be in flight) when the heap shrinks, so the next one of that size
 * faults in no fresh pages. glibc trims the whole free top once it is over the threshold, and
 * with both messages free the top is two of them plus the small allocations between: hence
 * three, not two (two let the top go after every burst, and the first messages of the next
 * one faulted in 256 MiB afresh; docs/benchmarks.md). */
static pthread_mutex_t malloc_keep_mu = PTHREAD_MUTEX_INITIALIZER;

static void malloc_keep_for(size_t n) {
#ifdef __GLIBC__
    size_t want = n > (size_t)INT_MAX / 3 ? (size_t)INT_MAX : 3 * n;
    size_t cur = atomic_load_explicit(&malloc_keep, memory_order_relaxed);
    if (!cur || want <= cur) return; /* the common case: no lock */
    pthread_mutex_lock(&malloc_keep_mu);
    if (want > atomic_load(&malloc_keep) && mallopt(M_TRIM_THRESHOLD, (int)want) == 1)
        atomic_store(&malloc_keep, want);
    pthread_mutex_unlock(&malloc_keep_mu);
#else
    (void)n;
#endif
}

static size_t unread_replies(void *clients, int *fd, size_t *total) {
    return dpc_largest(clients, fd, total);
}

struct dataplane *dataplane_start(struct engine *e, const char *host, int port, int workers,
                                  size_t max_message_bytes, char *err, size_t errlen) {
    struct dataplane *dp = calloc(1, sizeof(*dp));
    if (!dp) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    dp->e = e;
    dp->lg = log_get("lmcache.zmq");
    if (kv_guard_init() < 0) {
        errbuf_set(err, errlen, "cannot install the SIGBUS handler");
        free(dp);
        return NULL;
    }
    dp->max_msg = max_message_bytes;
    dp->budget = (size_t)e->cfg->worker_queue_mb << 20;
    dp->max_unread = (size_t)e->cfg->max_unread_reply_mb << 20;
    if (!(dp->clients = dpc_new())) {
        errbuf_set(err, errlen, "out of memory");
        free(dp);
        return NULL;
    }
    dp->nworkers = workers > 0 ? workers : 1;
    pthread_mutex_init(&dp->out_lock, NULL);
    dp->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    dp->zctx = zmq_ctx_new();
    if (dp->efd < 0 || !dp->zctx) {
        errbuf_set(err, errlen, "cannot create the ZMQ context");
        goto fail;
    }
    const struct server_config *cfg = e->cfg;
    if (dataplane_check_shm_options(cfg, err, errlen) < 0) goto fail;
    dp->sock = zmq_socket(dp->zctx, ZMQ_ROUTER);
    int64_t cap = (int64_t)max_message_bytes * 4;
    int linger = 0, rcvhwm = (int)e->cfg->zmq_rcvhwm;
    zmq_setsockopt(dp->sock, ZMQ_MAXMSGSIZE, &cap, sizeof(cap));
    zmq_setsockopt(dp->sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_setsockopt(dp->sock, ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
    if (cfg->curve_secret_key_file && *cfg->curve_secret_key_file) {
        /* CURVE: the handshake proves the server's key, encrypts, and the ZAP handler admits
         * only the client keys of the allow-list. */
        char sec[CURVE_Z85_LEN + 1], pub[CURVE_Z85_LEN + 1];
        int one = 1;
        if (!cfg->curve_allowed_clients || !*cfg->curve_allowed_clients) {
            errbuf_set(err, errlen, "--curve-secret-key-file needs --curve-allowed-clients");
            goto fail;
        }
        if (rcvhwm < 2) { /* libzmq then delivers no message of a CURVE connection at all */
            errbuf_set(err, errlen, "--zmq-rcvhwm must be at least 2 with CURVE");
            goto fail;
        }
        if (curve_read_key(cfg->curve_secret_key_file, sec, err, errlen) < 0) goto fail;
        if (zmq_curve_public(pub, sec) != 0) {
            errbuf_set(err, errlen, "--curve-secret-key-file: %s", zmq_strerror(errno));
            goto fail;
        }
        dp->zap = dp_zap_start(dp->zctx, cfg->curve_allowed_clients, err, errlen);
        if (!dp->zap) goto fail;
        if (zmq_setsockopt(dp->sock, ZMQ_CURVE_SERVER, &one, sizeof(one)) < 0 ||
            zmq_setsockopt(dp->sock, ZMQ_CURVE_SECRETKEY, sec, CURVE_Z85_LEN) < 0 ||
            zmq_setsockopt(dp->sock, ZMQ_ZAP_DOMAIN, "lmcache", 7) < 0) {
            errbuf_set(err, errlen, "CURVE: %s", zmq_strerror(errno));
            goto fail;
        }
        OPENSSL_cleanse(sec, sizeof(sec)); /* libzmq keeps its own copy */
        log_info(dp->lg, "CURVE on the tcp data socket; server public key %s", pub);
    }
    /* Before the bind: the guard must see every accepted connection. */
    dp->guard =
        connguard_start(dp->zctx, dp->sock, connguard_limit((uint64_t)rcvhwm, max_message_bytes),
                        dp->lg, e->dpm.conns_cut, err, errlen);
    if (!dp->guard) goto fail;
    uint64_t heap_limit = config_max_heap_bytes(cfg);
    connguard_set_heap_limit(dp->guard, heap_limit, e->dpm.heap_cuts);
    connguard_set_replies(dp->guard, unread_replies, dp->clients);
    if (heap_limit)
        log_info(dp->lg,
                 "data connections are cut while malloc holds over %llu MiB (--max-heap-mb)",
                 (unsigned long long)(heap_limit >> 20));
    if (cfg->ipc_path && *cfg->ipc_path) {
        char iep[300];
        if (snprintf(iep, sizeof(iep), "ipc://%s", cfg->ipc_path) >= (int)sizeof(iep)) {
            errbuf_set(err, errlen, "--ipc-path is too long");
            goto fail;
        }
        dp->isock = zmq_socket(dp->zctx, ZMQ_ROUTER);
        if (!dp->isock) {
            errbuf_set(err, errlen, "cannot create the ipc socket");
            goto fail;
        }
        zmq_setsockopt(dp->isock, ZMQ_MAXMSGSIZE, &cap, sizeof(cap));
        zmq_setsockopt(dp->isock, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_setsockopt(dp->isock, ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
        if (zmq_bind(dp->isock, iep) < 0) {
            errbuf_set(err, errlen, "cannot bind %s: %s", iep, zmq_strerror(errno));
            goto fail;
        }
        log_info(dp->lg, "data socket also on %s", iep);
    }
    /* libzmq binds interfaces and addresses, not host names: resolve (IPv4 first). */
    char addr[INET6_ADDRSTRLEN] = "";
    if (!strcmp(host, "*") || !strcmp(host, "0.0.0.0")) {
        snprintf(addr, sizeof(addr), "%s", host);
    } else {
        struct addrinfo hints = {0}, *res = NULL;
        hints.ai_family = AF_INET;
        hints.ai_socktype = SOCK_STREAM;
        if (getaddrinfo(host, NULL, &hints, &res) != 0) {
            errbuf_set(err, errlen, "--host %s: cannot resolve", host);
            goto fail;
        }
        inet_ntop(AF_INET, &((struct sockaddr_in *)res->ai_addr)->sin_addr, addr, sizeof(addr));
        freeaddrinfo(res);
    }
    char ep[300];
    snprintf(ep, sizeof(ep), "tcp://%s:%d", addr, port);
    if (zmq_bind(dp->sock, ep) < 0) {
        errbuf_set(err, errlen, "cannot bind %s: %s", ep, zmq_strerror(errno));
        goto fail;
    }
    dp->workers = calloc((size_t)dp->nworkers, sizeof(*dp->workers));
    if (!dp->workers) {
        errbuf_set(err, errlen, "out of memory");
        goto fail;
    }
    int started = 0, terr = 0;
    for (; started < dp->nworkers; started++) {
        struct worker *w = &dp->workers[started];
        w->dp = dp;
        pthread_mutex_init(&w->lock, NULL);
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
        pthread_cond_init(&w->cond, &ca);
        pthread_condattr_destroy(&ca);
        if ((terr = pthread_create(&w->tid, NULL, worker_main, w)) != 0) break;
    }
    if (terr == 0) terr = pthread_create(&dp->loop, NULL, loop_main, dp);
    if (terr != 0) {
        errbuf_set(err, errlen, "cannot start data-plane threads: %s", strerror(terr));
        for (int i = 0; i < started; i++) { /* stop the workers that did start */
            struct worker *w = &dp->workers[i];
            pthread_mutex_lock(&w->lock);
            w->stop = 1;
            pthread_cond_signal(&w->cond);
            pthread_mutex_unlock(&w->lock);
            pthread_join(w->tid, NULL);
        }
        free(dp->workers);
        goto fail;
    }
    log_info(dp->lg, "LMCache ZMQ cache server is running on %s (%d workers)", ep, dp->nworkers);
    return dp;
fail:
    connguard_stop(dp->guard);
    if (dp->sock) zmq_close(dp->sock);
    if (dp->isock) zmq_close(dp->isock);
    dp_zap_stop(dp->zap);
    if (dp->zctx) zmq_ctx_term(dp->zctx);
    dpc_free(dp->clients);
    if (dp->efd >= 0) close(dp->efd);
    free(dp);
    return NULL;
}

void dataplane_stop(struct dataplane *dp) {
    if (!dp) return;
    /* Stop reading, let workers finish what they hold, then the loop sends the last replies. */
    atomic_store(&dp->draining, 1);
    for (int i = 0; i < dp->nworkers; i++) {
        struct worker *w = &dp->workers[i];
        pthread_mutex_lock(&w->lock);
        w->stop = 1;
        pthread_cond_signal(&w->cond);
        pthread_mutex_unlock(&w->lock);
    }
    for (int i = 0; i < dp->nworkers; i++) pthread_join(dp->workers[i].tid, NULL);
    atomic_store(&dp->stop, 1);
    pthread_join(dp->loop, NULL);
    /* Replies the loop did not get to. */
    struct dp_out *o = dp->out_head;
    while (o) {
        struct dp_out *n = o->next;
        zmq_msg_close(&o->id);
        zmq_msg_close(&o->rid);
        zmq_msg_close(&o->op);
        free(o->body);
        dp_frames_release(o->frames, o->nframes);
        dpc_release(o->hold);
        free(o);
        o = n;
    }
    for (int i = 0; i < dp->nworkers; i++) {
        pthread_mutex_destroy(&dp->workers[i].lock);
        pthread_cond_destroy(&dp->workers[i].cond);
    }
    free(dp->workers);
    /* Replies already handed to libzmq get up to 2 s to leave (linger 0 would drop them). */
    int linger = 2000;
    connguard_stop(dp->guard);
    zmq_setsockopt(dp->sock, ZMQ_LINGER, &linger, sizeof(linger));
    zmq_close(dp->sock);
    if (dp->isock) {
        zmq_setsockopt(dp->isock, ZMQ_LINGER, &linger, sizeof(linger));
        zmq_close(dp->isock);
    }
    dp_zap_stop(dp->zap);
    zmq_ctx_term(dp->zctx); /* frees the replies left: their charges end */
    dpc_free(dp->clients);
    close(dp->efd);
    pthread_mutex_destroy(&dp->out_lock);
    free(dp);
}
