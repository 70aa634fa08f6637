/* The Redis metadata store: every operation of mstore.h as a few pipelined commands or
 * server-side Lua scripts (mstore_redis_lua.h) over a pool of hiredis connections.
 *
 * Failures: a transport error or an error reply records a per-thread failure (take_error),
 * the operation returns an empty result, and the RPC layer answers UNAVAILABLE. Within one
 * connect timeout after a failure the same thread fails fast without I/O, so one RPC of
 * several store operations costs at most about one timeout. A broken connection is dropped
 * and the next operation reconnects: the store recovers by itself when Redis returns.
 * NOSCRIPT (a restarted Redis has lost its script cache) loads the script and retries. */
#include "master/mstore_redis.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/hash.h"
#include "base/htab.h"
#include "base/log.h"
#include "base/metrics.h"
#include "master/mstore.h"
#include "master/mstore_redis_lua.h"

enum {
    S_REGISTER,
    S_HEARTBEAT,
    S_EVENTS,
    S_WIPE_BLOCKS,
    S_WIPE_EXTKV,
    S_EXT_REPORT,
    S_EXT_REVOKE,
    S_EXT_REVOKE_TIER,
    S_MATCH,
    S_HIT_GC,
    S_ROUTE_GET,
    S_EXISTS,
    S_LIST_ALIVE,
    S_UNREGISTER,
    S_EXPIRE,
    S_COUNT
};

static const char *const SCRIPT_SRC[S_COUNT] = {
    [S_REGISTER] = RLUA_REGISTER,     [S_HEARTBEAT] = RLUA_HEARTBEAT,
    [S_EVENTS] = RLUA_EVENTS,         [S_WIPE_BLOCKS] = RLUA_WIPE_BLOCKS,
    [S_WIPE_EXTKV] = RLUA_WIPE_EXTKV, [S_EXT_REPORT] = RLUA_EXT_REPORT,
    [S_EXT_REVOKE] = RLUA_EXT_REVOKE, [S_EXT_REVOKE_TIER] = RLUA_EXT_REVOKE_TIER,
    [S_MATCH] = RLUA_MATCH,           [S_HIT_GC] = RLUA_HIT_GC,
    [S_ROUTE_GET] = RLUA_ROUTE_GET,   [S_EXISTS] = RLUA_EXISTS,
    [S_LIST_ALIVE] = RLUA_LIST_ALIVE, [S_UNREGISTER] = RLUA_UNREGISTER,
    [S_EXPIRE] = RLUA_EXPIRE,
};

static const char *const OP_NAMES[] = {"RegisterClient",
                                       "UnregisterClient",
                                       "ApplyHeartbeat",
                                       "ExpireStaleClients",
                                       "AliveClientCount",
                                       "GetClientStatus",
                                       "GetClientTags",
                                       "ListAliveClients",
                                       "RegisterExternalKv",
                                       "UnregisterExternalKv",
                                       "UnregisterExternalKvByTier",
                                       "UnregisterExternalKvByNode",
                                       "MatchExternalKv",
                                       "GetExternalKvHitCounts",
                                       "GarbageCollectHits",
                                       "GetExternalKvCount",
                                       "BatchLookupBlockForRouteGet",
                                       "BatchExistsBlock"};
enum {
    OP_REGISTER,
    OP_UNREGISTER,
    OP_HEARTBEAT,
    OP_EXPIRE,
    OP_ALIVE_COUNT,
    OP_STATUS,
    OP_TAGS,
    OP_LIST_ALIVE,
    OP_XREPORT,
    OP_XREVOKE,
    OP_XREVOKE_TIER,
    OP_XREVOKE_NODE,
    OP_MATCH,
    OP_HITS,
    OP_HIT_GC,
    OP_XCOUNT,
    OP_ROUTE_GET,
    OP_EXISTS,
    OP_COUNT
};

struct ident {
    struct htab_node hn;
    uint64_t h;
    uint32_t idx;
    char id[];
};

struct slot {
    redisContext *c;
    bool busy;
};

/* One Redis endpoint and its connection pool. */
struct endpoint {
    char host[256];
    int port;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct slot *slots;
    uint32_t nslots;
};

struct rstore {
    struct mstore base;
    struct logger *lg;
    struct endpoint *ep; /* ep[0] holds the control keys and shard 0 */
    uint32_t nep;        /* > 1: multi mode, shard s on ep[s] */
    char *password;
    uint32_t connect_ms, socket_ms;
    uint32_t nshards;
    char ctl[300]; /* "{umbp:<ns>}" */
    char **tag;    /* per shard */
    char k_alive[320], k_peers[320], k_expired[320], k_node_prefix[320];

    pthread_mutex_t mu; /* sha */
    char sha[S_COUNT][41];

    pthread_mutex_t imu; /* interned node ids */
    struct htab itab;
    struct ident **ids;
    uint32_t nids, capids;

    struct metric *m_transport, *m_noscript, *m_pool_exhausted, *m_pool_wait;
    struct metric_family *f_degraded;
    _Atomic uint64_t last_warn_ns;
    struct metric *m_lat[OP_COUNT];
};
#define RS(s) ((struct rstore *)(s))

/* ---- per-thread failure ---- */

static _Thread_local struct {
    const struct rstore *owner;
    bool set;
    uint64_t at_ns;
    char msg[384];
} t_err;

static void set_err(struct rstore *r, const char *fmt, ...) {
    if (t_err.set && t_err.owner == r) return; /* keep the first reason */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_err.msg, sizeof(t_err.msg), fmt, ap);
    va_end(ap);
    t_err.owner = r;
    t_err.set = true;
    t_err.at_ns = clock_mono_ns();
}

static bool failing(struct rstore *r) {
    if (!t_err.set || t_err.owner != r) return false;
    if (clock_mono_ns() - t_err.at_ns < (uint64_t)r->connect_ms * 1000000ull) return true;
    t_err.set = false; /* stale: nobody took it (a metrics scrape); try again */
    return false;
}

static int rs_take_error(struct mstore *s, char *buf, size_t len) {
    if (!t_err.set || t_err.owner != RS(s)) return 0;
    snprintf(buf, len, "%s", t_err.msg);
    t_err.set = false;
    return 1;
}

/* ---- interned node ids (stable pointers for struct mstore_loc / match results) ---- */

static uint64_t ident_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return HTAB_ENTRY(n, struct ident, hn)->h;
}

static const char *intern(struct rstore *r, const char *p, size_t n, uint32_t *idx) {
    uint64_t h = fnv1a64(p, n);
    const char *out = NULL;
    pthread_mutex_lock(&r->imu);
    for (struct htab_node *e = *htab_bucket(&r->itab, h); e; e = e->next) {
        struct ident *d = HTAB_ENTRY(e, struct ident, hn);
        if (d->h == h && strlen(d->id) == n && memcmp(d->id, p, n) == 0) {
            *idx = d->idx;
            out = d->id;
            goto done;
        }
    }
    if (r->nids == r->capids) {
        uint32_t nc = r->capids ? r->capids * 2 : 64;
        struct ident **v = realloc(r->ids, nc * sizeof(*v));
        if (!v) goto done;
        r->ids = v;
        r->capids = nc;
    }
    struct ident *d = malloc(sizeof(*d) + n + 1);
    if (!d) goto done;
    d->h = h;
    d->idx = r->nids;
    memcpy(d->id, p, n);
    d->id[n] = 0;
    r->ids[r->nids++] = d;
    htab_insert(&r->itab, &d->hn, h);
    *idx = d->idx;
    out = d->id;
done:
    pthread_mutex_unlock(&r->imu);
    return out;
}

/* ---- command batches: every argument copied into one buffer, sent as one pipeline ---- */

struct bcmd {
    size_t a0, argc;
    int script; /* -1: plain command */
    redisReply *rep;
};

struct batch {
    char *buf;
    size_t blen, bcap;
    size_t *aoff, *alen;
    size_t na, acap;
    size_t astart; /* offset of the argument being written */
    struct bcmd *c;
    size_t nc, ccap;
    bool oom;
};

static void b_free(struct batch *b) {
    for (size_t i = 0; i < b->nc; i++)
        if (b->c[i].rep) freeReplyObject(b->c[i].rep);
    free(b->buf);
    free(b->aoff);
    free(b->alen);
    free(b->c);
    memset(b, 0, sizeof(*b));
}

static void b_put(struct batch *b, const void *p, size_t n) {
    if (b->oom) return;
    if (b->blen + n > b->bcap) {
        size_t nc = b->bcap ? b->bcap : 4096;
        while (nc < b->blen + n) nc *= 2;
        char *nb = realloc(b->buf, nc);
        if (!nb) {
            b->oom = true;
            return;
        }
        b->buf = nb;
        b->bcap = nc;
    }
    if (n) memcpy(b->buf + b->blen, p, n);
    b->blen += n;
}

static void b_puts(struct batch *b, const char *s) { b_put(b, s, strlen(s)); }

static void b_end(struct batch *b) {
    if (b->oom) return;
    if (b->na == b->acap) {
        size_t nc = b->acap ? b->acap * 2 : 64;
        size_t *o = realloc(b->aoff, nc * sizeof(*o));
        if (o) b->aoff = o;
        size_t *l = realloc(b->alen, nc * sizeof(*l));
        if (l) b->alen = l;
        if (!o || !l) {
            b->oom = true;
            return;
        }
        b->acap = nc;
    }
    b->aoff[b->na] = b->astart;
    b->alen[b->na] = b->blen - b->astart;
    b->na++;
    b->c[b->nc - 1].argc++;
    b->astart = b->blen;
}

static void b_arg(struct batch *b, const void *p, size_t n) {
    b_put(b, p, n);
    b_end(b);
}

static void b_str(struct batch *b, const char *s) { b_arg(b, s, strlen(s)); }

static void b_u64(struct batch *b, uint64_t v) {
    char t[24];
    int n = snprintf(t, sizeof(t), "%llu", (unsigned long long)v);
    b_arg(b, t, (size_t)n);
}

static void b_i64(struct batch *b, int64_t v) {
    char t[24];
    int n = snprintf(t, sizeof(t), "%lld", (long long)v);
    b_arg(b, t, (size_t)n);
}

/* Starts a command: a plain one (name) or a script call with numkeys keys to follow. */
static void b_cmd(struct batch *b, const char *name, int script, size_t numkeys) {
    if (b->oom) return;
    if (b->nc == b->ccap) {
        size_t nc = b->ccap ? b->ccap * 2 : 8;
        struct bcmd *c = realloc(b->c, nc * sizeof(*c));
        if (!c) {
            b->oom = true;
            return;
        }
        b->c = c;
        b->ccap = nc;
    }
    b->c[b->nc++] = (struct bcmd){.a0 = b->na, .script = script};
    b->astart = b->blen;
    if (script >= 0) {
        b_str(b, "EVALSHA");
        b_str(b, ""); /* the SHA, filled in at send time */
        b_u64(b, numkeys);
    } else {
        b_str(b, name);
    }
}

/* ---- the connection pool ---- */

static redisContext *dial(struct rstore *r, struct endpoint *ep, char *why, size_t wlen) {
    struct timeval ct = {r->connect_ms / 1000, (r->connect_ms % 1000) * 1000};
    redisContext *c = redisConnectWithTimeout(ep->host, ep->port, ct);
    if (!c || c->err) {
        snprintf(why, wlen, "connect %.100s:%d: %.200s", ep->host, ep->port,
                 c ? c->errstr : "no memory");
        redisFree(c);
        return NULL;
    }
    struct timeval st = {r->socket_ms / 1000, (r->socket_ms % 1000) * 1000};
    redisSetTimeout(c, st);
    redisEnableKeepAlive(c);
    if (*r->password) {
        redisReply *rep = redisCommand(c, "AUTH %s", r->password);
        bool ok = rep && rep->type != REDIS_REPLY_ERROR;
        if (!ok)
            snprintf(why, wlen, "AUTH %.100s:%d: %.200s", ep->host, ep->port,
                     rep ? rep->str : c->errstr);
        if (rep) freeReplyObject(rep);
        if (!ok) {
            redisFree(c);
            return NULL;
        }
    }
    return c;
}

static struct slot *pool_get(struct rstore *r, struct endpoint *ep) {
    pthread_mutex_lock(&ep->mu);
    uint64_t t0 = 0;
    for (;;) {
        for (uint32_t i = 0; i < ep->nslots; i++)
            if (!ep->slots[i].busy) {
                ep->slots[i].busy = true;
                pthread_mutex_unlock(&ep->mu);
                if (t0 && r->m_pool_exhausted) metric_inc(r->m_pool_exhausted, 1);
                if (t0 && r->m_pool_wait)
                    metric_observe(r->m_pool_wait, (double)(clock_mono_ns() - t0) / 1e9);
                return &ep->slots[i];
            }
        if (!t0) t0 = clock_mono_ns();
        pthread_cond_wait(&ep->cv, &ep->mu);
    }
}

static void pool_put(struct endpoint *ep, struct slot *s) {
    pthread_mutex_lock(&ep->mu);
    s->busy = false;
    pthread_cond_signal(&ep->cv);
    pthread_mutex_unlock(&ep->mu);
}

static bool load_script(struct rstore *r, redisContext *c, int sc) {
    redisReply *rep = redisCommand(c, "SCRIPT LOAD %s", SCRIPT_SRC[sc]);
    bool ok = rep && rep->type == REDIS_REPLY_STRING && rep->len == 40;
    if (ok) {
        pthread_mutex_lock(&r->mu);
        memcpy(r->sha[sc], rep->str, 40);
        r->sha[sc][40] = 0;
        pthread_mutex_unlock(&r->mu);
    }
    if (rep) freeReplyObject(rep);
    return ok;
}

/* Sends commands [from, to) of b on c and reads their replies. 0, or -1 on a transport
 * error (why filled). */
static int send_range(struct rstore *r, struct endpoint *ep, redisContext *c, struct batch *b,
                      const bool *only, char *why, size_t wlen) {
    size_t maxargc = 0;
    for (size_t i = 0; i < b->nc; i++)
        if (b->c[i].argc > maxargc) maxargc = b->c[i].argc;
    const char **argv = malloc((maxargc + 1) * sizeof(*argv));
    size_t *argl = malloc((maxargc + 1) * sizeof(*argl));
    if (!argv || !argl) {
        free(argv);
        free(argl);
        snprintf(why, wlen, "out of memory");
        return -2;
    }
    char sha[S_COUNT][41];
    pthread_mutex_lock(&r->mu);
    memcpy(sha, r->sha, sizeof(sha));
    pthread_mutex_unlock(&r->mu);
    size_t sent = 0;
    for (size_t i = 0; i < b->nc; i++) {
        if (only && !only[i]) continue;
        struct bcmd *cm = &b->c[i];
        for (size_t a = 0; a < cm->argc; a++) {
            argv[a] = b->buf + b->aoff[cm->a0 + a];
            argl[a] = b->alen[cm->a0 + a];
        }
        if (cm->script >= 0) {
            argv[1] = sha[cm->script];
            argl[1] = 40;
        }
        redisAppendCommandArgv(c, (int)cm->argc, argv, argl);
        sent++;
    }
    free(argv);
    free(argl);
    for (size_t i = 0; i < b->nc; i++) {
        if (only && !only[i]) continue;
        void *rep = NULL;
        if (redisGetReply(c, &rep) != REDIS_OK || !rep) {
            snprintf(why, wlen, "%.100s:%d: %.200s", ep->host, ep->port,
                     c->err ? c->errstr : "connection lost");
            return -1;
        }
        if (b->c[i].rep) freeReplyObject(b->c[i].rep);
        b->c[i].rep = rep;
    }
    (void)sent;
    return 0;
}

static bool is_noscript(const redisReply *rep) {
    return rep && rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, "NOSCRIPT", 8) == 0;
}

/* Runs the batch: one round trip (two after a NOSCRIPT, one more after a stale pooled
 * connection). 0; -1 with the thread's failure recorded. */
static int run_ep(struct rstore *r, struct endpoint *ep, struct batch *b, const char *degrade) {
    if (b->oom) {
        set_err(r, "out of memory");
        return -1;
    }
    if (!degrade && failing(r)) return -1;
    if (!b->nc) return 0;
    char why[384] = "";
    struct slot *s = pool_get(r, ep);
    int rc = -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        bool fresh = false;
        if (!s->c) {
            s->c = dial(r, ep, why, sizeof(why));
            if (!s->c) break;
            fresh = true;
        }
        /* Scripts never loaded (Redis was down at start): load them now. */
        for (size_t i = 0; i < b->nc; i++) {
            int sc = b->c[i].script;
            if (sc >= 0 && !r->sha[sc][0] && !load_script(r, s->c, sc)) {
                snprintf(why, sizeof(why), "%.100s:%d: SCRIPT LOAD failed", ep->host, ep->port);
                goto out;
            }
        }
        int e = send_range(r, ep, s->c, b, NULL, why, sizeof(why));
        if (e == -2) goto out;
        if (e) {
            if (r->m_transport) metric_inc(r->m_transport, 1);
            redisFree(s->c);
            s->c = NULL;
            if (fresh) break;
            continue; /* a pooled connection may be stale: one retry on a new one */
        }
        bool any = false;
        bool *redo = calloc(b->nc, sizeof(bool));
        if (!redo) {
            snprintf(why, sizeof(why), "out of memory");
            goto out;
        }
        for (size_t i = 0; i < b->nc; i++)
            if (is_noscript(b->c[i].rep)) {
                if (!redo[i] && !load_script(r, s->c, b->c[i].script)) {
                    free(redo);
                    snprintf(why, sizeof(why), "%.100s:%d: SCRIPT LOAD failed", ep->host, ep->port);
                    goto out;
                }
                redo[i] = any = true;
            }
        if (any) {
            if (r->m_noscript) metric_inc(r->m_noscript, 1);
            e = send_range(r, ep, s->c, b, redo, why, sizeof(why));
        }
        free(redo);
        if (e) {
            if (r->m_transport) metric_inc(r->m_transport, 1);
            redisFree(s->c);
            s->c = NULL;
            goto out;
        }
        rc = 0;
        for (size_t i = 0; i < b->nc; i++)
            if (b->c[i].rep->type == REDIS_REPLY_ERROR) {
                snprintf(why, sizeof(why), "%.100s:%d: %.200s", ep->host, ep->port,
                         b->c[i].rep->str);
                rc = -1;
                break;
            }
        break;
    }
out:
    pool_put(ep, s);
    if (rc) {
        if (!*why) snprintf(why, sizeof(why), "%.100s:%d: unreachable", ep->host, ep->port);
        /* At most one WARN a second while Redis is down (every RPC fails the same way). */
        uint64_t now = clock_mono_ns(), last = atomic_load(&r->last_warn_ns);
        bool say = now - last >= 1000000000ull &&
                   atomic_compare_exchange_strong(&r->last_warn_ns, &last, now);
        if (degrade) {
            /* Multi mode: a failed shard reads as misses. */
            if (say)
                log_warn(r->lg, "[MetadataStore] redis shard degraded (%s): %.300s", degrade, why);
            const char *v[] = {"redis", degrade};
            if (r->f_degraded) metrics_add(r->f_degraded, v, 1);
        } else {
            set_err(r, "%s", why);
            if (say) log_warn(r->lg, "[MetadataStore] redis: %.300s", why);
        }
    }
    return rc;
}

/* The control endpoint (and the only one outside multi mode). */
static int run(struct rstore *r, struct batch *b) { return run_ep(r, &r->ep[0], b, NULL); }

static struct endpoint *ep_of(const struct rstore *r, uint32_t shard) {
    return r->nep > 1 ? &r->ep[shard] : &r->ep[0];
}

/* Per-shard calls grouped into one pipeline per endpoint (one in all outside multi mode):
 * srep[s] gets shard s's reply, NULL when shard s was not asked or, in multi mode, failed
 * (read as misses). -1 when the single endpoint failed (recorded). */
static struct batch *sbatch(const struct rstore *r, struct batch *bs, uint32_t s) {
    return &bs[r->nep > 1 ? s : 0];
}

static int run_shards(struct rstore *r, struct batch *bs, const uint32_t *cmdof, redisReply **srep,
                      const char *method) {
    bool *ok = calloc(r->nep, sizeof(bool));
    if (!ok) {
        set_err(r, "out of memory");
        return -1;
    }
    int rc = 0;
    for (uint32_t e = 0; e < r->nep; e++) {
        if (!bs[e].nc) continue;
        ok[e] = run_ep(r, &r->ep[e], &bs[e], r->nep > 1 ? method : NULL) == 0;
        if (!ok[e] && r->nep == 1) rc = -1;
    }
    for (uint32_t s = 0; s < r->nshards; s++) {
        uint32_t e = r->nep > 1 ? s : 0;
        srep[s] = cmdof[s] != UINT32_MAX && ok[e] ? bs[e].c[cmdof[s]].rep : NULL;
    }
    free(ok);
    return rc;
}

static void free_batches(struct rstore *r, struct batch *bs) {
    for (uint32_t e = 0; bs && e < r->nep; e++) b_free(&bs[e]);
    free(bs);
}

/* ---- key names ---- */

static uint32_t shard_of(const struct rstore *r, const void *p, size_t n) {
    return r->nshards == 1 ? 0 : fnv1a32(p, n) % r->nshards;
}

static void b_node_key(struct batch *b, const struct rstore *r, const char *id) {
    b_puts(b, r->ctl);
    b_puts(b, ":node:");
    b_puts(b, id);
    b_end(b);
}

static void b_shard_key(struct batch *b, const struct rstore *r, uint32_t s, const char *mid,
                        const void *p, size_t n, const char *tail) {
    b_puts(b, r->tag[s]);
    b_puts(b, mid);
    b_put(b, p, n);
    if (tail) b_puts(b, tail);
    b_end(b);
}

static void b_control_keys(struct batch *b, const struct rstore *r, const char *id) {
    b_node_key(b, r, id);
    b_str(b, r->k_alive);
    b_str(b, r->k_peers);
    b_str(b, r->k_expired);
}

/* ---- encodings of the node record ---- */

static void b_caps(struct batch *b, const struct mstore_caps *c) {
    char t[80];
    bool first = true;
    for (int i = 0; i < MSTORE_NTIERS; i++) {
        if (!(c->mask & (1u << i))) continue;
        int n = snprintf(t, sizeof(t), "%s%d:%llu:%llu", first ? "" : ";", i,
                         (unsigned long long)c->total[i], (unsigned long long)c->avail[i]);
        b_put(b, t, (size_t)n);
        first = false;
    }
    b_end(b);
}

static void parse_caps(const char *s, size_t n, struct mstore_caps *c) {
    memset(c, 0, sizeof(*c));
    char buf[256];
    if (n >= sizeof(buf)) n = sizeof(buf) - 1;
    memcpy(buf, s, n);
    buf[n] = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ";", &save); tok;
         tok = strtok_r(NULL, ";", &save)) {
        int t;
        unsigned long long tot, av;
        if (sscanf(tok, "%d:%llu:%llu", &t, &tot, &av) == 3 && mstore_tier_valid(t)) {
            c->mask |= (uint8_t)(1u << t);
            c->total[t] = tot;
            c->avail[t] = av;
        }
    }
}

/* Tags joined with '\n'; a '\\' or '\n' inside a tag is escaped as "\\\\" or "\\n". */
static void b_tags(struct batch *b, char *const *tags, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (i) b_put(b, "\n", 1);
        for (const char *p = tags[i]; *p; p++) {
            if (*p == '\\')
                b_put(b, "\\\\", 2);
            else if (*p == '\n')
                b_put(b, "\\n", 2);
            else
                b_put(b, p, 1);
        }
    }
    b_end(b);
}

static int parse_tags(const char *s, size_t n, char ***out, size_t *nout) {
    *out = NULL;
    *nout = 0;
    if (!n) return 0;
    size_t cnt = 1;
    for (size_t i = 0; i < n; i++) cnt += s[i] == '\n';
    char **v = calloc(cnt, sizeof(*v));
    if (!v) return -1;
    size_t k = 0, i = 0;
    while (k < cnt) {
        size_t j = i;
        while (j < n && s[j] != '\n') j++;
        char *t = malloc(j - i + 1);
        if (!t) {
            for (size_t q = 0; q < k; q++) free(v[q]);
            free(v);
            return -1;
        }
        size_t o = 0;
        for (size_t p = i; p < j; p++) {
            if (s[p] == '\\' && p + 1 < j) {
                p++;
                t[o++] = s[p] == 'n' ? '\n' : s[p];
            } else {
                t[o++] = s[p];
            }
        }
        t[o] = 0;
        v[k++] = t;
        i = j + 1;
    }
    *out = v;
    *nout = cnt;
    return 0;
}

/* ---- timing ---- */

#define OP_BEGIN(r) uint64_t op_t0_ = (r)->m_lat[0] ? clock_mono_ns() : 0
#define OP_END(r, op)                                                                              \
    do {                                                                                           \
        if ((r)->m_lat[op])                                                                        \
            metric_observe((r)->m_lat[op], (double)(clock_mono_ns() - op_t0_) / 1e9);              \
    } while (0)

static long long rep_int(const redisReply *rep) {
    if (!rep) return 0;
    if (rep->type == REDIS_REPLY_INTEGER) return rep->integer;
    if (rep->type == REDIS_REPLY_STRING) return strtoll(rep->str, NULL, 10);
    return 0;
}

/* ---- clients ---- */

static int rs_register(struct mstore *s, const struct mstore_reg *g, int64_t now,
                       int64_t stale_after) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, NULL, S_REGISTER, 4);
    b_control_keys(&b, r, g->node_id);
    b_str(&b, g->node_id);
    b_i64(&b, now);
    b_i64(&b, stale_after);
    b_str(&b, g->node_address ? g->node_address : "");
    b_str(&b, g->peer_address ? g->peer_address : "");
    b_caps(&b, &g->caps);
    b_arg(&b, g->engine_desc, g->engine_desc_len);
    b_tags(&b, g->tags, g->ntags);
    int rc = run(r, &b) ? -1 : (int)rep_int(b.c[0].rep);
    b_free(&b);
    OP_END(r, OP_REGISTER);
    return rc;
}

/* Drops a node's blocks and external-KV entries, shard by shard, a bounded chunk per
 * script so that a large node never holds Redis for long. */
static void wipe_node(struct rstore *r, const char *id, bool blocks, bool extkv) {
    size_t idl = strlen(id);
    for (uint32_t sh = 0; sh < r->nshards; sh++) {
        for (int kind = 0; kind < 2; kind++) {
            if ((kind == 0 && !blocks) || (kind == 1 && !extkv)) continue;
            for (;;) {
                struct batch b = {0};
                if (kind == 0) {
                    b_cmd(&b, NULL, S_WIPE_BLOCKS, 1);
                    b_shard_key(&b, r, sh, ":node:", id, idl, ":blocks");
                } else {
                    b_cmd(&b, NULL, S_WIPE_EXTKV, 2);
                    b_shard_key(&b, r, sh, ":extkv:node:", id, idl, NULL);
                    b_shard_key(&b, r, sh, ":extkv_count", "", 0, NULL);
                }
                b_str(&b, id);
                b_u64(&b, MSTORE_REDIS_CHUNK);
                /* Best effort per shard in multi mode (a failed one keeps its entries). */
                long long n = run_ep(r, ep_of(r, sh), &b, r->nep > 1 ? "WipeNode" : NULL)
                                  ? 0
                                  : rep_int(b.c[0].rep);
                b_free(&b);
                if (n <= 0) break;
            }
        }
    }
}

static bool rs_unregister(struct mstore *s, const char *node_id) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, NULL, S_UNREGISTER, 4);
    b_control_keys(&b, r, node_id);
    b_str(&b, node_id);
    bool had = run(r, &b) == 0 && rep_int(b.c[0].rep) == 1;
    b_free(&b);
    if (had) wipe_node(r, node_id, true, true);
    OP_END(r, OP_UNREGISTER);
    return had;
}

static void b_events(struct batch *b, struct rstore *r, const char *id,
                     const struct mstore_event *ev, size_t n) {
    size_t idl = strlen(id);
    for (size_t i = 0; i < n; i++) {
        const char *k = ev[i].key;
        size_t kl = strlen(k);
        uint32_t sh = shard_of(r, k, kl);
        b_str(b, ev[i].kind == MSTORE_EV_REMOVE ? "1" : "0");
        b_shard_key(b, r, sh, ":block:", k, kl, NULL);
        b_shard_key(b, r, sh, ":node:", id, idl, ":blocks");
        b_u64(b, (uint64_t)ev[i].tier);
        b_u64(b, ev[i].size);
    }
}

static enum mstore_hb rs_heartbeat(struct mstore *s, const char *node_id, uint64_t seq, int64_t now,
                                   const struct mstore_caps *caps, const struct mstore_event *ev,
                                   size_t nev, bool full, uint64_t *acked) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    *acked = 0;
    enum mstore_hb res = MSTORE_HB_UNKNOWN;
    /* The CAS applies the first chunk itself, except in multi mode (events go to their
     * shards' endpoints). */
    size_t first = full || r->nep > 1 ? 0 : (nev < MSTORE_REDIS_CHUNK ? nev : MSTORE_REDIS_CHUNK);
    struct batch b = {0};
    b_cmd(&b, NULL, S_HEARTBEAT, 4);
    b_control_keys(&b, r, node_id);
    b_str(&b, node_id);
    b_i64(&b, now);
    b_u64(&b, seq);
    b_u64(&b, seq - 1);
    b_caps(&b, caps);
    b_str(&b, full ? "1" : "0");
    b_events(&b, r, node_id, ev, first);
    if (run(r, &b) == 0) {
        redisReply *rep = b.c[0].rep;
        if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 2) {
            long long st = rep_int(rep->element[0]);
            res = st == 0 ? MSTORE_HB_APPLIED : st == 1 ? MSTORE_HB_SEQ_GAP : MSTORE_HB_UNKNOWN;
            *acked = rep->element[1]->type == REDIS_REPLY_STRING
                         ? strtoull(rep->element[1]->str, NULL, 10)
                         : 0;
        }
    }
    b_free(&b);
    if (res == MSTORE_HB_APPLIED) {
        /* The rest in bounded chunks, in order; a full sync first wipes the node's blocks.
         * Readers may see a chunk boundary (as readers of the reference see shard ones). */
        if (full) wipe_node(r, node_id, true, false);
        bool shard_failed = false;
        struct mstore_event *part = r->nep > 1 ? malloc((nev + 1) * sizeof(*part)) : NULL;
        if (r->nep > 1 && !part) set_err(r, "out of memory");
        for (uint32_t sh = 0;
             sh < (r->nep > 1 ? r->nshards : 1) && !(t_err.set && t_err.owner == r); sh++) {
            const struct mstore_event *pe = ev + first;
            size_t m = nev - first;
            if (part) { /* this shard's events, in order */
                m = 0;
                for (size_t i = 0; i < nev; i++)
                    if (shard_of(r, ev[i].key, strlen(ev[i].key)) == sh) part[m++] = ev[i];
                pe = part;
            }
            for (size_t i = 0; i < m; i += MSTORE_REDIS_CHUNK) {
                size_t k = m - i < MSTORE_REDIS_CHUNK ? m - i : MSTORE_REDIS_CHUNK;
                struct batch e = {0};
                b_cmd(&e, NULL, S_EVENTS, 0);
                b_str(&e, node_id);
                b_i64(&e, now);
                b_str(&e, full ? "1" : "0");
                b_events(&e, r, node_id, pe + i, k);
                int rc = run_ep(r, ep_of(r, sh), &e, r->nep > 1 ? "ApplyHeartbeat" : NULL);
                b_free(&e);
                if (rc) {
                    shard_failed = true;
                    break;
                }
            }
        }
        free(part);
        /* A step that failed leaves the node behind its sequence: ask for a full sync. */
        if (shard_failed || (t_err.set && t_err.owner == r)) res = MSTORE_HB_SEQ_GAP;
    }
    OP_END(r, OP_HEARTBEAT);
    return res;
}

static size_t ids_of(const redisReply *a, char ***out) {
    *out = NULL;
    if (!a || a->type != REDIS_REPLY_ARRAY || !a->elements) return 0;
    char **v = calloc(a->elements, sizeof(*v));
    size_t n = 0;
    for (size_t i = 0; v && i < a->elements; i++)
        if (a->element[i]->type == REDIS_REPLY_STRING) v[n++] = strdup(a->element[i]->str);
    *out = v;
    return n;
}

static size_t rs_expire(struct mstore *s, int64_t cutoff, int64_t forget_before,
                        void (*fn)(const char *, void *), void *arg) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, NULL, S_EXPIRE, 3);
    b_str(&b, r->k_alive);
    b_str(&b, r->k_peers);
    b_str(&b, r->k_expired);
    b_str(&b, r->k_node_prefix);
    b_i64(&b, cutoff);
    b_i64(&b, forget_before);
    char **ex = NULL, **fg = NULL;
    size_t nex = 0, nfg = 0;
    if (run(r, &b) == 0 && b.c[0].rep->type == REDIS_REPLY_ARRAY && b.c[0].rep->elements == 2) {
        nex = ids_of(b.c[0].rep->element[0], &ex);
        nfg = ids_of(b.c[0].rep->element[1], &fg);
    }
    b_free(&b);
    for (size_t i = 0; i < nex; i++) {
        if (ex[i]) {
            wipe_node(r, ex[i], true, true);
            if (fn) fn(ex[i], arg);
        }
        free(ex[i]);
    }
    for (size_t i = 0; i < nfg; i++) {
        if (fg[i]) wipe_node(r, fg[i], true, true);
        free(fg[i]);
    }
    free(ex);
    free(fg);
    OP_END(r, OP_EXPIRE);
    return nex;
}

static size_t rs_alive_count(struct mstore *s) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, "SCARD", -1, 0);
    b_str(&b, r->k_alive);
    size_t n = run(r, &b) ? 0 : (size_t)rep_int(b.c[0].rep);
    b_free(&b);
    OP_END(r, OP_ALIVE_COUNT);
    return n;
}

static int rs_client_status(struct mstore *s, const char *node_id) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, "HGET", -1, 0);
    b_node_key(&b, r, node_id);
    b_str(&b, "status");
    int st = run(r, &b) ? MSTORE_STATUS_UNKNOWN : (int)rep_int(b.c[0].rep);
    b_free(&b);
    OP_END(r, OP_STATUS);
    return st;
}

static int rs_client_tags(struct mstore *s, const char *node_id, char ***tags, size_t *ntags) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    *tags = NULL;
    *ntags = 0;
    struct batch b = {0};
    b_cmd(&b, "HGET", -1, 0);
    b_node_key(&b, r, node_id);
    b_str(&b, "tags");
    int rc = 0;
    if (run(r, &b) == 0 && b.c[0].rep->type == REDIS_REPLY_STRING)
        rc = parse_tags(b.c[0].rep->str, b.c[0].rep->len, tags, ntags);
    b_free(&b);
    OP_END(r, OP_TAGS);
    return rc;
}

static int rs_list_alive(struct mstore *s, struct mstore_alive **out, size_t *n) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    *out = NULL;
    *n = 0;
    struct batch b = {0};
    b_cmd(&b, NULL, S_LIST_ALIVE, 1);
    b_str(&b, r->k_alive);
    b_str(&b, r->k_node_prefix);
    int rc = 0;
    if (run(r, &b) == 0 && b.c[0].rep->type == REDIS_REPLY_ARRAY) {
        redisReply *a = b.c[0].rep;
        size_t cnt = a->elements / 3;
        struct mstore_alive *v = calloc(cnt + 1, sizeof(*v));
        if (!v) rc = -1;
        for (size_t i = 0; v && i < cnt; i++) {
            redisReply *id = a->element[3 * i], *peer = a->element[3 * i + 1],
                       *caps = a->element[3 * i + 2];
            v[i].node_id = intern(r, id->str, id->len, &v[i].node);
            v[i].peer_address = strndup(peer->str ? peer->str : "", peer->len);
            parse_caps(caps->str ? caps->str : "", caps->len, &v[i].caps);
            if (!v[i].node_id || !v[i].peer_address) rc = -1;
        }
        if (rc && v) {
            for (size_t i = 0; i < cnt; i++) free(v[i].peer_address);
            free(v);
        } else if (v) {
            *out = v;
            *n = cnt;
        }
    }
    b_free(&b);
    OP_END(r, OP_LIST_ALIVE);
    return rc;
}

/* ---- external KV ---- */

static void b_ext_triples(struct batch *b, struct rstore *r, const char *node, char *const *h,
                          size_t n) {
    size_t idl = strlen(node);
    for (size_t i = 0; i < n; i++) {
        size_t hl = strlen(h[i]);
        uint32_t sh = shard_of(r, h[i], hl);
        b_shard_key(b, r, sh, ":extkv:", h[i], hl, NULL);
        b_shard_key(b, r, sh, ":extkv:node:", node, idl, NULL);
        b_shard_key(b, r, sh, ":extkv_count", "", 0, NULL);
    }
}

/* Reports and revokes go in chunks of MSTORE_REDIS_CHUNK hashes, all chunks in one
 * pipeline: one round trip, and no script runs longer than a chunk. */
static int ext_write(struct rstore *r, int script, const char *node, char *const *hashes, size_t n,
                     int tier) {
    bool multi = r->nep > 1;
    if (multi && script == S_EXT_REPORT) {
        /* The alive gate on the control endpoint, then the shards' writes (a node that
         * expires in between may get this one report in: the reference's window too). */
        struct batch g = {0};
        b_cmd(&g, "SISMEMBER", -1, 0);
        b_str(&g, r->k_alive);
        b_str(&g, node);
        int alive = run(r, &g) ? -1 : (int)rep_int(g.c[0].rep);
        b_free(&g);
        if (alive <= 0) return alive;
    }
    struct batch *bs = calloc(r->nep, sizeof(*bs));
    char **part = malloc((n + 1) * sizeof(char *));
    int rc = 1;
    if (!bs || !part) {
        free(bs);
        free(part);
        set_err(r, "out of memory");
        return -1;
    }
    for (uint32_t sh = 0; sh < (multi ? r->nshards : 1); sh++) {
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (!multi || shard_of(r, hashes[i], strlen(hashes[i])) == sh) part[m++] = hashes[i];
        struct batch *b = sbatch(r, bs, sh);
        for (size_t i = 0; i < m; i += MSTORE_REDIS_CHUNK) {
            size_t k = m - i < MSTORE_REDIS_CHUNK ? m - i : MSTORE_REDIS_CHUNK;
            bool gate = script == S_EXT_REPORT && !multi;
            b_cmd(b, NULL, script, gate ? 1 : 0);
            if (gate) b_str(b, r->k_alive);
            b_str(b, node);
            b_u64(b, 1ull << tier);
            b_ext_triples(b, r, node, part + i, k);
        }
    }
    for (uint32_t e = 0; e < r->nep; e++) {
        if (run_ep(r, &r->ep[e], &bs[e], NULL)) {
            rc = -1;
            continue;
        }
        if (script == S_EXT_REPORT)
            for (size_t i = 0; i < bs[e].nc; i++)
                if (rep_int(bs[e].c[i].rep) == 0) rc = rc < 0 ? rc : 0;
    }
    free(part);
    free_batches(r, bs);
    return rc;
}

static int rs_ext_report(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                         int tier) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    int rc = ext_write(r, S_EXT_REPORT, node_id, hashes, n, tier);
    if (rc < 0) rc = 0; /* the failure is recorded: the RPC answers UNAVAILABLE */
    OP_END(r, OP_XREPORT);
    return rc;
}

static void rs_ext_revoke(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                          int tier) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    ext_write(r, S_EXT_REVOKE, node_id, hashes, n, tier);
    OP_END(r, OP_XREVOKE);
}

static void rs_ext_revoke_tier(struct mstore *s, const char *node_id, int tier) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    size_t idl = strlen(node_id);
    for (uint32_t sh = 0; sh < r->nshards; sh++) {
        char cursor[32] = "0";
        do {
            struct batch b = {0};
            b_cmd(&b, NULL, S_EXT_REVOKE_TIER, 2);
            b_shard_key(&b, r, sh, ":extkv:node:", node_id, idl, NULL);
            b_shard_key(&b, r, sh, ":extkv_count", "", 0, NULL);
            b_str(&b, node_id);
            b_u64(&b, 1ull << tier);
            b_str(&b, cursor);
            b_u64(&b, MSTORE_REDIS_CHUNK);
            int rc = run_ep(r, ep_of(r, sh), &b, NULL);
            if (!rc && b.c[0].rep->type == REDIS_REPLY_STRING)
                snprintf(cursor, sizeof(cursor), "%s", b.c[0].rep->str);
            else
                snprintf(cursor, sizeof(cursor), "0");
            b_free(&b);
        } while (strcmp(cursor, "0") != 0);
    }
    OP_END(r, OP_XREVOKE_TIER);
}

static void rs_ext_revoke_node(struct mstore *s, const char *node_id) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    wipe_node(r, node_id, false, true);
    OP_END(r, OP_XREVOKE_NODE);
}

/* Distinct keys in request order: first[i] is true for the first occurrence. */
static bool *dedup(const struct mstore_key *keys, size_t n) {
    bool *first = calloc(n + 1, sizeof(bool));
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    uint32_t *set = calloc(cap, sizeof(uint32_t)); /* index + 1 */
    if (!first || !set) {
        free(first);
        free(set);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        size_t h = fnv1a64(keys[i].p, keys[i].n) & (cap - 1);
        for (;; h = (h + 1) & (cap - 1)) {
            if (!set[h]) {
                set[h] = (uint32_t)i + 1;
                first[i] = true;
                break;
            }
            const struct mstore_key *o = &keys[set[h] - 1];
            if (o->n == keys[i].n && memcmp(o->p, keys[i].p, o->n) == 0) break;
        }
    }
    free(set);
    return first;
}

struct mnode {
    uint32_t node;
    redisReply *peer;
};

struct mhit {
    uint32_t idx, node;
    uint8_t tiers;
};

static int rs_ext_match(struct mstore *s, const struct mstore_key *keys, size_t n,
                        bool count_as_hit, int64_t now, struct mstore_match *mt) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    memset(mt, 0, sizeof(*mt));
    if (!n) return 0;
    int rc = -1;
    bool *first = dedup(keys, n);
    uint32_t *sh = malloc(n * sizeof(uint32_t));
    uint32_t *cnt = calloc(r->nshards, sizeof(uint32_t));
    uint32_t *cmdof = malloc(r->nshards * sizeof(uint32_t));
    redisReply **srep = calloc(r->nshards, sizeof(*srep));
    const char **cur = calloc(r->nshards, sizeof(*cur));
    size_t *tab0 = calloc(r->nshards + 1, sizeof(size_t));
    struct batch *bs = calloc(r->nep, sizeof(*bs));
    struct mhit *h = NULL;
    uint32_t *slotmap = NULL, *slot = NULL;
    struct mnode *tab = NULL;
    char **peer = NULL;
    size_t *peerlen = NULL;
    struct batch pb = {0};
    if (!first || !sh || !cnt || !cmdof || !srep || !cur || !tab0 || !bs) goto out;
    for (size_t i = 0; i < n; i++)
        if (first[i]) {
            sh[i] = shard_of(r, keys[i].p, keys[i].n);
            cnt[sh[i]]++;
        }
    size_t hcap = 64, nh = 0, ntab = 0;
    redisReply *plain_peers = NULL;
    if (!count_as_hit && r->nep == 1) {
        /* A pure read on one endpoint: plain HGETALLs (Redis runs them several times faster
         * than the same reads inside a script) and the ALIVE peer map, one pipeline. */
        for (size_t i = 0; i < n; i++)
            if (first[i]) {
                b_cmd(&bs[0], "HGETALL", -1, 0);
                b_shard_key(&bs[0], r, sh[i], ":extkv:", keys[i].p, keys[i].n, NULL);
            }
        b_cmd(&bs[0], "HGETALL", -1, 0);
        b_str(&bs[0], r->k_peers);
        if (run(r, &bs[0])) {
            rc = 0; /* recorded */
            goto out;
        }
        h = malloc(hcap * sizeof(*h));
        tab = malloc(64 * sizeof(*tab)); /* per-call cache of interned nodes */
        if (!h || !tab) goto out;
        size_t c = 0;
        for (size_t i = 0; i < n; i++) {
            if (!first[i]) continue;
            redisReply *e = bs[0].c[c++].rep;
            for (size_t j = 0; e->type == REDIS_REPLY_ARRAY && j + 1 < e->elements; j += 2) {
                redisReply *nm = e->element[j];
                uint8_t tiers = (uint8_t)(rep_int(e->element[j + 1]) & 0xf);
                if (!tiers || nm->type != REDIS_REPLY_STRING) continue;
                uint32_t node = UINT32_MAX;
                for (size_t k = 0; k < ntab; k++)
                    if (tab[k].peer->len == nm->len &&
                        memcmp(tab[k].peer->str, nm->str, nm->len) == 0) {
                        node = tab[k].node;
                        break;
                    }
                if (node == UINT32_MAX) {
                    if (!intern(r, nm->str, nm->len, &node)) goto out;
                    if (ntab < 64) tab[ntab++] = (struct mnode){node, nm};
                }
                if (nh == hcap) {
                    struct mhit *nw = realloc(h, 2 * hcap * sizeof(*h));
                    if (!nw) goto out;
                    h = nw;
                    hcap *= 2;
                }
                h[nh++] = (struct mhit){(uint32_t)i, node, tiers};
            }
        }
        plain_peers = bs[0].c[c].rep;
        ntab = 0; /* tab no longer holds peers */
        goto group;
    }
    /* One script per shard touched, one pipeline per endpoint. */
    for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
        cmdof[s2] = UINT32_MAX;
        if (!cnt[s2]) continue;
        struct batch *b = sbatch(r, bs, s2);
        cmdof[s2] = (uint32_t)b->nc;
        b_cmd(b, NULL, S_MATCH, count_as_hit ? 2 * (size_t)cnt[s2] + 1 : cnt[s2]);
        for (size_t i = 0; i < n; i++)
            if (first[i] && sh[i] == s2)
                b_shard_key(b, r, s2, ":extkv:", keys[i].p, keys[i].n, NULL);
        if (count_as_hit) {
            for (size_t i = 0; i < n; i++)
                if (first[i] && sh[i] == s2)
                    b_shard_key(b, r, s2, ":hit:", keys[i].p, keys[i].n, NULL);
            b_shard_key(b, r, s2, ":hit:index", "", 0, NULL);
        }
        b_u64(b, cnt[s2]);
        b_str(b, count_as_hit ? "1" : "0");
        b_i64(b, now);
        b_str(b, r->k_peers);
    }
    if (run_shards(r, bs, cmdof, srep, "MatchExternalKv")) {
        rc = 0; /* recorded: the RPC answers UNAVAILABLE */
        goto out;
    }
    /* Each shard's node table, interned once per call. */
    for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
        redisReply *a = srep[s2];
        if (a &&
            (a->type != REDIS_REPLY_ARRAY || a->elements != 2 ||
             a->element[0]->type != REDIS_REPLY_ARRAY || a->element[1]->type != REDIS_REPLY_STRING))
            srep[s2] = NULL;
        else if (a)
            ntab += a->element[0]->elements / 2;
    }
    tab = malloc((ntab + 1) * sizeof(*tab));
    h = malloc(hcap * sizeof(*h));
    if (!tab || !h) goto out;
    ntab = 0;
    for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
        tab0[s2] = ntab;
        if (!srep[s2]) continue;
        redisReply *nv = srep[s2]->element[0];
        for (size_t j = 0; j + 1 < nv->elements; j += 2) {
            struct mnode *t = &tab[ntab++];
            t->peer = nv->element[j + 1];
            if (!intern(r, nv->element[j]->str, nv->element[j]->len, &t->node)) goto out;
        }
        cur[s2] = srep[s2]->element[1]->str;
    }
    tab0[r->nshards] = ntab;
    /* The request in order, each key's codes from its shard's string. */
    for (size_t i = 0; i < n; i++) {
        if (!first[i] || !cur[sh[i]]) continue;
        const char *p = cur[sh[i]];
        size_t lo = tab0[sh[i]], hi = tab0[sh[i] + 1];
        while (*p && *p != ';') {
            char *end;
            unsigned long long code = strtoull(p, &end, 10);
            if (end == p) break;
            p = *end == ',' ? end + 1 : end;
            size_t k = lo + (size_t)(code / 16);
            uint8_t tiers = (uint8_t)(code % 16);
            if (k >= hi || !tiers) continue;
            if (nh == hcap) {
                struct mhit *nw = realloc(h, 2 * hcap * sizeof(*h));
                if (!nw) goto out;
                h = nw;
                hcap *= 2;
            }
            h[nh++] = (struct mhit){(uint32_t)i, tab[k].node, tiers};
        }
        cur[sh[i]] = *p == ';' ? p + 1 : p;
    }
group:;
    /* Group as the in-memory store does: nodes in order of first appearance, per node and
     * tier the request-ordered indices in one pool. */
    uint32_t mcap = 16, nslots = 0;
    while (mcap < nh * 2) mcap <<= 1;
    slotmap = calloc((size_t)mcap * 2, sizeof(uint32_t));
    slot = malloc((nh + 1) * sizeof(uint32_t));
    if (!slotmap || !slot) goto out;
    for (size_t k = 0; k < nh; k++) {
        uint32_t x = (h[k].node * 2654435761u) & (mcap - 1);
        for (;; x = (x + 1) & (mcap - 1)) {
            if (!slotmap[2 * x]) {
                slotmap[2 * x] = h[k].node + 1;
                slotmap[2 * x + 1] = nslots++;
            }
            if (slotmap[2 * x] == h[k].node + 1) break;
        }
        slot[k] = slotmap[2 * x + 1];
    }
    mt->nodes = calloc(nslots + 1, sizeof(*mt->nodes));
    if (!mt->nodes) goto out;
    mt->nnodes = nslots;
    size_t ntot = 0;
    for (size_t k = 0; k < nh; k++) {
        struct mstore_match_node *mn = &mt->nodes[slot[k]];
        mn->node = h[k].node;
        mn->distinct++;
        for (int t = 0; t < MSTORE_NTIERS; t++)
            if (h[k].tiers & (1u << t)) {
                mn->tiers[t].n++;
                ntot++;
            }
    }
    mt->pool = malloc((ntot + 1) * sizeof(uint32_t));
    if (!mt->pool) goto out;
    uint32_t off = 0;
    for (uint32_t i = 0; i < nslots; i++)
        for (int t = 0; t < MSTORE_NTIERS; t++) {
            struct mstore_match_tier *bk = &mt->nodes[i].tiers[t];
            bk->tier = t;
            bk->idx = mt->pool + off;
            off += bk->n;
            bk->n = 0;
        }
    for (size_t k = 0; k < nh; k++) {
        struct mstore_match_node *mn = &mt->nodes[slot[k]];
        for (int t = 0; t < MSTORE_NTIERS; t++)
            if (h[k].tiers & (1u << t)) mn->tiers[t].idx[mn->tiers[t].n++] = h[k].idx;
    }
    /* Peers: from the replies (one endpoint holds the control keys), or in multi mode from
     * the control endpoint in one more round trip. */
    peer = calloc(nslots + 1, sizeof(char *));
    peerlen = calloc(nslots + 1, sizeof(size_t));
    if (!peer || !peerlen) goto out;
    for (uint32_t i = 0; i < nslots; i++) {
        struct mstore_match_node *mn = &mt->nodes[i];
        pthread_mutex_lock(&r->imu);
        mn->node_id = r->ids[mn->node]->id;
        pthread_mutex_unlock(&r->imu);
        peer[i] = "";
        for (size_t k = 0; r->nep == 1 && k < ntab; k++)
            if (tab[k].node == mn->node && tab[k].peer->type == REDIS_REPLY_STRING) {
                peer[i] = tab[k].peer->str;
                peerlen[i] = tab[k].peer->len;
                break;
            }
        size_t idl = strlen(mn->node_id);
        for (size_t k = 0;
             plain_peers && plain_peers->type == REDIS_REPLY_ARRAY && k + 1 < plain_peers->elements;
             k += 2) {
            redisReply *pk = plain_peers->element[k], *pv = plain_peers->element[k + 1];
            if (pk->len == idl && memcmp(pk->str, mn->node_id, idl) == 0 &&
                pv->type == REDIS_REPLY_STRING) {
                peer[i] = pv->str;
                peerlen[i] = pv->len;
                break;
            }
        }
    }
    if (r->nep > 1 && nslots) {
        b_cmd(&pb, "HMGET", -1, 0);
        b_str(&pb, r->k_peers);
        for (uint32_t i = 0; i < nslots; i++) b_str(&pb, mt->nodes[i].node_id);
        if (run_ep(r, &r->ep[0], &pb, "MatchExternalKv") == 0 &&
            pb.c[0].rep->type == REDIS_REPLY_ARRAY && pb.c[0].rep->elements == nslots)
            for (uint32_t i = 0; i < nslots; i++)
                if (pb.c[0].rep->element[i]->type == REDIS_REPLY_STRING) {
                    peer[i] = pb.c[0].rep->element[i]->str;
                    peerlen[i] = pb.c[0].rep->element[i]->len;
                }
    }
    rc = 0;
    for (uint32_t i = 0; i < nslots; i++) {
        struct mstore_match_node *mn = &mt->nodes[i];
        mn->peer_address = strndup(peer[i], peerlen[i]);
        if (!mn->peer_address) rc = -1;
        uint32_t k = 0;
        for (int t = 0; t < MSTORE_NTIERS; t++)
            if (mn->tiers[t].n) mn->tiers[k++] = mn->tiers[t];
        for (uint32_t t = k; t < MSTORE_NTIERS; t++) mn->tiers[t] = (struct mstore_match_tier){0};
        mn->ntiers = k;
    }
out:
    if (rc) mstore_match_free(mt);
    b_free(&pb);
    free(peer);
    free(peerlen);
    free(tab);
    free(tab0);
    free(slotmap);
    free(slot);
    free(h);
    free_batches(r, bs);
    free(first);
    free(sh);
    free(cnt);
    free(cmdof);
    free(srep);
    free(cur);
    OP_END(r, OP_MATCH);
    return rc;
}

static int rs_hit_counts(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                         size_t *nout) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    *out = NULL;
    *nout = 0;
    if (!n) return 0;
    struct mstore_key *keys = malloc(n * sizeof(*keys));
    uint64_t *where = malloc(n * sizeof(uint64_t)); /* endpoint << 32 | command */
    struct batch *bs = calloc(r->nep, sizeof(*bs));
    bool *ok = calloc(r->nep, sizeof(bool));
    bool *first = NULL;
    int rc = -1;
    if (!keys || !where || !bs || !ok) goto out;
    for (size_t i = 0; i < n; i++) keys[i] = (struct mstore_key){hashes[i], strlen(hashes[i])};
    if (!(first = dedup(keys, n))) goto out;
    for (size_t i = 0; i < n; i++)
        if (first[i]) {
            uint32_t sh = shard_of(r, keys[i].p, keys[i].n);
            struct batch *b = sbatch(r, bs, sh);
            where[i] = (uint64_t)(b - bs) << 32 | b->nc;
            b_cmd(b, "HGET", -1, 0);
            b_shard_key(b, r, sh, ":hit:", keys[i].p, keys[i].n, NULL);
            b_str(b, "c");
        }
    for (uint32_t e = 0; e < r->nep; e++) {
        ok[e] = run_ep(r, &r->ep[e], &bs[e], r->nep > 1 ? "GetExternalKvHitCounts" : NULL) == 0;
        if (!ok[e] && r->nep == 1) {
            rc = 0; /* recorded */
            goto out;
        }
    }
    struct mstore_hit *v = malloc((n + 1) * sizeof(*v));
    if (!v) goto out;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!first[i] || !ok[where[i] >> 32]) continue;
        redisReply *rep = bs[where[i] >> 32].c[where[i] & 0xffffffffu].rep;
        if (rep->type == REDIS_REPLY_STRING)
            v[k++] = (struct mstore_hit){(uint32_t)i, strtoull(rep->str, NULL, 10)};
    }
    *out = v;
    *nout = k;
    rc = 0;
out:
    free_batches(r, bs);
    free(ok);
    free(where);
    free(first);
    free(keys);
    OP_END(r, OP_HITS);
    return rc;
}

static size_t rs_hit_gc(struct mstore *s, int64_t cutoff) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    size_t total = 0;
    for (uint32_t sh = 0; sh < r->nshards; sh++) {
        char cursor[32] = "0";
        do {
            struct batch b = {0};
            b_cmd(&b, NULL, S_HIT_GC, 1);
            b_shard_key(&b, r, sh, ":hit:index", "", 0, NULL);
            b_str(&b, cursor);
            b_i64(&b, cutoff);
            b_u64(&b, MSTORE_REDIS_CHUNK);
            redisReply *rep = run_ep(r, ep_of(r, sh), &b, NULL) ? NULL : b.c[0].rep;
            if (rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
                rep->element[0]->type == REDIS_REPLY_STRING) {
                snprintf(cursor, sizeof(cursor), "%s", rep->element[0]->str);
                total += (size_t)rep_int(rep->element[1]);
            } else {
                snprintf(cursor, sizeof(cursor), "0");
            }
            b_free(&b);
        } while (strcmp(cursor, "0") != 0);
    }
    OP_END(r, OP_HIT_GC);
    return total;
}

static size_t rs_ext_count(struct mstore *s) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch *bs = calloc(r->nep, sizeof(*bs));
    long long total = 0;
    for (uint32_t sh = 0; bs && sh < r->nshards; sh++) {
        b_cmd(sbatch(r, bs, sh), "GET", -1, 0);
        b_shard_key(sbatch(r, bs, sh), r, sh, ":extkv_count", "", 0, NULL);
    }
    for (uint32_t e = 0; bs && e < r->nep; e++)
        if (run_ep(r, &r->ep[e], &bs[e], r->nep > 1 ? "GetExternalKvCount" : NULL) == 0)
            for (size_t i = 0; i < bs[e].nc; i++) total += rep_int(bs[e].c[i].rep);
    free_batches(r, bs);
    OP_END(r, OP_XCOUNT);
    return total > 0 ? (size_t)total : 0;
}

/* ---- block index ---- */

/* Groups keys by shard: one script per shard touched, one pipeline per endpoint. key i
 * is element pos[i] of srep[sh[i]], the reply of its shard (NULL: a failed shard in multi
 * mode, read as misses). -1: the single endpoint failed (recorded). */
static int block_scripts(struct rstore *r, int script, const char *method, char *const *keys,
                         size_t n, uint32_t *sh, uint32_t *pos, redisReply ***srep_out,
                         struct batch **bs_out, void (*argv)(struct batch *, void *), void *arg) {
    uint32_t *cnt = calloc(r->nshards, sizeof(uint32_t));
    uint32_t *cmdof = malloc(r->nshards * sizeof(uint32_t));
    redisReply **srep = calloc(r->nshards, sizeof(*srep));
    struct batch *bs = calloc(r->nep, sizeof(*bs));
    *srep_out = srep;
    *bs_out = bs;
    if (!cnt || !cmdof || !srep || !bs) {
        free(cnt);
        free(cmdof);
        set_err(r, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        sh[i] = shard_of(r, keys[i], strlen(keys[i]));
        pos[i] = cnt[sh[i]]++;
    }
    for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
        cmdof[s2] = UINT32_MAX;
        if (!cnt[s2]) continue;
        struct batch *b = sbatch(r, bs, s2);
        cmdof[s2] = (uint32_t)b->nc;
        b_cmd(b, NULL, script, cnt[s2]);
        for (size_t i = 0; i < n; i++)
            if (sh[i] == s2) b_shard_key(b, r, s2, ":block:", keys[i], strlen(keys[i]), NULL);
        if (argv) argv(b, arg);
    }
    int rc = run_shards(r, bs, cmdof, srep, method);
    free(cnt);
    free(cmdof);
    return rc;
}

static redisReply *key_reply(redisReply **srep, const uint32_t *sh, const uint32_t *pos, size_t i) {
    redisReply *a = srep[sh[i]];
    if (!a || a->type != REDIS_REPLY_ARRAY || pos[i] >= a->elements) return NULL;
    return a->element[pos[i]];
}

struct rg_args {
    int64_t now, lease_until;
    char *const *excl;
    size_t nexcl;
};

static void rg_argv(struct batch *b, void *arg) {
    struct rg_args *a = arg;
    b_i64(b, a->now);
    b_i64(b, a->lease_until);
    b_u64(b, a->nexcl);
    for (size_t i = 0; i < a->nexcl; i++) b_str(b, a->excl[i]);
}

static int rs_route_get(struct mstore *s, char *const *keys, size_t n, char *const *excl,
                        size_t nexcl, int64_t now, int64_t lease_until, struct mstore_loc **locs,
                        size_t *nlocs) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    for (size_t i = 0; i < n; i++) {
        locs[i] = NULL;
        nlocs[i] = 0;
    }
    if (!n) return 0;
    uint32_t *sh = malloc(n * sizeof(uint32_t)), *pos = malloc(n * sizeof(uint32_t));
    redisReply **srep = NULL;
    struct batch *bs = NULL;
    int rc = -1;
    if (!sh || !pos) goto out;
    struct rg_args a = {now, lease_until, excl, nexcl};
    if (block_scripts(r, S_ROUTE_GET, "BatchLookupBlockForRouteGet", keys, n, sh, pos, &srep, &bs,
                      rg_argv, &a)) {
        rc = 0; /* recorded */
        goto out;
    }
    rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        redisReply *e = key_reply(srep, sh, pos, i);
        if (!e || e->type != REDIS_REPLY_ARRAY || e->elements < 3) continue;
        size_t k = e->elements / 3;
        locs[i] = calloc(k, sizeof(struct mstore_loc));
        if (!locs[i]) {
            rc = -1;
            break;
        }
        for (size_t j = 0; j < k; j++) {
            struct mstore_loc *l = &locs[i][j];
            l->node_id = intern(r, e->element[3 * j]->str, e->element[3 * j]->len, &l->node);
            if (!l->node_id) rc = -1;
            l->tier = (int)rep_int(e->element[3 * j + 1]);
            l->size = strtoull(e->element[3 * j + 2]->str, NULL, 10);
        }
        nlocs[i] = k;
    }
    if (rc)
        for (size_t i = 0; i < n; i++) {
            free(locs[i]);
            locs[i] = NULL;
            nlocs[i] = 0;
        }
out:
    free_batches(r, bs);
    free(srep);
    free(sh);
    free(pos);
    OP_END(r, OP_ROUTE_GET);
    return rc;
}

static void rs_block_exists(struct mstore *s, char *const *keys, size_t n, bool *found) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    for (size_t i = 0; i < n; i++) found[i] = false;
    if (!n) return;
    uint32_t *sh = malloc(n * sizeof(uint32_t)), *pos = malloc(n * sizeof(uint32_t));
    redisReply **srep = NULL;
    struct batch *bs = NULL;
    if (!sh || !pos) {
        set_err(r, "out of memory");
        goto out;
    }
    if (block_scripts(r, S_EXISTS, "BatchExistsBlock", keys, n, sh, pos, &srep, &bs, NULL, NULL) ==
        0)
        for (size_t i = 0; i < n; i++) found[i] = rep_int(key_reply(srep, sh, pos, i)) == 1;
out:
    free_batches(r, bs);
    free(srep);
    free(sh);
    free(pos);
    OP_END(r, OP_EXISTS);
}

/* ---- lifecycle ---- */

static void rs_destroy(struct mstore *s) {
    struct rstore *r = RS(s);
    for (uint32_t e = 0; r->ep && e < r->nep; e++) {
        for (uint32_t i = 0; r->ep[e].slots && i < r->ep[e].nslots; i++)
            redisFree(r->ep[e].slots[i].c);
        free(r->ep[e].slots);
        pthread_mutex_destroy(&r->ep[e].mu);
        pthread_cond_destroy(&r->ep[e].cv);
    }
    free(r->ep);
    for (uint32_t i = 0; i < r->nids; i++) free(r->ids[i]);
    free(r->ids);
    htab_fini(&r->itab);
    for (uint32_t i = 0; r->tag && i < r->nshards; i++)
        if (r->tag[i] != r->ctl) free(r->tag[i]);
    free(r->tag);
    free(r->password);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->imu);
    free(r);
}

static const struct mstore_ops REDIS_OPS = {
    .name = "redis",
    .destroy = rs_destroy,
    .register_client = rs_register,
    .unregister_client = rs_unregister,
    .apply_heartbeat = rs_heartbeat,
    .expire_stale = rs_expire,
    .alive_count = rs_alive_count,
    .client_status = rs_client_status,
    .client_tags = rs_client_tags,
    .list_alive = rs_list_alive,
    .ext_report = rs_ext_report,
    .ext_revoke = rs_ext_revoke,
    .ext_revoke_tier = rs_ext_revoke_tier,
    .ext_revoke_node = rs_ext_revoke_node,
    .ext_match = rs_ext_match,
    .hit_counts = rs_hit_counts,
    .hit_gc = rs_hit_gc,
    .ext_count = rs_ext_count,
    .block_route_get = rs_route_get,
    .block_exists = rs_block_exists,
    .take_error = rs_take_error,
};

/* "tcp://host[:port]" (also "redis://", or a bare host[:port]); [v6] in brackets. */
static int parse_uri(const char *uri, char *host, size_t hlen, int *port) {
    const char *p = uri;
    if (strncmp(p, "tcp://", 6) == 0)
        p += 6;
    else if (strncmp(p, "redis://", 8) == 0)
        p += 8;
    *port = 6379;
    const char *end;
    if (*p == '[') {
        end = strchr(p, ']');
        if (!end) return -1;
        snprintf(host, hlen, "%.*s", (int)(end - p - 1), p + 1);
        end++;
    } else {
        end = strchr(p, ':');
        if (!end) end = p + strlen(p);
        snprintf(host, hlen, "%.*s", (int)(end - p), p);
    }
    if (!*host) return -1;
    if (*end == ':') {
        char *e;
        long v = strtol(end + 1, &e, 10);
        if (*e || v <= 0 || v > 65535) return -1;
        *port = (int)v;
    } else if (*end) {
        return -1;
    }
    return 0;
}

static void init_metrics(struct rstore *r, struct metrics *m) {
    if (!m) return;
    static const char *const L_B[] = {"backend", NULL};
    static const char *const L_OP[] = {"op", "backend", NULL};
    static const double LAT[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                 0.025,  0.05,    0.1,    0.25,  0.5,    1};
    static const double WAIT[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                                  0.005,  0.01,    0.025,  0.05,  0.1};
    const char *const be[] = {"redis"};
    struct metric_family *f;
    if ((f = metrics_counter(m, "mori_umbp_redis_transport_errors_total",
                             "Redis connection and protocol errors", L_B)))
        r->m_transport = metric_labels(f, be);
    if ((f = metrics_counter(m, "mori_umbp_redis_noscript_reload_total",
                             "Scripts reloaded after NOSCRIPT", L_B)))
        r->m_noscript = metric_labels(f, be);
    if ((f = metrics_counter(m, "mori_umbp_redis_pool_exhausted_total",
                             "Store operations that waited for a pooled connection", L_B)))
        r->m_pool_exhausted = metric_labels(f, be);
    if ((f = metrics_histogram(m, "mori_umbp_redis_pool_wait_seconds",
                               "Wait for a pooled Redis connection", L_B, WAIT,
                               sizeof(WAIT) / sizeof(WAIT[0]))))
        r->m_pool_wait = metric_labels(f, be);
    static const char *const L_BM[] = {"backend", "method", NULL};
    r->f_degraded =
        metrics_counter(m, "mori_umbp_redis_degraded_shard_total",
                        "Shard reads answered as misses because the shard failed", L_BM);
    if ((f = metrics_histogram(m, "mori_umbp_store_op_latency_seconds",
                               "Metadata store operation latency", L_OP, LAT,
                               sizeof(LAT) / sizeof(LAT[0]))))
        for (int i = 0; i < OP_COUNT; i++) {
            const char *v[] = {OP_NAMES[i], "redis"};
            r->m_lat[i] = metric_labels(f, v);
        }
}

/* PINGs an endpoint and loads every script there; the connection goes into its pool. */
static int probe(struct rstore *r, struct endpoint *ep, char *why, size_t wlen) {
    redisContext *c = dial(r, ep, why, wlen);
    if (c) {
        redisReply *rep = redisCommand(c, "PING");
        if (!rep || rep->type == REDIS_REPLY_ERROR) {
            snprintf(why, wlen, "PING %.100s:%d: %.200s", ep->host, ep->port,
                     rep ? rep->str : c->errstr);
            redisFree(c);
            c = NULL;
        }
        if (rep) freeReplyObject(rep);
    }
    for (int i = 0; c && i < S_COUNT; i++)
        if (!load_script(r, c, i)) {
            snprintf(why, wlen, "SCRIPT LOAD on %.100s:%d failed", ep->host, ep->port);
            redisFree(c);
            c = NULL;
        }
    if (!c) return -1;
    ep->slots[0].c = c;
    return 0;
}

struct mstore *mstore_redis_create(const struct mstore_redis_cfg *cfg, char *err, size_t errlen) {
    struct rstore *r = calloc(1, sizeof(*r));
    if (!r) {
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    r->base.ops = &REDIS_OPS;
    r->lg = cfg->lg;
    pthread_mutex_init(&r->mu, NULL);
    pthread_mutex_init(&r->imu, NULL);
    /* Multi mode: one endpoint per comma-separated URI, one shard each. */
    const char *uris = cfg->shard_uris && *cfg->shard_uris ? cfg->shard_uris : cfg->uri;
    r->nep = 1;
    for (const char *p = uris; *p; p++) r->nep += *p == ',';
    if (r->nep > 4096) r->nep = 4096;
    r->nshards = r->nep > 1 ? r->nep : cfg->shards ? cfg->shards : 1;
    r->connect_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : 1000;
    r->socket_ms = cfg->socket_timeout_ms ? cfg->socket_timeout_ms : 1000;
    r->password = strdup(cfg->password ? cfg->password : "");
    r->ep = calloc(r->nep, sizeof(*r->ep));
    r->tag = calloc(r->nshards, sizeof(char *));
    if (!r->password || !r->ep || !r->tag || htab_init(&r->itab, 256, ident_hash, NULL)) {
        errbuf_set(err, errlen, "out of memory");
        free(r->ep);
        r->ep = NULL;
        goto fail;
    }
    const char *u = uris;
    for (uint32_t e = 0; e < r->nep; e++) {
        struct endpoint *ep = &r->ep[e];
        pthread_mutex_init(&ep->mu, NULL);
        pthread_cond_init(&ep->cv, NULL);
        ep->nslots = cfg->pool_size ? cfg->pool_size : 4;
        ep->slots = calloc(ep->nslots, sizeof(*ep->slots));
        const char *comma = strchr(u, ',');
        char one[512];
        snprintf(one, sizeof(one), "%.*s", (int)(comma ? comma - u : (long)strlen(u)), u);
        if (!ep->slots) {
            errbuf_set(err, errlen, "out of memory");
            goto fail;
        }
        if (parse_uri(one, ep->host, sizeof(ep->host), &ep->port)) {
            errbuf_set(err, errlen, "%s '%s' is not tcp://host[:port]",
                       r->nep > 1 ? "UMBP_REDIS_SHARD_URIS entry" : "UMBP_REDIS_URI", one);
            goto fail;
        }
        u = comma ? comma + 1 : u + strlen(u);
    }
    if (strlen(cfg->ns) > 200 || strpbrk(cfg->ns, "{}")) {
        errbuf_set(err, errlen, "UMBP_REDIS_NAMESPACE must be at most 200 bytes without braces");
        goto fail;
    }
    snprintf(r->ctl, sizeof(r->ctl), "{umbp:%s}", cfg->ns);
    snprintf(r->k_alive, sizeof(r->k_alive), "%s:nodes:alive", r->ctl);
    snprintf(r->k_peers, sizeof(r->k_peers), "%s:alive_peers", r->ctl);
    snprintf(r->k_expired, sizeof(r->k_expired), "%s:nodes:expired", r->ctl);
    snprintf(r->k_node_prefix, sizeof(r->k_node_prefix), "%s:node:", r->ctl);
    for (uint32_t i = 0; i < r->nshards; i++) {
        if (r->nshards == 1) {
            r->tag[i] = r->ctl;
            break;
        }
        char t[300];
        snprintf(t, sizeof(t), "{umbp:%s:b%u}", cfg->ns, i);
        if (!(r->tag[i] = strdup(t))) {
            errbuf_set(err, errlen, "out of memory");
            goto fail;
        }
    }
    init_metrics(r, cfg->metrics);
    /* Probe: connect, load every script, on every endpoint. */
    for (uint32_t e = 0; e < r->nep; e++) {
        char why[384] = "";
        if (probe(r, &r->ep[e], why, sizeof(why)) == 0) continue;
        if (cfg->required) {
            errbuf_set(err, errlen, "redis unavailable: %s", why);
            goto fail;
        }
        log_warn(r->lg, "[MetadataStore] redis unavailable at start (%s); starting degraded", why);
    }
    return &r->base;
fail:
    rs_destroy(&r->base);
    return NULL;
}
