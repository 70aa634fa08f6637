/* The admin HTTP server: libmicrohttpd wiring, the route table, request and
 * response helpers shared by the route groups (one file per group). */
#ifndef LMCACHE_ADMIN_HTTP_H
#define LMCACHE_ADMIN_HTTP_H

#include <jansson.h>
#include <stddef.h>

struct engine;
struct MHD_Connection;

#define HTTP_MAX_PARAMS 4
#define HTTP_MAX_BODY   (16u << 20)

struct http_req {
    struct MHD_Connection *conn;
    const char *method;
    const char *path;
    const char *params[HTTP_MAX_PARAMS]; /* {name} segments of the pattern, decoded */
    size_t nparams;
    const char *body; /* NUL-terminated; len excludes the NUL */
    size_t body_len;
    const char *content_type;
    struct engine *engine;
    /* How a client of this admin API gets in (the /run_script child's `app`): the bearer
     * token (NULL without --admin-token-file) and whether it speaks HTTPS. */
    const char *admin_token;
    int admin_tls;
};

struct http_resp {
    int status;
    const char *content_type;
    char *body; /* malloc'd, owned by the response */
    size_t len;
    const char *allow;            /* Allow header for 405 */
    const char *www_authenticate; /* WWW-Authenticate header for 401 */
    unsigned retry_after;         /* Retry-After seconds for 503 (0: none) */
};

typedef void (*http_handler)(struct http_req *req, struct http_resp *resp);

/* Route flags (struct http_route.flags). By default a handler runs on an admin worker
 * thread, so a handler that waits (on L2, a child process, a large body) never holds up
 * the connection threads. */
enum {
    /* Cheap and never blocking: runs on the connection thread and answers even when
     * every admin worker is busy (/, /healthcheck, /metrics). */
    HTTP_INLINE = 1u << 0,
    /* May run for seconds (L2 round trips, scripts, large digests): at most all but one
     * admin worker run such routes at once, so quick routes always find a worker. */
    HTTP_SLOW = 1u << 1,
    /* Answered without the admin token (liveness probes). */
    HTTP_OPEN = 1u << 2,
    /* Answered without the admin token unless --admin-token-protects-metrics. */
    HTTP_OPEN_METRICS = 1u << 3,
};

struct http_route {
    const char *method;
    const char *pattern; /* "/quota/{cache_salt}" */
    http_handler handler;
    /* When non-NULL the route needs a ready engine and answers 503 with this JSON
     * body until then. */
    const char *unready_body;
    const char *summary;
    unsigned flags; /* HTTP_* above */
};

/* Route groups (one admin/..._api.c file each) export a table; http.c joins them. */
extern const struct http_route INFO_ROUTES[];
extern const struct http_route OBS_ROUTES[];
extern const struct http_route DIAG_ROUTES[];
extern const struct http_route CACHE_ROUTES[];
extern const struct http_route QUOTA_ROUTES[];
extern const struct http_route L2_ROUTES[];
extern const struct http_route RECONFIGURE_ROUTES[];

/* Query parameter (decoded) or NULL. */
const char *http_query(const struct http_req *req, const char *name);

void http_json(struct http_resp *resp, int status, json_t *body /* stolen */);
void http_json_indent(struct http_resp *resp, int status, json_t *body /* stolen */);
void http_text(struct http_resp *resp, int status, const char *text);
void http_text_own(struct http_resp *resp, int status, char *text, size_t len);
/* {"<field>": "<message>"} */
void http_error(struct http_resp *resp, int status, const char *field, const char *message);
/* Parses the body as a JSON object; on failure fills resp (status, {"detail": ...}) and
 * returns NULL. An empty body yields an empty object when allow_empty. */
json_t *http_body_object(const struct http_req *req, struct http_resp *resp, int status_on_error,
                         int allow_empty);

struct admin;
struct server_config;

/* What admin_start needs besides the engine: limits, and the token and TLS material read
 * from their files before any port is bound. */
struct admin_options {
    const char *host;
    int port;
    int token_set;
    unsigned char token_digest[32]; /* SHA-256 of the token; requests are compared digest to
                                     * digest in constant time */
    int token_protects_metrics;
    char *token;              /* the token itself, for the /run_script child; wiped on free */
    char *tls_cert, *tls_key; /* PEM text, NULL for plain HTTP */
    unsigned workers, queue_size;
    unsigned max_connections, max_connections_per_ip;
    unsigned idle_timeout_s, request_timeout_s;
};

/* Fills o from the parsed options, reading the token and TLS files. Returns -1 with a
 * one-line message naming the option when a file is unreadable, empty or malformed, or TLS
 * is asked for and libmicrohttpd lacks it (the caller exits 2). Warns about files other
 * users may read. */
int admin_options_load(struct admin_options *o, const struct server_config *cfg, char *err,
                       size_t errlen);
void admin_options_free(struct admin_options *o);

/* Starts the server. Returns NULL with err filled. */
struct admin *admin_start(struct engine *e, const struct admin_options *o, char *err,
                          size_t errlen);
/* Stops accepting, lets in-flight requests finish (up to timeout_s), answers requests still
 * queued for a worker with 503, waits for running handlers, then stops. */
void admin_stop(struct admin *a, double timeout_s);

/* Route matching, exposed for tests: returns the route for method+path, fills params;
 * *path_matched is set when some route has this path under another method. */
const struct http_route *http_match(const char *method, const char *path, char params[][256],
                                    size_t *nparams, int *path_matched, char *allow,
                                    size_t allow_len);

#endif
