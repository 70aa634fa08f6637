/* Private to the S3 adapter's files (s3.c, s3_config.c, s3_sign.c, s3_transport.c,
 * s3_list.c): the adapter, request and job structures and what the files call of each other. */
#ifndef LMCACHE_SERVER_L2_S3_INTERNAL_H
#define LMCACHE_SERVER_L2_S3_INTERNAL_H

#include <curl/curl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/strbuf.h"
#include "server/l2/s3.h"

#define S3_ERR_MAX         512
#define S3_BODY_MAX        (16u << 20) /* largest listing or error body we keep */
#define S3_MAP_BUCKETS     (1u << 16)
#define S3_LIST_ROUNDS_MAX 16 /* ListObjectsV2 requests per list() call */
#define S3_TOKEN_VERSION   0x01
#define S3_EMPTY_SHA256    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

/* The adapter's logger ("lmcache.l2.s3"). */
struct logger *s3_log(void);

enum s3_method { M_PUT, M_GET, M_HEAD, M_DELETE, M_LIST, M_PROBE };

static inline const char *s3_method_name(enum s3_method m) {
    static const char *const n[] = {"PUT", "GET", "HEAD", "DELETE", "GET", "HEAD"};
    return n[m];
}

struct s3;
struct s3_req;
typedef void (*s3_done_fn)(struct s3 *s, struct s3_req *r);

/* One HTTP request. Owned by a job (task), a sync waiter (delete/list) or the I/O thread
 * (probe). */
#define S3_RETRIES 3

struct s3_req {
    struct s3_req *next;          /* submission / pending queue */
    struct s3_req *aprev, *anext; /* the I/O thread's list of started requests */
    enum s3_method method;
    char *url; /* malloc'd */
    /* PUT source */
    const uint8_t *src;
    uint64_t src_len, src_off;
    /* GET destination */
    uint8_t *dst;
    uint64_t dst_cap, dst_len;
    bool overflow;
    /* other bodies (listing, errors), capped at S3_BODY_MAX */
    struct strbuf body;
    /* outcome */
    bool started, rejected, closed;
    CURLcode cc;
    long http;
    int64_t content_length;
    char curl_err[CURL_ERROR_SIZE];
    /* plumbing */
    CURL *easy;
    struct curl_slist *hdrs;
    s3_done_fn done;
    void *owner;
    size_t idx;
    int phase;    /* delete: 0 = HEAD, 1 = DELETE */
    int attempts; /* retries spent on 5xx answers */
    uint64_t size;
    char name[KEYS_L2_NAME_MAX];
};

struct s3_job { /* one l2_task */
    struct l2_task *t;
    atomic_size_t remaining;
    int status;
    struct s3_req reqs[];
};

struct s3_sync { /* a synchronous admin call waiting for its requests */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t remaining;
};

struct s3_ent { /* size cache + lookup locks, keyed by object name */
    struct s3_ent *next;
    uint64_t size;
    uint32_t locks;
    bool known; /* size is known (stored or seen by HEAD) and accounted */
    bool deleting;
    char name[];
};

struct s3 {
    struct l2_adapter base; /* first */
    /* configuration (immutable after create) */
    char *endpoint, *bucket, *region, *prefix, *base_url, *sigv4, *akid, *secret, *token_hdr;
    const char *cred_source;
    bool virtual_host, sign_payload;
    long max_in_flight, connect_timeout_ms, request_timeout_ms;
    /* I/O thread */
    pthread_t thread;
    bool thread_started;
    CURLM *multi;
    struct s3_req *pending_head, *pending_tail; /* I/O-thread-local */
    long active;
    struct s3_req *active_head;
    CURL **pool;
    long npool;
    struct s3_req probe;
    bool probe_active;
    /* submission queue */
    pthread_mutex_t q_mu;
    struct s3_req *q_head, *q_tail;
    bool stopping;
    atomic_long queued;
    /* size cache */
    pthread_mutex_t map_mu;
    struct s3_ent **ents;
    uint64_t nents;
    /* health */
    pthread_mutex_t st_mu;
    struct s3_breaker br;
    bool auth_error;
    char last_error[S3_ERR_MAX];
    double last_error_at;
    uint64_t connection_failures, http_errors;
};

/* ---- s3.c ---- */
void s3_free(struct s3 *s);

/* ---- s3_config.c ---- */
/* Reads the adapter's JSON config into s (strings, limits, endpoint and base URL, SigV4 scope,
 * credentials from the config or the environment, breaker). 0, or -1 with err filled; what it
 * set is freed by s3_free. */
int s3_configure(struct s3 *s, const json_t *cfg, char *err, size_t errlen);

/* ---- s3_sign.c ---- */
/* The URL of one object (malloc'd; NULL when the name is too long or out of memory). */
char *s3_object_url(struct s3 *s, const char *name);
/* Makes libcurl sign r with SigV4 (CURLOPT_AWS_SIGV4 and the credentials) and appends to *h the
 * headers the signature covers: x-amz-content-sha256 (the payload hash, which curl also signs)
 * and the session token. 0, or -1 when curl or memory fails (*h stays the caller's to free). */
int s3_sign_request(struct s3 *s, CURL *e, const struct s3_req *r, struct curl_slist **h);

/* ---- s3_transport.c ---- */
void s3_req_init(struct s3_req *r, enum s3_method m, s3_done_fn done, void *owner, size_t idx);
/* Frees what a request owns (URL, body, headers); the request itself belongs to its owner. */
void s3_req_release(struct s3_req *r);
/* Queues requests for the I/O thread. Returns L2_OK or L2_ERR_CLOSED (nothing was queued). */
int s3_enqueue(struct s3 *s, struct s3_req **rs, size_t n);
/* Puts r (already counted as finished by its owner's state) back at the head of the pending
 * queue, to be started again. I/O thread only (from a done callback). */
void s3_requeue_local(struct s3 *s, struct s3_req *r);
bool s3_req_ok(const struct s3_req *r);
/* The status to report for a request that did not succeed. */
int s3_req_status(const struct s3_req *r);
/* Remembers and logs (once per distinct message) the adapter's last error. */
void s3_set_error(struct s3 *s, bool auth, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A synchronous caller's wait for n requests; done callbacks call s3_sync_dec. */
int s3_sync_init(struct s3_sync *w, size_t n);
void s3_sync_dec(struct s3_sync *w);
void s3_sync_wait(struct s3_sync *w);
void s3_sync_fini(struct s3_sync *w);
/* The I/O thread (arg: the struct s3). */
void *s3_io_main(void *arg);

/* ---- s3_list.c ---- */
int s3_list(struct l2_adapter *a, const char *model_filter, size_t page_size, const char *token,
            struct l2_list_page *out, char *err, size_t errlen);

#endif
