/* The Redis metadata store: every operation of mstore.h as a few pipelined commands or
 * server-side Lua scripts (mstore_redis_lua.h); the transport (pools, routing in single,
 * multi and cluster mode, redirections) is mstore_redis_conn.c.
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
#include "master/mstore_match.h"
#include "master/mstore_redis_batch.h"
#include "master/mstore_redis_internal.h"

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
/* ---- interned node ids (stable pointers for struct mstore_loc / match results) ---- */

static uint64_t ident_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return HTAB_ENTRY(n, struct ident, hn)->h;
}

const char *rs_intern(struct rstore *r, const char *p, size_t n, uint32_t *idx) {
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
        struct ident **v =
            r->capids <= UINT32_MAX / 2 ? realloc(r->ids, (size_t)nc * sizeof(*v)) : NULL;
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

/* ---- clients ---- */

static int rs_register(struct mstore *s, const struct mstore_reg *g, int64_t now,
                       int64_t stale_after) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, ROUTE_CTL, NULL, S_REGISTER, 4);
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

/* Drops a node's blocks and external-KV entries: every shard's step in one batch (one round
 * trip per endpoint), again while a step still found entries; a bounded chunk per script so
 * that a large node never holds Redis for long. In split modes a failed shard keeps its
 * entries of the node (best effort). */
void rs_wipe_node(struct rstore *r, const char *id, bool blocks, bool extkv) {
    size_t idl = strlen(id);
    uint32_t nw = 2 * r->nshards;
    bool *more = malloc(nw * sizeof(bool));
    uint32_t *which = malloc(nw * sizeof(uint32_t));
    if (!more || !which) {
        free(more);
        free(which);
        rs_set_err(r, "out of memory");
        return;
    }
    for (uint32_t w = 0; w < nw; w++) more[w] = w < r->nshards ? blocks : extkv;
    for (;;) {
        struct batch b = {0};
        for (uint32_t w = 0; w < nw; w++) {
            if (!more[w]) continue;
            uint32_t sh = w % r->nshards;
            which[b.nc] = w;
            if (w < r->nshards) {
                b_cmd(&b, sh, NULL, S_WIPE_BLOCKS, 1);
                b_shard_key(&b, r, sh, ":node:", id, idl, ":blocks");
            } else {
                b_cmd(&b, sh, NULL, S_WIPE_EXTKV, 2);
                b_shard_key(&b, r, sh, ":extkv:node:", id, idl, NULL);
                b_shard_key(&b, r, sh, ":extkv_count", "", 0, NULL);
            }
            b_str(&b, id);
            b_u64(&b, MSTORE_REDIS_CHUNK);
        }
        if (!b.nc) break;
        bool ok = rs_run(r, &b, r->split ? "WipeNode" : NULL) == 0;
        for (size_t i = 0; i < b.nc; i++)
            if (!ok || rep_int(b.c[i].rep) <= 0) more[which[i]] = false;
        b_free(&b);
    }
    free(more);
    free(which);
}

static bool rs_unregister(struct mstore *s, const char *node_id) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    b_cmd(&b, ROUTE_CTL, NULL, S_UNREGISTER, 4);
    b_control_keys(&b, r, node_id);
    b_str(&b, node_id);
    bool had = run(r, &b) == 0 && rep_int(b.c[0].rep) == 1;
    b_free(&b);
    if (had) rs_wipe_node(r, node_id, true, true);
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
    bool revived = false;
    /* The CAS applies the first chunk itself, except in split modes (events go to their
     * shards' endpoints). */
    size_t first = full || r->split ? 0 : (nev < MSTORE_REDIS_CHUNK ? nev : MSTORE_REDIS_CHUNK);
    struct batch b = {0};
    b_cmd(&b, ROUTE_CTL, NULL, S_HEARTBEAT, 4);
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
        if (rep->type == REDIS_REPLY_ARRAY && rep->elements == 3) {
            long long st = rep_int(rep->element[0]);
            res = st == 0 ? MSTORE_HB_APPLIED : st == 1 ? MSTORE_HB_SEQ_GAP : MSTORE_HB_UNKNOWN;
            *acked = rep->element[1]->type == REDIS_REPLY_STRING
                         ? strtoull(rep->element[1]->str, NULL, 10)
                         : 0;
            revived = rep_int(rep->element[2]) == 1;
        }
    }
    b_free(&b);
    if (res == MSTORE_HB_APPLIED) {
        /* The rest in bounded chunks, in order; a full sync first wipes the node's blocks.
         * Readers may see a chunk boundary (as readers of the reference see shard ones). */
        if (full) rs_wipe_node(r, node_id, true, false);
        /* Every shard's chunks in one batch: one round trip per endpoint, a shard's chunks in
         * order on one connection. */
        bool shard_failed = false;
        struct mstore_event *part = r->split ? malloc((nev + 1) * sizeof(*part)) : NULL;
        if (r->split && !part) rs_set_err(r, "out of memory");
        struct batch e = {0};
        for (uint32_t sh = 0; sh < (r->split ? r->nshards : 1) && !rs_has_err(r); sh++) {
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
                /* KEYS: the shard's node-set key, which routes the call (cluster). */
                b_cmd(&e, sh, NULL, S_EVENTS, 1);
                b_shard_key(&e, r, sh, ":node:", node_id, strlen(node_id), ":blocks");
                b_str(&e, node_id);
                b_i64(&e, now);
                b_str(&e, full ? "1" : "0");
                b_events(&e, r, node_id, pe + i, k);
            }
        }
        if (!rs_has_err(r) && e.nc) {
            if (rs_run(r, &e, r->split ? "ApplyHeartbeat" : NULL)) shard_failed = true;
            for (size_t i = 0; i < e.nc; i++) shard_failed |= !e.c[i].rep;
        }
        b_free(&e);
        free(part);
        /* A step that failed leaves the node behind its sequence: ask for a full sync. */
        if (shard_failed || rs_has_err(r)) res = MSTORE_HB_SEQ_GAP;
    }
    OP_END(r, OP_HEARTBEAT);
    return revived && res != MSTORE_HB_UNKNOWN ? MSTORE_HB_REVIVED : res;
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
    b_cmd(&b, ROUTE_CTL, NULL, S_EXPIRE, 3);
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
            rs_wipe_node(r, ex[i], true, true);
            if (fn) fn(ex[i], arg);
        }
        free(ex[i]);
    }
    for (size_t i = 0; i < nfg; i++) {
        if (fg[i]) rs_wipe_node(r, fg[i], true, true);
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
    b_cmd(&b, ROUTE_CTL, "SCARD", -1, 0);
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
    b_cmd(&b, ROUTE_CTL, "HGET", -1, 0);
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
    b_cmd(&b, ROUTE_CTL, "HGET", -1, 0);
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
    b_cmd(&b, ROUTE_CTL, NULL, S_LIST_ALIVE, 1);
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
            v[i].node_id = rs_intern(r, id->str, id->len, &v[i].node);
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

/* ---- block index ---- */

/* Groups keys by shard: one script per shard touched, one pipeline per endpoint. Key i
 * is element pos[i] of the reply of command cmdof[sh[i]] (NULL: a failed shard in split
 * modes, read as misses). -1: failed (recorded). */
static int block_scripts(struct rstore *r, int script, const char *method, char *const *keys,
                         size_t n, uint32_t *sh, uint32_t *pos, redisReply ***srep_out,
                         struct batch *b, void (*argv)(struct batch *, void *), void *arg) {
    uint32_t *cnt = calloc(r->nshards, sizeof(uint32_t));
    uint32_t *cmdof = malloc(r->nshards * sizeof(uint32_t));
    redisReply **srep = calloc(r->nshards, sizeof(*srep));
    *srep_out = srep;
    if (!cnt || !cmdof || !srep) {
        free(cnt);
        free(cmdof);
        rs_set_err(r, "out of memory");
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        sh[i] = shard_of(r, keys[i], strlen(keys[i]));
        pos[i] = cnt[sh[i]]++;
    }
    for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
        cmdof[s2] = UINT32_MAX;
        if (!cnt[s2]) continue;
        cmdof[s2] = (uint32_t)b->nc;
        b_cmd(b, s2, NULL, script, cnt[s2]);
        for (size_t i = 0; i < n; i++)
            if (sh[i] == s2) b_shard_key(b, r, s2, ":block:", keys[i], strlen(keys[i]), NULL);
        if (argv) argv(b, arg);
    }
    int rc = rs_run(r, b, r->split ? method : NULL);
    for (uint32_t s2 = 0; !rc && s2 < r->nshards; s2++)
        srep[s2] = cmdof[s2] != UINT32_MAX ? b->c[cmdof[s2]].rep : NULL;
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
    struct batch b = {0};
    int rc = -1;
    if (!sh || !pos) goto out;
    struct rg_args a = {now, lease_until, excl, nexcl};
    if (block_scripts(r, S_ROUTE_GET, "BatchLookupBlockForRouteGet", keys, n, sh, pos, &srep, &b,
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
            l->node_id = rs_intern(r, e->element[3 * j]->str, e->element[3 * j]->len, &l->node);
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
    b_free(&b);
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
    struct batch b = {0};
    if (!sh || !pos) {
        rs_set_err(r, "out of memory");
        goto out;
    }
    if (block_scripts(r, S_EXISTS, "BatchExistsBlock", keys, n, sh, pos, &srep, &b, NULL, NULL) ==
        0)
        for (size_t i = 0; i < n; i++) found[i] = rep_int(key_reply(srep, sh, pos, i)) == 1;
out:
    b_free(&b);
    free(srep);
    free(sh);
    free(pos);
    OP_END(r, OP_EXISTS);
}

/* ---- lifecycle ---- */

static void rs_destroy(struct mstore *s) {
    struct rstore *r = RS(s);
    rs_track_stop(r); /* the listeners use the endpoints */
    rs_conn_fini(r);
    for (uint32_t i = 0; i < r->nids; i++) free(r->ids[i]);
    free(r->ids);
    htab_fini(&r->itab);
    for (uint32_t i = 0; r->tag && i < r->nshards; i++)
        if (r->tag[i] != r->ctl) free(r->tag[i]);
    free(r->tag);
    free(r->tslot);
    free(r->seeds);
    free(r->password);
    pthread_mutex_destroy(&r->mu);
    pthread_mutex_destroy(&r->imu);
    pthread_mutex_destroy(&r->tmu);
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

static void init_metrics(struct rstore *r, struct metrics *m) {
    if (!m) return;
    rs_metrics_init(r, m);
    static const char *const L_OP[] = {"op", "backend", NULL};
    static const double LAT[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                 0.025,  0.05,    0.1,    0.25,  0.5,    1};
    struct metric_family *f;
    if ((f = metrics_histogram(m, "mori_umbp_store_op_latency_seconds",
                               "Metadata store operation latency", L_OP, LAT,
                               sizeof(LAT) / sizeof(LAT[0]))))
        for (int i = 0; i < OP_COUNT; i++) {
            const char *v[] = {OP_NAMES[i], "redis"};
            r->m_lat[i] = metric_labels(f, v);
        }
}

static int set_tags(struct rstore *r, const char *ns, const uint32_t *num, uint32_t n) {
    r->nshards = n;
    r->tag = calloc(n, sizeof(char *));
    r->tslot = calloc(n, sizeof(uint16_t));
    if (!r->tag || !r->tslot) return -1;
    for (uint32_t i = 0; i < n; i++) {
        if (n == 1 && !r->cluster) {
            r->tag[i] = r->ctl; /* the legacy layout: everything under one tag */
            break;
        }
        char t[300];
        snprintf(t, sizeof(t), "{umbp:%s:b%u}", ns, num ? num[i] : i);
        if (!(r->tag[i] = strdup(t))) return -1;
        r->tslot[i] = rs_tag_slot(t);
    }
    return 0;
}

/* Cluster mode without an explicit shard count: one tag per master, tag k of master m the
 * first {umbp:<ns>:b<k>} whose slot m serves. The first master to start records the choice
 * under H:shard_tags; every later start (and every replica) reads it back, so the layout
 * outlives resharding and restarts. */
static int balanced_tags(struct rstore *r, const char *ns, char *err, size_t errlen) {
    uint32_t masters[RS_MAX_NODES], nums[RS_MAX_NODES];
    uint32_t nm = rs_cluster_masters(r, masters, RS_MAX_NODES);
    if (!nm) {
        errbuf_set(err, errlen, "redis cluster: no slot map (balanced tags need one at start)");
        return -1;
    }
    char list[RS_MAX_NODES * 8] = "";
    size_t ll = 0;
    for (uint32_t m = 0; m < nm; m++) {
        nums[m] = UINT32_MAX;
        for (uint32_t k = 0; k < (1u << 20) && nums[m] == UINT32_MAX; k++) {
            bool used = false;
            for (uint32_t q = 0; q < m && !used; q++) used = nums[q] == k;
            char t[300];
            snprintf(t, sizeof(t), "{umbp:%s:b%u}", ns, k);
            if (!used && rs_slot_owner(r, rs_tag_slot(t)) == masters[m]) nums[m] = k;
        }
        if (nums[m] == UINT32_MAX) continue;
        ll += (size_t)snprintf(list + ll, sizeof(list) - ll, "%s%u", ll ? "," : "", nums[m]);
    }
    struct batch b = {0};
    char key[340];
    snprintf(key, sizeof(key), "%s:shard_tags", r->ctl);
    b_cmd(&b, ROUTE_CTL, "SET", -1, 0);
    b_str(&b, key);
    b_str(&b, list);
    b_str(&b, "NX");
    b_cmd(&b, ROUTE_CTL, "GET", -1, 0);
    b_str(&b, key);
    int rc = -1;
    if (rs_run(r, &b, NULL) == 0 && b.c[1].rep->type == REDIS_REPLY_STRING) {
        uint32_t n = 0;
        for (const char *p = b.c[1].rep->str; *p && n < RS_MAX_NODES;) {
            char *end;
            unsigned long v = strtoul(p, &end, 10);
            if (end == p || v >= (1u << 20)) break;
            nums[n++] = (uint32_t)v;
            p = *end == ',' ? end + 1 : end;
        }
        if (n && set_tags(r, ns, nums, n) == 0) rc = 0;
    }
    if (rc) {
        char why[400] = "no answer";
        rs_take_error(&r->base, why, sizeof(why));
        errbuf_set(err, errlen, "redis cluster: cannot record the shard tags: %s", why);
    } else {
        log_info(r->lg,
                 "[MetadataStore] redis cluster: %u shard tags (%s), one per master at start",
                 r->nshards, b.c[1].rep->str);
    }
    b_free(&b);
    return rc;
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
    pthread_mutex_init(&r->tmu, NULL);
    bool have_multi = cfg->shard_uris && *cfg->shard_uris;
    r->cluster = cfg->cluster;
    r->multi = !r->cluster && have_multi && strchr(cfg->shard_uris, ',');
    r->split = r->multi || r->cluster;
    r->connect_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : 1000;
    r->socket_ms = cfg->socket_timeout_ms ? cfg->socket_timeout_ms : 1000;
    r->pool_size = cfg->pool_size ? cfg->pool_size : 4;
    r->password = strdup(cfg->password ? cfg->password : "");
    r->seeds = strdup(have_multi && !r->cluster ? cfg->shard_uris : cfg->uri);
    if (!r->password || !r->seeds || htab_init(&r->itab, 256, ident_hash, NULL)) {
        errbuf_set(err, errlen, "out of memory");
        goto fail;
    }
    if (r->cluster && have_multi) {
        errbuf_set(err, errlen,
                   "UMBP_REDIS_CLUSTER=1 and UMBP_REDIS_SHARD_URIS cannot be combined");
        goto fail;
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
    r->ctl_slot = rs_tag_slot(r->ctl);
    init_metrics(r, cfg->metrics);
    if (rs_conn_init(r, cfg, err, errlen)) goto fail;
    /* Multi mode: one shard per endpoint. Cluster: the given count, or one per master. */
    if (r->cluster && cfg->shards <= 1) {
        if (balanced_tags(r, cfg->ns, err, errlen)) goto fail;
    } else if (set_tags(r, cfg->ns, NULL,
                        r->multi      ? atomic_load(&r->nep)
                        : cfg->shards ? cfg->shards
                                      : 1)) {
        errbuf_set(err, errlen, "out of memory");
        goto fail;
    }
    if (rs_track_start(r, cfg->cache_mb, cfg->metrics)) {
        errbuf_set(err, errlen, "out of memory (read cache)");
        goto fail;
    }
    return &r->base;
fail:
    rs_destroy(&r->base);
    return NULL;
}
