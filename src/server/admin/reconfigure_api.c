/* Runtime L2 reconfiguration routes: GET /reconfigure/{backend}/status and
 * POST /reconfigure/{backend}/{operation}. The backend is an adapter type_name (matched without
 * regard to case), adapter_index is local to that backend, and the operation and its body go to
 * the adapter's reconfigure op unchanged, through the engine (the adapter validates them; dax
 * rejects extra fields). */
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "server/admin/http.h"
#include "server/engine.h"

#define SEG_MAX 256

/* Strips surrounding whitespace and lower-cases a path segment into out. */
static void normalise(const char *in, char out[SEG_MAX]) {
    while (*in && isspace((unsigned char)*in)) in++;
    size_t n = strlen(in);
    while (n && isspace((unsigned char)in[n - 1])) n--;
    if (n >= SEG_MAX) n = SEG_MAX - 1;
    for (size_t i = 0; i < n; i++) out[i] = (char)tolower((unsigned char)in[i]);
    out[n] = 0;
}

#define MAX_BACKEND_ADAPTERS 64

static void h_status(struct http_req *req, struct http_resp *resp) {
    char backend[SEG_MAX];
    normalise(req->params[0], backend);
    if (!*backend) {
        http_error(resp, 400, "detail", "backend must not be empty");
        return;
    }
    size_t n = engine_reconfigurable_count(req->engine, backend);
    if (n > MAX_BACKEND_ADAPTERS) n = MAX_BACKEND_ADAPTERS;
    json_t *list = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *st = engine_reconfigure_status(req->engine, backend, i);
        if (!st) break;
        json_object_set_new(st, "adapter_index", json_integer((json_int_t)i));
        json_array_append_new(list, st);
    }
    http_json(resp, 200,
              json_pack("{s:b, s:s, s:I, s:o}", "enabled", n > 0, "backend", backend,
                        "num_adapters", (json_int_t)n, "adapters", list));
}

static void h_operation(struct http_req *req, struct http_resp *resp) {
    char backend[SEG_MAX], op[SEG_MAX];
    normalise(req->params[0], backend);
    normalise(req->params[1], op);
    if (!*backend || !*op) {
        http_error(resp, 400, "detail", "backend and operation must not be empty");
        return;
    }
    json_t *body = http_body_object(req, resp, 422, 1);
    if (!body) return;
    json_t *ai = json_object_get(body, "adapter_index");
    if (ai && !json_is_integer(ai)) {
        http_error(resp, 422, "detail", "adapter_index must be an integer");
        goto out;
    }
    json_int_t idx = ai ? json_integer_value(ai) : 0;
    size_t n = engine_reconfigurable_count(req->engine, backend);
    if (n > MAX_BACKEND_ADAPTERS) n = MAX_BACKEND_ADAPTERS;
    if (idx < 0 || (size_t)idx >= n) {
        char msg[SEG_MAX + 128];
        snprintf(msg, sizeof(msg),
                 "adapter_index %lld is out of range: backend '%s' has %zu reconfigurable "
                 "adapter(s)",
                 (long long)idx, backend, n);
        http_error(resp, 404, "detail", msg);
        goto out;
    }
    int status = 500;
    json_t *res = engine_reconfigure(req->engine, backend, (size_t)idx, op, body, &status);
    if (!res) {
        http_error(resp, 500, "detail", "the adapter returned no result");
        goto out;
    }
    if (status == 200 && json_is_object(res))
        json_object_set_new(res, "adapter_index", json_integer(idx));
    http_json(resp, status, res);
out:
    json_decref(body);
}

#define UNREADY "{\"error\":\"engine not initialized\"}"

const struct http_route RECONFIGURE_ROUTES[] = {
    {"GET", "/reconfigure/{backend}/status", h_status, UNREADY,
     "Runtime-manageable L2 adapters of one backend type", 0},
    {"POST", "/reconfigure/{backend}/{operation}", h_operation, UNREADY,
     "Apply one runtime reconfiguration operation to a backend adapter", HTTP_SLOW},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
