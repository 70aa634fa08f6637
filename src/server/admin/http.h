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
};

struct http_resp {
    int status;
    const char *content_type;
    char *body; /* malloc'd, owned by the response */
    size_t len;
    const char *allow; /* Allow header for 405 */
};

typedef void (*http_handler)(struct http_req *req, struct http_resp *resp);

struct http_route {
    const char *method;
    const char *pattern; /* "/quota/{cache_salt}" */
    http_handler handler;
    /* When non-NULL the route needs a ready engine and answers 503 with this JSON
     * body until then. */
    const char *unready_body;
    const char *summary;
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
/* Starts the server on host:port. Returns NULL with errbuf filled. */
struct admin *admin_start(struct engine *e, const char *host, int port, char *errbuf,
                          size_t errlen);
/* Stops accepting, lets in-flight requests finish (up to timeout_s), then stops. */
void admin_stop(struct admin *a, double timeout_s);

/* Route matching, exposed for tests: returns the route for method+path, fills params;
 * *path_matched is set when some route has this path under another method. */
const struct http_route *http_match(const char *method, const char *path, char params[][256],
                                    size_t *nparams, int *path_matched, char *allow,
                                    size_t allow_len);

#endif
