/* Basic info routes: liveness, health, status, configuration, versions. */
#include "base/version.h"
#include "server/admin/http.h"
#include "server/engine.h"

static void h_root(struct http_req *req, struct http_resp *resp) {
    (void)req;
    http_json(resp, 200, json_pack("{s:s, s:s}", "status", "ok", "service", "LMCache HTTP API"));
}

static void h_healthcheck(struct http_req *req, struct http_resp *resp) {
    if (!engine_is_ready(req->engine))
        http_json(
            resp, 503,
            json_pack("{s:s, s:s}", "status", "unhealthy", "reason", "engine not initialized"));
    else
        http_json(resp, 200, json_pack("{s:s}", "status", "healthy"));
}

static void h_status(struct http_req *req, struct http_resp *resp) {
    http_json(resp, 200, engine_status(req->engine));
}

static void h_config(struct http_req *req, struct http_resp *resp) {
    json_t *cfg = engine_config_json(req->engine);
    if (!cfg) {
        http_error(resp, 503, "error", "configs not initialized");
        return;
    }
    http_json_indent(resp, 200, cfg);
}

static void h_adapters(struct http_req *req, struct http_resp *resp) {
    http_json(resp, 200, json_pack("{s:o}", "adapters", engine_adapters(req->engine)));
}

static void h_version(struct http_req *req, struct http_resp *resp) {
    (void)req;
    http_json(resp, 200, json_string(version_combined()));
}

static void h_lmc_version(struct http_req *req, struct http_resp *resp) {
    (void)req;
    http_json(resp, 200, json_string(version_lmc()));
}

static void h_commit_id(struct http_req *req, struct http_resp *resp) {
    (void)req;
    http_json(resp, 200, json_string(version_commit()));
}

#define UNREADY "{\"error\":\"engine not initialized\"}"

const struct http_route INFO_ROUTES[] = {
    {"GET", "/", h_root, NULL, "Static liveness ping (does not touch the engine)",
     HTTP_INLINE | HTTP_OPEN},
    {"GET", "/healthcheck", h_healthcheck, NULL, "Liveness/readiness probe; 503 until ready",
     HTTP_INLINE | HTTP_OPEN},
    {"GET", "/status", h_status, UNREADY, "Detailed engine snapshot", 0},
    {"GET", "/config", h_config, NULL, "The parsed server configuration", 0},
    {"GET", "/config/adapters", h_adapters, UNREADY, "The live L2 adapters", 0},
    {"GET", "/version", h_version, NULL, "Combined version string", 0},
    {"GET", "/lmc_version", h_lmc_version, NULL, "Package version string", 0},
    {"GET", "/commit_id", h_commit_id, NULL, "Build commit id", 0},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
