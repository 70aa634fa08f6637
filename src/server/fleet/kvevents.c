/* The KV-event publisher and its replay ROUTER (see kvevents.h and docs/fleet.md). */
#include "server/fleet/kvevents.h"

#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "server/fleet/ptable.h"

#define QUEUE_MAX   65536 /* events waiting; more are dropped */
#define BATCH_MAX   4096  /* events per EventBatch */
#define INTERVAL_MS 100
#define HASH_LEN    32
#define TRACKED_MAX (8u << 20) /* distinct hashes in the table; more are published untracked */

/* Replay: the ring holds the last REPLAY_BATCHES batches and at most REPLAY_BYTES of payload;
 * replayed messages share the ring's buffers, and at most INFLIGHT_BYTES of them may wait in
 * ZMQ's queues (a peer that does not read holds them until it goes). At most CURSORS replays run
 * at once, each sending at most TURN_MSGS messages per turn of the thread. */
#define REPLAY_BATCHES 10000
#define REPLAY_BYTES   (64u << 20)
#define INFLIGHT_BYTES (64u << 20)
#define CURSORS        16
#define TURN_REQUESTS  64
#define TURN_MSGS      256
#define STALL_S        10.0 /* a replay that cannot send for this long is abandoned */
#define REPLAY_SNDHWM  256  /* messages queued per peer */
#define REQ_MAX_BYTES  64   /* largest frame a peer may send (ZMQ_MAXMSGSIZE) */
#define ID_MAX         256  /* ROUTER identities are at most 255 bytes */

enum { M_CPU, M_FS, M_OBJ, NM };
static const char *const MEDIUM[NM] = {"CPU", "FS", "OBJ"};
enum { K_STORED, K_REMOVED, K_CLEARED };

struct ev {
    uint8_t hash[HASH_LEN];
    uint8_t medium, kind;
};

/* A held hash: how many objects carry it on each medium. */
struct entry {
    struct pt_entry pe;
    uint32_t cnt[NM];
};

struct kvevents;

/* A published batch kept for replay, shared with the ZMQ messages that replay it. */
struct payload {
    _Atomic uint32_t refs;
    size_t len;
    char *data;
    struct kvevents *k;
};

struct slot {
    uint64_t seq;
    struct payload *p;
};

/* One replay in progress: batches [next, end) to send to peer id, then the end marker. */
struct cursor {
    bool used;
    uint8_t id[ID_MAX];
    size_t idlen;
    uint64_t next, end;
    double progress; /* when it last sent something */
};

struct kvevents {
    struct engine *e;
    struct logger *lg;
    void *ctx, *pub, *router; /* each socket is used by its thread only (and at create/free) */
    long chunk_size;
    bool legacy, int_hashes;
    pthread_t tid, rtid;
    bool started, rstarted;
    /* mu (a leaf): the table, the queue, the stop flag */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct ptable tab;
    size_t tracked;
    uint64_t untracked; /* objects held whose hash the table could not take */
    struct ev *ring;
    size_t head, count;
    uint64_t lost; /* events dropped (queue full) since the last take */
    bool stopping;
    uint64_t seq; /* the kv-events thread's */
    /* rmu (a leaf): the replay ring */
    pthread_mutex_t rmu;
    struct slot *slots;
    size_t shead, scount, sbytes;
    _Atomic size_t inflight;
    _Atomic bool rstop;
    struct cursor cur[CURSORS]; /* the kv-replay thread's */
    struct metric *m_batches, *m_events, *m_dropped, *m_rq, *m_rrej, *m_rbatches, *m_rabort,
        *m_rbuf;
};

static uint64_t be64(const uint8_t *b) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | b[i];
    return v;
}

static struct entry *do_find(struct kvevents *k, const uint8_t *hash) {
    struct pt_entry *p = ptable_find(&k->tab, hash);
    return p ? PT_OWNER(p, struct entry, pe) : NULL;
}

static void do_push(struct kvevents *k, const uint8_t *hash, int medium, int kind) {
    if (k->count == QUEUE_MAX) {
        metric_inc(k->m_dropped, 1);
        k->lost++;
        return;
    }
    struct ev *v = &k->ring[(k->head + k->count++) % QUEUE_MAX];
    if (hash) memcpy(v->hash, hash, HASH_LEN);
    v->medium = (uint8_t)medium;
    v->kind = (uint8_t)kind;
    if (k->count == BATCH_MAX) pthread_cond_signal(&k->cv);
}

/* The engine's placement listener: data-path threads, cache locks held. O(1) under mu. */
static void on_placement(void *arg, const uint8_t hash[32], int tier, bool present) {
    struct kvevents *k = arg;
    int m = tier == ENGINE_TIER_DRAM ? M_CPU : tier == ENGINE_TIER_OBJ ? M_OBJ : M_FS;
    pthread_mutex_lock(&k->mu);
    struct entry *en = do_find(k, hash);
    if (!en && present) {
        if (k->tracked >= TRACKED_MAX || !(en = calloc(1, sizeof(*en)))) {
            k->untracked++; /* published as it comes, without the per-medium count */
            do_push(k, hash, m, K_STORED);
            pthread_mutex_unlock(&k->mu);
            return;
        }
        ptable_insert(&k->tab, &en->pe, hash);
        k->tracked++;
    }
    if (!en) { /* a removal of an untracked object (or of nothing we were told of) */
        if (k->untracked) {
            k->untracked--;
            do_push(k, hash, m, K_REMOVED);
        }
    } else if (present) {
        if (en->cnt[m]++ == 0) do_push(k, hash, m, K_STORED);
    } else if (en->cnt[m] && --en->cnt[m] == 0) {
        do_push(k, hash, m, K_REMOVED);
        if (!en->cnt[M_CPU] && !en->cnt[M_FS] && !en->cnt[M_OBJ]) {
            ptable_remove(&k->tab, &en->pe);
            free(en);
            k->tracked--;
        }
    }
    pthread_mutex_unlock(&k->mu);
}

/* After a clear: when the node holds nothing on any medium any more, the changes not yet
 * published net to an empty node, and one AllBlocksCleared replaces them. (With an L2 tier that
 * keeps its copies the clear is told block by block.) */
static void on_cleared(void *arg) {
    struct kvevents *k = arg;
    pthread_mutex_lock(&k->mu);
    if (k->tracked == 0 && k->untracked == 0) {
        k->count = 0;
        k->lost = 0; /* AllBlocksCleared resets every subscriber's view */
        do_push(k, NULL, 0, K_CLEARED);
        pthread_cond_signal(&k->cv);
    }
    pthread_mutex_unlock(&k->mu);
}

static void pack_str(msgpack_packer *p, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(p, n);
    msgpack_pack_str_body(p, s, n);
}

static void pack_hashes(struct kvevents *k, msgpack_packer *p, const struct ev *evs, size_t n) {
    msgpack_pack_array(p, n);
    for (size_t i = 0; i < n; i++) {
        if (k->int_hashes) { /* the digest's low 64 bits, big-endian (vLLM's integer form) */
            msgpack_pack_uint64(p, be64(evs[i].hash + HASH_LEN - 8));
        } else {
            msgpack_pack_bin(p, HASH_LEN);
            msgpack_pack_bin_body(p, evs[i].hash, HASH_LEN);
        }
    }
}

/* One event for a run of evs[0..n) of the same kind and medium. The current form is a map
 * tagged "type"; the legacy form the tagged positional array vLLM used before (BlockStored:
 * tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium). */
static void pack_event(struct kvevents *k, msgpack_packer *p, const struct ev *evs, size_t n) {
    const char *medium = MEDIUM[evs[0].medium];
    switch (evs[0].kind) {
    case K_CLEARED:
        if (k->legacy) {
            msgpack_pack_array(p, 1);
        } else {
            msgpack_pack_map(p, 1);
            pack_str(p, "type");
        }
        pack_str(p, "AllBlocksCleared");
        return;
    case K_STORED:
        if (k->legacy) {
            msgpack_pack_array(p, 7);
            pack_str(p, "BlockStored");
            pack_hashes(k, p, evs, n);
            msgpack_pack_nil(p);
            msgpack_pack_array(p, 0);
            msgpack_pack_long(p, k->chunk_size);
            msgpack_pack_nil(p);
            pack_str(p, medium);
            return;
        }
        msgpack_pack_map(p, 8);
        pack_str(p, "type");
        pack_str(p, "BlockStored");
        pack_str(p, "block_hashes");
        pack_hashes(k, p, evs, n);
        pack_str(p, "parent_block_hash");
        msgpack_pack_nil(p);
        pack_str(p, "token_ids");
        msgpack_pack_array(p, 0);
        pack_str(p, "block_size");
        msgpack_pack_long(p, k->chunk_size);
        pack_str(p, "lora_id");
        msgpack_pack_nil(p);
        pack_str(p, "lora_name");
        msgpack_pack_nil(p);
        pack_str(p, "medium");
        pack_str(p, medium);
        return;
    default:
        if (k->legacy) {
            msgpack_pack_array(p, 3);
            pack_str(p, "BlockRemoved");
            pack_hashes(k, p, evs, n);
            pack_str(p, medium);
            return;
        }
        msgpack_pack_map(p, 3);
        pack_str(p, "type");
        pack_str(p, "BlockRemoved");
        pack_str(p, "block_hashes");
        pack_hashes(k, p, evs, n);
        pack_str(p, "medium");
        pack_str(p, medium);
    }
}

static void payload_unref(struct payload *p) {
    if (atomic_fetch_sub(&p->refs, 1) == 1) {
        free(p->data);
        free(p);
    }
}

/* Keeps a published batch (takes data) for replay, dropping the oldest beyond the bounds. */
static void ring_append(struct kvevents *k, uint64_t seq, char *data, size_t len) {
    struct payload *p = malloc(sizeof(*p));
    if (!p) {
        free(data); /* a hole in the ring: a replay skips it, the subscriber sees the gap */
        return;
    }
    atomic_init(&p->refs, 1);
    p->len = len;
    p->data = data;
    p->k = k;
    pthread_mutex_lock(&k->rmu);
    while (k->scount && (k->scount == REPLAY_BATCHES || k->sbytes + len > REPLAY_BYTES)) {
        struct slot *s = &k->slots[k->shead];
        k->sbytes -= s->p->len;
        payload_unref(s->p);
        k->shead = (k->shead + 1) % REPLAY_BATCHES;
        k->scount--;
    }
    k->slots[(k->shead + k->scount) % REPLAY_BATCHES] = (struct slot){seq, p};
    k->scount++;
    k->sbytes += len;
    size_t bytes = k->sbytes;
    pthread_mutex_unlock(&k->rmu);
    metric_set(k->m_rbuf, (double)bytes);
}

/* Sends one EventBatch of evs[0..n) (in order; consecutive events of one kind and medium become
 * one event). */
static void publish(struct kvevents *k, const struct ev *evs, size_t n) {
    size_t nev = 0;
    for (size_t i = 0; i < n; i++)
        if (i == 0 || evs[i].kind != evs[i - 1].kind || evs[i].medium != evs[i - 1].medium) nev++;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer p;
    msgpack_packer_init(&p, &sb, msgpack_sbuffer_write);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_pack_array(&p, 3);
    msgpack_pack_double(&p, (double)ts.tv_sec + ts.tv_nsec / 1e9);
    msgpack_pack_array(&p, nev);
    for (size_t i = 0; i < n;) {
        size_t j = i + 1;
        while (j < n && evs[j].kind == evs[i].kind && evs[j].medium == evs[i].medium) j++;
        pack_event(k, &p, evs + i, j - i);
        i = j;
    }
    msgpack_pack_int(&p, 0);
    uint8_t seq[8];
    for (int i = 0; i < 8; i++) seq[i] = (uint8_t)(k->seq >> (56 - 8 * i));
    if (sb.data && zmq_send(k->pub, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) == 0 &&
        zmq_send(k->pub, seq, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT) == 8 &&
        zmq_send(k->pub, sb.data, sb.size, ZMQ_DONTWAIT) == (int)sb.size) {
        metric_inc(k->m_batches, 1);
        metric_inc(k->m_events, (double)nev);
    } else {
        metric_inc(k->m_dropped, (double)n);
    }
    if (k->router && sb.data) {
        size_t len = sb.size;
        ring_append(k, k->seq, msgpack_sbuffer_release(&sb), len);
    }
    k->seq++; /* a gap tells subscribers that a batch was lost */
    msgpack_sbuffer_destroy(&sb);
}

/* Takes up to BATCH_MAX queued events; 0 when none. When events were dropped since the last
 * take (a full queue), the sequence skips a number before the batch: subscribers see a gap, as
 * for a batch lost on the way, rather than a stream that silently lacks events. */
static size_t take(struct kvevents *k, struct ev *out) {
    pthread_mutex_lock(&k->mu);
    size_t n = k->count < BATCH_MAX ? k->count : BATCH_MAX;
    for (size_t i = 0; i < n; i++) out[i] = k->ring[(k->head + i) % QUEUE_MAX];
    k->head = (k->head + n) % QUEUE_MAX;
    k->count -= n;
    uint64_t lost = k->lost;
    k->lost = 0;
    pthread_mutex_unlock(&k->mu);
    if (lost) k->seq++;
    return n;
}

static void *kv_main(void *arg) {
    struct kvevents *k = arg;
    pthread_setname_np(pthread_self(), "kv-events");
    struct ev *buf = malloc(BATCH_MAX * sizeof(*buf));
    for (bool stop = false; buf && !stop;) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += INTERVAL_MS * 1000000L;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&k->mu);
        while (!k->stopping && k->count < BATCH_MAX)
            if (pthread_cond_timedwait(&k->cv, &k->mu, &ts) == ETIMEDOUT) break;
        stop = k->stopping;
        pthread_mutex_unlock(&k->mu);
        size_t n;
        while ((n = take(k, buf)) > 0) publish(k, buf, n);
    }
    free(buf);
    return NULL;
}

/* ---- replay ---------------------------------------------------------------------------------- */

/* ZMQ is done with a replayed message (sent, or dropped with its peer). Any thread. */
static void msg_free(void *data, void *hint) {
    (void)data;
    struct payload *p = hint;
    atomic_fetch_sub(&p->k->inflight, p->len);
    payload_unref(p);
}

/* Sends [id, "", seq, payload] (p NULL: the end marker, an empty payload); p's reference goes to
 * ZMQ. Returns 0 or the errno of the refused first frame (EAGAIN: the peer's queue is full,
 * EHOSTUNREACH: the peer is gone). */
static int send_reply(struct kvevents *k, const struct cursor *c, uint64_t seq, struct payload *p) {
    uint8_t sb[8];
    for (int i = 0; i < 8; i++) sb[i] = (uint8_t)(seq >> (56 - 8 * i));
    if (zmq_send(k->router, c->id, c->idlen, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        int err = zmq_errno();
        if (p) payload_unref(p);
        return err;
    }
    /* Once the first frame is accepted the rest of the message is too. */
    zmq_send(k->router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_send(k->router, sb, 8, ZMQ_SNDMORE | ZMQ_DONTWAIT);
    zmq_msg_t m;
    if (p) {
        atomic_fetch_add(&k->inflight, p->len);
        if (zmq_msg_init_data(&m, p->data, p->len, msg_free, p) != 0) {
            msg_free(NULL, p);
            zmq_msg_init(&m);
        }
    } else {
        zmq_msg_init(&m);
    }
    if (zmq_msg_send(&m, k->router, ZMQ_DONTWAIT) < 0) zmq_msg_close(&m);
    return 0;
}

/* The buffered batch with the smallest seq >= from and < end (a new reference), or NULL. */
static struct payload *ring_find(struct kvevents *k, uint64_t from, uint64_t end, uint64_t *seq) {
    struct payload *p = NULL;
    pthread_mutex_lock(&k->rmu);
    size_t lo = 0, hi = k->scount;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (k->slots[(k->shead + mid) % REPLAY_BATCHES].seq < from)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < k->scount) {
        struct slot *s = &k->slots[(k->shead + lo) % REPLAY_BATCHES];
        if (s->seq < end) {
            p = s->p;
            atomic_fetch_add(&p->refs, 1);
            *seq = s->seq;
        }
    }
    pthread_mutex_unlock(&k->rmu);
    return p;
}

/* Reads one request; false when none is waiting. A request is exactly [identity, "", 8 bytes];
 * anything else is counted and ignored. */
static bool read_request(struct kvevents *k) {
    uint8_t id[ID_MAX], sq[8];
    size_t idlen = 0, nframes = 0;
    bool ok = true, more = true;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, k->router, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            if (nframes == 0) return false;
            ok = false;
            break;
        }
        size_t sz = zmq_msg_size(&m);
        const uint8_t *d = zmq_msg_data(&m);
        if (nframes == 0) {
            if (sz == 0 || sz > sizeof(id))
                ok = false;
            else
                memcpy(id, d, idlen = sz);
        } else if (nframes == 1) {
            if (sz != 0) ok = false;
        } else if (nframes == 2) {
            if (sz != 8)
                ok = false;
            else
                memcpy(sq, d, 8);
        } else {
            ok = false;
        }
        nframes++;
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    if (!ok || nframes != 3) {
        metric_inc(k->m_rrej, 1);
        return true;
    }
    struct cursor *c = NULL;
    for (int i = 0; i < CURSORS && !c; i++)
        if (k->cur[i].used && k->cur[i].idlen == idlen && !memcmp(k->cur[i].id, id, idlen))
            c = &k->cur[i]; /* a peer asking again starts over */
    for (int i = 0; i < CURSORS && !c; i++)
        if (!k->cur[i].used) c = &k->cur[i];
    if (!c) {
        metric_inc(k->m_rrej, 1); /* busy: the peer asks again later */
        return true;
    }
    metric_inc(k->m_rq, 1);
    pthread_mutex_lock(&k->rmu);
    uint64_t end = k->scount ? k->slots[(k->shead + k->scount - 1) % REPLAY_BATCHES].seq + 1 : 0;
    pthread_mutex_unlock(&k->rmu);
    c->used = true;
    memcpy(c->id, id, idlen);
    c->idlen = idlen;
    c->next = be64(sq);
    c->end = end; /* what is buffered now; later batches reach the peer by PUB */
    c->progress = clock_mono();
    return true;
}

/* One turn of every replay in progress: at most TURN_MSGS messages each. */
static void serve(struct kvevents *k) {
    double now = clock_mono();
    for (int i = 0; i < CURSORS; i++) {
        struct cursor *c = &k->cur[i];
        if (!c->used) continue;
        int rc = 0;
        for (int sent = 0; sent < TURN_MSGS && c->used && rc == 0; sent++) {
            if (atomic_load(&k->inflight) >= INFLIGHT_BYTES) {
                rc = EAGAIN;
                break;
            }
            uint64_t seq = 0;
            struct payload *p = c->next < c->end ? ring_find(k, c->next, c->end, &seq) : NULL;
            if (p) {
                rc = send_reply(k, c, seq, p);
                if (rc == 0) {
                    c->next = seq + 1;
                    metric_inc(k->m_rbatches, 1);
                }
            } else {
                rc = send_reply(k, c, UINT64_MAX, NULL); /* seq -1: the end */
                if (rc == 0) c->used = false;
            }
            if (rc == 0) c->progress = now;
        }
        if (c->used && (rc == EHOSTUNREACH || now - c->progress > STALL_S)) {
            c->used = false;
            metric_inc(k->m_rabort, 1);
        }
    }
}

static void *replay_main(void *arg) {
    struct kvevents *k = arg;
    pthread_setname_np(pthread_self(), "kv-replay");
    while (!atomic_load(&k->rstop)) {
        bool busy = false;
        for (int i = 0; i < CURSORS; i++) busy |= k->cur[i].used;
        zmq_pollitem_t it = {k->router, 0, ZMQ_POLLIN, 0};
        int rc = zmq_poll(&it, 1, busy ? 10 : 100);
        if (rc < 0 && zmq_errno() != EINTR) break;
        for (int i = 0; rc > 0 && i < TURN_REQUESTS && read_request(k); i++) {
        }
        serve(k);
    }
    return NULL;
}

/* ---- life cycle ------------------------------------------------------------------------------ */

static bool binds(const char *ep) {
    return strchr(ep, '*') || strstr(ep, "::") || strncmp(ep, "ipc://", 6) == 0 ||
           strncmp(ep, "inproc://", 9) == 0;
}

static struct metric *counter(struct metrics *m, const char *name, const char *help) {
    struct metric_family *f = metrics_counter(m, name, help, NULL);
    return f ? metric_series(f) : NULL;
}

static int setup_replay(struct kvevents *k, const char *ep, char *err, size_t errlen) {
    k->slots = calloc(REPLAY_BATCHES, sizeof(*k->slots));
    k->router = zmq_socket(k->ctx, ZMQ_ROUTER);
    if (!k->slots || !k->router) {
        errbuf_set(err, errlen, "argument --kv-events-replay-endpoint: out of memory");
        return -1;
    }
    int one = 1, zero = 0, sndhwm = REPLAY_SNDHWM, rcvhwm = 64, hb_ivl = 1000, hb_to = 5000;
    int64_t maxmsg = REQ_MAX_BYTES;
    zmq_setsockopt(k->router, ZMQ_ROUTER_MANDATORY, &one, sizeof(one));
    zmq_setsockopt(k->router, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(k->router, ZMQ_SNDHWM, &sndhwm, sizeof(sndhwm));
    zmq_setsockopt(k->router, ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
    zmq_setsockopt(k->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
    zmq_setsockopt(k->router, ZMQ_HEARTBEAT_IVL, &hb_ivl, sizeof(hb_ivl));
    zmq_setsockopt(k->router, ZMQ_HEARTBEAT_TIMEOUT, &hb_to, sizeof(hb_to));
    if (zmq_bind(k->router, ep) != 0) {
        errbuf_set(err, errlen, "argument --kv-events-replay-endpoint: %s: %s", ep,
                   zmq_strerror(zmq_errno()));
        return -1;
    }
    struct metrics *m = k->e->metrics;
    k->m_rq = counter(m, "lmcache_mp_kv_events_replay_requests_total",
                      "KV-event replay requests accepted");
    k->m_rrej = counter(m, "lmcache_mp_kv_events_replay_rejected_total",
                        "KV-event replay requests ignored (malformed, or 16 replays running)");
    k->m_rbatches = counter(m, "lmcache_mp_kv_events_replayed_batches_total",
                            "KV-event batches sent by replays");
    k->m_rabort = counter(m, "lmcache_mp_kv_events_replay_aborted_total",
                          "KV-event replays abandoned (peer gone, or not reading for 10 s)");
    struct metric_family *f =
        metrics_gauge(m, "lmcache_mp_kv_events_replay_buffer_bytes",
                      "Payload bytes of the KV-event batches kept for replay", NULL);
    k->m_rbuf = f ? metric_series(f) : NULL;
    if (!k->m_rq || !k->m_rrej || !k->m_rbatches || !k->m_rabort || !k->m_rbuf) {
        errbuf_set(err, errlen, "argument --kv-events-replay-endpoint: cannot set up");
        return -1;
    }
    return 0;
}

struct kvevents *kvevents_create(struct engine *e, char *err, size_t errlen) {
    const struct server_config *c = e->cfg;
    const char *endpoint = c->kv_events_endpoint;
    struct kvevents *k = calloc(1, sizeof(*k));
    if (!k) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    k->e = e;
    k->lg = log_get("lmcache.master");
    k->chunk_size = c->chunk_size;
    k->legacy = c->kv_events_format && strcmp(c->kv_events_format, "legacy") == 0;
    k->int_hashes = c->kv_events_hash_format && strcmp(c->kv_events_hash_format, "int64") == 0;
    pthread_mutex_init(&k->mu, NULL);
    pthread_mutex_init(&k->rmu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&k->cv, &ca);
    pthread_condattr_destroy(&ca);
    k->ring = malloc(QUEUE_MAX * sizeof(*k->ring));
    k->ctx = zmq_ctx_new();
    k->pub = k->ctx ? zmq_socket(k->ctx, ZMQ_PUB) : NULL;
    if (!k->ring || !k->pub || ptable_init(&k->tab)) {
        errbuf_set(err, errlen, "argument --kv-events-endpoint: out of memory");
        kvevents_free(k);
        return NULL;
    }
    int hwm = 100000, linger = 0;
    zmq_setsockopt(k->pub, ZMQ_SNDHWM, &hwm, sizeof(hwm));
    zmq_setsockopt(k->pub, ZMQ_LINGER, &linger, sizeof(linger));
    int rc = binds(endpoint) ? zmq_bind(k->pub, endpoint) : zmq_connect(k->pub, endpoint);
    if (rc != 0) {
        errbuf_set(err, errlen, "argument --kv-events-endpoint: %s: %s", endpoint,
                   zmq_strerror(zmq_errno()));
        kvevents_free(k);
        return NULL;
    }
    const char *rep = c->kv_events_replay_endpoint;
    if (rep && rep[0] && setup_replay(k, rep, err, errlen) < 0) {
        kvevents_free(k);
        return NULL;
    }
    k->m_batches =
        counter(e->metrics, "lmcache_mp_kv_events_batches_total", "KV-event batches published");
    k->m_events = counter(e->metrics, "lmcache_mp_kv_events_total",
                          "KV events (BlockStored, BlockRemoved, AllBlocksCleared) published");
    k->m_dropped = counter(e->metrics, "lmcache_mp_kv_events_dropped_total",
                           "Placement changes not published (queue full or socket refused)");
    if (!k->m_batches || !k->m_events || !k->m_dropped ||
        engine_add_placement_listener(e, on_placement, on_cleared, k) < 0) {
        errbuf_set(err, errlen, "argument --kv-events-endpoint: cannot set up");
        kvevents_free(k);
        return NULL;
    }
    /* A subscriber that knew an earlier life of this node forgets it; what the node holds (the
     * fs rescan) follows. */
    on_cleared(k);
    log_info(k->lg, "publishing KV events on %s (%s, %s form, %s hashes)%s%s", endpoint,
             binds(endpoint) ? "bound" : "connected", k->legacy ? "legacy" : "current",
             k->int_hashes ? "int64" : "bytes", k->router ? ", replay on " : "",
             k->router ? rep : "");
    return k;
}

int kvevents_start(struct kvevents *k, char *err, size_t errlen) {
    int rc = pthread_create(&k->tid, NULL, kv_main, k);
    if (rc != 0) {
        errbuf_set(err, errlen, "kv-events thread: %s", strerror(rc));
        return -1;
    }
    k->started = true;
    if (k->router) {
        rc = pthread_create(&k->rtid, NULL, replay_main, k);
        if (rc != 0) {
            errbuf_set(err, errlen, "kv-replay thread: %s", strerror(rc));
            return -1;
        }
        k->rstarted = true;
    }
    return 0;
}

void kvevents_stop(struct kvevents *k) {
    if (!k) return;
    if (k->started) {
        pthread_mutex_lock(&k->mu);
        k->stopping = true;
        pthread_cond_signal(&k->cv);
        pthread_mutex_unlock(&k->mu);
        pthread_join(k->tid, NULL);
        k->started = false;
    }
    if (k->rstarted) {
        atomic_store(&k->rstop, true);
        pthread_join(k->rtid, NULL);
        k->rstarted = false;
    }
}

void kvevents_free(struct kvevents *k) {
    if (!k) return;
    if (k->pub) zmq_close(k->pub);
    if (k->router) zmq_close(k->router);
    if (k->ctx) zmq_ctx_term(k->ctx); /* frees the replayed messages still queued */
    for (size_t i = 0; k->slots && i < k->scount; i++)
        payload_unref(k->slots[(k->shead + i) % REPLAY_BATCHES].p);
    free(k->slots);
    ptable_fini(&k->tab, offsetof(struct entry, pe));
    pthread_mutex_destroy(&k->mu);
    pthread_mutex_destroy(&k->rmu);
    pthread_cond_destroy(&k->cv);
    free(k->ring);
    free(k);
}
