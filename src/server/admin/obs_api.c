/* Observability routes: Prometheus metrics and runtime log levels. */
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "base/metrics.h"
#include "base/strbuf.h"
#include "server/admin/http.h"
#include "server/engine.h"

static void h_metrics(struct http_req *req, struct http_resp *resp) {
    struct strbuf sb = STRBUF_INIT;
    engine_refresh_metrics(req->engine);
    if (metrics_render(req->engine->metrics, &sb) < 0) {
        sb_free(&sb);
        http_error(resp, 500, "detail", "out of memory");
        return;
    }
    size_t len = 0;
    char *body = sb_detach(&sb, &len);
    http_text_own(resp, 200, body, len);
    resp->content_type = "text/plain; version=0.0.4; charset=utf-8";
}

static void h_metrics_reset(struct http_req *req, struct http_resp *resp) {
    metrics_reset(req->engine->metrics);
    http_text(resp, 200, "ok");
}

static void list_one(const struct logger *lg, void *arg) {
    sb_printf(arg, "%s: %s\n", log_name(lg), log_level_name(log_effective_level(lg)));
}

static void h_loglevel(struct http_req *req, struct http_resp *resp) {
    const char *name = http_query(req, "logger_name");
    const char *level = http_query(req, "level");
    int has_name = name && *name, has_level = level && *level;
    struct strbuf sb = STRBUF_INIT;
    if (!has_name && !has_level) {
        log_foreach(list_one, &sb);
    } else if (has_name && !has_level) {
        sb_printf(&sb, "%s: %s", name, log_level_name(log_effective_level_of(name)));
    } else if (has_name) {
        int lvl = log_level_parse(level);
        if (lvl < 0) {
            char msg[160];
            snprintf(msg, sizeof(msg),
                     "Invalid log level: %.64s (use DEBUG, INFO, WARNING, ERROR or CRITICAL)",
                     level);
            http_text(resp, 400, msg);
            return;
        }
        struct logger *lg = log_get(name);
        if (!lg) {
            http_text(resp, 400, "Invalid logger name (empty, too long, or too many loggers)");
            return;
        }
        log_set_level(lg, lvl);
        sb_printf(&sb, "Set %s level to %s", name, log_level_name(lvl));
    } else {
        /* level without logger_name matches no mode: a JSON null, as documented. */
        http_json(resp, 200, json_null());
        return;
    }
    size_t len = 0;
    char *body = sb_detach(&sb, &len);
    http_text_own(resp, 200, body, len);
}

const struct http_route OBS_ROUTES[] = {
    {"GET", "/metrics", h_metrics, NULL, "Prometheus exposition format",
     HTTP_INLINE | HTTP_OPEN_METRICS},
    {"POST", "/metrics/reset", h_metrics_reset, NULL, "Reset every metric", 0},
    {"GET", "/loglevel", h_loglevel, NULL, "List, read or set logger levels", 0},
    {NULL, NULL, NULL, NULL, NULL, 0},
};
