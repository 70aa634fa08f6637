/* Cache management routes that act on L1. */
#include <stdio.h>
#include <string.h>

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
            json_decref(body);
            clear_error(resp, "tier must be a string");
            return;
        }
        t = json_string_value(tier);
    }
    if (force && !json_is_boolean(force) && !json_is_null(force)) {
        json_decref(body);
        clear_error(resp, "force must be a boolean");
        return;
    }
    if (strcmp(t, "l1") != 0) {
        char msg[200];
        snprintf(msg, sizeof(msg), "Unsupported tier: '%.64s'. Only 'l1' can be cleared.", t);
        json_decref(body);
        clear_error(resp, msg);
        return;
    }
    json_decref(body);
    engine_clear_l1(req->engine);
    http_json(resp, 200, json_pack("{s:s, s:{s:s}}", "status", "ok", "cleared", "tier", "l1"));
}

const struct http_route CACHE_ROUTES[] = {
    {"POST", "/cache/clear", h_clear, "{\"detail\":\"server not initialized\"}",
     "Force-clear a tier (l1)"},
    {NULL, NULL, NULL, NULL, NULL},
};
