/* L2 object management and warm prefetch: GET/DELETE /cache/objects, POST /cache/prefetches,
 * GET /cache/prefetches/{request_id}, through the engine API. L1 is not touched by the object
 * routes (as documented). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "server/admin/http.h"
#include "server/engine.h"
#include "server/keys.h"

#define MAX_DELETE_BATCH    10000
#define MAX_PREFETCH_TOKENS (1u << 22)

/* 503 without L2; else the adapter index selected by name (NULL/"" = primary), or -1 with a 404
 * already answered. */
static int select_adapter(struct http_req *req, struct http_resp *resp, const char *name) {
    int idx = engine_l2_find(req->engine, name);
    if (idx == ENGINE_ERR_NO_L2) {
        http_error(resp, 503, "detail", "no L2 adapters configured");
    } else if (idx < 0) {
        char msg[160];
        snprintf(msg, sizeof(msg), "no adapter named '%.64s' (see GET /config/adapters)", name);
        http_error(resp, 404, "detail", msg);
    }
    return idx < 0 ? -1 : idx;
}

static json_t *key_json(const struct keys_object_key *k) {
    char hex[2 * KEYS_HASH_MAX + 1];
    keys_hex_encode(k->hash, k->hash_len, hex);
    return json_pack("{s:s, s:s, s:I, s:I, s:s}", "chunk_hash_hex", hex, "model_name",
                     k->model_name, "kv_rank", (json_int_t)k->kv_rank, "object_group_id",
                     (json_int_t)k->object_group_id, "cache_salt", k->cache_salt);
}

static void h_list(struct http_req *req, struct http_resp *resp) {
    const char *adapter = http_query(req, "adapter");
    const char *model = http_query(req, "model_name");
    const char *ps = http_query(req, "page_size");
    const char *token = http_query(req, "page_token");
    long page_size = 500;
    if (ps) {
        char *end;
        errno = 0;
        page_size = strtol(ps, &end, 10);
        if (!*ps || *end || errno || page_size < 1 || page_size > ENGINE_PAGE_SIZE_MAX) {
            http_error(resp, 422, "detail", "page_size must be an integer in [1, 5000]");
            return;
        }
    }
    int idx = select_adapter(req, resp, adapter);
    if (idx < 0) return;
    const char *name = engine_l2_name(req->engine, idx);
    struct engine_object_page page;
    char err[256] = "";
    int rc = engine_l2_list(req->engine, idx, model && *model ? model : NULL, (size_t)page_size,
                            token && *token ? token : NULL, &page, err, sizeof(err));
    if (rc == ENGINE_ERR_NOT_SUPPORTED) {
        char msg[160];
        snprintf(msg, sizeof(msg), "adapter '%s' does not support listing", name);
        http_error(resp, 501, "detail", msg);
        return;
    }
    if (rc == ENGINE_ERR_BAD_TOKEN) {
        http_error(resp, 400, "detail", *err ? err : "malformed page_token");
        return;
    }
    if (rc != ENGINE_OK) {
        http_error(resp, rc == ENGINE_ERR_INVAL ? 422 : 500, "detail", err);
        return;
    }
    json_t *entries = json_array();
    for (size_t i = 0; i < page.count; i++)
        json_array_append_new(entries,
                              json_pack("{s:o, s:I}", "key", key_json(&page.entries[i].key),
                                        "size_bytes", (json_int_t)page.entries[i].size));
    json_t *next = page.next_token ? json_string(page.next_token) : json_null();
    engine_object_page_free(&page);
    http_json(
        resp, 200,
        json_pack("{s:s, s:o, s:o}", "adapter", name, "entries", entries, "next_page_token", next));
}

/* One EncodedObjectKey: 422 for a wrong shape, 400 for a broken ObjectKey invariant. */
static int parse_key(const json_t *j, size_t i, struct keys_object_key *k, int *status, char *err,
                     size_t errlen) {
    json_t *h = json_object_get(j, "chunk_hash_hex"), *m = json_object_get(j, "model_name");
    json_t *r = json_object_get(j, "kv_rank"), *g = json_object_get(j, "object_group_id");
    json_t *s = json_object_get(j, "cache_salt");
    if (!json_is_object(j) || !json_is_string(h) || !json_is_string(m) || !json_is_integer(r) ||
        (g && !json_is_null(g) && !json_is_integer(g)) ||
        (s && !json_is_null(s) && !json_is_string(s))) {
        *status = 422;
        errbuf_set(err, errlen,
                   "keys[%zu]: expected {chunk_hash_hex: str, model_name: str, kv_rank: int, "
                   "object_group_id: int, cache_salt: str}",
                   i);
        return -1;
    }
    json_int_t rank = json_integer_value(r);
    if (rank < 0 || rank > UINT32_MAX) {
        *status = 400;
        errbuf_set(err, errlen, "keys[%zu]: kv_rank out of range", i);
        return -1;
    }
    char why[KEYS_ERR_MAX];
    const char *salt = json_is_string(s) ? json_string_value(s) : "";
    if (keys_object_key_init(k, json_string_value(h), json_string_length(h), json_string_value(m),
                             json_string_length(m), (uint32_t)rank,
                             json_is_integer(g) ? json_integer_value(g) : 0, salt,
                             json_is_string(s) ? json_string_length(s) : 0, why, sizeof(why)) < 0) {
        *status = 400;
        errbuf_set(err, errlen, "keys[%zu]: %s", i, why);
        return -1;
    }
    return 0;
}

static void h_delete(struct http_req *req, struct http_resp *resp) {
    json_t *body = http_body_object(req, resp, 422, 0);
    if (!body) return;
    json_t *keys = json_object_get(body, "keys"), *tier = json_object_get(body, "tier");
    json_t *adapter = json_object_get(body, "adapter");
    struct keys_object_key *ks = NULL;
    uint8_t *deleted = NULL;
    if (!json_is_array(keys) || (adapter && !json_is_null(adapter) && !json_is_string(adapter)) ||
        (tier && !json_is_null(tier) && !json_is_string(tier))) {
        http_error(resp, 422, "detail", "body must be {keys: [EncodedObjectKey], tier?, adapter?}");
        goto out;
    }
    if (tier && json_is_string(tier) && strcmp(json_string_value(tier), "l2") != 0) {
        http_error(resp, 422, "detail", "tier must be \"l2\"");
        goto out;
    }
    size_t n = json_array_size(keys);
    if (n > MAX_DELETE_BATCH) {
        char msg[96];
        snprintf(msg, sizeof(msg), "at most %d keys per request (got %zu)", MAX_DELETE_BATCH, n);
        http_error(resp, 400, "detail", msg);
        goto out;
    }
    ks = calloc(n ? n : 1, sizeof(*ks));
    deleted = calloc(n ? n : 1, 1);
    if (!ks || !deleted) {
        http_error(resp, 500, "detail", "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        int status;
        char msg[256];
        if (parse_key(json_array_get(keys, i), i, &ks[i], &status, msg, sizeof(msg)) < 0) {
            http_error(resp, status, "detail", msg);
            goto out;
        }
    }
    int idx = select_adapter(req, resp, adapter ? json_string_value(adapter) : NULL);
    if (idx < 0) goto out;
    size_t skipped = 0;
    char err[256] = "";
    int rc = engine_l2_delete(req->engine, idx, ks, n, deleted, &skipped, err, sizeof(err));
    size_t nd = 0;
    for (size_t i = 0; i < n; i++) nd += deleted[i];
    const char *name = engine_l2_name(req->engine, idx);
    json_t *out = json_pack("{s:I, s:s, s:b, s:I, s:I}", "requested", (json_int_t)n, "adapter",
                            name, "ok", rc == ENGINE_OK, "deleted", (json_int_t)nd,
                            "skipped_locked", (json_int_t)skipped);
    if (rc != ENGINE_OK) json_object_set_new(out, "error", json_string(err));
    http_json(resp, 200, out);
out:
    free(ks);
    free(deleted);
    json_decref(body);
}

static void h_prefetch(struct http_req *req, struct http_resp *resp) {
    struct engine *e = req->engine;
    json_t *body = http_body_object(req, resp, 422, 0);
    if (!body) return;
    json_t *jm = json_object_get(body, "model_name"), *jw = json_object_get(body, "world_size");
    json_t *jt = json_object_get(body, "token_ids"), *js = json_object_get(body, "cache_salt");
    uint32_t *tokens = NULL;
    if (!json_is_string(jm) || !json_is_integer(jw) || !json_is_array(jt) ||
        (js && !json_is_null(js) && !json_is_string(js))) {
        http_error(resp, 422, "detail",
                   "body must be {model_name: str, world_size: int, token_ids: [int], "
                   "cache_salt?: str}");
        goto out;
    }
    json_int_t ws = json_integer_value(jw);
    size_t ntok = json_array_size(jt);
    const char *salt = json_is_string(js) ? json_string_value(js) : "";
    char err[KEYS_ERR_MAX];
    if (ws < 1 || ws > 255) {
        http_error(resp, 422, "detail", "world_size must be in [1, 255]");
        goto out;
    }
    if (ntok > MAX_PREFETCH_TOKENS) {
        http_error(resp, 400, "detail", "token_ids exceeds the per-request cap of 4194304");
        goto out;
    }
    if (keys_check_cache_salt(salt, json_is_string(js) ? json_string_length(js) : 0, err,
                              sizeof(err)) < 0) {
        http_error(resp, 400, "detail", err);
        goto out;
    }
    if (keys_check_model_name(json_string_value(jm), json_string_length(jm), err, sizeof(err)) <
        0) {
        http_error(resp, 422, "detail", err);
        goto out;
    }
    tokens = malloc((ntok ? ntok : 1) * sizeof(*tokens));
    if (!tokens) {
        http_error(resp, 500, "detail", "out of memory");
        goto out;
    }
    for (size_t i = 0; i < ntok; i++) {
        json_t *t = json_array_get(jt, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 ||
            json_integer_value(t) > UINT32_MAX) {
            http_error(resp, 422, "detail", "token_ids must be integers in [0, 4294967295]");
            goto out;
        }
        tokens[i] = (uint32_t)json_integer_value(t);
    }
    uint64_t id = 0;
    size_t nch = 0;
    int rc = engine_warm_prefetch(e, json_string_value(jm), (uint32_t)ws, salt, tokens, ntok, &id,
                                  &nch, err, sizeof(err));
    if (rc == ENGINE_ERR_NO_LAYOUT) {
        char msg[400];
        snprintf(msg, sizeof(msg),
                 "no KV layout registered for model_name '%.256s' with world_size %lld: the model "
                 "has not allocated its KV cache on this node yet",
                 json_string_value(jm), (long long)ws);
        http_error(resp, 409, "detail", msg);
        goto out;
    }
    if (rc == ENGINE_ERR_TOO_MANY_NAMES) {
        http_error(resp, 503, "detail", "too many distinct model names or cache salts");
        goto out;
    }
    if (rc != ENGINE_OK) {
        http_error(resp, rc == ENGINE_ERR_INTERNAL ? 500 : 503, "detail", err);
        goto out;
    }
    if (nch == 0) {
        http_json(resp, 202, json_pack("{s:i, s:s}", "chunks", 0, "status", "noop"));
        goto out;
    }
    char rid[32];
    snprintf(rid, sizeof(rid), "%" PRIx64, id);
    http_json(resp, 202,
              json_pack("{s:s, s:I, s:s}", "request_id", rid, "chunks", (json_int_t)nch, "status",
                        "submitted"));
out:
    free(tokens);
    json_decref(body);
}

static void h_prefetch_status(struct http_req *req, struct http_resp *resp) {
    const char *s = req->params[0];
    char *end;
    errno = 0;
    uint64_t id = strtoull(s, &end, 16);
    uint64_t found = 0, total = 0;
    int rc = (!*s || *end || errno) ? ENGINE_ERR_NOT_FOUND
                                    : engine_warm_prefetch_poll(req->engine, id, &found, &total);
    if (rc == ENGINE_ERR_BUSY) {
        http_json(resp, 200, json_pack("{s:s}", "status", "pending"));
    } else if (rc == ENGINE_OK) {
        http_json(resp, 200,
                  json_pack("{s:s, s:I, s:I}", "status", "completed", "found_keys",
                            (json_int_t)found, "total_keys", (json_int_t)total));
    } else {
        char msg[400];
        snprintf(msg, sizeof(msg),
                 "unknown request_id '%.256s' (completed and consumed, or never "
                 "submitted)",
                 s);
        http_error(resp, 404, "detail", msg);
    }
}

#define UNREADY "{\"detail\":\"engine not initialized\"}"

const struct http_route L2_ROUTES[] = {
    {"GET", "/cache/objects", h_list, UNREADY, "Page through the objects of an L2 adapter",
     HTTP_SLOW},
    {"DELETE", "/cache/objects", h_delete, UNREADY, "Delete keys from an L2 adapter", HTTP_SLOW},
    {"POST", "/cache/prefetches", h_prefetch, UNREADY, "Warm L1 from L2 for a token sequence",
     HTTP_SLOW},
    {"GET", "/cache/prefetches/{request_id}", h_prefetch_status, UNREADY, "Poll a warm prefetch",
     0},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
