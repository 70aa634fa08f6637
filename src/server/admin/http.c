/* libmicrohttpd wiring: epoll connection threads that only parse and answer, a bounded
 * pool of admin workers that run the handlers which may wait (connections are suspended
 * meanwhile), connection limits and a whole-request deadline against slow clients, bearer
 * token authentication, TLS, body accumulation with a size cap, routing, per-route
 * metrics. */
#include "server/admin/http.h"

#include <errno.h>
#include <fcntl.h>
#include <microhttpd.h>
#include <netdb.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/ratelimit.h"
#include "base/strbuf.h"
#include "server/admin/pathparam.h"
#include "server/config.h"
#include "server/engine.h"

static const struct http_route *const GROUPS[] = {INFO_ROUTES,       OBS_ROUTES,   DIAG_ROUTES,
                                                  CACHE_ROUTES,      QUOTA_ROUTES, L2_ROUTES,
                                                  RECONFIGURE_ROUTES};

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

#define LOG_WINDOW_S   10.0
#define LOG_PER_WINDOW 10
#define REAP_PERIOD_S  0.5

/* One per TCP connection (MHD's socket context), in the admin's connection list. */
struct conn_track {
    struct conn_track *prev, *next; /* oldest first */
    MHD_socket fd;
    /* The request being received must be complete by then; 0 while a handler runs. */
    double deadline;
    int doomed; /* shut down by us; MHD closes it on its next event */
};

enum req_state {
    REQ_RECEIVING, /* headers parsed, body arriving */
    REQ_QUEUED,    /* connection suspended, waiting for or running on a worker */
    REQ_DONE,      /* resp filled by a worker, connection resumed */
    REQ_ANSWERED,  /* response queued with MHD */
};

/* One per request (MHD's con_cls). */
struct conn_ctx {
    struct conn_ctx *next; /* worker queue link */
    struct MHD_Connection *conn;
    struct strbuf body;
    int too_large;
    double started;
    enum req_state state;
    const struct http_route *route;
    int path_matched;
    char allow[64];
    char params[HTTP_MAX_PARAMS][256];
    size_t nparams;
    struct http_req req;
    struct http_resp resp;
};

struct admin {
    struct MHD_Daemon *d;
    struct engine *e;
    struct metric_family *requests, *duration, *dropped;
    _Atomic int inflight; /* requests between their first byte and their completion */
    _Atomic int closing;  /* admin_stop has begun: new requests are answered 503 */

    int token_set, protect_metrics;
    unsigned char token_digest[32];
    char *token;              /* handed to the /run_script child, wiped at stop */
    char *tls_cert, *tls_key; /* MHD reads them while starting; kept until stop */
    double request_timeout_s;
    unsigned max_connections;

    /* Worker pool: `mu` guards everything down to `stopping`. */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct conn_ctx *qhead, *qtail;
    size_t queued;     /* in the queue, plus slots reserved by a submitter */
    size_t queue_size; /* bound of queued */
    unsigned running_slow, max_slow;
    int stopping;
    pthread_t *workers;
    unsigned nworkers;

    /* Connection list: `track_mu` guards it and every conn_track. */
    pthread_mutex_t track_mu;
    pthread_cond_t track_cv; /* wakes the reaper for stop */
    struct conn_track *thead, *ttail;
    unsigned nconns; /* connections not yet doomed */
    int reaper_stop, reaper_started;
    pthread_t reaper;

    /* Log rate limit for per-connection warnings. */
    struct ratelimit log_rl;
};

/* Per-connection warnings (limits reached, timeouts, failed authentication) come at the
 * rate a client chooses; at most LOG_PER_WINDOW of them are logged per window, and the
 * number dropped is reported with the next one logged. */
static void rl_warn(struct admin *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rl_warn(struct admin *a, const char *fmt, ...) {
    unsigned long dropped;
    if (!ratelimit_allow(&a->log_rl, clock_mono(), &dropped)) return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    /* Paths and addresses come from the client: no control characters into the log. */
    for (char *c = buf; *c; c++)
        if ((unsigned char)*c < 0x20 || *c == 0x7f) *c = '?';
    if (dropped)
        log_warn(lg(), "%s (%lu similar messages suppressed in the last %.0f s)", buf, dropped,
                 LOG_WINDOW_S);
    else
        log_warn(lg(), "%s", buf);
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    char buf[512];
    vsnprintf(buf, sizeof(buf), fmt, ap);
    rl_warn(cls, "libmicrohttpd: %s", buf);
}

/* Pool occupancy for the gauges; one admin server per process. */
static _Atomic long g_queued, g_busy;

static double gauge_queued(void *arg) {
    (void)arg;
    return (double)atomic_load(&g_queued);
}

static double gauge_busy(void *arg) {
    (void)arg;
    return (double)atomic_load(&g_busy);
}

static void count_dropped(struct admin *a, const char *reason, unsigned n) {
    if (!n) return;
    const char *labels[] = {reason};
    metrics_add(a->dropped, labels, n);
}

/* ---- connections: limit and whole-request deadline ---- */

/* libmicrohttpd's own timeout is an idle timeout: a client that trickles one header byte
 * at a time keeps a connection forever. The admin therefore keeps every connection in a
 * list with a deadline for its current request (armed when it connects, when its answer is
 * queued and after the answer is sent; cleared while a handler runs); the reaper shuts down the
 * socket of one that misses it. shutdown() (not close()) leaves the descriptor to libmicrohttpd,
 * which sees end-of-file and closes the connection itself; the CLOSED notification, which comes
 * before libmicrohttpd closes the descriptor, unlinks it under track_mu, so a descriptor is never
 * shut down after it was closed and reused. */

static struct conn_track *track_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

static void track_set_deadline(struct admin *a, struct MHD_Connection *c, double deadline) {
    struct conn_track *t = track_of(c);
    if (!t) return;
    pthread_mutex_lock(&a->track_mu);
    t->deadline = deadline;
    pthread_mutex_unlock(&a->track_mu);
}

static void do_doom(struct admin *a, struct conn_track *t) {
    t->doomed = 1;
    a->nconns--;
    shutdown(t->fd, SHUT_RDWR);
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode code) {
    struct admin *a = cls;
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci =
            MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        struct conn_track *t = calloc(1, sizeof(*t));
        if (!t || !ci) {
            /* Untracked: only the idle timeout applies to it. */
            free(t);
            return;
        }
        t->fd = ci->connect_fd;
        t->deadline = clock_mono() + a->request_timeout_s;
        unsigned replaced = 0;
        pthread_mutex_lock(&a->track_mu);
        t->prev = a->ttail;
        if (a->ttail)
            a->ttail->next = t;
        else
            a->thead = t;
        a->ttail = t;
        a->nconns++;
        /* Over the limit: the oldest connection still receiving a request (or idle between
         * requests) makes room, so a crowd of slow clients cannot lock probes out. When
         * every other connection has a handler running, the new one goes. */
        if (a->nconns > a->max_connections) {
            struct conn_track *v = a->thead;
            while (v && (v == t || v->doomed || v->deadline == 0)) v = v->next;
            do_doom(a, v ? v : t);
            replaced = 1;
        }
        pthread_mutex_unlock(&a->track_mu);
        *socket_context = t;
        if (replaced) {
            count_dropped(a, "connection_limit", 1);
            rl_warn(a,
                    "admin API: over %u connections, closed the oldest idle or incomplete one "
                    "(or the new one)",
                    a->max_connections);
        }
        return;
    }
    struct conn_track *t = *socket_context;
    if (!t) return;
    pthread_mutex_lock(&a->track_mu);
    if (t->prev)
        t->prev->next = t->next;
    else
        a->thead = t->next;
    if (t->next)
        t->next->prev = t->prev;
    else
        a->ttail = t->prev;
    if (!t->doomed) a->nconns--;
    pthread_mutex_unlock(&a->track_mu);
    free(t);
    *socket_context = NULL;
}

static void *reaper_main(void *arg) {
    struct admin *a = arg;
    pthread_setname_np(pthread_self(), "admin-reaper");
    pthread_mutex_lock(&a->track_mu);
    while (!a->reaper_stop) {
        double now = clock_mono();
        unsigned n = 0;
        for (struct conn_track *t = a->thead; t; t = t->next) {
            if (t->doomed || t->deadline == 0 || now < t->deadline) continue;
            do_doom(a, t);
            n++;
        }
        if (n) {
            pthread_mutex_unlock(&a->track_mu);
            count_dropped(a, "request_timeout", n);
            rl_warn(a,
                    "admin API: closed %u connection(s) whose request was not complete within "
                    "%.0f s",
                    n, a->request_timeout_s);
            pthread_mutex_lock(&a->track_mu);
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long ns = ts.tv_nsec + (long)(REAP_PERIOD_S * 1e9);
        ts.tv_sec += ns / 1000000000L;
        ts.tv_nsec = ns % 1000000000L;
        if (!a->reaper_stop) pthread_cond_timedwait(&a->track_cv, &a->track_mu, &ts);
    }
    pthread_mutex_unlock(&a->track_mu);
    return NULL;
}

/* ---- responses ---- */

static enum MHD_Result queue(struct MHD_Connection *c, struct http_resp *resp) {
    struct MHD_Response *r = MHD_create_response_from_buffer(
        resp->len, resp->body ? resp->body : (void *)"",
        resp->body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r) {
        free(resp->body);
        resp->body = NULL;
        return MHD_NO;
    }
    resp->body = NULL;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                            resp->content_type ? resp->content_type : "application/json");
    if (resp->allow) MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, resp->allow);
    if (resp->www_authenticate)
        MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, resp->www_authenticate);
    if (resp->retry_after) {
        char ra[16];
        snprintf(ra, sizeof(ra), "%u", resp->retry_after);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)resp->status, r);
    MHD_destroy_response(r);
    return ret;
}

/* Counts and queues ctx->resp. */
static enum MHD_Result respond(struct admin *a, struct conn_ctx *ctx, const char *method,
                               const char *url) {
    struct http_resp *resp = &ctx->resp;
    if (!resp->body && resp->status == 0) http_error(resp, 500, "detail", "internal error");
    char code[8];
    snprintf(code, sizeof(code), "%d", resp->status);
    const char *rname = ctx->route ? ctx->route->pattern : "unmatched";
    const char *labels[] = {method, rname, code};
    metrics_add(a->requests, labels, 1);
    const char *dl[] = {rname};
    metric_observe(metric_labels(a->duration, dl), clock_mono() - ctx->started);
    log_debug(lg(), "%s %s -> %d", method, url, resp->status);
    ctx->state = REQ_ANSWERED;
    /* The answer must be taken within the same time a request gets to arrive. */
    track_set_deadline(a, ctx->conn, clock_mono() + a->request_timeout_s);
    return queue(ctx->conn, resp);
}

/* ---- authentication ---- */

static int needs_token(const struct admin *a, const struct http_route *r) {
    if (!a->token_set) return 0;
    if (r && (r->flags & HTTP_OPEN)) return 0;
    if (r && (r->flags & HTTP_OPEN_METRICS) && !a->protect_metrics) return 0;
    return 1;
}

/* 1 when the request carries "Authorization: Bearer <token>". Digests of equal length are
 * compared in constant time, so neither the token's length nor its prefix leaks. */
static int token_ok(const struct admin *a, struct MHD_Connection *c, int *presented) {
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    *presented = h != NULL;
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return 0;
    h += 7;
    while (*h == ' ') h++;
    unsigned char d[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)h, strlen(h), d);
    return CRYPTO_memcmp(d, a->token_digest, sizeof(d)) == 0;
}

static const char *client_ip(struct MHD_Connection *c, char *buf, size_t len) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    snprintf(buf, len, "?");
    if (ci && ci->client_addr) {
        socklen_t sl = ci->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                              : sizeof(struct sockaddr_in);
        getnameinfo(ci->client_addr, sl, buf, (socklen_t)len, NULL, 0, NI_NUMERICHOST);
    }
    return buf;
}

/* ---- worker pool ---- */

/* The first queued job a worker may start: any, except that long-running routes stop at
 * max_slow running. Caller holds a->mu. */
static struct conn_ctx *do_take(struct admin *a, int any) {
    struct conn_ctx *prev = NULL;
    for (struct conn_ctx *j = a->qhead; j; prev = j, j = j->next) {
        int slow = (j->route->flags & HTTP_SLOW) != 0;
        if (!any && slow && a->running_slow >= a->max_slow) continue;
        if (prev)
            prev->next = j->next;
        else
            a->qhead = j->next;
        if (a->qtail == j) a->qtail = prev;
        j->next = NULL;
        a->queued--;
        atomic_fetch_sub(&g_queued, 1);
        if (!any && slow) a->running_slow++;
        return j;
    }
    return NULL;
}

static void finish_job(struct conn_ctx *j) {
    j->state = REQ_DONE;
    MHD_resume_connection(j->conn);
}

static void *worker_main(void *arg) {
    struct admin *a = arg;
    pthread_setname_np(pthread_self(), "admin-worker");
    pthread_mutex_lock(&a->mu);
    for (;;) {
        if (a->stopping) {
            /* Jobs still queued are answered 503; exit once no submitter holds a slot. */
            if (a->queued == 0) break;
            struct conn_ctx *j = do_take(a, 1);
            if (!j) {
                pthread_cond_wait(&a->cv, &a->mu);
                continue;
            }
            pthread_mutex_unlock(&a->mu);
            http_error(&j->resp, 503, "detail", "server shutting down");
            finish_job(j);
            pthread_mutex_lock(&a->mu);
            continue;
        }
        struct conn_ctx *j = do_take(a, 0);
        if (!j) {
            pthread_cond_wait(&a->cv, &a->mu);
            continue;
        }
        pthread_mutex_unlock(&a->mu);
        int slow = (j->route->flags & HTTP_SLOW) != 0;
        atomic_fetch_add(&g_busy, 1);
        j->resp.status = 200;
        j->route->handler(&j->req, &j->resp);
        atomic_fetch_sub(&g_busy, 1);
        finish_job(j);
        pthread_mutex_lock(&a->mu);
        if (slow) {
            a->running_slow--;
            pthread_cond_broadcast(&a->cv); /* a skipped slow job may start now */
        }
    }
    pthread_mutex_unlock(&a->mu);
    return NULL;
}

/* Hands ctx to the workers, suspending its connection. The connection is suspended before
 * the job becomes visible: a worker resuming a connection not yet suspended would leave it
 * suspended forever. Returns -1 (nothing done) when the queue is full or stopping. */
static int submit(struct admin *a, struct conn_ctx *ctx) {
    pthread_mutex_lock(&a->mu);
    if (a->stopping || a->queued >= a->queue_size) {
        pthread_mutex_unlock(&a->mu);
        return -1;
    }
    a->queued++; /* reserves the slot */
    atomic_fetch_add(&g_queued, 1);
    pthread_mutex_unlock(&a->mu);
    ctx->state = REQ_QUEUED;
    MHD_suspend_connection(ctx->conn);
    pthread_mutex_lock(&a->mu);
    if (a->qtail)
        a->qtail->next = ctx;
    else
        a->qhead = ctx;
    a->qtail = ctx;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    return 0;
}

/* ---- the access handler ---- */

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
    (void)version;
    struct admin *a = cls;
    struct conn_ctx *ctx = *con_cls;
    if (!ctx) {
        /* Headers are complete: route and authenticate before reading any body. */
        ctx = calloc(1, sizeof(*ctx));
        if (!ctx) return MHD_NO;
        ctx->started = clock_mono();
        ctx->conn = conn;
        *con_cls = ctx;
        atomic_fetch_add(&a->inflight, 1);
        if (atomic_load(&a->closing)) {
            http_error(&ctx->resp, 503, "detail", "server shutting down");
            return respond(a, ctx, method, url);
        }
        ctx->route = http_match(method, url, ctx->params, &ctx->nparams, &ctx->path_matched,
                                ctx->allow, sizeof(ctx->allow));
        if (needs_token(a, ctx->route)) {
            int presented = 0;
            if (!token_ok(a, conn, &presented)) {
                char ip[64];
                rl_warn(a, "admin API: %s %s from %s: %s", method, url,
                        client_ip(conn, ip, sizeof(ip)),
                        presented ? "wrong credentials" : "no credentials");
                http_error(&ctx->resp, 401, "detail",
                           presented ? "invalid bearer token" : "authentication required");
                ctx->resp.www_authenticate =
                    presented ? "Bearer realm=\"lmcache\", error=\"invalid_token\""
                              : "Bearer realm=\"lmcache\"";
                return respond(a, ctx, method, url);
            }
        }
        return MHD_YES;
    }
    if (ctx->state == REQ_DONE) return respond(a, ctx, method, url);
    if (ctx->state != REQ_RECEIVING) {
        *upload_data_size = 0; /* the rest of a body already answered */
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

    /* The whole request is in: its deadline no longer applies. */
    track_set_deadline(a, conn, 0);
    struct http_resp *resp = &ctx->resp;
    const struct http_route *route = ctx->route;
    if (ctx->too_large) {
        http_error(resp, 413, "detail", "request body too large");
    } else if (ctx->body.oom) {
        http_error(resp, 500, "detail", "out of memory");
    } else if (!route && ctx->path_matched) {
        http_error(resp, 405, "detail", "Method Not Allowed");
        resp->allow = ctx->allow;
    } else if (!route) {
        http_error(resp, 404, "detail", "Not Found");
    } else if (route->unready_body && !engine_is_ready(a->e)) {
        const char *b = route->unready_body;
        set_body(resp, 503, "application/json", strdup(b), strlen(b));
    } else {
        struct http_req *req = &ctx->req;
        req->conn = conn;
        req->method = method;
        req->path = url;
        /* libmicrohttpd has already percent-decoded the path. */
        for (size_t i = 0; i < ctx->nparams; i++) req->params[i] = ctx->params[i];
        req->nparams = ctx->nparams;
        req->body = ctx->body.buf ? ctx->body.buf : "";
        req->body_len = ctx->body.len;
        req->content_type =
            MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
        req->engine = a->e;
        req->admin_token = a->token;
        req->admin_tls = a->tls_cert != NULL;
        if (route->flags & HTTP_INLINE) {
            resp->status = 200;
            route->handler(req, resp);
        } else if (submit(a, ctx) == 0) {
            return MHD_YES; /* a worker resumes the connection with ctx->resp filled */
        } else {
            http_error(resp, 503, "detail", "admin API busy, retry later");
            resp->retry_after = 1;
            char ip[64];
            rl_warn(a, "admin API: worker queue full, %s %s from %s answered 503", method, url,
                    client_ip(conn, ip, sizeof(ip)));
        }
    }
    return respond(a, ctx, method, url);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)toe;
    struct admin *a = cls;
    struct conn_ctx *ctx = *con_cls;
    /* A keep-alive connection's next request gets a fresh deadline. */
    track_set_deadline(a, conn, clock_mono() + a->request_timeout_s);
    if (ctx) {
        atomic_fetch_sub(&a->inflight, 1);
        sb_free(&ctx->body);
        free(ctx->resp.body);
        free(ctx);
        *con_cls = NULL;
    }
}

/* ---- options ---- */

#define TOKEN_MAX (4u << 10)
#define PEM_MAX   (1u << 20)

/* Reads a whole regular file of at most max bytes into a NUL-terminated buffer. */
static char *read_file(const char *flag, const char *path, size_t max, size_t *len, char *err,
                       size_t errlen) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        errbuf_set(err, errlen, "argument --%s: cannot read %s: %s", flag, path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || (size_t)st.st_size > max) {
        errbuf_set(err, errlen, "argument --%s: %s is not a regular file of at most %zu bytes",
                   flag, path, max);
        close(fd);
        return NULL;
    }
    if (st.st_mode & S_IROTH)
        log_warn(lg(), "--%s %s is readable by every user of this host; chmod o-r it", flag, path);
    char *buf = malloc((size_t)st.st_size + 1);
    size_t n = 0;
    while (buf && n < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + n, (size_t)st.st_size - n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        n += (size_t)r;
    }
    int saved = errno;
    close(fd);
    if (!buf || n != (size_t)st.st_size) {
        errbuf_set(err, errlen, "argument --%s: cannot read %s: %s", flag, path,
                   buf ? strerror(saved) : "out of memory");
        free(buf);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static int no_passphrase(char *buf, int size, int rwflag, void *u) {
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return -1;
}

/* Parses the PEM certificate and key and checks that they belong together, so a wrong file is
 * reported as a bad option value before anything starts (libmicrohttpd would only say it cannot
 * start). Encrypted keys are refused: nothing could type their passphrase. */
static int check_tls_pair(const char *cert_pem, const char *key_pem, char *err, size_t errlen) {
    BIO *cb = BIO_new_mem_buf(cert_pem, -1), *kb = BIO_new_mem_buf(key_pem, -1);
    X509 *x = cb ? PEM_read_bio_X509(cb, NULL, no_passphrase, NULL) : NULL;
    EVP_PKEY *k = kb ? PEM_read_bio_PrivateKey(kb, NULL, no_passphrase, NULL) : NULL;
    int rc = -1;
    if (!x)
        errbuf_set(err, errlen, "argument --http-tls-cert: no PEM certificate in the file");
    else if (!k)
        errbuf_set(err, errlen,
                   "argument --http-tls-key: no unencrypted PEM private key in the file");
    else if (X509_check_private_key(x, k) != 1)
        errbuf_set(err, errlen,
                   "argument --http-tls-key: the key does not belong to the --http-tls-cert "
                   "certificate");
    else
        rc = 0;
    X509_free(x);
    EVP_PKEY_free(k);
    BIO_free(cb);
    BIO_free(kb);
    return rc;
}

int admin_options_load(struct admin_options *o, const struct server_config *cfg, char *err,
                       size_t errlen) {
    memset(o, 0, sizeof(*o));
    o->host = cfg->http_host;
    o->port = (int)cfg->http_port;
    o->token_protects_metrics = cfg->admin_token_protects_metrics;
    o->workers = (unsigned)cfg->admin_workers;
    o->queue_size = (unsigned)cfg->admin_queue_size;
    o->max_connections = (unsigned)cfg->http_max_connections;
    o->max_connections_per_ip = (unsigned)cfg->http_max_connections_per_ip;
    o->idle_timeout_s = (unsigned)cfg->http_idle_timeout_seconds;
    o->request_timeout_s = (unsigned)cfg->http_request_timeout_seconds;

    if (cfg->admin_token_file && *cfg->admin_token_file) {
        size_t len = 0;
        char *tok =
            read_file("admin-token-file", cfg->admin_token_file, TOKEN_MAX, &len, err, errlen);
        if (!tok) return -1;
        /* One line; surrounding whitespace (a trailing newline) is not part of it. */
        size_t b = 0, e = len;
        while (b < e && strchr(" \t\r\n", tok[b])) b++;
        while (e > b && strchr(" \t\r\n", tok[e - 1])) e--;
        int bad = 0;
        for (size_t i = b; i < e; i++)
            if ((unsigned char)tok[i] <= ' ' || (unsigned char)tok[i] == 0x7f) bad = 1;
        if (e == b || bad) {
            errbuf_set(err, errlen,
                       "argument --admin-token-file: %s must hold one token of printable "
                       "characters without spaces (it is %s)",
                       cfg->admin_token_file, e == b ? "empty" : "not");
            explicit_bzero(tok, len);
            free(tok);
            return -1;
        }
        SHA256((const unsigned char *)tok + b, e - b, o->token_digest);
        o->token = strndup(tok + b, e - b);
        explicit_bzero(tok, len);
        free(tok);
        if (!o->token) {
            errbuf_set(err, errlen, "out of memory");
            return -1;
        }
        o->token_set = 1;
    }

    int has_cert = cfg->http_tls_cert && *cfg->http_tls_cert;
    int has_key = cfg->http_tls_key && *cfg->http_tls_key;
    if (has_cert != has_key) {
        errbuf_set(err, errlen, "argument --%s: requires --%s",
                   has_cert ? "http-tls-cert" : "http-tls-key",
                   has_cert ? "http-tls-key" : "http-tls-cert");
        return -1;
    }
    if (has_cert) {
        if (MHD_is_feature_supported(MHD_FEATURE_TLS) != MHD_YES) {
            errbuf_set(err, errlen,
                       "argument --http-tls-cert: this libmicrohttpd was built without TLS");
            return -1;
        }
        size_t len;
        o->tls_cert = read_file("http-tls-cert", cfg->http_tls_cert, PEM_MAX, &len, err, errlen);
        if (!o->tls_cert) return -1;
        o->tls_key = read_file("http-tls-key", cfg->http_tls_key, PEM_MAX, &len, err, errlen);
        if (!o->tls_key) {
            admin_options_free(o);
            return -1;
        }
        if (check_tls_pair(o->tls_cert, o->tls_key, err, errlen) < 0) {
            admin_options_free(o);
            return -1;
        }
    }
    return 0;
}

void admin_options_free(struct admin_options *o) {
    if (o->tls_key) explicit_bzero(o->tls_key, strlen(o->tls_key));
    free(o->tls_cert);
    free(o->tls_key);
    o->tls_cert = o->tls_key = NULL;
    explicit_bzero(o->token_digest, sizeof(o->token_digest));
    if (o->token) explicit_bzero(o->token, strlen(o->token));
    free(o->token);
    o->token = NULL;
}

/* ---- start and stop ---- */

static void admin_free(struct admin *a) {
    free(a->workers);
    if (a->tls_key) explicit_bzero(a->tls_key, strlen(a->tls_key));
    free(a->tls_cert);
    free(a->tls_key);
    if (a->token) explicit_bzero(a->token, strlen(a->token));
    free(a->token);
    pthread_mutex_destroy(&a->mu);
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->track_mu);
    pthread_cond_destroy(&a->track_cv);
    pthread_mutex_destroy(&a->log_rl.mu);
    free(a);
}

/* Stops and joins the workers (queued jobs get 503) and the reaper. */
static void stop_threads(struct admin *a) {
    pthread_mutex_lock(&a->mu);
    a->stopping = 1;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    for (unsigned i = 0; i < a->nworkers; i++) pthread_join(a->workers[i], NULL);
    a->nworkers = 0;
    if (a->reaper_started) {
        pthread_mutex_lock(&a->track_mu);
        a->reaper_stop = 1;
        pthread_cond_signal(&a->track_cv);
        pthread_mutex_unlock(&a->track_mu);
        pthread_join(a->reaper, NULL);
        a->reaper_started = 0;
    }
}

struct admin *admin_start(struct engine *e, const struct admin_options *o, char *err,
                          size_t errlen) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", o->port);
    int gai = getaddrinfo(o->host, ps, &hints, &res);
    if (gai != 0) {
        errbuf_set(err, errlen, "--http-host %s: %s", o->host, gai_strerror(gai));
        return NULL;
    }
    struct admin *a = calloc(1, sizeof(*a));
    if (!a) {
        freeaddrinfo(res);
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    a->e = e;
    a->token_set = o->token_set;
    memcpy(a->token_digest, o->token_digest, sizeof(a->token_digest));
    a->protect_metrics = o->token_protects_metrics;
    a->request_timeout_s = o->request_timeout_s;
    a->max_connections = o->max_connections;
    a->queue_size = o->queue_size;
    a->max_slow = o->workers - 1; /* the options keep workers >= 2 */
    pthread_mutex_init(&a->mu, NULL);
    pthread_cond_init(&a->cv, NULL);
    pthread_mutex_init(&a->track_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->track_cv, &ca);
    pthread_condattr_destroy(&ca);
    a->log_rl = (struct ratelimit)RATELIMIT_INIT(LOG_WINDOW_S, LOG_PER_WINDOW);
    if (o->token && !(a->token = strdup(o->token))) {
        freeaddrinfo(res);
        admin_free(a);
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    if (o->tls_cert) {
        a->tls_cert = strdup(o->tls_cert);
        a->tls_key = strdup(o->tls_key);
        if (!a->tls_cert || !a->tls_key) {
            freeaddrinfo(res);
            admin_free(a);
            errbuf_set(err, errlen, "out of memory");
            return NULL;
        }
    }
    static const char *const REQ_LABELS[] = {"method", "route", "code", NULL};
    static const char *const DUR_LABELS[] = {"route", NULL};
    static const char *const DROP_LABELS[] = {"reason", NULL};
    a->requests = metrics_counter(e->metrics, "lmcache_http_requests_total",
                                  "Admin HTTP requests by method, route pattern and status code.",
                                  REQ_LABELS);
    a->duration = metrics_histogram(e->metrics, "lmcache_http_request_duration_seconds",
                                    "Admin HTTP request handling time.", DUR_LABELS,
                                    METRICS_LATENCY_BUCKETS, METRICS_LATENCY_NBUCKETS);
    a->dropped = metrics_counter(e->metrics, "lmcache_http_connections_dropped_total",
                                 "Admin HTTP connections closed by the server before their "
                                 "request was answered, by reason (request_timeout, "
                                 "connection_limit).",
                                 DROP_LABELS);
    metrics_gauge_fn(e->metrics, "lmcache_http_admin_queued_requests",
                     "Admin requests waiting for an admin worker.", gauge_queued, NULL);
    metrics_gauge_fn(e->metrics, "lmcache_http_admin_busy_workers",
                     "Admin workers running a handler.", gauge_busy, NULL);

    a->workers = calloc(o->workers, sizeof(*a->workers));
    if (!a->workers) {
        freeaddrinfo(res);
        admin_free(a);
        errbuf_set(err, errlen, "out of memory");
        return NULL;
    }
    int perr = 0;
    for (unsigned i = 0; i < o->workers && !perr; i++) {
        perr = pthread_create(&a->workers[i], NULL, worker_main, a);
        if (!perr) a->nworkers++;
    }
    if (!perr) {
        perr = pthread_create(&a->reaper, NULL, reaper_main, a);
        a->reaper_started = perr == 0;
    }
    if (perr) {
        freeaddrinfo(res);
        stop_threads(a);
        admin_free(a);
        errbuf_set(err, errlen, "cannot start admin threads: %s", strerror(perr));
        return NULL;
    }

    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_USE_ERROR_LOG | MHD_ALLOW_SUSPEND_RESUME;
    if (res->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    if (a->tls_cert) flags |= MHD_USE_TLS;
    /* MHD's own limit leaves room above ours: a connection over our limit is accepted and
     * then replaces an older one (on_connection), rather than being refused. */
    unsigned mhd_limit = o->max_connections + o->max_connections / 8 + 16;
    struct MHD_OptionItem opts[] = {
        {MHD_OPTION_EXTERNAL_LOGGER, (intptr_t)on_mhd_log, a},
        {MHD_OPTION_SOCK_ADDR, 0, res->ai_addr},
        {MHD_OPTION_THREAD_POOL_SIZE, 2, NULL},
        {MHD_OPTION_CONNECTION_TIMEOUT, (intptr_t)o->idle_timeout_s, NULL},
        {MHD_OPTION_CONNECTION_LIMIT, (intptr_t)mhd_limit, NULL},
        {MHD_OPTION_PER_IP_CONNECTION_LIMIT, (intptr_t)o->max_connections_per_ip, NULL},
        {MHD_OPTION_NOTIFY_COMPLETED, (intptr_t)on_completed, a},
        {MHD_OPTION_NOTIFY_CONNECTION, (intptr_t)on_connection, a},
        {MHD_OPTION_UNESCAPE_CALLBACK, (intptr_t)pathparam_unescape, NULL},
        {a->tls_cert ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, 0, a->tls_cert},
        {a->tls_cert ? MHD_OPTION_HTTPS_MEM_KEY : MHD_OPTION_END, 0, a->tls_key},
        {MHD_OPTION_END, 0, NULL},
    };
    a->d = MHD_start_daemon(flags, (uint16_t)o->port, NULL, NULL, on_request, a, MHD_OPTION_ARRAY,
                            opts, MHD_OPTION_END);
    freeaddrinfo(res);
    if (!a->d) {
        if (a->tls_cert)
            errbuf_set(err, errlen,
                       "cannot listen on %s:%d (address in use or not available, or the TLS "
                       "certificate and key do not load or match)",
                       o->host, o->port);
        else
            errbuf_set(err, errlen, "cannot listen on %s:%d (address in use or not available)",
                       o->host, o->port);
        stop_threads(a);
        admin_free(a);
        return NULL;
    }
    return a;
}

void admin_stop(struct admin *a, double timeout_s) {
    if (!a) return;
    /* New requests are answered 503 from here on; the listening socket stays libmicrohttpd's
     * until MHD_stop_daemon closes it. Not MHD_quiesce_daemon: with the epoll thread it takes
     * the listening socket out of the epoll set from this thread while the epoll thread, seeing
     * the daemon quiesced, may do the same, and the loser's failed epoll_ctl aborts the process
     * ("Failed to remove listen FD from epoll set", libmicrohttpd 0.9.75). */
    atomic_store(&a->closing, 1);
    double deadline = clock_mono() + timeout_s;
    /* Idle keep-alive connections are not waited for, only requests in flight. */
    while (atomic_load(&a->inflight) > 0 && clock_mono() < deadline) usleep(10 * 1000);
    /* Every suspended connection is resumed before MHD_stop_daemon, as it requires: the
     * workers answer what is still queued and finish what they run. */
    stop_threads(a);
    MHD_stop_daemon(a->d);
    admin_free(a);
}
