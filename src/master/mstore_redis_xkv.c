/* The Redis store's external-KV operations: reports and revokes in chunked scripts, the
 * match (plain HGETALLs or per-shard scripts with hit counting), hit counters and their GC,
 * the live count. Routing and failures: mstore_redis_conn.c. */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "master/mcache.h"
#include "master/mstore_match.h"
#include "master/mstore_redis_batch.h"
#include "master/mstore_redis_internal.h"

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

/* Reports and revokes go in chunks of MSTORE_REDIS_CHUNK hashes, all chunks in one batch:
 * one round trip per endpoint, and no script runs longer than a chunk. */
static int ext_write(struct rstore *r, int script, const char *node, char *const *hashes, size_t n,
                     int tier) {
    if (r->split && script == S_EXT_REPORT) {
        /* The alive gate on the control endpoint, then the shards' writes (a node that
         * expires in between may get this one report in: the reference's window too). */
        struct batch g = {0};
        b_cmd(&g, ROUTE_CTL, "SISMEMBER", -1, 0);
        b_str(&g, r->k_alive);
        b_str(&g, node);
        int alive = run(r, &g) ? -1 : (int)rep_int(g.c[0].rep);
        b_free(&g);
        if (alive <= 0) return alive;
    }
    char **part = malloc((n + 1) * sizeof(char *));
    if (!part) {
        rs_set_err(r, "out of memory");
        return -1;
    }
    struct batch b = {0};
    for (uint32_t sh = 0; sh < (r->split ? r->nshards : 1); sh++) {
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (!r->split || shard_of(r, hashes[i], strlen(hashes[i])) == sh) part[m++] = hashes[i];
        for (size_t i = 0; i < m; i += MSTORE_REDIS_CHUNK) {
            size_t k = m - i < MSTORE_REDIS_CHUNK ? m - i : MSTORE_REDIS_CHUNK;
            /* KEYS: the alive set (the gate, single mode), else the shard's count key,
             * which routes the call (cluster). */
            bool gate = script == S_EXT_REPORT && !r->split;
            b_cmd(&b, sh, NULL, script, 1);
            if (gate)
                b_str(&b, r->k_alive);
            else
                b_shard_key(&b, r, sh, ":extkv_count", "", 0, NULL);
            b_str(&b, node);
            b_u64(&b, 1ull << tier);
            if (script == S_EXT_REPORT) b_str(&b, gate ? "1" : "0");
            b_ext_triples(&b, r, node, part + i, k);
        }
    }
    int rc = 1;
    if (run(r, &b))
        rc = -1;
    else if (script == S_EXT_REPORT)
        for (size_t i = 0; i < b.nc; i++)
            if (rep_int(b.c[i].rep) == 0) rc = 0;
    b_free(&b);
    free(part);
    return rc;
}

int rs_ext_report(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    int rc = ext_write(r, S_EXT_REPORT, node_id, hashes, n, tier);
    if (rc < 0) rc = 0; /* the failure is recorded: the RPC answers UNAVAILABLE */
    OP_END(r, OP_XREPORT);
    return rc;
}

void rs_ext_revoke(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    ext_write(r, S_EXT_REVOKE, node_id, hashes, n, tier);
    OP_END(r, OP_XREVOKE);
}

/* One SSCAN-style step per shard in one batch, again for the shards whose cursor is not
 * back at "0". step adds shard sh's command with its cursor; the reply is {cursor, n} or a
 * bare cursor. Returns the sum of the n. */
static size_t scan_shards(struct rstore *r, const char *method,
                          void (*step)(struct batch *, struct rstore *, uint32_t, const char *,
                                       const void *),
                          const void *arg) {
    char(*cur)[32] = calloc(r->nshards, sizeof(*cur));
    uint32_t *which = malloc(r->nshards * sizeof(uint32_t));
    size_t total = 0;
    if (!cur || !which) {
        rs_set_err(r, "out of memory");
        goto out;
    }
    for (uint32_t sh = 0; sh < r->nshards; sh++) snprintf(cur[sh], sizeof(cur[sh]), "0");
    for (bool start = true;; start = false) {
        struct batch b = {0};
        for (uint32_t sh = 0; sh < r->nshards; sh++) {
            if (!start && strcmp(cur[sh], "0") == 0) continue;
            which[b.nc] = sh;
            step(&b, r, sh, cur[sh], arg);
        }
        if (!b.nc) break;
        bool ok = rs_run(r, &b, r->split ? method : NULL) == 0;
        for (size_t i = 0; i < b.nc; i++) {
            redisReply *rep = ok ? b.c[i].rep : NULL;
            char *c = cur[which[i]];
            if (rep && rep->type == REDIS_REPLY_STRING) {
                snprintf(c, 32, "%s", rep->str);
            } else if (rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == 2 &&
                       rep->element[0]->type == REDIS_REPLY_STRING) {
                snprintf(c, 32, "%s", rep->element[0]->str);
                total += (size_t)rep_int(rep->element[1]);
            } else {
                snprintf(c, 32, "0");
            }
        }
        b_free(&b);
    }
out:
    free(cur);
    free(which);
    return total;
}

struct tier_arg {
    const char *node;
    int tier;
};

static void revoke_tier_step(struct batch *b, struct rstore *r, uint32_t sh, const char *cursor,
                             const void *arg) {
    const struct tier_arg *a = arg;
    b_cmd(b, sh, NULL, S_EXT_REVOKE_TIER, 2);
    b_shard_key(b, r, sh, ":extkv:node:", a->node, strlen(a->node), NULL);
    b_shard_key(b, r, sh, ":extkv_count", "", 0, NULL);
    b_str(b, a->node);
    b_u64(b, 1ull << a->tier);
    b_str(b, cursor);
    b_u64(b, MSTORE_REDIS_CHUNK);
}

void rs_ext_revoke_tier(struct mstore *s, const char *node_id, int tier) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct tier_arg a = {node_id, tier};
    scan_shards(r, NULL, revoke_tier_step, &a);
    OP_END(r, OP_XREVOKE_TIER);
}

void rs_ext_revoke_node(struct mstore *s, const char *node_id) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    rs_wipe_node(r, node_id, false, true);
    OP_END(r, OP_XREVOKE_NODE);
}

/* A node name of a reply, interned once per call. */
struct mnode {
    uint32_t node;
    const redisReply *name, *peer;
};

/* The peer of an ALIVE node from an HGETALL of the alive-peers map ("" when absent). */
static const redisReply *peer_in(const redisReply *peers, const char *id) {
    size_t idl = strlen(id);
    for (size_t k = 0; peers && peers->type == REDIS_REPLY_ARRAY && k + 1 < peers->elements;
         k += 2) {
        const redisReply *pk = peers->element[k], *pv = peers->element[k + 1];
        if (pk->len == idl && memcmp(pk->str, id, idl) == 0 && pv->type == REDIS_REPLY_STRING)
            return pv;
    }
    return NULL;
}

static bool push_hit(struct mstore_hitrec **h, size_t *nh, size_t *hcap, struct mstore_hitrec x) {
    if (*nh == *hcap) {
        struct mstore_hitrec *nw = realloc(*h, 2 * *hcap * sizeof(**h));
        if (!nw) return false;
        *h = nw;
        *hcap *= 2;
    }
    (*h)[(*nh)++] = x;
    return true;
}

/* The (node, tiers) codes of an HGETALL reply of an extkv hash, appended to out as
 * node << 4 | tiers (uint32). False on no memory or a node index too large to code. */
static bool codes_of(struct rstore *r, const redisReply *e, struct mcache_buf *out) {
    for (size_t j = 0; e && e->type == REDIS_REPLY_ARRAY && j + 1 < e->elements; j += 2) {
        const redisReply *nm = e->element[j], *tv = e->element[j + 1];
        uint8_t tiers =
            (uint8_t)((tv->type == REDIS_REPLY_STRING && tv->len == 1 ? (uint8_t)(tv->str[0] - '0')
                                                                      : rep_int(tv)) &
                      0xf);
        if (!tiers || nm->type != REDIS_REPLY_STRING) continue;
        uint32_t node;
        if (!rs_intern(r, nm->str, nm->len, &node) || node >= (1u << 28)) return false;
        uint32_t code = node << 4 | tiers;
        if (!mcache_buf_put(out, &code, sizeof(code))) return false;
    }
    return true;
}

/* The peer map as cached: per ALIVE node {uint32 node, uint32 len, len bytes}. */
static bool peers_of(struct rstore *r, const redisReply *p, struct mcache_buf *out) {
    for (size_t k = 0; p && p->type == REDIS_REPLY_ARRAY && k + 1 < p->elements; k += 2) {
        const redisReply *pk = p->element[k], *pv = p->element[k + 1];
        if (pk->type != REDIS_REPLY_STRING || pv->type != REDIS_REPLY_STRING) continue;
        uint32_t node, len = (uint32_t)pv->len;
        if (!rs_intern(r, pk->str, pk->len, &node) || pv->len > UINT32_MAX ||
            !mcache_buf_put(out, &node, 4) || !mcache_buf_put(out, &len, 4) ||
            !mcache_buf_put(out, pv->str, pv->len))
            return false;
    }
    return true;
}

/* A plain match through the read cache (mstore_redis_track.c). The fence first (every write
 * acknowledged before this call is then invalidated), then each hash from the cache; the
 * misses, and the peer map when it is not cached, are read in one pipeline as in the
 * uncached path and filled back with the tickets of their misses. 1: answered (mt filled,
 * or empty with the failure recorded); 0: the cache cannot serve now, read Redis directly;
 * -1: no memory. */
static int match_cached(struct rstore *r, const struct mstore_key *keys, size_t n,
                        const bool *first, struct mstore_match *mt) {
    if (rs_track_fence(r)) {
        if (r->m_c_bypass) metric_inc(r->m_c_bypass, 1);
        return 0;
    }
    int rc = -1;
    size_t *off = malloc(n * sizeof(size_t)), *len = malloc(n * sizeof(size_t));
    uint64_t *tick = malloc(n * sizeof(uint64_t)), *khv = malloc(n * sizeof(uint64_t));
    uint32_t *cmd = malloc(n * sizeof(uint32_t));
    size_t hcap = 64, nh = 0, nhit = 0, nmiss = 0;
    struct mstore_hitrec *h = malloc(hcap * sizeof(*h));
    struct mcache_buf cb = {0}, pb = {0};
    struct batch b = {0};
    if (!off || !len || !tick || !khv || !cmd || !h) goto out;
    for (size_t i = 0; i < n; i++) khv[i] = first[i] ? mcache_hash('x', keys[i].p, keys[i].n) : 0;
    /* Two rounds of prefetches so that the lookups' cache misses overlap. */
    mcache_prefetch(r->cache, khv, n, 0);
    mcache_prefetch(r->cache, khv, n, 1);
    for (size_t i = 0; i < n; i++) {
        cmd[i] = UINT32_MAX;
        if (!first[i]) continue;
        size_t at = cb.n;
        int g = mcache_get(r->cache, 'x', keys[i].p, keys[i].n, khv[i], &cb, &tick[i]);
        if (g < 0) {
            rc = 0; /* turned off meanwhile (or no memory): the direct path */
            goto out;
        }
        off[i] = at;
        len[i] = cb.n - at;
        if (g == 1) {
            nhit++;
            continue;
        }
        nmiss++;
        uint32_t sh = shard_of(r, keys[i].p, keys[i].n);
        cmd[i] = (uint32_t)b.nc;
        b_cmd(&b, sh, "HGETALL", -1, 0);
        b_shard_key(&b, r, sh, ":extkv:", keys[i].p, keys[i].n, NULL);
    }
    uint64_t phv = mcache_hash('p', "", 0), ptick = 0;
    int pg = mcache_get(r->cache, 'p', "", 0, phv, &pb, &ptick);
    if (pg < 0) {
        rc = 0;
        goto out;
    }
    size_t pcmd = SIZE_MAX;
    if (pg == 0) {
        pcmd = b.nc;
        b_cmd(&b, ROUTE_CTL, "HGETALL", -1, 0);
        b_str(&b, r->k_peers);
    }
    if (r->m_c_hit) metric_inc(r->m_c_hit, (double)nhit);
    if (r->m_c_miss) metric_inc(r->m_c_miss, (double)nmiss);
    if (b.nc && rs_run(r, &b, r->split ? "MatchExternalKv" : NULL)) {
        rc = 1; /* recorded: the RPC answers UNAVAILABLE */
        goto out;
    }
    /* The misses: codes appended after the hits' (off/len re-pointed), filled back. */
    for (size_t i = 0; i < n; i++) {
        if (!first[i] || cmd[i] == UINT32_MAX) continue;
        const redisReply *e = b.c[cmd[i]].rep; /* NULL: a failed shard (split modes) */
        size_t at = cb.n;
        if (!codes_of(r, e, &cb)) goto out;
        off[i] = at;
        len[i] = cb.n - at;
        if (e && e->type == REDIS_REPLY_ARRAY)
            mcache_fill(r->cache, 'x', keys[i].p, keys[i].n, khv[i], tick[i],
                        len[i] ? cb.p + at : NULL, len[i]);
    }
    if (pcmd != SIZE_MAX) {
        const redisReply *p = b.c[pcmd].rep;
        if (!peers_of(r, p, &pb)) goto out;
        if (p && p->type == REDIS_REPLY_ARRAY)
            mcache_fill(r->cache, 'p', "", 0, phv, ptick, pb.p, pb.n);
    }
    for (size_t i = 0; i < n; i++) {
        if (!first[i]) continue;
        for (size_t k = 0; k + 4 <= len[i]; k += 4) {
            uint32_t code;
            memcpy(&code, cb.p + off[i] + k, 4);
            if (!push_hit(&h, &nh, &hcap,
                          (struct mstore_hitrec){(uint32_t)i, code >> 4, (uint8_t)(code & 15)}))
                goto out;
        }
    }
    if (mstore_match_group(h, nh, mt)) goto out;
    rc = 1;
    for (uint32_t i = 0; i < mt->nnodes; i++) {
        struct mstore_match_node *mn = &mt->nodes[i];
        pthread_mutex_lock(&r->imu);
        mn->node_id = r->ids[mn->node]->id;
        pthread_mutex_unlock(&r->imu);
        const char *ps = "";
        uint32_t pl = 0;
        for (size_t k = 0; k + 8 <= pb.n;) {
            uint32_t node, l;
            memcpy(&node, pb.p + k, 4);
            memcpy(&l, pb.p + k + 4, 4);
            if (node == mn->node) {
                ps = (const char *)pb.p + k + 8;
                pl = l;
                break;
            }
            k += 8 + (size_t)l;
        }
        mn->peer_address = strndup(ps, pl);
        if (!mn->peer_address) rc = -1;
        mstore_match_compact(mn);
    }
out:
    b_free(&b);
    free(cb.p);
    free(pb.p);
    free(h);
    free(off);
    free(len);
    free(tick);
    free(khv);
    free(cmd);
    return rc;
}

/* One round trip per endpoint: without count_as_hit a pipeline of plain HGETALLs, each to
 * its shard's endpoint (Redis runs them several times faster than the same reads inside a
 * script), plus the ALIVE peer map from the control endpoint; with count_as_hit one match
 * script per shard touched (hit counting fused in), and in split modes the peer map in the
 * same round. */
int rs_ext_match(struct mstore *s, const struct mstore_key *keys, size_t n, bool count_as_hit,
                 int64_t now, struct mstore_match *mt) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    memset(mt, 0, sizeof(*mt));
    if (!n) return 0;
    int rc = -1;
    bool *first = malloc(n * sizeof(bool));
    uint64_t *hv = malloc(n * sizeof(uint64_t));
    uint32_t *sh = malloc(n * sizeof(uint32_t));
    uint32_t *cnt = calloc(r->nshards, sizeof(uint32_t));
    uint32_t *cmdof = malloc(r->nshards * sizeof(uint32_t));
    const char **cur = calloc(r->nshards, sizeof(*cur));
    size_t *tab0 = calloc(r->nshards + 1, sizeof(size_t));
    size_t hcap = 64, nh = 0, ntab = 0, tcap = 64;
    struct mstore_hitrec *h = malloc(hcap * sizeof(*h));
    struct mnode *tab = NULL;
    struct batch b = {0};
    if (!first || !hv || !sh || !cnt || !cmdof || !cur || !tab0 || !h ||
        mstore_match_dedup(keys, n, hv, first))
        goto out;
    for (size_t i = 0; i < n; i++)
        if (first[i]) {
            sh[i] = shard_of(r, keys[i].p, keys[i].n);
            cnt[sh[i]]++;
        }
    bool plain = !count_as_hit;
    if (plain && r->cache) {
        int c = match_cached(r, keys, n, first, mt);
        if (c) {
            rc = c > 0 ? 0 : -1;
            goto out;
        }
        memset(mt, 0, sizeof(*mt));
    }
    size_t kbytes = 0;
    for (size_t i = 0; i < n; i++) kbytes += keys[i].n + 48;
    b_reserve(&b, n + r->nshards + 2, 2 * n + 8 * r->nshards + 8, 2 * kbytes + 512);
    for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
        cmdof[s2] = UINT32_MAX;
        if (plain || !cnt[s2]) continue;
        cmdof[s2] = (uint32_t)b.nc;
        b_cmd(&b, s2, NULL, S_MATCH, count_as_hit ? 2 * (size_t)cnt[s2] + 1 : cnt[s2]);
        for (size_t i = 0; i < n; i++)
            if (first[i] && sh[i] == s2)
                b_shard_key(&b, r, s2, ":extkv:", keys[i].p, keys[i].n, NULL);
        if (count_as_hit) {
            for (size_t i = 0; i < n; i++)
                if (first[i] && sh[i] == s2)
                    b_shard_key(&b, r, s2, ":hit:", keys[i].p, keys[i].n, NULL);
            b_shard_key(&b, r, s2, ":hit:index", "", 0, NULL);
        }
        b_u64(&b, cnt[s2]);
        b_str(&b, count_as_hit ? "1" : "0");
        b_i64(&b, now);
        b_str(&b, r->split ? "" : r->k_peers); /* split: the peers are not on the shard */
    }
    for (size_t i = 0; plain && i < n; i++)
        if (first[i]) {
            b_cmd(&b, sh[i], "HGETALL", -1, 0);
            b_shard_key(&b, r, sh[i], ":extkv:", keys[i].p, keys[i].n, NULL);
        }
    size_t pcmd = b.nc;
    if (plain || r->split) {
        b_cmd(&b, ROUTE_CTL, "HGETALL", -1, 0);
        b_str(&b, r->k_peers);
    }
    if (rs_run(r, &b, r->split ? "MatchExternalKv" : NULL)) {
        rc = 0; /* recorded: the RPC answers UNAVAILABLE */
        goto out;
    }
    const redisReply *peers = pcmd < b.nc ? b.c[pcmd].rep : NULL;
    tab = calloc(tcap, sizeof(*tab));
    if (!tab) goto out;
    if (plain) {
        /* Node names interned once per call through a small cache. */
        size_t c = 0;
        for (size_t i = 0; i < n; i++) {
            if (!first[i]) continue;
            const redisReply *e = b.c[c++].rep; /* NULL: a failed shard (split modes) */
            for (size_t j = 0; e && e->type == REDIS_REPLY_ARRAY && j + 1 < e->elements; j += 2) {
                const redisReply *nm = e->element[j];
                const redisReply *tv = e->element[j + 1];
                uint8_t tiers = (uint8_t)((tv->type == REDIS_REPLY_STRING && tv->len == 1
                                               ? (uint8_t)(tv->str[0] - '0')
                                               : rep_int(tv)) &
                                          0xf);
                if (!tiers || nm->type != REDIS_REPLY_STRING) continue;
                /* tab as a 64-slot open-addressing cache keyed by the name's hash. */
                uint32_t node = UINT32_MAX, x = fnv1a32(nm->str, nm->len) & 63;
                for (size_t probe = 0; probe < 64; probe++, x = (x + 1) & 63) {
                    const struct mnode *t = &tab[x];
                    if (!t->name) break;
                    if (t->name->len == nm->len && memcmp(t->name->str, nm->str, nm->len) == 0) {
                        node = t->node;
                        break;
                    }
                }
                if (node == UINT32_MAX) {
                    if (!rs_intern(r, nm->str, nm->len, &node)) goto out;
                    if (!tab[x].name) tab[x] = (struct mnode){node, nm, NULL};
                }
                if (!push_hit(&h, &nh, &hcap, (struct mstore_hitrec){(uint32_t)i, node, tiers}))
                    goto out;
            }
        }
    } else {
        /* Each shard's reply: its node table {name, peer, ...}, interned once, and one
         * string of codes per key ((node number) * 16 + tier mask). */
        for (uint32_t s2 = 0; s2 < r->nshards; s2++) {
            tab0[s2] = ntab;
            const redisReply *a = cmdof[s2] != UINT32_MAX ? b.c[cmdof[s2]].rep : NULL;
            if (!a || a->type != REDIS_REPLY_ARRAY || a->elements != 2 ||
                a->element[0]->type != REDIS_REPLY_ARRAY ||
                a->element[1]->type != REDIS_REPLY_STRING)
                continue; /* a failed shard (split modes): misses */
            const redisReply *nv = a->element[0];
            for (size_t j = 0; j + 1 < nv->elements; j += 2) {
                if (ntab == tcap) {
                    struct mnode *nw = realloc(tab, 2 * tcap * sizeof(*tab));
                    if (!nw) goto out;
                    tab = nw;
                    tcap *= 2;
                }
                struct mnode *t = &tab[ntab++];
                t->name = nv->element[j];
                t->peer = nv->element[j + 1];
                if (!rs_intern(r, t->name->str, t->name->len, &t->node)) goto out;
            }
            cur[s2] = a->element[1]->str;
        }
        tab0[r->nshards] = ntab;
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
                if (!push_hit(&h, &nh, &hcap,
                              (struct mstore_hitrec){(uint32_t)i, tab[k].node, tiers}))
                    goto out;
            }
            cur[sh[i]] = *p == ';' ? p + 1 : p;
        }
    }
    if (mstore_match_group(h, nh, mt)) goto out;
    rc = 0;
    for (uint32_t i = 0; i < mt->nnodes; i++) {
        struct mstore_match_node *mn = &mt->nodes[i];
        pthread_mutex_lock(&r->imu);
        mn->node_id = r->ids[mn->node]->id;
        pthread_mutex_unlock(&r->imu);
        /* The peer from the ALIVE map, or (one endpoint, script) from the shard's table. */
        const redisReply *pv = peers ? peer_in(peers, mn->node_id) : NULL;
        for (size_t k = 0; !peers && k < ntab && !pv; k++)
            if (tab[k].node == mn->node && tab[k].peer && tab[k].peer->type == REDIS_REPLY_STRING)
                pv = tab[k].peer;
        mn->peer_address = pv ? strndup(pv->str, pv->len) : strdup("");
        if (!mn->peer_address) rc = -1;
        mstore_match_compact(mn);
    }
out:
    if (rc) mstore_match_free(mt);
    b_free(&b);
    free(tab);
    free(tab0);
    free(h);
    free(first);
    free(hv);
    free(sh);
    free(cnt);
    free(cmdof);
    free(cur);
    OP_END(r, OP_MATCH);
    return rc;
}

int rs_hit_counts(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                  size_t *nout) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    *out = NULL;
    *nout = 0;
    if (!n) return 0;
    struct mstore_key *keys = malloc(n * sizeof(*keys));
    uint32_t *where = malloc(n * sizeof(uint32_t)); /* command of key i */
    uint64_t *hv = malloc(n * sizeof(uint64_t));
    bool *first = malloc(n * sizeof(bool));
    struct batch b = {0};
    int rc = -1;
    if (!keys || !where || !hv || !first) goto out;
    for (size_t i = 0; i < n; i++) keys[i] = (struct mstore_key){hashes[i], strlen(hashes[i])};
    if (mstore_match_dedup(keys, n, hv, first)) goto out;
    for (size_t i = 0; i < n; i++)
        if (first[i]) {
            uint32_t sh = shard_of(r, keys[i].p, keys[i].n);
            where[i] = (uint32_t)b.nc;
            b_cmd(&b, sh, "HGET", -1, 0);
            b_shard_key(&b, r, sh, ":hit:", keys[i].p, keys[i].n, NULL);
            b_str(&b, "c");
        }
    if (rs_run(r, &b, r->split ? "GetExternalKvHitCounts" : NULL)) {
        rc = 0; /* recorded */
        goto out;
    }
    struct mstore_hit *v = malloc((n + 1) * sizeof(*v));
    if (!v) goto out;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const redisReply *rep = first[i] ? b.c[where[i]].rep : NULL;
        if (rep && rep->type == REDIS_REPLY_STRING)
            v[k++] = (struct mstore_hit){(uint32_t)i, strtoull(rep->str, NULL, 10)};
    }
    *out = v;
    *nout = k;
    rc = 0;
out:
    b_free(&b);
    free(where);
    free(hv);
    free(first);
    free(keys);
    OP_END(r, OP_HITS);
    return rc;
}

static void hit_gc_step(struct batch *b, struct rstore *r, uint32_t sh, const char *cursor,
                        const void *arg) {
    b_cmd(b, sh, NULL, S_HIT_GC, 1);
    b_shard_key(b, r, sh, ":hit:index", "", 0, NULL);
    b_str(b, cursor);
    b_i64(b, *(const int64_t *)arg);
    b_u64(b, MSTORE_REDIS_CHUNK);
}

size_t rs_hit_gc(struct mstore *s, int64_t cutoff) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    size_t total = scan_shards(r, NULL, hit_gc_step, &cutoff);
    OP_END(r, OP_HIT_GC);
    return total;
}

size_t rs_ext_count(struct mstore *s) {
    struct rstore *r = RS(s);
    OP_BEGIN(r);
    struct batch b = {0};
    long long total = 0;
    for (uint32_t sh = 0; sh < r->nshards; sh++) {
        b_cmd(&b, sh, "GET", -1, 0);
        b_shard_key(&b, r, sh, ":extkv_count", "", 0, NULL);
    }
    if (rs_run(r, &b, r->split ? "GetExternalKvCount" : NULL) == 0)
        for (size_t i = 0; i < b.nc; i++) total += rep_int(b.c[i].rep);
    b_free(&b);
    OP_END(r, OP_XCOUNT);
    return total > 0 ? (size_t)total : 0;
}
