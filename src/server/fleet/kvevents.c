/* The KV-event publisher (see kvevents.h and docs/fleet.md). */
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

#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"

#define QUEUE_MAX   65536 /* events waiting; more are dropped */
#define BATCH_MAX   4096  /* events per EventBatch */
#define INTERVAL_MS 100
#define HASH_LEN    32

struct ev {
    uint8_t hash[HASH_LEN];
    uint8_t tier;
    bool present;
};

struct kvevents {
    struct engine *e;
    struct logger *lg;
    void *ctx, *pub; /* the socket is used by the thread only (and at create/free) */
    long chunk_size;
    pthread_t tid;
    bool started;
    /* mu (a leaf): the ring, the stop flag */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct ev *ring;
    size_t head, count;
    bool stopping;
    uint64_t seq;
    struct metric *m_batches, *m_events, *m_dropped;
};

/* The engine's placement listener: data-path threads, cache locks held. */
static void on_placement(void *arg, const uint8_t hash[32], int tier, bool present) {
    struct kvevents *k = arg;
    pthread_mutex_lock(&k->mu);
    if (k->count == QUEUE_MAX) {
        pthread_mutex_unlock(&k->mu);
        metric_inc(k->m_dropped, 1);
        return;
    }
    struct ev *v = &k->ring[(k->head + k->count++) % QUEUE_MAX];
    memcpy(v->hash, hash, HASH_LEN);
    v->tier = (uint8_t)tier;
    v->present = present;
    if (k->count == BATCH_MAX) pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
}

static void pack_str(msgpack_packer *p, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(p, n);
    msgpack_pack_str_body(p, s, n);
}

/* One event for a run of evs[0..n) of the same kind and tier. */
static void pack_event(struct kvevents *k, msgpack_packer *p, const struct ev *evs, size_t n) {
    const char *medium = evs[0].tier == ENGINE_TIER_DRAM ? "CPU" : "FS";
    if (evs[0].present) {
        msgpack_pack_map(p, 8);
        pack_str(p, "type");
        pack_str(p, "BlockStored");
    } else {
        msgpack_pack_map(p, 3);
        pack_str(p, "type");
        pack_str(p, "BlockRemoved");
    }
    pack_str(p, "block_hashes");
    msgpack_pack_array(p, n);
    for (size_t i = 0; i < n; i++) {
        msgpack_pack_bin(p, HASH_LEN);
        msgpack_pack_bin_body(p, evs[i].hash, HASH_LEN);
    }
    if (evs[0].present) {
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
    }
    pack_str(p, "medium");
    pack_str(p, medium);
}

/* Sends one EventBatch of evs[0..n) (in order; consecutive events of one kind and tier become
 * one event). */
static void publish(struct kvevents *k, const struct ev *evs, size_t n) {
    size_t nev = 0;
    for (size_t i = 0; i < n; i++)
        if (i == 0 || evs[i].present != evs[i - 1].present || evs[i].tier != evs[i - 1].tier) nev++;
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
        while (j < n && evs[j].present == evs[i].present && evs[j].tier == evs[i].tier) j++;
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
    k->seq++; /* a gap tells subscribers that a batch was lost */
    msgpack_sbuffer_destroy(&sb);
}

/* Takes up to BATCH_MAX queued events; false when none. */
static size_t take(struct kvevents *k, struct ev *out) {
    pthread_mutex_lock(&k->mu);
    size_t n = k->count < BATCH_MAX ? k->count : BATCH_MAX;
    for (size_t i = 0; i < n; i++) out[i] = k->ring[(k->head + i) % QUEUE_MAX];
    k->head = (k->head + n) % QUEUE_MAX;
    k->count -= n;
    pthread_mutex_unlock(&k->mu);
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

static bool binds(const char *ep) {
    return strchr(ep, '*') || strstr(ep, "::") || strncmp(ep, "ipc://", 6) == 0 ||
           strncmp(ep, "inproc://", 9) == 0;
}

struct kvevents *kvevents_create(struct engine *e, const char *endpoint, char *err, size_t errlen) {
    struct kvevents *k = calloc(1, sizeof(*k));
    if (!k) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    k->e = e;
    k->lg = log_get("lmcache.master");
    k->chunk_size = e->cfg->chunk_size;
    pthread_mutex_init(&k->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&k->cv, &ca);
    pthread_condattr_destroy(&ca);
    k->ring = malloc(QUEUE_MAX * sizeof(*k->ring));
    k->ctx = zmq_ctx_new();
    k->pub = k->ctx ? zmq_socket(k->ctx, ZMQ_PUB) : NULL;
    if (!k->ring || !k->pub) {
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
    struct metric_family *f;
    f = metrics_counter(e->metrics, "lmcache_mp_kv_events_batches_total",
                        "KV-event batches published", NULL);
    k->m_batches = f ? metric_series(f) : NULL;
    f = metrics_counter(e->metrics, "lmcache_mp_kv_events_total",
                        "KV events (BlockStored, BlockRemoved) published", NULL);
    k->m_events = f ? metric_series(f) : NULL;
    f = metrics_counter(e->metrics, "lmcache_mp_kv_events_dropped_total",
                        "Placement changes not published (queue full or socket refused)", NULL);
    k->m_dropped = f ? metric_series(f) : NULL;
    if (!k->m_batches || !k->m_events || !k->m_dropped ||
        engine_add_placement_listener(e, on_placement, k) < 0) {
        errbuf_set(err, errlen, "argument --kv-events-endpoint: cannot set up");
        kvevents_free(k);
        return NULL;
    }
    log_info(k->lg, "publishing KV events on %s (%s)", endpoint,
             binds(endpoint) ? "bound" : "connected");
    return k;
}

int kvevents_start(struct kvevents *k, char *err, size_t errlen) {
    int rc = pthread_create(&k->tid, NULL, kv_main, k);
    if (rc != 0) {
        errbuf_set(err, errlen, "kv-events thread: %s", strerror(rc));
        return -1;
    }
    k->started = true;
    return 0;
}

void kvevents_stop(struct kvevents *k) {
    if (!k || !k->started) return;
    pthread_mutex_lock(&k->mu);
    k->stopping = true;
    pthread_cond_signal(&k->cv);
    pthread_mutex_unlock(&k->mu);
    pthread_join(k->tid, NULL);
    k->started = false;
}

void kvevents_free(struct kvevents *k) {
    if (!k) return;
    if (k->pub) zmq_close(k->pub);
    if (k->ctx) zmq_ctx_term(k->ctx);
    pthread_mutex_destroy(&k->mu);
    pthread_cond_destroy(&k->cv);
    free(k->ring);
    free(k);
}
