/* libmicrohttpd wiring: epoll with a small thread pool, the two-phase access
 * handler (queueing on the first call would cost keep-alive), body accumulation
 * with a size cap, routing, per-route metrics. */
#include "server/admin/http.h"

#include <microhttpd.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/strbuf.h"
#include "server/admin/pathparam.h"
#include "server/engine.h"

static const struct http_route *const GROUPS[] = {INFO_ROUTES,       OBS_ROUTES,   DIAG_ROUTES,
                                                  CACHE_ROUTES,      QUOTA_ROUTES, L2_ROUTES,
                                                  RECONFIGURE_ROUTES};

struct admin {
    struct MHD_Daemon *d;
    struct engine *e;
    struct metric_family *requests, *duration;
    _Atomic int inflight; /* requests between their first byte and their completion */
};

struct conn_ctx {
    struct strbuf body;
    int too_large;
    double started;
};

static struct logger *lg(void) {
    static struct logger *l;
    if (!l) l = log_get("lmcache.http");
    return l;
}

/* ---- helpers for handlers ---- */

const char *http_query(const struct http_req *req, const char *name) {
    return MHD_lookup_connection_value(req->conn, MHD_GET_ARGUMENT_KIND, name);
}

static void set_body(struct http_resp *resp, int status, const char *ctype, char *body,
                     size_t len) {
    free(resp->body);
    resp->status = status;
    resp->content_type = ctype;
    resp->body = body;
    resp->len = len;
}

static void json_out(struct http_resp *resp, int status, json_t *body, size_t flags) {
    char *s = body ? json_dumps(body, flags | JSON_REAL_PRECISION(15) | JSON_ENCODE_ANY) : NULL;
    json_decref(body);
    if (!s) {
        set_body(resp, 500, "application/json", strdup("{\"detail\":\"out of memory\"}"), 26);
        return;
    }
    set_body(resp, status, "application/json", s, strlen(s));
}

void http_json(struct http_resp *resp, int status, json_t *body) {
    json_out(resp, status, body, JSON_COMPACT);
}

void http_json_indent(struct http_resp *resp, int status, json_t *body) {
    json_out(resp, status, body, JSON_INDENT(2));
}

void http_text(struct http_resp *resp, int status, const char *text) {
    char *s = strdup(text);
    set_body(resp, status, "text/plain; charset=utf-8", s, s ? strlen(s) : 0);
}

void http_text_own(struct http_resp *resp, int status, char *text, size_t len) {
    set_body(resp, status, "text/plain; charset=utf-8", text, len);
}

void http_error(struct http_resp *resp, int status, const char *field, const char *message) {
    http_json(resp, status, json_pack("{s:s}", field, message));
}

json_t *http_body_object(const struct http_req *req, struct http_resp *resp, int status_on_error,
                         int allow_empty) {
    size_t i = 0;
    while (i < req->body_len && req->body[i] && strchr(" \t\r\n", req->body[i])) i++;
    if (i == req->body_len) {
        if (allow_empty) return json_object();
        http_error(resp, status_on_error, "detail", "request body is required");
        return NULL;
    }
    json_error_t je;
    json_t *o = json_loadb(req->body, req->body_len, JSON_REJECT_DUPLICATES, &je);
    if (!o) {
        char msg[256];
        snprintf(msg, sizeof(msg), "malformed JSON body: %s", je.text);
        http_error(resp, status_on_error, "detail", msg);
        return NULL;
    }
    if (!json_is_object(o)) {
        json_decref(o);
        http_error(resp, status_on_error, "detail", "request body must be a JSON object");
        return NULL;
    }
    return o;
}

/* ---- routing ---- */

/* Matches pattern against path segment by segment; {x} takes one non-empty segment. */
static int match_pattern(const char *pattern, const char *path, char params[][256],
                         size_t *nparams) {
    size_t np = 0;
    const char *p = pattern, *s = path;
    while (*p && *s) {
        if (*p == '{') {
            const char *pe = strchr(p, '}');
            const char *se = strchr(s, '/');
            size_t len = se ? (size_t)(se - s) : strlen(s);
            if (!pe || len == 0 || len >= 256 || np >= HTTP_MAX_PARAMS) return 0;
            memcpy(params[np], s, len);
            params[np][len] = 0;
            np++;
            p = pe + 1;
            s += len;
            continue;
        }
        if (*p != *s) return 0;
        p++;
        s++;
    }
    if (*p || *s) return 0;
    *nparams = np;
    return 1;
}

const struct http_route *http_match(const char *method, const char *path, char params[][256],
                                    size_t *nparams, int *path_matched, char *allow,
                                    size_t allow_len) {
    *path_matched = 0;
    if (allow_len) allow[0] = 0;
    const struct http_route *found = NULL;
    for (size_t g = 0; g < sizeof(GROUPS) / sizeof(GROUPS[0]); g++) {
        for (const struct http_route *r = GROUPS[g]; r->method; r++) {
            char tmp[HTTP_MAX_PARAMS][256];
            size_t n = 0;
            if (!match_pattern(r->pattern, path, tmp, &n)) continue;
            if (strcmp(r->method, method) == 0 ||
                (strcmp(method, "HEAD") == 0 && strcmp(r->method, "GET") == 0)) {
                if (!found) {
                    found = r;
                    memcpy(params, tmp, sizeof(tmp));
                    *nparams = n;
                }
            } else {
                *path_matched = 1;
                size_t l = strlen(allow);
                if (l + strlen(r->method) + 3 < allow_len)
                    snprintf(allow + l, allow_len - l, "%s%s", l ? ", " : "", r->method);
            }
        }
    }
    return found;
}

/* ---- MHD glue ---- */

static enum MHD_Result queue(struct MHD_Connection *c, struct http_resp *resp) {
    struct MHD_Response *r = MHD_create_response_from_buffer(
        resp->len, resp->body ? resp->body : (void *)"",
        resp->body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        free(resp->body);
        return MHD_NO;
    }
    resp->body = NULL;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                            resp->content_type ? resp->content_type : "application/json");
    if (resp->allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, resp->allow);
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)resp->status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
    (void)version;
    struct admin *a = cls;
    struct conn_ctx *ctx = *con_cls;
    if (!ctx) {
        ctx = calloc(1, sizeof(*ctx));
        if (!ctx) return MHD_NO;
        ctx->started = clock_mono();
        *con_cls = ctx;
        atomic_fetch_add(&a->inflight, 1);
        return MHD_YES;
    }
    if (*upload_data_size) {
        if (!ctx->too_large) {
            if (ctx->body.len + *upload_data_size > HTTP_MAX_BODY) {
                ctx->too_large = 1;
                sb_free(&ctx->body);
            } else {
                sb_append(&ctx->body, upload_data, *upload_data_size);
            }
        }
        *upload_data_size = 0;
        return MHD_YES;
    }

    struct http_resp resp = {0};
    char params[HTTP_MAX_PARAMS][256];
    char allow[64];
    size_t np = 0;
    int path_matched = 0;
    const struct http_route *route = NULL;
    if (ctx->too_large) {
        http_error(&resp, 413, "detail", "request body too large");
    } else if (ctx->body.oom) {
        http_error(&resp, 500, "detail", "out of memory");
    } else {
        route = http_match(method, url, params, &np, &path_matched, allow, sizeof(allow));
        if (!route && path_matched) {
            http_error(&resp, 405, "detail", "Method Not Allowed");
            resp.allow = allow;
        } else if (!route) {
            http_error(&resp, 404, "detail", "Not Found");
        } else if (route->unready_body && !engine_is_ready(a->e)) {
            const char *b = route->unready_body;
            set_body(&resp, 503, "application/json", strdup(b), strlen(b));
        } else {
            struct http_req req = {0};
            req.conn = conn;
            req.method = method;
            req.path = url;
            /* libmicrohttpd has already percent-decoded the path. */
            for (size_t i = 0; i < np; i++) req.params[i] = params[i];
            req.nparams = np;
            req.body = ctx->body.buf ? ctx->body.buf : "";
            req.body_len = ctx->body.len;
            req.content_type =
                MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
            req.engine = a->e;
            resp.status = 200;
            route->handler(&req, &resp);
        }
    }
    if (!resp.body && resp.status == 0) http_error(&resp, 500, "detail", "internal error");

    char code[8];
    snprintf(code, sizeof(code), "%d", resp.status);
    const char *rname = route ? route->pattern : "unmatched";
    const char *labels[] = {method, rname, code};
    metrics_add(a->requests, labels, 1);
    const char *dl[] = {rname};
    metric_observe(metric_labels(a->duration, dl), clock_mono() - ctx->started);
    log_debug(lg(), "%s %s -> %d", method, url, resp.status);
    return queue(conn, &resp);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)conn;
    (void)toe;
    struct admin *a = cls;
    struct conn_ctx *ctx = *con_cls;
    if (ctx) {
        atomic_fetch_sub(&a->inflight, 1);
        sb_free(&ctx->body);
        free(ctx);
        *con_cls = NULL;
    }
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char buf[512];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    buf[strcspn(buf, "\n")] = 0;
    log_warn(lg(), "libmicrohttpd: %s", buf);
}

struct admin *admin_start(struct engine *e, const char *host, int port, char *errbuf,
                          size_t errlen) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", port);
    int gai = getaddrinfo(host, ps, &hints, &res);
    if (gai != 0) {
        snprintf(errbuf, errlen, "--http-host %s: %s", host, gai_strerror(gai));
        return NULL;
    }
    struct admin *a = calloc(1, sizeof(*a));
    if (!a) {
        freeaddrinfo(res);
        snprintf(errbuf, errlen, "out of memory");
        return NULL;
    }
    a->e = e;
    static const char *const REQ_LABELS[] = {"method", "route", "code", NULL};
    static const char *const DUR_LABELS[] = {"route", NULL};
    a->requests = metrics_counter(e->metrics, "lmcache_http_requests_total",
                                  "Admin HTTP requests by method, route pattern and status code.",
                                  REQ_LABELS);
    a->duration = metrics_histogram(e->metrics, "lmcache_http_request_duration_seconds",
                                    "Admin HTTP request handling time.", DUR_LABELS,
                                    METRICS_LATENCY_BUCKETS, METRICS_LATENCY_NBUCKETS);
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG | MHD_USE_ITC;
    if (res->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    a->d = MHD_start_daemon(flags, (uint16_t)port, NULL, NULL, on_request, a,
                            MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, a, MHD_OPTION_SOCK_ADDR,
                            res->ai_addr, MHD_OPTION_THREAD_POOL_SIZE, 2u,
                            MHD_OPTION_CONNECTION_TIMEOUT, 30u, MHD_OPTION_CONNECTION_LIMIT, 1024u,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, a,
                            MHD_OPTION_UNESCAPE_CALLBACK, pathparam_unescape, NULL, MHD_OPTION_END);
    freeaddrinfo(res);
    if (!a->d) {
        snprintf(errbuf, errlen, "cannot listen on %s:%d (address in use or not available)", host,
                 port);
        free(a);
        return NULL;
    }
    return a;
}

void admin_stop(struct admin *a, double timeout_s) {
    if (!a) return;
    MHD_socket s = MHD_quiesce_daemon(a->d);
    if (s != MHD_INVALID_SOCKET) close(s);
    double deadline = clock_mono() + timeout_s;
    /* Idle keep-alive connections are not waited for, only requests in flight. */
    while (atomic_load(&a->inflight) > 0 && clock_mono() < deadline) usleep(10 * 1000);
    MHD_stop_daemon(a->d);
    free(a);
}
