/* The master reporter (see reporter.h and docs/fleet.md). */
#include "server/fleet/reporter.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "lmcache/umbp_client.h"
#include "server/fleet/ptable.h"

#define HASH_LEN      32
#define HEX_LEN       64
#define BATCH_MAX     4096       /* hashes per RPC, and queued hashes taken per flush */
#define KICK_PENDING  1024       /* queued hashes that wake the thread before its interval */
#define TRACKED_MAX   (8u << 20) /* distinct hashes tracked; more are not reported */
#define RPC_TIMEOUT   2000       /* ms */
#define RETRY_MS      1000       /* between registration attempts */
#define DEFAULT_HB_MS 5000       /* when the master returns no interval */

enum { T_DRAM = 0, T_SSD = 1, NT = 2 };
static const enum umbp_tier TIER_OF[NT] = {UMBP_TIER_DRAM, UMBP_TIER_SSD};

struct entry {
    struct pt_entry pe;
    struct entry *qnext; /* pending queue link */
    uint32_t cnt[NT];    /* objects with this hash per tier (object groups share a hash) */
    uint8_t reported;    /* tiers the master was last told of (bit per tier) */
    bool queued;
    uint32_t sync_gen; /* the full report that last copied it (0: none) */
};

struct reporter {
    struct engine *e;
    struct logger *lg;
    char *address, *node_id, *node_address;
    uint32_t flush_ms;
    struct umbp_client *c; /* used by the thread only */
    pthread_t tid;
    bool started;

    /* mu (a leaf): the table, the queue, the stop flag */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct ptable tab;
    struct entry *qhead, *qtail;
    size_t pending;
    bool stopping;

    double next_hb;    /* monotonic seconds; the thread's own */
    uint32_t sync_gen; /* the latest full report; the thread's own */

    /* thread state, read by /status without a lock */
    _Atomic bool connected, registered, dirty;
    _Atomic uint32_t hb_ms;
    _Atomic uint64_t tracked, dropped;
    /* heartbeats the master answered since it last failed, and that count when the last full
     * report completed (-1: none yet): how soon a returning master is re-synced */
    _Atomic uint32_t hb_answered;
    _Atomic int32_t resync_hb;
    pthread_mutex_t err_mu; /* leaf: last_error */
    char last_error[256];

    struct metric *m_reports, *m_revokes, *m_rep_hashes, *m_rev_hashes, *m_failures, *m_full,
        *m_queue, *m_connected, *m_tracked;
};

static uint8_t mask_of(const struct entry *en) {
    return (uint8_t)((en->cnt[T_DRAM] ? 1 : 0) | (en->cnt[T_SSD] ? 2 : 0));
}

static struct entry *do_find(struct reporter *r, const uint8_t *hash) {
    struct pt_entry *p = ptable_find(&r->tab, hash);
    return p ? PT_OWNER(p, struct entry, pe) : NULL;
}

static void do_queue(struct reporter *r, struct entry *en) {
    if (en->queued) return;
    en->queued = true;
    en->qnext = NULL;
    if (r->qtail)
        r->qtail->qnext = en;
    else
        r->qhead = en;
    r->qtail = en;
    if (++r->pending == KICK_PENDING) pthread_cond_signal(&r->cv);
}

/* Drops an entry nobody holds and the master was told is gone. */
static void do_forget(struct reporter *r, struct entry *en) {
    ptable_remove(&r->tab, &en->pe);
    free(en);
    atomic_fetch_sub(&r->tracked, 1);
}

/* The engine's placement listener: data-path threads, cache locks held. O(1) under mu. */
static void on_placement(void *arg, const uint8_t hash[32], int tier, bool present) {
    struct reporter *r = arg;
    if (tier == ENGINE_TIER_OBJ) return; /* shared by the fleet: not a placement of this node */
    int t = tier == ENGINE_TIER_DRAM ? T_DRAM : T_SSD;
    pthread_mutex_lock(&r->mu);
    struct entry *en = do_find(r, hash);
    if (!en) {
        if (!present || atomic_load(&r->tracked) >= TRACKED_MAX || !(en = calloc(1, sizeof(*en)))) {
            if (present) atomic_fetch_add(&r->dropped, 1);
            pthread_mutex_unlock(&r->mu);
            return;
        }
        ptable_insert(&r->tab, &en->pe, hash);
        atomic_fetch_add(&r->tracked, 1);
    }
    if (present)
        en->cnt[t]++;
    else if (en->cnt[t])
        en->cnt[t]--;
    do_queue(r, en);
    pthread_mutex_unlock(&r->mu);
}

static void set_error(struct reporter *r, const char *msg) {
    pthread_mutex_lock(&r->err_mu);
    snprintf(r->last_error, sizeof(r->last_error), "%s", msg);
    pthread_mutex_unlock(&r->err_mu);
}

/* A failed RPC: the master is unreachable or refused; everything is re-sent in full later. */
static void failed(struct reporter *r, const char *what, int rc, const char *err) {
    metric_inc(r->m_failures, 1);
    if (atomic_exchange(&r->connected, false) || !atomic_load(&r->dirty))
        log_warn(r->lg, "master %s: %s failed (%d): %s; serving on, full report when it is back",
                 r->address, what, rc, err);
    atomic_store(&r->dirty, true);
    atomic_store(&r->hb_answered, 0);
    metric_set(r->m_connected, 0);
    set_error(r, err[0] ? err : what);
}

/* Hex strings of a batch, one allocation. */
struct hexbatch {
    char (*hex)[HEX_LEN + 1];
    const char **ptr;
    size_t n, cap;
};

static int hb_add(struct hexbatch *b, const uint8_t *hash) {
    if (b->n == b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        void *nh = realloc(b->hex, nc * sizeof(*b->hex));
        if (!nh) return -1;
        b->hex = nh;
        void *np = realloc(b->ptr, nc * sizeof(*b->ptr));
        if (!np) return -1;
        b->ptr = np;
        b->cap = nc;
    }
    static const char D[] = "0123456789abcdef";
    for (int i = 0; i < HASH_LEN; i++) {
        b->hex[b->n][2 * i] = D[hash[i] >> 4];
        b->hex[b->n][2 * i + 1] = D[hash[i] & 15];
    }
    b->hex[b->n][HEX_LEN] = 0;
    b->n++;
    return 0;
}

static void hb_free(struct hexbatch *b) {
    free(b->hex);
    free(b->ptr);
    memset(b, 0, sizeof(*b));
}

/* The node's tiers now: DRAM (L1), SSD when fs/dax adapters have a capacity. */
static size_t capacities(struct reporter *r, struct umbp_tier_capacity caps[2]) {
    struct engine_tier_capacity cap;
    engine_tier_capacities(r->e, &cap);
    caps[0] = (struct umbp_tier_capacity){UMBP_TIER_DRAM, cap.dram_total, cap.dram_available};
    caps[1] = (struct umbp_tier_capacity){UMBP_TIER_SSD, cap.ssd_total, cap.ssd_available};
    return cap.ssd_total ? 2 : 1;
}

enum hb_result { HB_ALIVE, HB_RESYNC, HB_UNKNOWN, HB_FAILED };

/* One capacity-carrying heartbeat; sets the next deadline. HB_RESYNC: the master asks for every
 * placement again (it had expired the node, wiping them, and this heartbeat revived it);
 * HB_UNKNOWN: it forgot the node, which must register again. Both leave the reporter dirty. */
static enum hb_result heartbeat(struct reporter *r) {
    bool alive = false;
    char err[256] = "";
    struct umbp_tier_capacity caps[2];
    size_t ncaps = capacities(r, caps);
    r->next_hb = clock_mono() + atomic_load(&r->hb_ms) / 1000.0;
    int rc = umbp_client_heartbeat_caps(r->c, caps, ncaps, &alive, err, sizeof(err));
    if (rc != 0) {
        failed(r, "Heartbeat", rc, err);
        return HB_FAILED;
    }
    atomic_fetch_add(&r->hb_answered, 1);
    if (!alive) {
        /* the master forgot us (restart, or our record was reaped): register anew */
        log_warn(r->lg, "master %s does not know node %s: registering again", r->address,
                 r->node_id);
        atomic_store(&r->registered, false);
        atomic_store(&r->dirty, true);
        return HB_UNKNOWN;
    }
    if (!atomic_exchange(&r->connected, true)) {
        metric_set(r->m_connected, 1);
        log_info(r->lg, "master %s answers again", r->address);
    }
    if (umbp_client_full_sync_requested(r->c)) {
        log_warn(r->lg,
                 "master %s had expired node %s and dropped its placements: reporting "
                 "them again",
                 r->address, r->node_id);
        atomic_store(&r->dirty, true);
        return HB_RESYNC;
    }
    return HB_ALIVE;
}

/* Sends b in RPCs of at most BATCH_MAX hashes. Returns 0 or the first failure. Heartbeats
 * when one is due between RPCs, so that a long send (a full report of millions of hashes)
 * does not let the node expire; a heartbeat that is not a plain ALIVE stops the send (the
 * reporter is dirty then, and a full report follows). */
static int send_batch(struct reporter *r, struct hexbatch *b, int t, bool report) {
    for (size_t i = 0; i < b->n; i++) b->ptr[i] = b->hex[i];
    char err[256] = "";
    for (size_t off = 0; off < b->n; off += BATCH_MAX) {
        if (clock_mono() >= r->next_hb && heartbeat(r) != HB_ALIVE) return -1;
        size_t n = b->n - off < BATCH_MAX ? b->n - off : BATCH_MAX;
        int rc = report ? umbp_report_external_kv_blocks(r->c, r->node_id, b->ptr + off, n,
                                                         TIER_OF[t], err, sizeof(err))
                        : umbp_revoke_external_kv_blocks(r->c, r->node_id, b->ptr + off, n,
                                                         TIER_OF[t], err, sizeof(err));
        if (rc != 0) {
            failed(r, report ? "ReportExternalKvBlocks" : "RevokeExternalKvBlocks", rc, err);
            return rc;
        }
        metric_inc(report ? r->m_reports : r->m_revokes, 1);
        metric_inc(report ? r->m_rep_hashes : r->m_rev_hashes, (double)n);
    }
    return 0;
}

/* Takes up to max queued hashes (all with max 0) and records their net change since the last
 * report: rev[t] lost tier t, add[t] gained it. The table then counts them as reported. With
 * out-of-memory the rest is re-sent by a full report. */
static void take_queue(struct reporter *r, size_t max, struct hexbatch *add, struct hexbatch *rev,
                       bool *oom) {
    pthread_mutex_lock(&r->mu);
    size_t n = 0;
    while (r->qhead && (max == 0 || n < max)) {
        struct entry *en = r->qhead;
        r->qhead = en->qnext;
        if (!r->qhead) r->qtail = NULL;
        r->pending--;
        en->queued = false;
        n++;
        uint8_t cur = mask_of(en);
        for (int t = 0; add && t < NT; t++) {
            uint8_t bit = (uint8_t)(1u << t);
            if ((cur & bit) && !(en->reported & bit) && hb_add(&add[t], en->pe.hash) < 0)
                *oom = true;
            if (!(cur & bit) && (en->reported & bit) && hb_add(&rev[t], en->pe.hash) < 0)
                *oom = true;
        }
        en->reported = cur;
        if (!cur) do_forget(r, en);
    }
    metric_set(r->m_queue, (double)r->pending);
    metric_set(r->m_tracked, (double)atomic_load(&r->tracked));
    pthread_mutex_unlock(&r->mu);
}

/* Sends the queued changes: revokes first, then reports (one hash is in at most one of them per
 * tier, so the order between them only matters across flushes, which run one after another). */
static void flush(struct reporter *r) {
    struct hexbatch add[NT] = {0}, rev[NT] = {0};
    bool oom = false;
    bool sending = atomic_load(&r->connected) && !atomic_load(&r->dirty);
    take_queue(r, BATCH_MAX * 4, sending ? add : NULL, rev, &oom);
    if (oom) atomic_store(&r->dirty, true);
    for (int t = 0; sending && !oom && t < NT; t++)
        if (rev[t].n && send_batch(r, &rev[t], t, false) != 0) sending = false;
    for (int t = 0; sending && !oom && t < NT; t++)
        if (add[t].n && send_batch(r, &add[t], t, true) != 0) sending = false;
    for (int t = 0; t < NT; t++) {
        hb_free(&add[t]);
        hb_free(&rev[t]);
    }
}

/* Digests copied out of the table under mu for one step of a full report. */
struct synccopy {
    uint8_t (*hash)[HASH_LEN];
    uint8_t *mask;
    size_t n, taken, cap;
    uint32_t gen;
};

static bool copy_one(struct pt_entry *p, void *arg) {
    struct synccopy *sc = arg;
    struct entry *en = PT_OWNER(p, struct entry, pe);
    if (en->sync_gen == sc->gen) return true; /* copied before the table grew */
    if (sc->taken == sc->cap) return false;
    sc->taken++;
    en->sync_gen = sc->gen;
    uint8_t cur = mask_of(en);
    en->reported = cur; /* what this report tells the master; later changes are queued */
    if (cur) {
        memcpy(sc->hash[sc->n], p->hash, HASH_LEN);
        sc->mask[sc->n++] = cur;
    }
    return true;
}

/* One step of a full report: copies the state of up to sc->cap entries that this report has
 * not copied yet, walking the buckets from *b on, under mu (O(cap) per hold, no allocation).
 * Returns false once the walk is past the last bucket. */
static bool take_sync_batch(struct reporter *r, size_t *b, struct synccopy *sc) {
    sc->n = sc->taken = 0;
    pthread_mutex_lock(&r->mu);
    while (*b < ptable_nbuckets(&r->tab) && ptable_each_in_bucket(&r->tab, *b, copy_one, sc))
        (*b)++;
    bool more = *b < ptable_nbuckets(&r->tab);
    pthread_mutex_unlock(&r->mu);
    return more;
}

/* The idempotent full report: the node's placements are dropped, then every held hash is
 * reported anew, in steps of at most BATCH_MAX entries copied under mu and hex-encoded and sent
 * outside it, so the placement listener never waits long. Why nothing is lost while the lock is
 * dropped (docs/threads.md): only this thread removes entries, and not during a report; a step
 * sets each copied entry's `reported` to the state it copies, so a change after that step is
 * queued and sent by a flush after the report (which follows all its RPCs); an entry changed
 * before its step is copied in its new state (its queued change then nets to nothing); an entry
 * added during the report is queued with `reported` 0 whether or not a step copies it; growth
 * of the table never moves an entry behind the walk, and sync_gen skips one copied twice. */
static int full_sync(struct reporter *r) {
    struct hexbatch hx[NT] = {0};
    struct synccopy sc = {.cap = BATCH_MAX};
    sc.hash = malloc(sc.cap * sizeof(*sc.hash));
    sc.mask = malloc(sc.cap);
    if (++r->sync_gen == 0) r->sync_gen = 1; /* 0 is a new entry's */
    sc.gen = r->sync_gen;
    int rc = -1;
    char err[256] = "";
    if (sc.hash && sc.mask) {
        rc = umbp_revoke_all_external_kv_blocks_for_node(r->c, r->node_id, err, sizeof(err));
        if (rc != 0) failed(r, "RevokeAllExternalKvBlocksForNode", rc, err);
        metric_inc(r->m_revokes, rc == 0);
    }
    size_t b = 0;
    for (bool more = true; rc == 0 && more;) {
        more = take_sync_batch(r, &b, &sc);
        for (int t = 0; t < NT; t++) hx[t].n = 0;
        for (size_t i = 0; rc == 0 && i < sc.n; i++)
            for (int t = 0; rc == 0 && t < NT; t++)
                if ((sc.mask[i] & (1u << t)) && hb_add(&hx[t], sc.hash[i]) < 0) rc = -1;
        for (int t = 0; rc == 0 && t < NT; t++)
            if (hx[t].n) rc = send_batch(r, &hx[t], t, true);
    }
    for (int t = 0; t < NT; t++) hb_free(&hx[t]);
    free(sc.hash);
    free(sc.mask);
    if (rc == 0) {
        atomic_store(&r->dirty, false);
        atomic_store(&r->resync_hb, (int32_t)atomic_load(&r->hb_answered));
        metric_inc(r->m_full, 1);
        log_info(r->lg, "master %s: full report sent (%llu hashes)", r->address,
                 (unsigned long long)atomic_load(&r->tracked));
    }
    return rc;
}

static int do_register(struct reporter *r) {
    struct umbp_tier_capacity caps[2];
    size_t ncaps = capacities(r, caps);
    char err[256] = "";
    int rc = umbp_client_register(r->c, caps, ncaps, err, sizeof(err));
    if (rc == 6 /* ALREADY_EXISTS: our previous life is still alive there */) {
        /* Replace its record rather than adopt it: the record holds that life's address
         * (heartbeats carry none, so peers would be sent there for good) and our client would
         * not count as registered, so stopping would not unregister. */
        log_info(r->lg, "master %s still has node %s from an earlier life: replacing it",
                 r->address, r->node_id);
        rc = umbp_unregister_node(r->c, r->node_id, err, sizeof(err));
        if (rc == 0) rc = umbp_client_register(r->c, caps, ncaps, err, sizeof(err));
    }
    if (rc != 0) {
        failed(r, "RegisterClient", rc, err);
        return rc;
    }
    uint32_t hb = umbp_client_heartbeat_interval_ms(r->c);
    atomic_store(&r->hb_ms, hb ? hb : DEFAULT_HB_MS);
    atomic_store(&r->registered, true);
    atomic_store(&r->connected, true);
    atomic_store(&r->dirty, true);
    metric_set(r->m_connected, 1);
    log_info(r->lg, "registered with master %s as %s (%s), heartbeat every %u ms", r->address,
             r->node_id, r->node_address, atomic_load(&r->hb_ms));
    return 0;
}

/* Waits on the condition variable until ms elapsed, the queue asks for a flush, or stop.
 * Returns false when stopping. */
static bool wait_ms(struct reporter *r, double ms) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long ns = (long long)ts.tv_nsec + (long long)(ms * 1e6);
    ts.tv_sec += (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    pthread_mutex_lock(&r->mu);
    while (!r->stopping && r->pending < KICK_PENDING)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &ts) == ETIMEDOUT) break;
    bool go = !r->stopping;
    pthread_mutex_unlock(&r->mu);
    return go;
}

static void *reporter_main(void *arg) {
    struct reporter *r = arg;
    pthread_setname_np(pthread_self(), "master-reporter");
    r->next_hb = 0;
    for (;;) {
        double now = clock_mono();
        if (!atomic_load(&r->registered)) {
            if (do_register(r) != 0) {
                flush(r); /* keeps the queue short while the master is away */
                if (!wait_ms(r, RETRY_MS)) break;
                continue;
            }
            r->next_hb = now + atomic_load(&r->hb_ms) / 1000.0;
        }
        if (now >= r->next_hb && heartbeat(r) == HB_UNKNOWN) continue;
        if (atomic_load(&r->connected) && atomic_load(&r->dirty)) full_sync(r);
        if (!atomic_load(&r->registered)) continue; /* a heartbeat during the report: forgotten */
        flush(r);
        double until_hb = (r->next_hb - clock_mono()) * 1000.0;
        double w = until_hb < r->flush_ms ? until_hb : r->flush_ms;
        if (!atomic_load(&r->connected) && w < RETRY_MS && until_hb > 0) w = until_hb;
        if (!wait_ms(r, w > 1 ? w : 1)) break;
    }
    return NULL;
}

static json_t *status_json(void *arg) {
    struct reporter *r = arg;
    char le[256];
    pthread_mutex_lock(&r->err_mu);
    snprintf(le, sizeof(le), "%s", r->last_error);
    pthread_mutex_unlock(&r->err_mu);
    pthread_mutex_lock(&r->mu);
    size_t pending = r->pending;
    pthread_mutex_unlock(&r->mu);
    return json_pack("{s:s, s:s, s:s, s:b, s:b, s:b, s:I, s:I, s:I, s:I, s:s, s:i}", "address",
                     r->address, "node_id", r->node_id, "node_address", r->node_address,
                     "connected", atomic_load(&r->connected), "registered",
                     atomic_load(&r->registered), "full_sync_pending", atomic_load(&r->dirty),
                     "heartbeat_interval_ms", (json_int_t)atomic_load(&r->hb_ms), "tracked_hashes",
                     (json_int_t)atomic_load(&r->tracked), "queue_depth", (json_int_t)pending,
                     "untracked_admissions", (json_int_t)atomic_load(&r->dropped), "last_error", le,
                     "resync_heartbeats", (int)atomic_load(&r->resync_hb));
}

static struct metric *counter(struct metrics *m, const char *name, const char *help) {
    struct metric_family *f = metrics_counter(m, name, help, NULL);
    return f ? metric_series(f) : NULL;
}

static struct metric *gauge(struct metrics *m, const char *name, const char *help) {
    struct metric_family *f = metrics_gauge(m, name, help, NULL);
    return f ? metric_series(f) : NULL;
}

struct reporter *reporter_create(struct engine *e, char *err, size_t errlen) {
    const struct server_config *c = e->cfg;
    struct reporter *r = calloc(1, sizeof(*r));
    if (!r) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    r->e = e;
    r->lg = log_get("lmcache.master");
    r->flush_ms = (uint32_t)c->master_report_interval_ms;
    atomic_init(&r->resync_hb, -1);
    char addr[300];
    if (c->node_address && c->node_address[0])
        snprintf(addr, sizeof(addr), "%s", c->node_address);
    else
        snprintf(addr, sizeof(addr), "tcp://%s:%ld", c->host, c->port);
    r->address = strdup(c->master_address);
    r->node_id = strdup(c->node_id && c->node_id[0] ? c->node_id : e->instance_id);
    r->node_address = strdup(addr);
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->err_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (!r->address || !r->node_id || !r->node_address || ptable_init(&r->tab)) {
        errbuf_set(err, errlen, "out of memory");
        reporter_free(r);
        return NULL;
    }
    r->c = umbp_client_new(r->address, r->node_id, r->node_address);
    if (!r->c || umbp_client_set_peer_address(r->c, r->node_address) < 0) {
        errbuf_set(err, errlen, "master client: out of memory");
        reporter_free(r);
        return NULL;
    }
    umbp_client_set_timeout_ms(r->c, RPC_TIMEOUT);
    struct metrics *m = e->metrics;
    r->m_reports = counter(m, "lmcache_mp_master_reports_total",
                           "ReportExternalKvBlocks calls that succeeded");
    r->m_revokes = counter(m, "lmcache_mp_master_revokes_total",
                           "Revoke calls that succeeded (per hash and node-wide)");
    r->m_rep_hashes = counter(m, "lmcache_mp_master_reported_hashes_total",
                              "Placement hashes reported to the master");
    r->m_rev_hashes = counter(m, "lmcache_mp_master_revoked_hashes_total",
                              "Placement hashes revoked at the master");
    r->m_failures =
        counter(m, "lmcache_mp_master_failures_total", "Master RPCs that failed or timed out");
    r->m_full = counter(m, "lmcache_mp_master_full_syncs_total", "Full reports sent");
    r->m_queue = gauge(m, "lmcache_mp_master_queue_depth", "Placement changes waiting to be sent");
    r->m_connected = gauge(m, "lmcache_mp_master_connected", "1 while the master answers");
    r->m_tracked = gauge(m, "lmcache_mp_master_tracked_hashes", "Placement hashes this node holds");
    if (!r->m_reports || !r->m_revokes || !r->m_rep_hashes || !r->m_rev_hashes || !r->m_failures ||
        !r->m_full || !r->m_queue || !r->m_connected || !r->m_tracked) {
        errbuf_set(err, errlen, "master reporter metrics: out of memory");
        reporter_free(r);
        return NULL;
    }
    if (engine_add_placement_listener(e, on_placement, NULL, r) < 0) {
        errbuf_set(err, errlen, "master reporter: too many placement listeners");
        reporter_free(r);
        return NULL;
    }
    engine_set_master_status(e, status_json, r);
    return r;
}

int reporter_start(struct reporter *r, char *err, size_t errlen) {
    int rc = pthread_create(&r->tid, NULL, reporter_main, r);
    if (rc != 0) {
        errbuf_set(err, errlen, "master reporter thread: %s", strerror(rc));
        return -1;
    }
    r->started = true;
    return 0;
}

void reporter_stop(struct reporter *r) {
    if (!r || !r->started) return;
    pthread_mutex_lock(&r->mu);
    r->stopping = true;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->tid, NULL);
    r->started = false;
    if (umbp_client_is_registered(r->c)) {
        char err[256] = "";
        int rc = umbp_client_unregister(r->c, err, sizeof(err));
        if (rc != 0)
            log_warn(r->lg, "master %s: unregister failed (%d): %s", r->address, rc, err);
        else
            log_info(r->lg, "unregistered %s from master %s", r->node_id, r->address);
    }
    atomic_store(&r->registered, false);
    atomic_store(&r->connected, false);
}

void reporter_free(struct reporter *r) {
    if (!r) return;
    if (r->c) umbp_client_free(r->c);
    ptable_fini(&r->tab, offsetof(struct entry, pe));
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->err_mu);
    pthread_cond_destroy(&r->cv);
    free(r->address);
    free(r->node_id);
    free(r->node_address);
    free(r);
}
