/* The routing query (see mquery.h). */
#include "master/mquery.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/fleethash.h"
#include "base/jscan.h"
#include "base/strbuf.h"

static const char *const TIER_NAME[MSTORE_NTIERS] = {"UNKNOWN", "HBM", "DRAM", "SSD"};
#define SEED_STRING "lmcache-chunk-hash-v1"

static int fail(struct strbuf *out, int status, const char *msg) {
    json_t *j = json_pack("{s:s}", "error", msg);
    char *s = j ? json_dumps(j, JSON_COMPACT) : NULL;
    sb_puts(out, s ? s : "{\"error\":\"out of memory\"}");
    free(s);
    json_decref(j);
    return status;
}

/* A tier's read rank: HBM 0, DRAM 1, SSD 2, anything else 3 (lower is better). */
static int rank_of(int tier) { return tier == 1 ? 0 : tier == 2 ? 1 : tier == 3 ? 2 : 3; }

struct noderes {
    const struct mstore_match_node *m;
    uint32_t prefix;                  /* chunks */
    uint32_t per_tier[MSTORE_NTIERS]; /* prefix chunks by their best tier */
    uint64_t avail;                   /* available bytes over all tiers (ALIVE nodes) */
    bool alive;
};

/* Better for routing: longer prefix, then more of it in HBM+DRAM, then more available. */
static bool better(const struct noderes *a, const struct noderes *b) {
    if (a->prefix != b->prefix) return a->prefix > b->prefix;
    uint32_t fa = a->per_tier[1] + a->per_tier[2], fb = b->per_tier[1] + b->per_tier[2];
    if (fa != fb) return fa > fb;
    return a->avail > b->avail;
}

/* Reads the request into hex placement hashes: hashes[] given, or computed from token_ids. */
static int read_hashes(json_t *req, const char *jt, size_t jt_len,
                       char (**hex)[FLEETHASH_HEX_LEN + 1], size_t *n, long *chunk_size,
                       struct strbuf *out) {
    json_t *jh = json_object_get(req, "hashes");
    if ((jh != NULL) == (jt != NULL))
        return fail(out, 400, "exactly one of token_ids or hashes is required");
    *chunk_size = MQUERY_DEFAULT_CHUNK;
    json_t *jc = json_object_get(req, "chunk_size"); /* with hashes: only for token counts */
    if (jc) {
        if (!json_is_integer(jc) || json_integer_value(jc) < 1 ||
            json_integer_value(jc) > MQUERY_MAX_CHUNK)
            return fail(out, 400, "chunk_size must be an integer in 1..65536");
        *chunk_size = (long)json_integer_value(jc);
    }
    if (jh) {
        if (!json_is_array(jh)) return fail(out, 400, "hashes must be an array of strings");
        if (json_array_size(jh) > MQUERY_MAX_HASHES) return fail(out, 413, "too many hashes");
        *n = json_array_size(jh);
        *hex = calloc(*n ? *n : 1, sizeof(**hex));
        if (!*hex) return fail(out, 500, "out of memory");
        for (size_t i = 0; i < *n; i++) {
            const char *s = json_string_value(json_array_get(jh, i));
            if (!s || strlen(s) != FLEETHASH_HEX_LEN)
                return fail(out, 400, "hashes must be 64-character hex strings");
            memcpy((*hex)[i], s, FLEETHASH_HEX_LEN + 1);
        }
        return 0;
    }
    json_t *jm = json_object_get(req, "model_name"), *js = json_object_get(req, "cache_salt");
    json_t *jw = json_object_get(req, "world_size");
    json_t *jr = json_object_get(req, "rank"), *jseed = json_object_get(req, "hash_seed");
    if (!json_is_string(jm) || !json_string_length(jm))
        return fail(out, 400, "model_name (a non-empty string) is required with token_ids");
    if (js && !json_is_string(js)) return fail(out, 400, "cache_salt must be a string");
    if (jseed && !json_is_string(jseed)) return fail(out, 400, "hash_seed must be a string");
    long ws = jw ? (long)json_integer_value(jw) : 1, rk = jr ? (long)json_integer_value(jr) : 0;
    if ((jw && !json_is_integer(jw)) || (jr && !json_is_integer(jr)) || ws < 1 || ws > 255 ||
        rk < 0 || rk >= ws)
        return fail(out, 400, "world_size must be 1..255 and rank 0..world_size-1");
    uint32_t *toks = malloc(MQUERY_MAX_TOKENS * sizeof(*toks));
    if (!toks) return fail(out, 500, "out of memory");
    long got_t = jscan_u32_array(jt, jt_len, toks, MQUERY_MAX_TOKENS);
    if (got_t < 0) {
        free(toks);
        return got_t == -2
                   ? fail(out, 413, "too many token_ids")
                   : fail(out, 400, "token_ids must be an array of integers in 0..4294967295");
    }
    size_t nt = (size_t)got_t;
    size_t nc = nt / (size_t)*chunk_size;
    if (nc > MQUERY_MAX_HASHES) nc = MQUERY_MAX_HASHES;
    uint8_t(*ch)[FLEETHASH_LEN] = malloc((nc ? nc : 1) * sizeof(*ch));
    *hex = calloc(nc ? nc : 1, sizeof(**hex));
    long got = ch && *hex ? fleethash_chunks(jseed ? json_string_value(jseed) : SEED_STRING, toks,
                                             nt, (size_t)*chunk_size, ch, nc)
                          : -1;
    free(toks);
    if (got < 0) {
        free(ch);
        return fail(out, 500, "hashing failed");
    }
    uint32_t kv_rank = (uint32_t)(ws << 24 | rk << 16 | ws << 8 | rk);
    static const char D[] = "0123456789abcdef";
    for (long c = 0; c < got; c++) {
        uint8_t p[FLEETHASH_LEN];
        if (fleethash_compute(json_string_value(jm), js ? json_string_value(js) : "", kv_rank,
                              ch[c], FLEETHASH_LEN, p) != 0) {
            free(ch);
            return fail(out, 500, "hashing failed");
        }
        for (int i = 0; i < FLEETHASH_LEN; i++) {
            (*hex)[c][2 * i] = D[p[i] >> 4];
            (*hex)[c][2 * i + 1] = D[p[i] & 15];
        }
        (*hex)[c][FLEETHASH_HEX_LEN] = 0;
    }
    free(ch);
    *n = (size_t)got;
    return 0;
}

static json_t *node_json(const struct noderes *r, long chunk_size) {
    json_t *tiers = json_object();
    for (int t = 0; tiers && t < MSTORE_NTIERS; t++)
        if (r->per_tier[t])
            json_object_set_new(tiers, TIER_NAME[t],
                                json_integer((json_int_t)r->per_tier[t] * chunk_size));
    return json_pack("{s:s, s:s, s:I, s:I, s:o}", "node_id", r->m->node_id, "peer_address",
                     r->m->peer_address ? r->m->peer_address : "", "prefix_chunks",
                     (json_int_t)r->prefix, "prefix_tokens", (json_int_t)r->prefix * chunk_size,
                     "tokens_by_tier", tiers);
}

/* The request's members: token_ids kept as text for jscan_u32_array (a DOM parser would spend
 * most of the query on a long prompt's numbers), every other member decoded into an object. */
struct route_req {
    json_t *rest;
    const char *tok;
    size_t tok_len;
};

enum { MEMBER_BAD = 1, MEMBER_DUP, MEMBER_OOM };

static int on_member(void *arg, const struct jscan_member *m) {
    struct route_req *rq = arg;
    char *key = NULL;
    if (!m->key_escaped) { /* raw control bytes (NUL among them) were refused by the scan */
        key = strndup(m->key, m->key_len);
    } else { /* the quoted key, decoded as a JSON string (\u0000 refused) */
        json_t *k = json_loadb(m->key - 1, m->key_len + 2, JSON_DECODE_ANY, NULL);
        if (!json_is_string(k)) {
            json_decref(k);
            return MEMBER_BAD;
        }
        key = strdup(json_string_value(k));
        json_decref(k);
    }
    if (!key) return MEMBER_OOM;
    int rc = 0;
    if (strcmp(key, "token_ids") == 0) {
        if (rq->tok) rc = MEMBER_DUP;
        rq->tok = m->val;
        rq->tok_len = m->val_len;
    } else if (json_object_get(rq->rest, key)) {
        rc = MEMBER_DUP;
    } else {
        json_t *v = json_loadb(m->val, m->val_len, JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, NULL);
        if (!v)
            rc = MEMBER_BAD;
        else if (json_object_set_new(rq->rest, key, v) != 0)
            rc = MEMBER_OOM;
    }
    free(key);
    return rc;
}

int mquery_route(struct mstore *s, const char *body, size_t len, struct strbuf *out) {
    if (len > MQUERY_MAX_BODY) return fail(out, 413, "request body exceeds 1 MiB");
    struct route_req rq = {json_object(), NULL, 0};
    if (!rq.rest) return fail(out, 500, "out of memory");
    int sc = jscan_object(body, len, MQUERY_MAX_DEPTH, on_member, &rq);
    if (sc != 0) {
        json_decref(rq.rest);
        return sc == MEMBER_OOM   ? fail(out, 500, "out of memory")
               : sc == MEMBER_DUP ? fail(out, 400, "a member appears twice in the body")
                                  : fail(out, 400, "the body must be a JSON object");
    }
    char(*hex)[FLEETHASH_HEX_LEN + 1] = NULL;
    size_t n = 0;
    long chunk_size = MQUERY_DEFAULT_CHUNK;
    int st = read_hashes(rq.rest, rq.tok, rq.tok_len, &hex, &n, &chunk_size, out);
    json_decref(rq.rest);
    if (st) {
        free(hex);
        return st;
    }
    struct mstore_key *keys = calloc(n ? n : 1, sizeof(*keys));
    struct mstore_match mt = {0};
    struct mstore_alive *alive = NULL;
    size_t nalive = 0;
    struct noderes *res = NULL;
    uint8_t *best = NULL;
    json_t *reply = NULL;
    int status = 500;
    if (!keys) goto out;
    for (size_t i = 0; i < n; i++) keys[i] = (struct mstore_key){hex[i], FLEETHASH_HEX_LEN};
    if (n && s->ops->ext_match(s, keys, n, false, 0, &mt) != 0) goto out;
    if (s->ops->list_alive(s, &alive, &nalive) != 0) goto out;
    res = calloc(mt.nnodes + nalive + 1, sizeof(*res));
    best = malloc(n ? n : 1);
    if (!res || !best) goto out;
    size_t nres = 0;
    for (uint32_t k = 0; k < mt.nnodes; k++) {
        const struct mstore_match_node *m = &mt.nodes[k];
        struct noderes *r = &res[nres];
        r->m = m;
        /* best (lowest-rank) tier of each matched chunk on this node; 0xff = absent */
        memset(best, 0xff, n ? n : 1);
        for (int t = 0; t < MSTORE_NTIERS; t++)
            for (uint32_t i = 0; i < m->tiers[t].n; i++) {
                uint32_t q = m->tiers[t].idx[i];
                int tier = m->tiers[t].tier;
                if (best[q] == 0xff || rank_of(tier) < rank_of(best[q])) best[q] = (uint8_t)tier;
            }
        while (r->prefix < n && best[r->prefix] != 0xff) r->per_tier[best[r->prefix++]]++;
        for (size_t a = 0; a < nalive; a++)
            if (alive[a].node == m->node) {
                r->alive = true;
                for (int t = 0; t < MSTORE_NTIERS; t++) r->avail += alive[a].caps.avail[t];
            }
        if (r->prefix) nres++;
    }
    /* nodes without a match: candidates for the recommendation when nobody has a prefix */
    struct mstore_match_node *extra = calloc(nalive ? nalive : 1, sizeof(*extra));
    if (!extra) goto out;
    /* nodes by their prefix, longest first (insertion sort: a handful of nodes) */
    for (size_t i = 1; i < nres; i++)
        for (size_t j = i; j > 0 && better(&res[j], &res[j - 1]); j--) {
            struct noderes t = res[j];
            res[j] = res[j - 1];
            res[j - 1] = t;
        }
    const struct noderes *pick = NULL;
    for (size_t i = 0; i < nres; i++)
        if (res[i].alive && (!pick || better(&res[i], pick))) pick = &res[i];
    struct noderes idle = {0};
    if (!pick)
        for (size_t a = 0; a < nalive; a++) {
            extra[a].node_id = alive[a].node_id;
            extra[a].peer_address = alive[a].peer_address;
            struct noderes r = {.m = &extra[a], .alive = true};
            for (int t = 0; t < MSTORE_NTIERS; t++) r.avail += alive[a].caps.avail[t];
            if (!pick || better(&r, pick)) {
                idle = r;
                pick = &idle;
            }
        }
    json_t *nodes = json_array();
    for (size_t i = 0; nodes && i < nres; i++)
        json_array_append_new(nodes, node_json(&res[i], chunk_size));
    reply = json_pack("{s:I, s:I, s:o, s:o}", "chunks", (json_int_t)n, "chunk_size",
                      (json_int_t)chunk_size, "nodes", nodes ? nodes : json_null(), "recommended",
                      pick ? node_json(pick, chunk_size) : json_null());
    char *txt = reply ? json_dumps(reply, JSON_COMPACT) : NULL;
    if (txt && sb_puts(out, txt) == 0) status = 200;
    free(txt);
    free(extra);
out:
    if (status != 200) fail(out, 500, "out of memory");
    json_decref(reply);
    free(best);
    free(res);
    if (alive) {
        for (size_t a = 0; a < nalive; a++) free(alive[a].peer_address);
        free(alive);
    }
    mstore_match_free(&mt);
    free(keys);
    free(hex);
    return status;
}
