/* The Redis store's read cache, kept coherent with Redis' server-assisted client-side
 * caching (CLIENT TRACKING, BCAST mode). Per endpoint one listener connection, read by a
 * thread of its own: CLIENT ID, then CLIENT TRACKING on REDIRECT <its own id> BCAST with one
 * PREFIX per external-KV key tag served there (and the ALIVE peer map on the control
 * endpoint), then SUBSCRIBE __redis__:invalidate. Every write to such a key, by anyone,
 * arrives as an invalidation message; a nil key list (FLUSHALL...) flushes the cache.
 * Tracking and listening on one connection means one failure mode: when it is lost (Redis
 * restart, CLIENT KILL, a timeout), the tracking is gone with it, the cache is flushed and
 * bypassed until a new listener is up on every endpoint.
 *
 * The fence: invalidations and the answers to a PING sent on the listener travel in order
 * on one connection, and Redis queues the invalidations of a write before the write's reply
 * is sent. So once a PING written after a match began is answered, every invalidation of a
 * write acknowledged (to any master replica) before the match began has been applied. One
 * PING is in flight per listener; callers that arrive meanwhile ask for the next one (want),
 * sent as soon as the current one is answered.
 *
 * Cluster mode: one listener per master of the slot map, each tracking every shard tag's
 * prefix and the peer map (a prefix costs nothing on a node without such keys), so a key
 * written on any master, before, during or after a slot's migration, is invalidated by the
 * listener of the node it was written on; the fence PINGs every master's listener. Every
 * slot-map change (a re-read that differs, MOVED, ASK, TRYAGAIN) bumps map_gen: the cache is
 * flushed and bypassed until the listeners of the new map's masters are all up (started on
 * demand by the next fence or the watch thread). The watch thread re-reads the map and the
 * masters (CLUSTER NODES, those without slots too) every second, so a master added to the
 * cluster is tracked before a slot can migrate to it, even when this master is never
 * redirected. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/metrics.h"
#include "master/mcache.h"
#include "master/mstore_redis_internal.h"

struct rtrack {
    struct rstore *r;
    uint32_t e; /* endpoint */
    pthread_t th;
    bool started;
    pthread_mutex_t mu; /* all below; the writes of PINGs on fd */
    pthread_cond_t cv;
    int fd;        /* -1 while down */
    bool up;       /* tracking on and subscribed */
    uint64_t conn; /* changes on every connection and every loss */
    uint64_t want, sent, done;
    bool inflight, stop;
    bool wanted; /* cluster: its node is a master of the map (else it idles once down) */
};

static const char PING[] = "*1\r\n$4\r\nPING\r\n";

/* Caller holds t->mu: writes the PING that want asks for. False when the socket failed. */
static bool do_send_ping(struct rtrack *t) {
    size_t off = 0, n = sizeof(PING) - 1;
    while (off < n) {
        ssize_t w = send(t->fd, PING + off, n - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            shutdown(t->fd, SHUT_RDWR); /* the reader sees the loss */
            return false;
        }
        off += (size_t)w;
    }
    t->sent = t->want;
    t->inflight = true;
    return true;
}

static bool listener_up(struct rtrack *t) {
    pthread_mutex_lock(&t->mu);
    bool up = t->up;
    pthread_mutex_unlock(&t->mu);
    return up;
}

/* Caller holds tmu: serves when every needed listener is up for the current map. */
static void try_enable(struct rstore *r) {
    if (mcache_enabled(r->cache) || !r->nneed) return;
    if (r->cluster && atomic_load(&r->need_gen) != atomic_load(&r->map_gen)) return;
    for (uint32_t k = 0; k < r->nneed; k++)
        if (!listener_up(r->trk[r->need[k]])) return;
    mcache_enable(r->cache);
    if (r->m_c_up) metric_set(r->m_c_up, 1);
    if (r->cluster)
        log_debug(r->lg, "[MetadataStore] redis read cache: tracking on %u master(s), serving",
                  r->nneed);
    else
        log_info(r->lg, "[MetadataStore] redis read cache: tracking on %u endpoint(s), serving",
                 r->nneed);
}

/* Caller holds tmu: flushed and off. */
static void turn_off(struct rstore *r) {
    if (mcache_enabled(r->cache) && r->m_c_up) metric_set(r->m_c_up, 0);
    mcache_disable(r->cache);
    if (r->m_c_flush) metric_inc(r->m_c_flush, 1);
}

static void set_up(struct rstore *r, bool up) {
    pthread_mutex_lock(&r->tmu);
    if (!up) {
        if (mcache_enabled(r->cache))
            log_warn(r->lg, "[MetadataStore] redis read cache: invalidation listener lost; "
                            "flushed and bypassed until tracking is back");
        turn_off(r);
    }
    try_enable(r);
    pthread_mutex_unlock(&r->tmu);
}

static bool ok_reply(redisReply *rep, int type) {
    bool ok = rep && rep->type == type;
    if (rep) freeReplyObject(rep);
    return ok;
}

/* CLIENT ID, CLIENT TRACKING ... BCAST PREFIX ..., SUBSCRIBE; false on any failure. */
static bool setup(struct rtrack *t, redisContext *c) {
    struct rstore *r = t->r;
    redisReply *rep = redisCommand(c, "CLIENT ID");
    if (!rep || rep->type != REDIS_REPLY_INTEGER) {
        if (rep) freeReplyObject(rep);
        return false;
    }
    char id[24];
    snprintf(id, sizeof(id), "%lld", rep->integer);
    freeReplyObject(rep);
    size_t cap = 8 + 2 * (size_t)r->nshards + 2, argc = 0;
    const char **argv = malloc(cap * sizeof(char *));
    char **own = calloc(r->nshards, sizeof(char *));
    bool ok = argv && own;
    if (ok) {
        argv[argc++] = "CLIENT";
        argv[argc++] = "TRACKING";
        argv[argc++] = "on";
        argv[argc++] = "REDIRECT";
        argv[argc++] = id;
        argv[argc++] = "BCAST";
        /* Single and cluster: every shard tag (cluster: a key of any tag may be written
         * here after a migration). Multi: shard e on endpoint e. Keys of a tag
         * that are not hashes' (":extkv:node:<id>") share the prefix: their invalidations
         * drop at most an entry of a hash spelled "node:<id>", never too little. */
        for (uint32_t s = 0; s < r->nshards && ok; s++) {
            if (r->multi && s != t->e) continue;
            size_t len = strlen(r->tag[s]) + 8;
            if (!(own[s] = malloc(len))) {
                ok = false;
                break;
            }
            snprintf(own[s], len, "%s:extkv:", r->tag[s]);
            argv[argc++] = "PREFIX";
            argv[argc++] = own[s];
        }
        if (t->e == 0 || r->cluster) { /* cluster: the control slot may be anywhere */
            argv[argc++] = "PREFIX";
            argv[argc++] = r->k_peers;
        }
    }
    if (ok) ok = ok_reply(redisCommandArgv(c, (int)argc, argv, NULL), REDIS_REPLY_STATUS);
    for (uint32_t s = 0; own && s < r->nshards; s++) free(own[s]);
    free(own);
    free(argv);
    if (ok) {
        rep = redisCommand(c, "SUBSCRIBE __redis__:invalidate");
        ok = rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == 3;
        if (rep) freeReplyObject(rep);
    }
    return ok;
}

/* One invalidated key: "<tag>:extkv:<hash>" drops the hash, the peer map key the map. */
static void invalidate(struct rstore *r, const char *k, size_t n) {
    size_t pl = strlen(r->k_peers);
    if (n == pl && memcmp(k, r->k_peers, pl) == 0) {
        mcache_invalidate(r->cache, 'p', "", 0);
        return;
    }
    const char *close = memchr(k, '}', n);
    static const char MID[] = ":extkv:";
    size_t ml = sizeof(MID) - 1;
    if (close && (size_t)(k + n - close) > ml && memcmp(close + 1, MID, ml) == 0) {
        const char *h = close + 1 + ml;
        mcache_invalidate(r->cache, 'x', h, (size_t)(k + n - h));
    }
}

/* A message read on the listener; false when it is not one we expect. */
static bool on_reply(struct rtrack *t, redisReply *rep) {
    struct rstore *r = t->r;
    if (rep->type != REDIS_REPLY_ARRAY || rep->elements < 2 ||
        rep->element[0]->type != REDIS_REPLY_STRING)
        return false;
    const char *kind = rep->element[0]->str;
    if (strcmp(kind, "pong") == 0) {
        pthread_mutex_lock(&t->mu);
        t->done = t->sent;
        t->inflight = false;
        bool ok = t->want <= t->sent || do_send_ping(t);
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
        return ok;
    }
    if (strcmp(kind, "message") != 0 || rep->elements != 3) return false;
    const redisReply *keys = rep->element[2];
    if (keys->type == REDIS_REPLY_ARRAY) {
        for (size_t i = 0; i < keys->elements; i++)
            if (keys->element[i]->type == REDIS_REPLY_STRING)
                invalidate(r, keys->element[i]->str, keys->element[i]->len);
        if (r->m_c_inval) metric_inc(r->m_c_inval, (double)keys->elements);
    } else {
        /* nil: FLUSHALL / FLUSHDB, or Redis dropped its tracking table. */
        mcache_flush(r->cache);
        if (r->m_c_flush) metric_inc(r->m_c_flush, 1);
    }
    return true;
}

static void *listener(void *arg) {
    struct rtrack *t = arg;
    struct rstore *r = t->r;
    struct endpoint *ep = r->ep[t->e];
    uint32_t backoff_ms = 50;
    for (;;) {
        pthread_mutex_lock(&t->mu);
        while (!t->stop && !t->wanted) pthread_cond_wait(&t->cv, &t->mu);
        bool stop = t->stop;
        pthread_mutex_unlock(&t->mu);
        if (stop) break;
        char why[384] = "";
        redisContext *c = rs_dial(r, ep->host, ep->port, why, sizeof(why));
        bool ok = c != NULL;
        if (ok) {
            pthread_mutex_lock(&t->mu);
            t->fd = c->fd; /* from here rs_track_stop can interrupt a read */
            ok = !t->stop;
            pthread_mutex_unlock(&t->mu);
        }
        if (ok && !setup(t, c)) {
            ok = false;
            snprintf(why, sizeof(why), "CLIENT TRACKING / SUBSCRIBE refused: %s",
                     c->err ? c->errstr : "unexpected reply");
        }
        if (ok) {
            struct timeval none = {0, 0}; /* idle listeners wait for messages forever */
            redisSetTimeout(c, none);
            pthread_mutex_lock(&t->mu);
            t->up = true;
            t->conn++;
            t->inflight = false;
            t->want = t->sent = t->done;
            pthread_mutex_unlock(&t->mu);
            set_up(r, true);
            backoff_ms = 50;
            for (;;) {
                redisReply *rep = NULL;
                if (redisGetReply(c, (void **)&rep) != REDIS_OK || !rep) break;
                bool fine = on_reply(t, rep);
                freeReplyObject(rep);
                if (!fine) break;
            }
            snprintf(why, sizeof(why), "%s", c->err ? c->errstr : "unexpected message");
            pthread_mutex_lock(&t->mu);
            t->up = false;
            t->conn++;
            pthread_cond_broadcast(&t->cv);
            pthread_mutex_unlock(&t->mu);
            set_up(r, false);
        }
        pthread_mutex_lock(&t->mu);
        t->fd = -1;
        stop = t->stop;
        pthread_mutex_unlock(&t->mu);
        if (c) redisFree(c);
        if (stop) break;
        log_warn(r->lg, "[MetadataStore] redis read cache: listener %s:%d down (%s); retrying",
                 ep->host, ep->port, why);
        /* Back off, woken early by rs_track_stop. */
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += backoff_ms / 1000;
        dl.tv_nsec += (long)(backoff_ms % 1000) * 1000000L;
        if (dl.tv_nsec >= 1000000000L) {
            dl.tv_sec++;
            dl.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&t->mu);
        while (!t->stop && pthread_cond_timedwait(&t->cv, &t->mu, &dl) == 0) {
        }
        pthread_mutex_unlock(&t->mu);
        backoff_ms = backoff_ms * 2 > 2000 ? 2000 : backoff_ms * 2;
    }
    return NULL;
}

static struct rtrack *new_listener(struct rstore *r, uint32_t e) {
    struct rtrack *t = calloc(1, sizeof(*t));
    if (!t) return NULL;
    t->r = r;
    t->e = e;
    t->fd = -1;
    t->wanted = true;
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    if (pthread_create(&t->th, NULL, listener, t) != 0) {
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        free(t);
        return NULL;
    }
    t->started = true;
    return t;
}

/* Cluster mode, caller holds tmu: need becomes the masters of the current map, a listener
 * started for each new one; listeners of nodes no longer masters idle once down. */
static void reconcile(struct rstore *r) {
    uint64_t g = atomic_load(&r->map_gen);
    if (atomic_load(&r->need_gen) == g) return;
    uint32_t m[RS_MAX_NODES];
    uint32_t nm = rs_cluster_all_masters(r, m, RS_MAX_NODES);
    r->nneed = 0;
    if (nm > RS_TRACK_MAX) {
        log_warn(r->lg, "[MetadataStore] redis read cache: %u masters, more than %d: not serving",
                 nm, RS_TRACK_MAX);
        nm = 0;
    }
    for (uint32_t k = 0; k < nm; k++) {
        if (!r->trk[m[k]] && !(r->trk[m[k]] = new_listener(r, m[k]))) {
            r->nneed = 0;
            return; /* no memory or thread: the next fence tries again */
        }
        if (m[k] >= r->ntrk) r->ntrk = m[k] + 1;
        r->need[r->nneed++] = m[k];
    }
    for (uint32_t e = 0; e < r->ntrk; e++) {
        struct rtrack *t = r->trk[e];
        if (!t) continue;
        bool w = false;
        for (uint32_t k = 0; k < r->nneed && !w; k++) w = r->need[k] == e;
        pthread_mutex_lock(&t->mu);
        t->wanted = w;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
    atomic_store(&r->need_gen, g);
    try_enable(r);
}

void rs_track_map_changed(struct rstore *r) {
    if (!r->cache) return;
    atomic_fetch_add(&r->map_gen, 1);
    pthread_mutex_lock(&r->tmu);
    if (mcache_enabled(r->cache)) {
        /* At most one line a second (a migration redirects many calls). */
        uint64_t now = clock_mono_ns(), last = atomic_load(&r->last_map_log_ns);
        if (now - last >= 1000000000ull &&
            atomic_compare_exchange_strong(&r->last_map_log_ns, &last, now))
            log_info(r->lg, "[MetadataStore] redis read cache: cluster slot map changed or a "
                            "slot is migrating; flushed and bypassed until every master's "
                            "listener tracks");
    }
    turn_off(r);
    pthread_mutex_unlock(&r->tmu);
}

int rs_track_fence(struct rstore *r) {
    if (!r->cache) return -1;
    uint32_t idx[RS_TRACK_MAX], n;
    if (r->cluster) {
        if (atomic_load(&r->need_gen) != atomic_load(&r->map_gen)) {
            pthread_mutex_lock(&r->tmu);
            reconcile(r);
            pthread_mutex_unlock(&r->tmu);
        }
        if (!mcache_enabled(r->cache)) return -1;
        pthread_mutex_lock(&r->tmu);
        n = r->nneed;
        memcpy(idx, r->need, n * sizeof(*idx));
        bool cur = atomic_load(&r->need_gen) == atomic_load(&r->map_gen);
        pthread_mutex_unlock(&r->tmu);
        if (!cur || !n) return -1;
    } else {
        if (!mcache_enabled(r->cache) || r->ntrk > RS_TRACK_MAX) return -1;
        n = r->ntrk;
        for (uint32_t i = 0; i < n; i++) idx[i] = i;
    }
    uint64_t target[RS_TRACK_MAX], conn[RS_TRACK_MAX];
    for (uint32_t i = 0; i < n; i++) {
        struct rtrack *t = r->trk[idx[i]];
        pthread_mutex_lock(&t->mu);
        bool ok = t->up;
        if (ok) {
            /* The PING in flight may predate this call: wait for the next one. */
            target[i] = t->sent + 1;
            conn[i] = t->conn;
            if (t->want < target[i]) t->want = target[i];
            if (!t->inflight) ok = do_send_ping(t);
        }
        pthread_mutex_unlock(&t->mu);
        if (!ok) return -1;
    }
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += r->socket_ms / 1000;
    dl.tv_nsec += (long)(r->socket_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    int rc = 0;
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        struct rtrack *t = r->trk[idx[i]];
        pthread_mutex_lock(&t->mu);
        while (t->up && t->conn == conn[i] && t->done < target[i]) {
            if (pthread_cond_timedwait(&t->cv, &t->mu, &dl) != ETIMEDOUT) continue;
            /* No answer within the socket timeout: coherence unproven; reconnect. */
            if (t->up && t->conn == conn[i] && t->done < target[i] && t->fd >= 0)
                shutdown(t->fd, SHUT_RDWR);
            break;
        }
        if (!(t->up && t->conn == conn[i] && t->done >= target[i])) rc = -1;
        pthread_mutex_unlock(&t->mu);
    }
    return rc;
}

static double gauge_entries(void *arg) {
    struct mcache_stats st;
    mcache_stats(arg, &st);
    return (double)st.entries;
}

static double gauge_bytes(void *arg) {
    struct mcache_stats st;
    mcache_stats(arg, &st);
    return (double)st.bytes;
}

static void track_metrics(struct rstore *r, struct metrics *m) {
    if (!m) return;
    static const char *const L_B[] = {"backend", NULL};
    const char *const be[] = {"redis"};
    struct metric_family *f;
    if ((f = metrics_counter(m, "lmcache_master_redis_cache_hits_total",
                             "MatchExternalKv hashes answered from the read cache", L_B)))
        r->m_c_hit = metric_labels(f, be);
    if ((f = metrics_counter(m, "lmcache_master_redis_cache_misses_total",
                             "MatchExternalKv hashes read from Redis with the cache serving", L_B)))
        r->m_c_miss = metric_labels(f, be);
    if ((f = metrics_counter(m, "lmcache_master_redis_cache_invalidations_total",
                             "Keys named by Redis invalidation messages", L_B)))
        r->m_c_inval = metric_labels(f, be);
    if ((f = metrics_counter(m, "lmcache_master_redis_cache_flushes_total",
                             "Whole-cache flushes (listener lost, FLUSHALL, tracking reset)", L_B)))
        r->m_c_flush = metric_labels(f, be);
    if ((f = metrics_counter(m, "lmcache_master_redis_cache_bypassed_total",
                             "MatchExternalKv calls that read Redis directly because the "
                             "cache's coherence was not proven",
                             L_B)))
        r->m_c_bypass = metric_labels(f, be);
    if ((f = metrics_gauge(m, "lmcache_master_redis_cache_serving",
                           "1 while tracking is on for every endpoint and the cache serves", L_B)))
        r->m_c_up = metric_labels(f, be);
    metrics_gauge_fn(m, "lmcache_master_redis_cache_entries", "Entries in the read cache",
                     gauge_entries, r->cache);
    metrics_gauge_fn(m, "lmcache_master_redis_cache_bytes",
                     "Bytes the read cache's entries cost (keys, values, overhead)", gauge_bytes,
                     r->cache);
}

/* Cluster mode: the slot map read again every second (a master added or a slot reassigned
 * without this master being redirected), and the listeners matched to it. */
static void *watcher(void *arg) {
    struct rstore *r = arg;
    pthread_mutex_lock(&r->tmu);
    while (!r->wstop) {
        struct timespec dl;
        clock_gettime(CLOCK_REALTIME, &dl);
        dl.tv_sec += 1;
        while (!r->wstop && pthread_cond_timedwait(&r->wcv, &r->tmu, &dl) == 0) {
        }
        if (r->wstop) break;
        pthread_mutex_unlock(&r->tmu);
        rs_cluster_reread(r);
        pthread_mutex_lock(&r->tmu);
        reconcile(r);
    }
    pthread_mutex_unlock(&r->tmu);
    return NULL;
}

int rs_track_start(struct rstore *r, size_t cache_mb, struct metrics *m) {
    if (!cache_mb) return 0;
    uint32_t n = atomic_load(&r->nep);
    if (!r->cluster && (!n || n > RS_TRACK_MAX)) return 0; /* more than fences track */
    if (!(r->cache = mcache_new(cache_mb << 20))) return -1;
    if (!(r->trk = calloc(r->cluster ? RS_MAX_NODES : n, sizeof(*r->trk)))) return -1;
    pthread_cond_init(&r->wcv, NULL);
    track_metrics(r, m);
    if (r->cluster) rs_cluster_reread(r); /* the masters without slots too */
    pthread_mutex_lock(&r->tmu);
    int rc = 0;
    if (r->cluster) {
        atomic_store(&r->need_gen, UINT64_MAX);
        reconcile(r);
        if (pthread_create(&r->watch, NULL, watcher, r) == 0)
            r->watching = true;
        else
            rc = -1;
    } else {
        for (uint32_t e = 0; e < n && rc == 0; e++) {
            if (!(r->trk[e] = new_listener(r, e))) {
                rc = -1;
                break;
            }
            r->ntrk = e + 1;
            r->need[r->nneed++] = e;
        }
    }
    pthread_mutex_unlock(&r->tmu);
    return rc;
}

void rs_track_stop(struct rstore *r) {
    if (!r->trk) goto out;
    pthread_mutex_lock(&r->tmu);
    r->wstop = true;
    pthread_cond_broadcast(&r->wcv);
    pthread_mutex_unlock(&r->tmu);
    if (r->watching) pthread_join(r->watch, NULL);
    pthread_cond_destroy(&r->wcv);
    for (uint32_t e = 0; e < r->ntrk; e++) {
        struct rtrack *t = r->trk[e];
        if (!t) continue;
        pthread_mutex_lock(&t->mu);
        t->stop = true;
        if (t->fd >= 0) shutdown(t->fd, SHUT_RDWR);
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
    }
    /* Every listener joined before any is freed: a listener going down looks at the
     * others' state (set_up). */
    for (uint32_t e = 0; e < r->ntrk; e++)
        if (r->trk[e] && r->trk[e]->started) pthread_join(r->trk[e]->th, NULL);
    for (uint32_t e = 0; e < r->ntrk; e++) {
        struct rtrack *t = r->trk[e];
        if (!t) continue;
        pthread_mutex_destroy(&t->mu);
        pthread_cond_destroy(&t->cv);
        free(t);
    }
    free(r->trk);
    r->trk = NULL;
out:
    mcache_free(r->cache);
    r->cache = NULL;
}
