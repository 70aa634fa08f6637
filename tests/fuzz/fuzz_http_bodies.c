/* libFuzzer driver for the admin API's JSON body decoders: input = route selector byte, body.
 * Every input must give a response with a status code and a body. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "server/admin/http.h"

static const struct {
    const char *method, *path;
} ROUTES[] = {
    {"PUT", "/quota/alice"},
    {"PUT", "/quota/_default"},
    {"POST", "/cache/clear"},
    {"POST", "/cache/checksums"},
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    struct engine *e = fuzz_engine();
    size_t which = data[0] % (sizeof(ROUTES) / sizeof(ROUTES[0]));
    char params[HTTP_MAX_PARAMS][256], allow[64];
    size_t np = 0;
    int pm = 0;
    const struct http_route *r = http_match(ROUTES[which].method, ROUTES[which].path, params, &np,
                                            &pm, allow, sizeof(allow));
    if (!r) __builtin_trap();
    char *body = malloc(size);
    if (!body) return 0;
    memcpy(body, data + 1, size - 1);
    body[size - 1] = 0;
    struct http_req req = {0};
    req.method = ROUTES[which].method;
    req.path = ROUTES[which].path;
    for (size_t i = 0; i < np; i++) req.params[i] = params[i];
    req.nparams = np;
    req.body = body;
    req.body_len = size - 1;
    req.engine = e;
    struct http_resp resp = {0};
    resp.status = 200;
    r->handler(&req, &resp);
    if (resp.status < 200 || resp.status > 599 || !resp.body) __builtin_trap();
    free(resp.body);
    free(body);
    return 0;
}
