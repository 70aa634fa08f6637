/* Cache management routes: POST /cache/clear (L1) and POST /cache/checksums (reads of an
 * engine's registered KV cache), through the engine API. */
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/strbuf.h"

#include "server/admin/http.h"
#include "server/engine.h"

static void clear_error(struct http_resp *resp, const char *reason) {
    http_json(resp, 400, json_pack("{s:s, s:s}", "status", "error", "reason", reason));
}

/* POST /cache/clear: optional body {"tier": "l1", "force": true}; force is accepted but the
 * clear always ignores locks, as documented. */
static void h_clear(struct http_req *req, struct http_resp *resp) {
    json_t *body = http_body_object(req, resp, 400, 1);
    if (!body) return;
    json_t *tier = json_object_get(body, "tier");
    json_t *force = json_object_get(body, "force");
    const char *t = "l1";
    if (tier && !json_is_null(tier)) {
        if (!json_is_string(tier)) {
            clear_error(resp, "tier must be a string");
            goto out;
        }
        t = json_string_value(tier);
    }
    if (force && !json_is_boolean(force) && !json_is_null(force)) {
        clear_error(resp, "force must be a boolean");
        goto out;
    }
    if (strcmp(t, "l1") != 0) {
        char msg[200];
        snprintf(msg, sizeof(msg), "Unsupported tier: '%.64s'. Only 'l1' can be cleared.", t);
        clear_error(resp, msg);
        goto out;
    }
    engine_clear_l1(req->engine);
    http_json(resp, 200, json_pack("{s:s, s:{s:s}}", "status", "ok", "cleared", "tier", "l1"));
out:
    json_decref(body);
}

/* "0,[2,5],8": runs of consecutive ids as inclusive ranges, in request order. */
static char *block_ranges(const uint32_t *ids, size_t n) {
    struct strbuf sb = STRBUF_INIT;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j + 1 < n && ids[j + 1] == ids[j] + 1) j++;
        if (j > i)
            sb_printf(&sb, "%s[%u,%u]", i ? "," : "", ids[i], ids[j]);
        else
            sb_printf(&sb, "%s%u", i ? "," : "", ids[i]);
        i = j + 1;
    }
    return sb_detach(&sb, NULL);
}

static int md5_update(void *arg, const void *bytes, size_t len) {
    return EVP_DigestUpdate(arg, bytes, len) == 1 ? 0 : 1;
}

/* MD5 over (for each layer in [l0, l1)) K then V of each block of the chunk, in order. */
static int chunk_md5(struct engine *e, const struct kv_context *c, const uint32_t *ids, size_t n,
                     uint32_t l0, uint32_t l1, char hex[33]) {
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int dl = 0;
    int rc = -1;
    if (!md || EVP_DigestInit_ex(md, EVP_md5(), NULL) != 1) goto out;
    /* nonzero: the mapping shrank, or the digest failed */
    if (engine_context_read_blocks(e, c, ids, n, l0, l1, md5_update, md) != 0) goto out;
    if (EVP_DigestFinal_ex(md, d, &dl) != 1) goto out;
    for (unsigned i = 0; i < dl; i++) snprintf(hex + 2 * i, 3, "%02x", d[i]);
    rc = 0;
out:
    EVP_MD_CTX_free(md);
    return rc;
}

/* /cache/checksums reports every failure as {"error": ...} (as /status and /config do), while
 * the shared body parser answers {"detail": ...}: its message is moved to the error field. */
static void detail_to_error(struct http_resp *resp) {
    json_t *o = resp->body ? json_loadb(resp->body, resp->len, 0, NULL) : NULL;
    const char *m = json_string_value(json_object_get(o, "detail"));
    http_error(resp, resp->status, "error", m ? m : "malformed request body");
    json_decref(o);
}

#define CHECKSUMS_MAX_DIGESTS 262144u /* about 10 MB of answer */

/* POST /cache/checksums: block-centric MD5s of the engine KV cache of a registered instance. */
static void h_checksums(struct http_req *req, struct http_resp *resp) {
    json_t *body = http_body_object(req, resp, 422, 0);
    if (!body) {
        detail_to_error(resp);
        return;
    }
    json_t *jids = json_object_get(body, "block_ids"), *jcs = json_object_get(body, "chunk_size");
    json_t *jinst = json_object_get(body, "instance_id"), *jlw = json_object_get(body, "layerwise");
    uint32_t *ids = NULL;
    struct kv_context *c = NULL;
    if (!jids || !json_is_array(jids) || (jcs && !json_is_integer(jcs)) ||
        (jinst && !json_is_integer(jinst)) || (jlw && !json_is_boolean(jlw))) {
        http_error(resp, jids ? 422 : 400, "error",
                   jids ? "block_ids must be a list of ints, chunk_size and instance_id ints, "
                          "layerwise a bool"
                        : "block_ids is required");
        goto out;
    }
    size_t n = json_array_size(jids);
    if (n == 0) {
        http_error(resp, 400, "error", "block_ids must not be empty");
        goto out;
    }
    if (!jcs || json_integer_value(jcs) <= 0) {
        http_error(resp, 400, "error", "chunk_size must be a positive integer");
        goto out;
    }
    size_t cs = (size_t)json_integer_value(jcs);
    int64_t inst = jinst ? json_integer_value(jinst) : 0;
    int layerwise = jlw && json_is_true(jlw);
    c = engine_context_get(req->engine, inst, NULL, clock_mono_ns());
    if (!c) {
        char msg[96];
        snprintf(msg, sizeof(msg), "instance_id %lld is not registered", (long long)inst);
        http_error(resp, 404, "error", msg);
        goto out;
    }
    /* Work and answer bounded by the cache, not by how often a body repeats an id: at most
     * num_blocks ids (the whole cache hashed once), at most CHECKSUMS_MAX_DIGESTS digests. */
    if (n > c->layout.num_blocks) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "block_ids has %zu ids, more than the KV cache's num_blocks (%u)", n,
                 c->layout.num_blocks);
        http_error(resp, 400, "error", msg);
        goto out;
    }
    size_t ndig = ((n + cs - 1) / cs) * (jlw && json_is_true(jlw) ? c->layout.num_layers : 1);
    if (ndig > CHECKSUMS_MAX_DIGESTS) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "the answer would hold %zu checksums, more than %u: ask for fewer blocks, a "
                 "larger chunk_size, or not layerwise",
                 ndig, CHECKSUMS_MAX_DIGESTS);
        http_error(resp, 400, "error", msg);
        goto out;
    }
    ids = malloc(n * sizeof(*ids));
    if (!ids) {
        http_error(resp, 500, "error", "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(jids, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (!json_is_integer(v)) {
            http_error(resp, 422, "error", "block_ids must be a list of ints");
            goto out;
        }
        if (x < 0 || x >= c->layout.num_blocks) {
            char msg[128];
            snprintf(msg, sizeof(msg), "block id %lld is out of range (num_blocks %u)",
                     (long long)x, c->layout.num_blocks);
            http_error(resp, 400, "error", msg);
            goto out;
        }
        ids[i] = (uint32_t)x;
    }
    size_t nchunks = (n + cs - 1) / cs;
    int failed = 0;
    json_t *sums;
    char hex[33];
    if (!layerwise) {
        sums = json_array();
        for (size_t k = 0; k < nchunks; k++) {
            size_t m = k + 1 < nchunks ? cs : n - k * cs;
            if (chunk_md5(req->engine, c, ids + k * cs, m, 0, c->layout.num_layers, hex) < 0) {
                failed = 1;
                break;
            }
            json_array_append_new(sums, json_string(hex));
        }
    } else {
        sums = json_object();
        for (uint32_t layer = 0; layer < c->layout.num_layers; layer++) {
            json_t *a = json_array();
            for (size_t k = 0; k < nchunks; k++) {
                size_t m = k + 1 < nchunks ? cs : n - k * cs;
                if (chunk_md5(req->engine, c, ids + k * cs, m, layer, layer + 1, hex) < 0) {
                    failed = 1;
                    break;
                }
                json_array_append_new(a, json_string(hex));
            }
            char key[32];
            snprintf(key, sizeof(key), "layer_%u", layer);
            json_object_set_new(sums, key, a);
        }
    }
    if (failed) {
        json_decref(sums);
        http_error(resp, 404, "error",
                   "the registered KV cache is unreadable: its shared memory is smaller than its "
                   "layout");
        goto out;
    }
    char *ranges = block_ranges(ids, n);
    http_json(resp, 200,
              json_pack("{s:s, s:I, s:I, s:o, s:b, s:s}", "status", "success", "chunk_size",
                        (json_int_t)cs, "num_chunks", (json_int_t)nchunks, "chunk_checksums", sums,
                        "layerwise", layerwise, "block_id_ranges", ranges ? ranges : ""));
    free(ranges);
out:
    free(ids);
    if (c) engine_context_put(c);
    json_decref(body);
}

const struct http_route CACHE_ROUTES[] = {
    {"POST", "/cache/checksums", h_checksums, "{\"error\":\"engine not initialized\"}",
     "MD5 checksums over engine KV blocks", HTTP_SLOW},
    {"POST", "/cache/clear", h_clear, "{\"detail\":\"server not initialized\"}",
     "Force-clear a tier (l1)", HTTP_SLOW},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
