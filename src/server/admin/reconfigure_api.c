/* Runtime L2 reconfiguration routes: GET /reconfigure/{backend}/status and
 * POST /reconfigure/{backend}/{operation}. The backend is an adapter type_name (matched without
 * regard to case), adapter_index is local to that backend, and the operation and its body go to
 * the adapter's reconfigure op unchanged (the adapter validates them; dax rejects extra fields). */
#include <ctype.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "server/admin/http.h"
#include "server/engine.h"
#include "server/l2/adapter.h"

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

/* The reconfigurable adapters whose type_name is backend, in configuration order; returns how
 * many, filling at most max of them into out. */
static size_t backend_adapters(struct engine *e, const char *backend, struct l2_adapter **out,
                               size_t max) {
    size_t n = 0, found = 0;
    struct l2_adapter **all = engine_l2_adapters(e, &n);
    for (size_t i = 0; i < n; i++) {
        if (!l2_adapter_reconfigurable(all[i])) continue;
        if (strcasecmp(l2_adapter_type_name(all[i]), backend) != 0) continue;
        if (found < max) out[found] = all[i];
        found++;
    }
    return found;
}

#define MAX_BACKEND_ADAPTERS 64

static void h_status(struct http_req *req, struct http_resp *resp) {
    char backend[SEG_MAX];
    normalise(req->params[0], backend);
    if (!*backend) {
        http_error(resp, 400, "detail", "backend must not be empty");
        return;
    }
    struct l2_adapter *as[MAX_BACKEND_ADAPTERS];
    size_t n = backend_adapters(req->engine, backend, as, MAX_BACKEND_ADAPTERS);
    if (n > MAX_BACKEND_ADAPTERS) n = MAX_BACKEND_ADAPTERS;
    json_t *list = json_array();
    for (size_t i = 0; i < n; i++) {
        json_t *st = as[i]->ops->reconfigure_status ? as[i]->ops->reconfigure_status(as[i]) : NULL;
        if (!json_is_object(st)) {
            json_decref(st);
            st = json_pack("{s:s}", "type", l2_adapter_type_name(as[i]));
        }
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
        json_decref(body);
        http_error(resp, 422, "detail", "adapter_index must be an integer");
        return;
    }
    json_int_t idx = ai ? json_integer_value(ai) : 0;
    struct l2_adapter *as[MAX_BACKEND_ADAPTERS];
    size_t n = backend_adapters(req->engine, backend, as, MAX_BACKEND_ADAPTERS);
    if (n > MAX_BACKEND_ADAPTERS) n = MAX_BACKEND_ADAPTERS;
    if (idx < 0 || (size_t)idx >= n) {
        json_decref(body);
        char msg[SEG_MAX + 128];
        snprintf(msg, sizeof(msg),
                 "adapter_index %lld is out of range: backend '%s' has %zu reconfigurable "
                 "adapter(s)",
                 (long long)idx, backend, n);
        http_error(resp, 404, "detail", msg);
        return;
    }
    struct l2_adapter *a = as[idx];
    int status = 500;
    json_t *res = a->ops->reconfigure(a, op, body, &status);
    json_decref(body);
    if (!res) {
        http_error(resp, 500, "detail", "the adapter returned no result");
        return;
    }
    if (status == 200 && json_is_object(res))
        json_object_set_new(res, "adapter_index", json_integer(idx));
    http_json(resp, status, res);
}

#define UNREADY "{\"error\":\"engine not initialized\"}"

const struct http_route RECONFIGURE_ROUTES[] = {
    {"GET", "/reconfigure/{backend}/status", h_status, UNREADY,
     "Runtime-manageable L2 adapters of one backend type", 0},
    {"POST", "/reconfigure/{backend}/{operation}", h_operation, UNREADY,
     "Apply one runtime reconfiguration operation to a backend adapter", HTTP_SLOW},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
