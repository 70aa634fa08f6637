/* The Redis store's transport: connection pools per endpoint, the pipelined execution of a
 * batch across endpoints, and Redis Cluster routing (slot map, MOVED, ASK, TRYAGAIN).
 *
 * A batch's commands carry routes (a key shard or the control keys). rs_run resolves each
 * route to an endpoint (single: the one; multi: endpoint s for shard s; cluster: the master
 * owning the slot of the shard's hash tag), writes every endpoint's pipeline, then reads the
 * replies: one round trip per endpoint, the endpoints in parallel. Replies that redirect
 * (cluster) or say NOSCRIPT are sent again in a further round, only those. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "master/mstore_redis_internal.h"
#include "master/mstore_redis_lua.h"

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

#define NO_OWNER UINT16_MAX
#define NO_EP    UINT32_MAX

/* ---- per-thread failure ---- */

static _Thread_local struct {
    const struct rstore *owner;
    bool set;
    uint64_t at_ns;
    char msg[384];
} t_err;

void rs_set_err(struct rstore *r, const char *fmt, ...) {
    if (t_err.set && t_err.owner == r) return; /* keep the first reason */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_err.msg, sizeof(t_err.msg), fmt, ap);
    va_end(ap);
    t_err.owner = r;
    t_err.set = true;
    t_err.at_ns = clock_mono_ns();
}

bool rs_has_err(const struct rstore *r) { return t_err.set && t_err.owner == r; }

bool rs_failing(struct rstore *r) {
    if (!t_err.set || t_err.owner != r) return false;
    if (clock_mono_ns() - t_err.at_ns < (uint64_t)r->connect_ms * 1000000ull) return true;
    t_err.set = false; /* stale: nobody took it (a metrics scrape); try again */
    return false;
}

int rs_take_error(struct mstore *s, char *buf, size_t len) {
    if (!t_err.set || t_err.owner != RS(s)) return 0;
    snprintf(buf, len, "%s", t_err.msg);
    t_err.set = false;
    return 1;
}

/* ---- replies in the batch's arena ---- */

struct rachunk {
    struct rachunk *next;
    size_t used, cap;
    max_align_t data[];
};

static _Thread_local struct rarena *t_arena; /* the batch being read on this thread */

/* Each thread keeps a few freed chunks for its next batch: a match reads ~200 KB of replies,
 * and giving that back to malloc every call cost page faults and TLB shootdowns when glibc
 * trimmed its heaps. The cache goes with the thread (a key destructor frees it). */
#define ARENA_CHUNK 65536
#define ARENA_KEEP  8
struct chunk_cache {
    struct rachunk *v[ARENA_KEEP];
    int n;
};
static pthread_key_t g_cache_key;
static pthread_once_t g_cache_once = PTHREAD_ONCE_INIT;

static void cache_free(void *p) {
    struct chunk_cache *cc = p;
    for (int i = 0; i < cc->n; i++) free(cc->v[i]);
    free(cc);
}

static void cache_key_init(void) {
    if (pthread_key_create(&g_cache_key, cache_free)) g_cache_key = (pthread_key_t)-1;
}

static struct chunk_cache *chunk_cache(void) {
    pthread_once(&g_cache_once, cache_key_init);
    if (g_cache_key == (pthread_key_t)-1) return NULL;
    struct chunk_cache *cc = pthread_getspecific(g_cache_key);
    if (!cc && (cc = calloc(1, sizeof(*cc))) && pthread_setspecific(g_cache_key, cc)) {
        free(cc);
        cc = NULL;
    }
    return cc;
}

static void *arena_alloc(struct rarena *a, size_t n) {
    n = (n + sizeof(max_align_t) - 1) & ~(sizeof(max_align_t) - 1);
    struct rachunk *c = a->head;
    if (!c || c->used + n > c->cap) {
        struct chunk_cache *cc = n <= ARENA_CHUNK ? chunk_cache() : NULL;
        if (cc && cc->n) {
            c = cc->v[--cc->n];
        } else {
            size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
            if (!(c = malloc(sizeof(*c) + cap))) return NULL;
            c->cap = cap;
        }
        c->next = a->head;
        c->used = 0;
        a->head = c;
    }
    void *p = (char *)c->data + c->used;
    c->used += n;
    return p;
}

void rs_arena_free(struct rarena *a) {
    struct chunk_cache *cc = a->head ? chunk_cache() : NULL;
    for (struct rachunk *c = a->head, *nx; c; c = nx) {
        nx = c->next;
        if (cc && c->cap == ARENA_CHUNK && cc->n < ARENA_KEEP)
            cc->v[cc->n++] = c;
        else
            free(c);
    }
    a->head = NULL;
}

static redisReply *arena_obj(const redisReadTask *task, int type, size_t extra) {
    redisReply *r = arena_alloc(t_arena, sizeof(*r) + extra);
    if (!r) return NULL;
    memset(r, 0, sizeof(*r));
    r->type = type;
    if (task->parent) {
        redisReply *p = task->parent->obj;
        p->element[task->idx] = r;
    }
    return r;
}

static void *arena_string(const redisReadTask *task, char *str, size_t len) {
    redisReply *r = arena_obj(task, task->type, len + 1);
    if (!r) return NULL;
    r->str = (char *)(r + 1);
    memcpy(r->str, str, len);
    r->str[len] = 0;
    r->len = len;
    return r;
}

static void *arena_array(const redisReadTask *task, int elements) {
    redisReply *r = arena_obj(task, REDIS_REPLY_ARRAY, 0);
    if (!r) return NULL;
    if (elements > 0) {
        r->element = arena_alloc(t_arena, (size_t)elements * sizeof(redisReply *));
        if (!r->element) return NULL;
        memset(r->element, 0, (size_t)elements * sizeof(redisReply *));
    }
    r->elements = elements > 0 ? (size_t)elements : 0;
    return r;
}

static void *arena_integer(const redisReadTask *task, long long value) {
    redisReply *r = arena_obj(task, REDIS_REPLY_INTEGER, 0);
    if (r) r->integer = value;
    return r;
}

static void *arena_nil(const redisReadTask *task) { return arena_obj(task, REDIS_REPLY_NIL, 0); }

static void arena_none(void *obj) { (void)obj; /* the arena goes with its batch */ }

static redisReplyObjectFunctions ARENA_FNS = {arena_string, arena_array, arena_integer, arena_nil,
                                              arena_none};

/* ---- endpoints and pools ---- */

static struct endpoint *ep_new(const char *host, int port, uint32_t nslots) {
    struct endpoint *ep = calloc(1, sizeof(*ep));
    if (!ep) return NULL;
    ep->slots = calloc(nslots, sizeof(*ep->slots));
    if (!ep->slots) {
        free(ep);
        return NULL;
    }
    snprintf(ep->host, sizeof(ep->host), "%s", host);
    ep->port = port;
    ep->nslots = nslots;
    pthread_mutex_init(&ep->mu, NULL);
    pthread_cond_init(&ep->cv, NULL);
    return ep;
}

static void ep_free(struct endpoint *ep) {
    if (!ep) return;
    for (uint32_t i = 0; ep->slots && i < ep->nslots; i++) redisFree(ep->slots[i].c);
    free(ep->slots);
    pthread_mutex_destroy(&ep->mu);
    pthread_cond_destroy(&ep->cv);
    free(ep);
}

redisContext *rs_dial(struct rstore *r, const char *host, int port, char *why, size_t wlen) {
    struct timeval ct = {r->connect_ms / 1000, (r->connect_ms % 1000) * 1000};
    redisContext *c = redisConnectWithTimeout(host, port, ct);
    if (!c || c->err) {
        snprintf(why, wlen, "connect %.100s:%d: %.200s", host, port, c ? c->errstr : "no memory");
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
            snprintf(why, wlen, "AUTH %.100s:%d: %.200s", host, port, rep ? rep->str : c->errstr);
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

static struct endpoint *ep_at(struct rstore *r, uint32_t i) {
    return i < atomic_load(&r->nep) ? r->ep[i] : NULL;
}

/* ---- cluster slot map ---- */

/* CRC16-CCITT (XMODEM), as Redis Cluster hashes keys. */
static uint16_t crc16(const char *p, size_t n) {
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)((uint8_t)p[i] << 8);
        for (int b = 0; b < 8; b++) crc = crc & 0x8000 ? (uint16_t)(crc << 1) ^ 0x1021 : crc << 1;
    }
    return crc;
}

uint16_t rs_tag_slot(const char *key) {
    size_t n = strlen(key);
    const char *o = memchr(key, '{', n);
    if (o) {
        const char *c = memchr(o + 1, '}', n - (size_t)(o + 1 - key));
        if (c && c > o + 1) return crc16(o + 1, (size_t)(c - o - 1)) & (RS_NSLOTS - 1);
    }
    return crc16(key, n) & (RS_NSLOTS - 1);
}

/* The endpoint for host:port, added when new; caller holds smu for writing. NO_EP when the
 * node table is full or memory is out. */
static uint32_t do_ep_find_or_add(struct rstore *r, const char *host, int port) {
    uint32_t n = atomic_load(&r->nep);
    for (uint32_t i = 0; i < n; i++)
        if (r->ep[i]->port == port && strcmp(r->ep[i]->host, host) == 0) return i;
    if (n >= RS_MAX_NODES) return NO_EP;
    struct endpoint *ep = ep_new(host, port, r->pool_size);
    if (!ep) return NO_EP;
    r->ep[n] = ep;
    atomic_store(&r->nep, n + 1);
    return n;
}

uint32_t rs_slot_owner(struct rstore *r, uint16_t slot) {
    pthread_rwlock_rdlock(&r->smu);
    uint16_t o = r->owner[slot];
    pthread_rwlock_unlock(&r->smu);
    return o == NO_OWNER ? NO_EP : o;
}

uint32_t rs_cluster_masters(struct rstore *r, uint32_t *out, uint32_t max) {
    uint32_t n = 0;
    pthread_rwlock_rdlock(&r->smu);
    for (uint32_t s = 0; s < RS_NSLOTS; s++) {
        uint16_t o = r->owner[s];
        if (o == NO_OWNER) continue;
        bool seen = false;
        for (uint32_t k = 0; k < n && !seen; k++) seen = out[k] == o;
        if (!seen && n < max) out[n++] = o;
    }
    pthread_rwlock_unlock(&r->smu);
    return n;
}

/* Reads CLUSTER SLOTS from host:port and replaces the slot map. 0, or -1 with why. */
static int refresh_from(struct rstore *r, const char *host, int port, char *why, size_t wlen) {
    redisContext *c = rs_dial(r, host, port, why, wlen);
    if (!c) return -1;
    redisReply *rep = redisCommand(c, "CLUSTER SLOTS");
    int rc = -1;
    if (!rep || rep->type != REDIS_REPLY_ARRAY || !rep->elements) {
        snprintf(why, wlen, "CLUSTER SLOTS on %.100s:%d: %.200s", host, port,
                 rep && rep->type == REDIS_REPLY_ERROR ? rep->str
                 : rep                                 ? "no slots served"
                                                       : c->errstr);
        goto out;
    }
    uint16_t *nw = malloc(RS_NSLOTS * sizeof(*nw));
    if (!nw) {
        snprintf(why, wlen, "out of memory");
        goto out;
    }
    for (uint32_t s = 0; s < RS_NSLOTS; s++) nw[s] = NO_OWNER;
    pthread_rwlock_wrlock(&r->smu);
    for (size_t i = 0; i < rep->elements; i++) {
        redisReply *e = rep->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2)
            continue;
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        redisReply *m = e->element[2];
        if (lo < 0 || hi >= RS_NSLOTS || lo > hi || m->element[1]->type != REDIS_REPLY_INTEGER)
            continue;
        /* An empty or "?" address means "the node you asked". */
        const char *h = m->element[0]->type == REDIS_REPLY_STRING && m->element[0]->len &&
                                strcmp(m->element[0]->str, "?") != 0
                            ? m->element[0]->str
                            : host;
        uint32_t idx = do_ep_find_or_add(r, h, (int)m->element[1]->integer);
        if (idx == NO_EP) continue;
        for (long long s = lo; s <= hi; s++) nw[s] = (uint16_t)idx;
    }
    bool changed = memcmp(r->owner, nw, RS_NSLOTS * sizeof(*nw)) != 0;
    memcpy(r->owner, nw, RS_NSLOTS * sizeof(*nw));
    pthread_rwlock_unlock(&r->smu);
    free(nw);
    if (changed) rs_track_map_changed(r);
    rc = 0;
out:
    if (rep) freeReplyObject(rep);
    redisFree(c);
    return rc;
}

/* After a node failed or a slot had no owner: the map again, from any node that answers,
 * at most every 100 ms. */
static void maybe_refresh(struct rstore *r) {
    if (!atomic_load(&r->refresh)) return;
    uint64_t now = clock_mono_ns(), last = atomic_load(&r->last_refresh_ns);
    if (now - last < 100000000ull ||
        !atomic_compare_exchange_strong(&r->last_refresh_ns, &last, now))
        return;
    char why[384] = "";
    for (uint32_t i = 0; i < atomic_load(&r->nep); i++)
        if (refresh_from(r, r->ep[i]->host, r->ep[i]->port, why, sizeof(why)) == 0) {
            atomic_store(&r->refresh, false);
            if (r->m_refresh) metric_inc(r->m_refresh, 1);
            log_info(r->lg, "[MetadataStore] redis cluster: slot map read again from %s:%d",
                     r->ep[i]->host, r->ep[i]->port);
            return;
        }
}

uint32_t rs_cluster_all_masters(struct rstore *r, uint32_t *out, uint32_t max) {
    uint32_t n = rs_cluster_masters(r, out, max);
    pthread_rwlock_rdlock(&r->smu);
    for (uint32_t k = 0; k < r->nlisted_m; k++) {
        bool seen = false;
        for (uint32_t q = 0; q < n && !seen; q++) seen = out[q] == r->listed_m[k];
        if (!seen && n < max) out[n++] = r->listed_m[k];
    }
    pthread_rwlock_unlock(&r->smu);
    return n;
}

/* One field of a CLUSTER NODES line is in the comma-separated list flags. */
static bool has_flag(const char *flags, size_t n, const char *f) {
    size_t fl = strlen(f);
    for (const char *p = flags, *end = flags + n; p < end;) {
        const char *c = memchr(p, ',', (size_t)(end - p));
        size_t l = c ? (size_t)(c - p) : (size_t)(end - p);
        if (l == fl && memcmp(p, f, fl) == 0) return true;
        p += l + 1;
    }
    return false;
}

/* CLUSTER NODES on host:port: every master not failed, with or without slots (a master
 * added to the cluster is tracked before a slot can migrate to it). 0, or -1. */
static int read_masters(struct rstore *r, const char *host, int port) {
    char why[384];
    redisContext *c = rs_dial(r, host, port, why, sizeof(why));
    if (!c) return -1;
    redisReply *rep = redisCommand(c, "CLUSTER NODES");
    int rc = -1;
    uint16_t got[RS_TRACK_MAX];
    uint32_t n = 0;
    bool over = false;
    if (!rep || rep->type != REDIS_REPLY_STRING) goto out;
    for (char *line = rep->str, *nl; line && *line; line = nl ? nl + 1 : NULL) {
        nl = strchr(line, '\n');
        if (nl) *nl = 0;
        /* <id> <ip:port@cport[,hostname]> <flags> ... */
        char *sp1 = strchr(line, ' '), *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
        char *sp3 = sp2 ? strchr(sp2 + 1, ' ') : NULL;
        if (!sp3) continue;
        const char *fl = sp2 + 1;
        size_t fln = (size_t)(sp3 - fl);
        if (!has_flag(fl, fln, "master") || has_flag(fl, fln, "fail") ||
            has_flag(fl, fln, "handshake") || has_flag(fl, fln, "noaddr"))
            continue;
        char *addr = sp1 + 1;
        *sp2 = 0;
        char *at = strchr(addr, '@');
        if (at) *at = 0;
        char *colon = strrchr(addr, ':');
        if (!colon) continue;
        *colon = 0;
        long p = strtol(colon + 1, NULL, 10);
        if (p <= 0 || p > 65535) continue;
        pthread_rwlock_wrlock(&r->smu);
        uint32_t idx = do_ep_find_or_add(r, *addr ? addr : host, (int)p);
        pthread_rwlock_unlock(&r->smu);
        if (idx == NO_EP) continue;
        if (n == RS_TRACK_MAX) {
            over = true;
            break;
        }
        got[n++] = (uint16_t)idx;
    }
    /* Sorted: the list is compared with the last one. */
    for (uint32_t i = 1; i < n; i++)
        for (uint32_t j = i; j > 0 && got[j - 1] > got[j]; j--) {
            uint16_t x = got[j];
            got[j] = got[j - 1];
            got[j - 1] = x;
        }
    pthread_rwlock_wrlock(&r->smu);
    bool changed = n != r->nlisted_m || memcmp(got, r->listed_m, n * sizeof(*got)) != 0;
    if (changed && !over) {
        memcpy(r->listed_m, got, n * sizeof(*got));
        r->nlisted_m = n;
    }
    pthread_rwlock_unlock(&r->smu);
    if (changed && !over) rs_track_map_changed(r);
    rc = 0;
out:
    if (rep) freeReplyObject(rep);
    redisFree(c);
    return rc;
}

void rs_cluster_reread(struct rstore *r) {
    /* From a master of the current map first (a node that left may answer with an old one). */
    uint32_t m[RS_MAX_NODES];
    uint32_t nm = rs_cluster_masters(r, m, RS_MAX_NODES);
    char why[384];
    for (uint32_t k = 0; k < nm; k++) {
        struct endpoint *ep = r->ep[m[k]];
        if (refresh_from(r, ep->host, ep->port, why, sizeof(why)) == 0) {
            read_masters(r, ep->host, ep->port);
            return;
        }
    }
    for (uint32_t i = 0; i < atomic_load(&r->nep); i++) {
        struct endpoint *ep = r->ep[i];
        if (refresh_from(r, ep->host, ep->port, why, sizeof(why)) == 0) {
            read_masters(r, ep->host, ep->port);
            return;
        }
    }
}

/* "MOVED 3999 127.0.0.1:6381" / "ASK 3999 host:port": the slot and the endpoint index
 * (added when new). */
static uint32_t redirect_target(struct rstore *r, const char *msg, long *slot, char *host,
                                size_t hlen, int *port) {
    const char *p = strchr(msg, ' ');
    if (!p) return NO_EP;
    char *end;
    *slot = strtol(p + 1, &end, 10);
    if (*end != ' ' || *slot < 0 || *slot >= RS_NSLOTS) return NO_EP;
    const char *hp = end + 1, *colon = strrchr(hp, ':');
    if (!colon || colon == hp) return NO_EP;
    snprintf(host, hlen, "%.*s", (int)(colon - hp), hp);
    *port = atoi(colon + 1);
    if (*port <= 0 || *port > 65535) return NO_EP;
    pthread_rwlock_wrlock(&r->smu);
    uint32_t idx = do_ep_find_or_add(r, host, *port);
    pthread_rwlock_unlock(&r->smu);
    return idx;
}

static uint32_t route_ep(struct rstore *r, uint32_t route) {
    if (r->multi) return route == ROUTE_CTL ? 0 : route;
    if (!r->cluster) return 0;
    return rs_slot_owner(r, route == ROUTE_CTL ? r->ctl_slot : r->tslot[route]);
}

/* ---- running a batch ---- */

enum { C_PENDING, C_DONE, C_FAILED };

struct cstate {
    uint32_t ep, ask; /* this round's endpoint; ASK target (NO_EP: none) */
    uint8_t st;
    bool sent;
};

struct link {
    uint32_t ep;
    struct slot *s;
    bool fresh, bad;
    size_t got; /* replies read */
};

static bool err_is(const redisReply *rep, const char *word) {
    size_t n = strlen(word);
    return rep && rep->type == REDIS_REPLY_ERROR && strncmp(rep->str, word, n) == 0 &&
           (rep->str[n] == ' ' || rep->str[n] == 0);
}

static void warn_limited(struct rstore *r, const char *fmt, const char *a, const char *b) {
    /* At most one WARN a second while Redis is down (every RPC fails the same way). */
    uint64_t now = clock_mono_ns(), last = atomic_load(&r->last_warn_ns);
    if (now - last >= 1000000000ull && atomic_compare_exchange_strong(&r->last_warn_ns, &last, now))
        log_warn(r->lg, fmt, a, b);
}

/* "<kind><n>\r\n" at w; returns the end. */
static char *resp_len(char *w, char kind, size_t n) {
    char t[24];
    int k = 0;
    do t[k++] = (char)('0' + n % 10);
    while ((n /= 10));
    *w++ = kind;
    while (k) *w++ = t[--k];
    *w++ = '\r';
    *w++ = '\n';
    return w;
}

/* Writes the pending commands routed to l->ep on its connection. false: transport error. */
static bool send_link(struct rstore *r, struct link *l, struct batch *b, struct cstate *cs,
                      char *why, size_t wlen) {
    struct endpoint *ep = r->ep[l->ep];
    redisContext *c = l->s->c;
    char sha[S_COUNT][41];
    pthread_mutex_lock(&r->mu);
    memcpy(sha, r->sha, sizeof(sha));
    pthread_mutex_unlock(&r->mu);
    for (size_t i = 0; i < b->nc; i++) {
        if (cs[i].st != C_PENDING || cs[i].ep != l->ep) continue;
        int sc = b->c[i].script;
        if (sc >= 0 && !sha[sc][0]) { /* Redis was down at start: load it now */
            if (!load_script(r, c, sc)) {
                snprintf(why, wlen, "%.100s:%d: SCRIPT LOAD failed", ep->host, ep->port);
                return false;
            }
            pthread_mutex_lock(&r->mu);
            memcpy(sha[sc], r->sha[sc], 41);
            pthread_mutex_unlock(&r->mu);
        }
    }
    /* The RESP of every command for this endpoint, formatted here into one buffer and
     * handed to hiredis in one piece (its per-command formatting was a tenth of a match's
     * CPU). */
    size_t need = 0;
    for (size_t i = 0; i < b->nc; i++) {
        if (cs[i].st != C_PENDING || cs[i].ep != l->ep) continue;
        const struct bcmd *cm = &b->c[i];
        need += 48 + (cs[i].ask != NO_EP ? 24 : 0);
        for (size_t a = 0; a < cm->argc; a++) need += b->alen[cm->a0 + a] + 24;
    }
    char *out = malloc(need + 1), *w = out;
    if (!out) {
        snprintf(why, wlen, "out of memory");
        return false;
    }
    for (size_t i = 0; i < b->nc; i++) {
        if (cs[i].st != C_PENDING || cs[i].ep != l->ep) continue;
        const struct bcmd *cm = &b->c[i];
        if (cs[i].ask != NO_EP) {
            static const char ASKING[] = "*1\r\n$6\r\nASKING\r\n";
            memcpy(w, ASKING, sizeof(ASKING) - 1);
            w += sizeof(ASKING) - 1;
        }
        w = resp_len(w, '*', cm->argc);
        for (size_t a = 0; a < cm->argc; a++) {
            const char *p = b->buf + b->aoff[cm->a0 + a];
            size_t n = b->alen[cm->a0 + a];
            if (a == 1 && cm->script >= 0) {
                p = sha[cm->script];
                n = 40;
            }
            w = resp_len(w, '$', n);
            memcpy(w, p, n);
            w += n;
            *w++ = '\r';
            *w++ = '\n';
        }
        cs[i].sent = true;
    }
    bool ok = redisAppendFormattedCommand(c, out, (size_t)(w - out)) == REDIS_OK;
    free(out);
    if (!ok) {
        snprintf(why, wlen, "out of memory");
        return false;
    }
    int done = 0;
    while (!done)
        if (redisBufferWrite(c, &done) != REDIS_OK) {
            snprintf(why, wlen, "%.100s:%d: %.200s", ep->host, ep->port,
                     c->err ? c->errstr : "write failed");
            return false;
        }
    return true;
}

/* Reads the replies of what send_link wrote into the batch's arena. false: transport error
 * (the reader keeps the arena's functions: its partial reply must not reach free()). */
static bool recv_link(struct rstore *r, struct link *l, struct batch *b, struct cstate *cs,
                      char *why, size_t wlen) {
    struct endpoint *ep = r->ep[l->ep];
    redisContext *c = l->s->c;
    redisReplyObjectFunctions *fn = c->reader->fn;
    c->reader->fn = &ARENA_FNS;
    t_arena = &b->arena;
    for (size_t i = 0; i < b->nc; i++) {
        if (!cs[i].sent || cs[i].ep != l->ep) continue;
        void *rep = NULL;
        if (cs[i].ask != NO_EP && (redisGetReply(c, &rep) != REDIS_OK || !rep)) goto lost;
        if (redisGetReply(c, &rep) != REDIS_OK || !rep) goto lost;
        b->c[i].rep = rep;
        cs[i].sent = false;
        l->got++;
    }
    c->reader->fn = fn;
    t_arena = NULL;
    return true;
lost:
    t_arena = NULL;
    snprintf(why, wlen, "%.100s:%d: %.200s", ep->host, ep->port,
             c->err ? c->errstr : "connection lost");
    return false;
}

int rs_run(struct rstore *r, struct batch *b, const char *degrade) {
    if (b->oom) {
        rs_set_err(r, "out of memory");
        return -1;
    }
    if (!degrade && rs_failing(r)) return -1;
    if (!b->nc) return 0;
    if (r->cluster) maybe_refresh(r);
    size_t nc = b->nc;
    struct cstate *cs = calloc(nc, sizeof(*cs));
    struct link *lk = calloc(nc, sizeof(*lk));
    if (!cs || !lk) {
        free(cs);
        free(lk);
        rs_set_err(r, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < nc; i++) cs[i] = (struct cstate){.ask = NO_EP, .st = C_PENDING};
    char why[384] = "", fail[384] = "", hard[384] = "";
    bool stale_retry = true, refreshed = false, gave_up = false;
    int redirects = 0, rounds = 0;
    for (;; rounds++) {
        /* This round's endpoints, ascending: pools are taken in that order (no deadlock
         * between calls that need the same endpoints). */
        size_t nl = 0;
        for (size_t i = 0; i < nc; i++) {
            if (cs[i].st != C_PENDING) continue;
            cs[i].ep = cs[i].ask != NO_EP ? cs[i].ask : route_ep(r, b->c[i].route);
            if (cs[i].ep == NO_EP || !ep_at(r, cs[i].ep)) {
                cs[i].st = C_FAILED;
                snprintf(fail, sizeof(fail), "redis cluster: no node serves the slot of %s",
                         b->c[i].route == ROUTE_CTL ? r->ctl : r->tag[b->c[i].route]);
                atomic_store(&r->refresh, true);
                continue;
            }
            size_t k = 0;
            while (k < nl && lk[k].ep < cs[i].ep) k++;
            if (k < nl && lk[k].ep == cs[i].ep) continue;
            memmove(&lk[k + 1], &lk[k], (nl - k) * sizeof(*lk));
            lk[k] = (struct link){.ep = cs[i].ep};
            nl++;
        }
        if (!nl) break;
        for (size_t k = 0; k < nl; k++) {
            struct link *l = &lk[k];
            struct endpoint *ep = r->ep[l->ep];
            l->s = pool_get(r, ep);
            if (!l->s->c) {
                l->s->c = rs_dial(r, ep->host, ep->port, why, sizeof(why));
                l->fresh = true;
            }
            l->bad = !l->s->c || !send_link(r, l, b, cs, why, sizeof(why));
            if (l->bad) snprintf(fail, sizeof(fail), "%s", why);
        }
        for (size_t k = 0; k < nl; k++)
            if (!lk[k].bad && !recv_link(r, &lk[k], b, cs, why, sizeof(why))) {
                lk[k].bad = true;
                snprintf(fail, sizeof(fail), "%s", why);
            }
        bool again = false, tryagain = false;
        for (size_t k = 0; k < nl; k++) {
            struct link *l = &lk[k];
            if (l->bad) {
                if (l->s->c && r->m_transport) metric_inc(r->m_transport, 1);
                redisFree(l->s->c);
                l->s->c = NULL;
                if (r->cluster) atomic_store(&r->refresh, true);
                /* A pooled connection may be stale (Redis restarted): the unanswered
                 * commands once more on a new one. */
                bool retry = !l->fresh && !l->got && stale_retry;
                if (retry) stale_retry = false;
                for (size_t i = 0; i < nc; i++)
                    if (cs[i].st == C_PENDING && cs[i].ep == l->ep && !b->c[i].rep) {
                        cs[i].sent = false;
                        if (retry)
                            again = true;
                        else
                            cs[i].st = C_FAILED;
                    }
            }
            for (size_t i = 0; i < nc; i++) {
                if (cs[i].st != C_PENDING || cs[i].ep != l->ep || !b->c[i].rep) continue;
                redisReply *rep = b->c[i].rep;
                bool moved = err_is(rep, "MOVED"), ask = err_is(rep, "ASK");
                if (moved || ask) {
                    long slot;
                    char host[256];
                    int port;
                    uint32_t to = redirect_target(r, rep->str, &slot, host, sizeof(host), &port);
                    if (to == NO_EP) {
                        cs[i].st = C_DONE; /* an error reply like any other */
                        continue;
                    }
                    if (moved) {
                        if (r->m_moved) metric_inc(r->m_moved, 1);
                        /* The map changed (resharding, failover): read it again from the
                         * node named, once a call; this slot at least points there. */
                        if (!refreshed) {
                            refreshed = true;
                            char w[384];
                            if (refresh_from(r, host, port, w, sizeof(w)) == 0 && r->m_refresh)
                                metric_inc(r->m_refresh, 1);
                        }
                        pthread_rwlock_wrlock(&r->smu);
                        r->owner[slot] = (uint16_t)to;
                        pthread_rwlock_unlock(&r->smu);
                        cs[i].ask = NO_EP;
                    } else {
                        if (r->m_ask) metric_inc(r->m_ask, 1);
                        cs[i].ask = to; /* this command only; the map stays */
                    }
                    /* The read cache: flushed, bypassed until listeners match the map. */
                    rs_track_map_changed(r);
                    snprintf(hard, sizeof(hard), "%.300s", rep->str);
                    b->c[i].rep = NULL;
                    again = true;
                } else if (err_is(rep, "TRYAGAIN")) {
                    /* A multi-key command during a slot migration: a moment later. */
                    snprintf(hard, sizeof(hard), "%.300s", rep->str);
                    b->c[i].rep = NULL;
                    cs[i].ask = NO_EP;
                    again = tryagain = true;
                    rs_track_map_changed(r);
                } else if (err_is(rep, "NOSCRIPT") && !l->bad &&
                           load_script(r, l->s->c, b->c[i].script)) {
                    /* A restarted or failed-over node without our scripts. */
                    if (r->m_noscript) metric_inc(r->m_noscript, 1);
                    b->c[i].rep = NULL;
                    again = true;
                } else {
                    cs[i].st = C_DONE;
                }
            }
            pool_put(r->ep[l->ep], l->s);
        }
        if (!again) break;
        if (tryagain || hard[0]) redirects++;
        if (redirects > RS_MAX_REDIRECTS || rounds > RS_MAX_REDIRECTS + 2) {
            for (size_t i = 0; i < nc; i++)
                if (cs[i].st == C_PENDING) cs[i].st = C_FAILED;
            gave_up = true;
            rs_set_err(r, "redis cluster: still redirected after %d tries (%s)", RS_MAX_REDIRECTS,
                       hard[0] ? hard : "no progress");
            warn_limited(r, "[MetadataStore] redis cluster: %s%s", "too many redirections: ", hard);
            break;
        }
        if (tryagain) {
            struct timespec ts = {0, 1000000L << (redirects < 6 ? redirects : 6)};
            nanosleep(&ts, NULL);
        }
    }
    /* Failures: transport, no owner, error replies. */
    int rc = 0;
    bool failed = false;
    for (size_t i = 0; !gave_up && i < nc; i++) {
        redisReply *rep = b->c[i].rep;
        if (cs[i].st == C_FAILED || !rep) {
            failed = true;
        } else if (rep->type == REDIS_REPLY_ERROR) {
            struct endpoint *ep = r->ep[cs[i].ep];
            snprintf(fail, sizeof(fail), "%.100s:%d: %.200s", ep->host, ep->port, rep->str);
            failed = true;
            if (degrade) b->c[i].rep = NULL;
        }
    }
    if (gave_up) {
        rc = -1;
    } else if (failed) {
        if (!fail[0]) snprintf(fail, sizeof(fail), "unreachable");
        if (degrade) {
            warn_limited(r, "[MetadataStore] redis shard degraded (%s): %.300s", degrade, fail);
            const char *v[] = {"redis", degrade};
            if (r->f_degraded) metrics_add(r->f_degraded, v, 1);
        } else {
            rs_set_err(r, "%s", fail);
            warn_limited(r, "[MetadataStore] redis: %s%.300s", "", fail);
            rc = -1;
        }
    }
    free(cs);
    free(lk);
    return rc;
}

/* ---- set-up ---- */

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

void rs_metrics_init(struct rstore *r, struct metrics *m) {
    if (!m) return;
    static const char *const L_B[] = {"backend", NULL};
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
    if (r->cluster) {
        static const char *const L_BK[] = {"backend", "kind", NULL};
        if ((f = metrics_counter(m, "lmcache_master_redis_cluster_redirects_total",
                                 "Redis Cluster redirections followed (MOVED, ASK)", L_BK))) {
            const char *mv[] = {"redis", "moved"}, *av[] = {"redis", "ask"};
            r->m_moved = metric_labels(f, mv);
            r->m_ask = metric_labels(f, av);
        }
        if ((f = metrics_counter(m, "lmcache_master_redis_cluster_slot_map_reads_total",
                                 "Redis Cluster slot maps read after start", L_B)))
            r->m_refresh = metric_labels(f, be);
    }
}

/* PINGs an endpoint and loads every script there; the connection goes into its pool. */
static int probe(struct rstore *r, struct endpoint *ep, char *why, size_t wlen) {
    redisContext *c = rs_dial(r, ep->host, ep->port, why, wlen);
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

int rs_conn_init(struct rstore *r, const struct mstore_redis_cfg *cfg, char *err, size_t errlen) {
    pthread_rwlock_init(&r->smu, NULL);
    const char *uris = r->multi ? cfg->shard_uris : cfg->uri;
    uint32_t n = 1;
    for (const char *p = uris; *p; p++) n += *p == ',';
    if (n > 4096) n = 4096;
    if (!r->multi && !r->cluster) n = 1;
    r->ep = calloc(r->cluster ? RS_MAX_NODES : n, sizeof(*r->ep));
    if (!r->ep) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    const char *u = uris;
    for (uint32_t e = 0; e < n; e++) {
        const char *comma = strchr(u, ',');
        char one[512], host[256];
        int port;
        snprintf(one, sizeof(one), "%.*s", (int)(comma ? comma - u : (long)strlen(u)), u);
        u = comma ? comma + 1 : u + strlen(u);
        if (parse_uri(one, host, sizeof(host), &port)) {
            errbuf_set(err, errlen, "%s '%s' is not tcp://host[:port]",
                       r->multi ? "UMBP_REDIS_SHARD_URIS entry" : "UMBP_REDIS_URI", one);
            return -1;
        }
        if (r->cluster) {
            pthread_rwlock_wrlock(&r->smu);
            uint32_t idx = do_ep_find_or_add(r, host, port);
            pthread_rwlock_unlock(&r->smu);
            if (idx == NO_EP) {
                errbuf_set(err, errlen, "out of memory");
                return -1;
            }
            continue;
        }
        if (!(r->ep[e] = ep_new(host, port, r->pool_size))) {
            errbuf_set(err, errlen, "out of memory");
            return -1;
        }
        atomic_store(&r->nep, e + 1);
    }
    if (r->cluster) {
        r->owner = malloc(RS_NSLOTS * sizeof(*r->owner));
        if (!r->owner) {
            errbuf_set(err, errlen, "out of memory");
            return -1;
        }
        for (uint32_t s = 0; s < RS_NSLOTS; s++) r->owner[s] = NO_OWNER;
        /* The slot map from the first seed that answers. */
        char why[384] = "no seed";
        bool ok = false;
        uint32_t nseeds = atomic_load(&r->nep);
        for (uint32_t e = 0; e < nseeds && !ok; e++)
            ok = refresh_from(r, r->ep[e]->host, r->ep[e]->port, why, sizeof(why)) == 0;
        if (!ok) {
            if (cfg->required) {
                errbuf_set(err, errlen, "redis unavailable: %s", why);
                return -1;
            }
            log_warn(r->lg, "[MetadataStore] redis cluster map unavailable at start (%s)", why);
            atomic_store(&r->refresh, true);
            return 0;
        }
        uint32_t masters[RS_MAX_NODES];
        uint32_t nm = rs_cluster_masters(r, masters, RS_MAX_NODES);
        log_info(r->lg, "[MetadataStore] redis cluster: %u masters serve the slots", nm);
        for (uint32_t k = 0; k < nm; k++) {
            char why2[384] = "";
            if (probe(r, r->ep[masters[k]], why2, sizeof(why2)) == 0) continue;
            if (cfg->required) {
                errbuf_set(err, errlen, "redis unavailable: %s", why2);
                return -1;
            }
            log_warn(r->lg, "[MetadataStore] redis unavailable at start (%s); starting degraded",
                     why2);
        }
        return 0;
    }
    for (uint32_t e = 0; e < n; e++) {
        char why[384] = "";
        if (probe(r, r->ep[e], why, sizeof(why)) == 0) continue;
        if (cfg->required) {
            errbuf_set(err, errlen, "redis unavailable: %s", why);
            return -1;
        }
        log_warn(r->lg, "[MetadataStore] redis unavailable at start (%s); starting degraded", why);
    }
    return 0;
}

void rs_conn_fini(struct rstore *r) {
    uint32_t n = atomic_load(&r->nep);
    for (uint32_t e = 0; r->ep && e < n; e++) ep_free(r->ep[e]);
    free(r->ep);
    free(r->owner);
    pthread_rwlock_destroy(&r->smu);
}
