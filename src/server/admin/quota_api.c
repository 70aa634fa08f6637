/* Per-cache_salt quota routes (IsolatedLRU budgets). "GB" means GiB; the path segment
 * `_default` stands for the empty salt and is echoed back for it. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "server/admin/http.h"
#include "server/admin/pathparam.h"
#include "server/keys.h"
#include "server/engine.h"

#define DEFAULT_SALT "_default"
#define GIB          ((double)(1ULL << 30))

static const char *salt_of(const char *segment) {
    return strcmp(segment, DEFAULT_SALT) == 0 ? "" : segment;
}

/* The decoded {cache_salt} segment must be a valid cache_salt (the ObjectKey rules) and
 * printable UTF-8: anything else answers 400 before the quota table is touched. */
static int check_segment(const char *seg, struct http_resp *resp) {
    char err[KEYS_ERR_MAX], msg[KEYS_ERR_MAX + 32];
    size_t len = strlen(seg);
    if (pathparam_check_text(seg, len, err, sizeof(err)) < 0 ||
        keys_check_cache_salt(salt_of(seg), strlen(salt_of(seg)), err, sizeof(err)) < 0) {
        snprintf(msg, sizeof(msg), "cache_salt %s", err);
        http_error(resp, 400, "detail", msg);
        return -1;
    }
    return 0;
}

static const char *label_of(const char *salt) { return *salt ? salt : DEFAULT_SALT; }

/* Rounded to the byte-level precision a GiB figure can show. */
static double gib(uint64_t bytes) { return round((double)bytes / GIB * 1e6) / 1e6; }

static void h_put(struct http_req *req, struct http_resp *resp) {
    const char *seg = req->params[0];
    if (check_segment(seg, resp) < 0) return;
    json_t *body = http_body_object(req, resp, 400, 0);
    if (!body) return;
    json_t *v = json_object_get(body, "limit_gb");
    const char *problem = NULL;
    double limit = 0;
    if (!v)
        problem = "limit_gb is required";
    else if (!json_is_number(v))
        problem = "limit_gb must be a number";
    else {
        limit = json_number_value(v);
        if (!isfinite(limit))
            problem = "limit_gb must be finite";
        else if (limit < 0)
            problem = "limit_gb must be non-negative";
    }
    json_decref(body);
    if (problem) {
        http_error(resp, 400, "detail", problem);
        return;
    }
    double bytes = limit * GIB;
    uint64_t lb = bytes >= 18446744073709551615.0 ? UINT64_MAX : (uint64_t)bytes;
    char err[200];
    if (quota_set(req->engine->quota, salt_of(seg), lb, err, sizeof(err)) < 0) {
        http_error(resp, 400, "detail", err);
        return;
    }
    engine_quota_changed(req->engine);
    http_json(resp, 200,
              json_pack("{s:s, s:f, s:s}", "cache_salt", seg, "limit_gb", limit, "status", "ok"));
}

static void h_get(struct http_req *req, struct http_resp *resp) {
    const char *seg = req->params[0];
    if (check_segment(seg, resp) < 0) return;
    const char *salt = salt_of(seg);
    uint64_t limit = 0;
    int exists = quota_get(req->engine->quota, salt, &limit);
    http_json(resp, 200,
              json_pack("{s:s, s:f, s:f, s:b}", "cache_salt", seg, "limit_gb",
                        exists ? (double)limit / GIB : 0.0, "current_usage_gb",
                        gib(engine_salt_usage_bytes(req->engine, salt)), "exists", exists));
}

static void h_delete(struct http_req *req, struct http_resp *resp) {
    const char *seg = req->params[0];
    if (check_segment(seg, resp) < 0) return;
    int removed = quota_remove(req->engine->quota, salt_of(seg));
    if (removed) engine_quota_changed(req->engine);
    http_json(
        resp, 200,
        json_pack("{s:s, s:s}", "cache_salt", seg, "status", removed ? "removed" : "not_found"));
}

/* Runs under the quota table's lock (a leaf lock): only records the limits. */
static void collect(const char *salt, uint64_t limit_bytes, void *arg) {
    json_object_set_new(arg, label_of(salt),
                        json_pack("{s:f}", "limit_gb", (double)limit_bytes / GIB));
}

static void h_list(struct http_req *req, struct http_resp *resp) {
    json_t *users = json_object();
    quota_foreach(req->engine->quota, collect, users);
    const char *label;
    json_t *u;
    json_object_foreach(users, label, u) {
        uint64_t used = engine_salt_usage_bytes(req->engine, salt_of(label));
        json_object_set_new(u, "current_usage_gb", json_real(gib(used)));
    }
    http_json(resp, 200, json_pack("{s:o}", "users", users));
}

#define UNREADY "{\"error\":\"engine not initialized\"}"

const struct http_route QUOTA_ROUTES[] = {
    {"GET", "/quota", h_list, UNREADY, "Every registered quota with live usage", 0},
    {"PUT", "/quota/{cache_salt}", h_put, UNREADY, "Set a salt's quota in GB", 0},
    {"GET", "/quota/{cache_salt}", h_get, UNREADY, "A salt's quota and live usage", 0},
    {"DELETE", "/quota/{cache_salt}", h_delete, UNREADY, "Remove a salt's quota", 0},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
