/* The "s3" L2 adapter: every KV object is one S3 object named by keys_l2_name() (DESIGN §5).
 *
 * One I/O thread drives a libcurl multi handle: tasks are split into one request per key, queued
 * under q_mu, and the I/O thread starts at most max_in_flight of them at a time (the multi handle
 * keeps connections alive between requests). Requests are signed by libcurl (CURLOPT_AWS_SIGV4)
 * with three workarounds for libcurl 7.88: we send x-amz-content-sha256 ourselves (curl signs it
 * and uses it as the payload hash), we build the query string already sorted and RFC 3986-encoded
 * (curl signs it verbatim) and we percent-encode object names ourselves (curl signs the path
 * verbatim). Every PUT carries its Content-Length (CURLOPT_INFILESIZE_LARGE); the "Expect:" header
 * is left to curl because removing it breaks curl's signature.
 *
 * The size cache (ents, under map_mu) remembers the size of every object this process stored or
 * found, and holds the lookup locks; a delete skips keys with locks and marks the others as
 * "deleting" so that lookups racing with it report a miss.
 *
 * Lock order: q_mu and map_mu and st_mu are leaves, never held together, except that map_mu may
 * be held while the base's accounting lock is taken (l2_adapter_notify_*). */
#include "server/l2/s3.h"

#include <curl/curl.h>
#include <errno.h>
#include <inttypes.h>
#include <openssl/sha.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/check.h"
#include "base/clock.h"
#include "base/log.h"
#include "base/strbuf.h"
#include "server/l2/s3_xml.h"
#include "base/hash.h"

#define S3_ERR_MAX         512
#define S3_BODY_MAX        (16u << 20) /* largest listing or error body we keep */
#define S3_MAP_BUCKETS     (1u << 16)
#define S3_LIST_ROUNDS_MAX 16 /* ListObjectsV2 requests per list() call */
#define S3_TOKEN_VERSION   0x01
#define S3_EMPTY_SHA256    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

static struct logger *s3_log(void) {
    static struct logger *lg;
    if (!lg) lg = log_get("lmcache.l2.s3");
    return lg;
}

/* ---- helpers for tests and URLs --------------------------------------------------------------
 */

long s3_uri_encode(const char *in, size_t len, bool keep_slash, char *out, size_t outlen) {
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)in[i];
        bool keep = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/');
        if (keep) {
            if (o + 1 >= outlen) return -1;
            out[o++] = (char)c;
        } else {
            if (o + 3 >= outlen) return -1;
            out[o++] = '%';
            out[o++] = hex[c >> 4];
            out[o++] = hex[c & 15];
        }
    }
    if (o >= outlen) return -1;
    out[o] = '\0';
    return (long)o;
}

static const char b64url[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

char *s3_token_encode(const char *continuation) {
    size_t n = strlen(continuation) + 1;
    size_t outlen = (n * 4 + 2) / 3;
    if (outlen > L2_PAGE_TOKEN_MAX) return NULL;
    unsigned char *raw = malloc(n);
    char *out = malloc(outlen + 1);
    if (!raw || !out) {
        free(raw);
        free(out);
        return NULL;
    }
    raw[0] = S3_TOKEN_VERSION;
    memcpy(raw + 1, continuation, n - 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)raw[i] << 16;
        if (i + 1 < n) v |= (uint32_t)raw[i + 1] << 8;
        if (i + 2 < n) v |= raw[i + 2];
        out[o++] = b64url[(v >> 18) & 63];
        out[o++] = b64url[(v >> 12) & 63];
        if (i + 1 < n) out[o++] = b64url[(v >> 6) & 63];
        if (i + 2 < n) out[o++] = b64url[v & 63];
    }
    out[o] = '\0';
    free(raw);
    return out;
}

static int b64url_val(char c) {
    const char *p = c ? strchr(b64url, c) : NULL;
    return p ? (int)(p - b64url) : -1;
}

char *s3_token_decode(const char *token) {
    size_t len = strlen(token);
    if (len < 2 || len > L2_PAGE_TOKEN_MAX || len % 4 == 1) return NULL;
    unsigned char *raw = malloc(len);
    if (!raw) return NULL;
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        size_t k = len - i < 4 ? len - i : 4;
        uint32_t v = 0;
        for (size_t j = 0; j < 4; j++) {
            int d = j < k ? b64url_val(token[i + j]) : 0;
            if (d < 0) {
                free(raw);
                return NULL;
            }
            v = v << 6 | (uint32_t)d;
        }
        raw[o++] = (unsigned char)(v >> 16);
        if (k > 2) raw[o++] = (unsigned char)(v >> 8);
        if (k > 3) raw[o++] = (unsigned char)v;
    }
    /* version byte, then a non-empty continuation token without NULs or control bytes */
    bool ok = o >= 2 && raw[0] == S3_TOKEN_VERSION;
    for (size_t i = 1; ok && i < o; i++) ok = raw[i] >= 0x20;
    char *out = ok ? malloc(o) : NULL;
    if (out) {
        memcpy(out, raw + 1, o - 1);
        out[o - 1] = '\0';
    }
    free(raw);
    return out;
}

/* ---- circuit breaker ------------------------------------------------------------------------ */

void s3_breaker_init(struct s3_breaker *b, uint32_t threshold, uint64_t cooldown_ns,
                     uint64_t cooldown_max_ns) {
    memset(b, 0, sizeof(*b));
    b->threshold = threshold ? threshold : 1;
    b->cooldown_ns = cooldown_ns;
    b->cooldown_max_ns = cooldown_max_ns < cooldown_ns ? cooldown_ns : cooldown_max_ns;
    b->cur_cooldown_ns = cooldown_ns;
}

bool s3_breaker_allow(const struct s3_breaker *b) { return b->state == S3_BREAKER_CLOSED; }

void s3_breaker_on_failure(struct s3_breaker *b, uint64_t now_ns) {
    switch (b->state) {
    case S3_BREAKER_CLOSED:
        if (++b->failures >= b->threshold) {
            b->state = S3_BREAKER_OPEN;
            b->opened_at_ns = now_ns;
            b->cur_cooldown_ns = b->cooldown_ns;
            b->opens++;
        }
        break;
    case S3_BREAKER_HALF_OPEN:
        b->state = S3_BREAKER_OPEN;
        b->opened_at_ns = now_ns;
        b->cur_cooldown_ns = b->cur_cooldown_ns * 2 > b->cooldown_max_ns ? b->cooldown_max_ns
                                                                         : b->cur_cooldown_ns * 2;
        break;
    case S3_BREAKER_OPEN:
        break; /* requests that were already in flight when it opened */
    }
}

void s3_breaker_on_success(struct s3_breaker *b) {
    b->state = S3_BREAKER_CLOSED;
    b->failures = 0;
    b->cur_cooldown_ns = b->cooldown_ns;
}

bool s3_breaker_probe_due(struct s3_breaker *b, uint64_t now_ns) {
    if (b->state != S3_BREAKER_OPEN || now_ns - b->opened_at_ns < b->cur_cooldown_ns) return false;
    b->state = S3_BREAKER_HALF_OPEN;
    return true;
}

const char *s3_breaker_state_name(enum s3_breaker_state s) {
    switch (s) {
    case S3_BREAKER_CLOSED:
        return "closed";
    case S3_BREAKER_OPEN:
        return "open";
    case S3_BREAKER_HALF_OPEN:
        return "half_open";
    }
    return "?";
}

/* ---- the adapter ---------------------------------------------------------------------------- */

enum s3_method { M_PUT, M_GET, M_HEAD, M_DELETE, M_LIST, M_PROBE };

static const char *method_name(enum s3_method m) {
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

static void set_error(struct s3 *s, bool auth, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_error(struct s3 *s, bool auth, const char *fmt, ...) {
    char msg[S3_ERR_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&s->st_mu);
    bool changed = strcmp(msg, s->last_error) != 0 || (auth && !s->auth_error);
    snprintf(s->last_error, sizeof(s->last_error), "%s", msg);
    s->last_error_at = clock_wall();
    if (auth) s->auth_error = true;
    pthread_mutex_unlock(&s->st_mu);
    /* Log each distinct error once, not once per request. */
    if (changed) log_error(s3_log(), "%s", msg);
}

/* ---- size cache ----------------------------------------------------------------------------- */

static unsigned name_hash(const char *s) { return fnv1a32_str(s) & (S3_MAP_BUCKETS - 1); }

/* Caller holds map_mu. */
static struct s3_ent *do_ent_find(struct s3 *s, const char *name) {
    for (struct s3_ent *e = s->ents[name_hash(name)]; e; e = e->next)
        if (strcmp(e->name, name) == 0) return e;
    return NULL;
}

/* Caller holds map_mu. NULL when out of memory. */
static struct s3_ent *do_ent_get(struct s3 *s, const char *name) {
    struct s3_ent *e = do_ent_find(s, name);
    if (e) return e;
    size_t len = strlen(name);
    e = calloc(1, sizeof(*e) + len + 1);
    if (!e) return NULL;
    memcpy(e->name, name, len + 1);
    unsigned h = name_hash(name);
    e->next = s->ents[h];
    s->ents[h] = e;
    s->nents++;
    return e;
}

/* Caller holds map_mu. Frees e when nothing needs it any more. */
static void do_ent_maybe_free(struct s3 *s, struct s3_ent *e) {
    if (e->known || e->locks || e->deleting) return;
    struct s3_ent **pp = &s->ents[name_hash(e->name)];
    while (*pp != e) pp = &(*pp)->next;
    *pp = e->next;
    s->nents--;
    free(e);
}

/* The object is gone (404 or deleted): un-account it. Caller holds map_mu. */
static void do_ent_forget(struct s3 *s, struct s3_ent *e, const struct keys_object_key *k) {
    if (e->known) {
        e->known = false;
        if (k) l2_adapter_notify_deleted(&s->base, k, e->size);
    }
    do_ent_maybe_free(s, e);
}

/* ---- requests ------------------------------------------------------------------------------- */

/* A segment of the name (between slashes, or at either end) that is "." or "..". */
static bool dot_segment(const char *seg, size_t n) {
    return (n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.');
}

long s3_key_escape(const char *name, char *out, size_t outlen) {
    size_t o = 0;
    for (const char *seg = name;;) {
        size_t n = strcspn(seg, "/");
        bool dots = dot_segment(seg, n);
        for (size_t i = 0; i < n; i++) {
            const char *rep = seg[i] == '%' ? "%25" : dots ? "%2E" : NULL;
            size_t rl = rep ? 3 : 1;
            if (o + rl >= outlen) return -1;
            if (rep)
                memcpy(out + o, rep, 3);
            else
                out[o] = seg[i];
            o += rl;
        }
        if (!seg[n]) break;
        if (o + 1 >= outlen) return -1;
        out[o++] = '/';
        seg += n + 1;
    }
    out[o] = '\0';
    return (long)o;
}

long s3_key_unescape(const char *key, size_t len, char *out, size_t outlen) {
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        char c = key[i];
        if (c == '%') {
            if (i + 2 >= len || key[i + 1] != '2') return -1;
            if (key[i + 2] == '5')
                c = '%';
            else if (key[i + 2] == 'E')
                c = '.';
            else
                return -1;
            i += 2;
        }
        if (o + 1 >= outlen) return -1;
        out[o++] = c;
    }
    out[o] = '\0';
    /* Only the escaper's output is accepted: a dot segment written with plain dots, or an
     * escaped dot outside a dot segment, is not a name of ours. */
    char again[S3_KEY_MAX + 1];
    long n = s3_key_escape(out, again, sizeof(again));
    if (n < 0 || (size_t)n != len || memcmp(again, key, len) != 0) return -1;
    return (long)o;
}

long s3_object_path(const char *prefix, const char *name, char *out, size_t outlen) {
    size_t plen = strlen(prefix);
    char full[S3_KEY_MAX + 1];
    if (plen >= sizeof(full)) return -1;
    memcpy(full, prefix, plen);
    long n = s3_key_escape(name, full + plen, sizeof(full) - plen);
    if (n < 0) return -1;
    return s3_uri_encode(full, plen + (size_t)n, true, out, outlen);
}

/* The URL of one object. Its path is sent and signed exactly as built here (CURLOPT_PATH_AS_IS in
 * req_start), and the key holds no dot segment of the model name, so no request and no object
 * ever leaves the configured bucket and prefix. */
static char *object_url(struct s3 *s, const char *name) {
    char enc[3 * S3_KEY_MAX + 1];
    if (s3_object_path(s->prefix, name, enc, sizeof(enc)) < 0) return NULL;
    struct strbuf sb = STRBUF_INIT;
    sb_printf(&sb, "%s/%s", s->base_url, enc);
    if (sb.oom) {
        sb_free(&sb);
        return NULL;
    }
    return sb_detach(&sb, NULL);
}

static void req_init(struct s3_req *r, enum s3_method m, s3_done_fn done, void *owner, size_t idx) {
    memset(r, 0, sizeof(*r));
    r->method = m;
    r->done = done;
    r->owner = owner;
    r->idx = idx;
    r->content_length = -1;
}

static void req_release(struct s3_req *r) {
    free(r->url);
    r->url = NULL;
    sb_free(&r->body);
    curl_slist_free_all(r->hdrs);
    r->hdrs = NULL;
}

/* Queues requests for the I/O thread. Returns L2_OK or L2_ERR_CLOSED (nothing was queued). */
static int enqueue(struct s3 *s, struct s3_req **rs, size_t n) {
    if (n == 0) return L2_OK;
    pthread_mutex_lock(&s->q_mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->q_mu);
        return L2_ERR_CLOSED;
    }
    for (size_t i = 0; i < n; i++) {
        rs[i]->next = NULL;
        if (s->q_tail)
            s->q_tail->next = rs[i];
        else
            s->q_head = rs[i];
        s->q_tail = rs[i];
    }
    atomic_fetch_add(&s->queued, (long)n);
    pthread_mutex_unlock(&s->q_mu);
    curl_multi_wakeup(s->multi);
    return L2_OK;
}

static size_t on_read(char *buf, size_t size, size_t nmemb, void *arg) {
    struct s3_req *r = arg;
    size_t want = size * nmemb, left = (size_t)(r->src_len - r->src_off);
    if (want > left) want = left;
    memcpy(buf, r->src + r->src_off, want);
    r->src_off += want;
    return want;
}

static size_t on_write_dst(char *data, size_t size, size_t nmemb, void *arg) {
    struct s3_req *r = arg;
    size_t n = size * nmemb;
    if (r->http != 200) { /* an error body: keep it for the message */
        if (r->body.len + n <= 64 * 1024) sb_append(&r->body, data, n);
        return n;
    }
    if (n > r->dst_cap - r->dst_len) {
        r->overflow = true; /* the object is larger than the caller's buffer: abort */
        return 0;
    }
    memcpy(r->dst + r->dst_len, data, n);
    r->dst_len += n;
    return n;
}

static size_t on_write_body(char *data, size_t size, size_t nmemb, void *arg) {
    struct s3_req *r = arg;
    size_t n = size * nmemb;
    if (r->body.len + n > S3_BODY_MAX || sb_append(&r->body, data, n) != 0) {
        r->overflow = true;
        return 0;
    }
    return n;
}

/* The status line arrives before the body: remember the code so the body goes to the right
 * place (an error document must not land in the caller's buffer). */
static size_t on_header(char *data, size_t size, size_t nmemb, void *arg) {
    struct s3_req *r = arg;
    size_t n = size * nmemb;
    if (n > 9 && memcmp(data, "HTTP/", 5) == 0) {
        const char *sp = memchr(data, ' ', n);
        if (sp && (size_t)(sp - data) + 4 <= n) {
            long code = strtol(sp + 1, NULL, 10);
            if (code != 100) r->http = code;
        }
    }
    return n;
}

static void sha256_hex(const uint8_t *d, size_t n, char out[65]) {
    unsigned char md[SHA256_DIGEST_LENGTH];
    SHA256(d, n, md);
    keys_hex_encode(md, sizeof(md), out);
}

static CURL *easy_get(struct s3 *s) {
    if (s->npool > 0) {
        CURL *e = s->pool[--s->npool];
        curl_easy_reset(e);
        return e;
    }
    return curl_easy_init();
}

static void easy_put(struct s3 *s, CURL *e) {
    if (s->npool < s->max_in_flight + 1)
        s->pool[s->npool++] = e;
    else
        curl_easy_cleanup(e);
}

#define SETOPT(e, o, v)                                                                            \
    do {                                                                                           \
        if (curl_easy_setopt((e), (o), (v)) != CURLE_OK) goto fail;                                \
    } while (0)

/* Configures and adds r to the multi handle. Returns 0, or -1 (r is finished by the caller). */
static int req_start(struct s3 *s, struct s3_req *r) {
    CURL *e = easy_get(s);
    if (!e) return -1;
    char hdr[256];
    struct curl_slist *h = NULL, *t;
    r->easy = e;
    r->started = true;
    SETOPT(e, CURLOPT_URL, r->url);
    /* libcurl would otherwise remove "/../" and "/./" from the path (RFC 3986 normalisation) and
     * sign the rewritten path: a model name "../../x" then named an object outside the prefix,
     * even another bucket. As is, the path sent is the path signed is the object's key. */
    SETOPT(e, CURLOPT_PATH_AS_IS, 1L);
    SETOPT(e, CURLOPT_PRIVATE, r);
    SETOPT(e, CURLOPT_NOSIGNAL, 1L);
    SETOPT(e, CURLOPT_ERRORBUFFER, r->curl_err);
    SETOPT(e, CURLOPT_AWS_SIGV4, s->sigv4);
    SETOPT(e, CURLOPT_USERNAME, s->akid);
    SETOPT(e, CURLOPT_PASSWORD, s->secret);
    SETOPT(e, CURLOPT_CONNECTTIMEOUT_MS, s->connect_timeout_ms);
    SETOPT(e, CURLOPT_TIMEOUT_MS, s->request_timeout_ms);
    SETOPT(e, CURLOPT_HEADERFUNCTION, on_header);
    SETOPT(e, CURLOPT_HEADERDATA, r);
    SETOPT(e, CURLOPT_WRITEFUNCTION, r->method == M_GET ? on_write_dst : on_write_body);
    SETOPT(e, CURLOPT_WRITEDATA, r);
    const char *payload = S3_EMPTY_SHA256;
    char digest[65];
    switch (r->method) {
    case M_PUT:
        SETOPT(e, CURLOPT_UPLOAD, 1L);
        SETOPT(e, CURLOPT_READFUNCTION, on_read);
        SETOPT(e, CURLOPT_READDATA, r);
        SETOPT(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)r->src_len);
        if (s->sign_payload) {
            sha256_hex(r->src, (size_t)r->src_len, digest);
            payload = digest;
        } else {
            payload = "UNSIGNED-PAYLOAD";
        }
        if (!(t = curl_slist_append(h, "Content-Type: application/octet-stream"))) goto fail;
        h = t;
        break;
    case M_HEAD:
    case M_PROBE:
        SETOPT(e, CURLOPT_NOBODY, 1L);
        break;
    case M_DELETE:
        SETOPT(e, CURLOPT_CUSTOMREQUEST, "DELETE");
        break;
    case M_GET:
    case M_LIST:
        SETOPT(e, CURLOPT_HTTPGET, 1L);
        break;
    }
    snprintf(hdr, sizeof(hdr), "x-amz-content-sha256: %s", payload);
    if (!(t = curl_slist_append(h, hdr))) goto fail;
    h = t;
    if (s->token_hdr) {
        if (!(t = curl_slist_append(h, s->token_hdr))) goto fail;
        h = t;
    }
    r->hdrs = h;
    SETOPT(e, CURLOPT_HTTPHEADER, h);
    if (curl_multi_add_handle(s->multi, e) != CURLM_OK) goto fail;
    s->active++;
    r->aprev = NULL;
    r->anext = s->active_head;
    if (s->active_head) s->active_head->aprev = r;
    s->active_head = r;
    return 0;
fail:
    curl_slist_free_all(h);
    r->hdrs = NULL;
    easy_put(s, e);
    r->easy = NULL;
    snprintf(r->curl_err, sizeof(r->curl_err), "could not set up the request");
    r->cc = CURLE_FAILED_INIT;
    return -1;
}

static bool connection_class(CURLcode cc) {
    switch (cc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_PARTIAL_FILE:
        return true;
    default:
        return false;
    }
}

/* Health bookkeeping for a finished request (I/O thread). */
static void req_account(struct s3 *s, struct s3_req *r) {
    if (r->rejected || r->closed) return;
    if (r->cc != CURLE_OK && connection_class(r->cc)) {
        pthread_mutex_lock(&s->st_mu);
        s->connection_failures++;
        enum s3_breaker_state before = s->br.state;
        s3_breaker_on_failure(&s->br, clock_mono_ns());
        enum s3_breaker_state after = s->br.state;
        pthread_mutex_unlock(&s->st_mu);
        set_error(s, false, "%s %s: %s (%s)", method_name(r->method), s->endpoint,
                  r->curl_err[0] ? r->curl_err : curl_easy_strerror(r->cc),
                  curl_easy_strerror(r->cc));
        if (before != after)
            log_warn(s3_log(), "circuit breaker %s -> %s (endpoint %s)",
                     s3_breaker_state_name(before), s3_breaker_state_name(after), s->endpoint);
        return;
    }
    if (r->cc != CURLE_OK) return; /* e.g. our own abort on a size mismatch: S3 answered */
    pthread_mutex_lock(&s->st_mu);
    enum s3_breaker_state before = s->br.state;
    s3_breaker_on_success(&s->br);
    bool was_auth = s->auth_error;
    if (r->http >= 200 && r->http < 300) s->auth_error = false;
    if (r->http >= 400 && r->http != 404) s->http_errors++;
    pthread_mutex_unlock(&s->st_mu);
    if (before != S3_BREAKER_CLOSED)
        log_info(s3_log(), "circuit breaker %s -> closed: %s answers again",
                 s3_breaker_state_name(before), s->endpoint);
    if (was_auth && r->http >= 200 && r->http < 300)
        log_info(s3_log(), "%s accepts the credentials again", s->endpoint);
    if (r->http == 403 || r->http == 401) {
        char code[128], msg[256];
        s3_xml_parse_error(r->body.buf, r->body.len, code, sizeof(code), msg, sizeof(msg));
        set_error(s, true,
                  "%s %s: HTTP %ld %s%s%s: S3 rejected the request; check access_key_id, "
                  "secret_access_key, session_token and region (%s)",
                  method_name(r->method), s->endpoint, r->http, code[0] ? code : "Forbidden",
                  msg[0] ? ": " : "", msg, s->cred_source);
    } else if (r->http >= 500 || (r->http >= 400 && r->http != 404 && r->method != M_PROBE)) {
        char code[128], msg[256];
        s3_xml_parse_error(r->body.buf, r->body.len, code, sizeof(code), msg, sizeof(msg));
        set_error(s, false, "%s %s: HTTP %ld %s%s%s", method_name(r->method), r->url, r->http, code,
                  msg[0] ? ": " : "", msg);
    }
}

/* Completes r: unhooks curl, records health and calls the owner's callback (I/O thread, or the
 * destroying thread after the I/O thread stopped). */
static void req_finish(struct s3 *s, struct s3_req *r) {
    if (r->easy) {
        int64_t cl = -1;
        curl_off_t v;
        if (curl_easy_getinfo(r->easy, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &v) == CURLE_OK) cl = v;
        r->content_length = cl;
        long code = 0;
        if (curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &code) == CURLE_OK && code)
            r->http = code;
        curl_multi_remove_handle(s->multi, r->easy);
        easy_put(s, r->easy);
        r->easy = NULL;
        s->active--;
        if (r->aprev)
            r->aprev->anext = r->anext;
        else
            s->active_head = r->anext;
        if (r->anext) r->anext->aprev = r->aprev;
        r->aprev = r->anext = NULL;
    }
    curl_slist_free_all(r->hdrs);
    r->hdrs = NULL;
    /* S3 asks clients to retry 500/502/503/504 (InternalError, SlowDown, ...). Every request we
     * send is idempotent, so it is sent again as it was, up to S3_RETRIES times. */
    if (r->method != M_PROBE && !r->closed && !r->rejected && r->cc == CURLE_OK && r->http >= 500 &&
        r->http <= 504 && r->http != 501 && r->attempts < S3_RETRIES) {
        r->attempts++;
        long was = r->http;
        r->src_off = 0;
        r->dst_len = 0;
        r->overflow = false;
        r->started = false;
        r->http = 0;
        r->content_length = -1;
        r->curl_err[0] = 0;
        sb_free(&r->body);
        struct s3_req *one = r;
        if (enqueue(s, &one, 1) == L2_OK) {
            log_debug(s3_log(), "%s %s: HTTP %ld, retrying (%d of %d)", method_name(r->method),
                      r->url, was, r->attempts, S3_RETRIES);
            return;
        }
        r->http = was; /* shutting down: report the failure */
    }
    req_account(s, r);
    r->done(s, r);
}

static bool req_ok(const struct s3_req *r) {
    return !r->rejected && !r->closed && r->cc == CURLE_OK && r->http >= 200 && r->http < 300;
}

/* The status to report for a request that did not succeed. */
static int req_status(const struct s3_req *r) {
    if (r->closed) return L2_ERR_CLOSED;
    if (r->cc == CURLE_OK && r->http == 404) return L2_ERR_NOT_FOUND;
    return L2_ERR_IO;
}

/* ---- tasks ---------------------------------------------------------------------------------- */

static void job_dec(struct s3 *s, struct s3_job *j) {
    if (atomic_fetch_sub(&j->remaining, 1) != 1) return;
    struct l2_task *t = j->t;
    t->status = j->status;
    for (size_t i = 0; i < t->n; i++) req_release(&j->reqs[i]);
    free(j);
    l2_adapter_complete(&s->base, t);
}

static void job_fail(struct s3_job *j, int status) {
    if (j->status == L2_OK) j->status = status;
}

static void store_done(struct s3 *s, struct s3_req *r) {
    struct s3_job *j = r->owner;
    struct l2_task *t = j->t;
    if (req_ok(r)) {
        t->ok[r->idx] = 1;
        t->bytes += r->src_len;
        pthread_mutex_lock(&s->map_mu);
        struct s3_ent *e = do_ent_get(s, r->name);
        if (e && !e->deleting) {
            if (e->known && e->size != r->src_len)
                l2_adapter_notify_deleted(&s->base, &t->keys[r->idx], e->size);
            if (!e->known || e->size != r->src_len)
                l2_adapter_notify_stored(&s->base, &t->keys[r->idx], r->src_len);
            e->known = true;
            e->size = r->src_len;
        }
        pthread_mutex_unlock(&s->map_mu);
    } else {
        job_fail(j, req_status(r) == L2_ERR_NOT_FOUND ? L2_ERR_IO : req_status(r));
    }
    job_dec(s, j);
}

static void lookup_done(struct s3 *s, struct s3_req *r) {
    struct s3_job *j = r->owner;
    struct l2_task *t = j->t;
    const struct keys_object_key *k = &t->keys[r->idx];
    bool found = req_ok(r) && r->content_length > 0;
    pthread_mutex_lock(&s->map_mu);
    struct s3_ent *e = do_ent_find(s, r->name);
    if (found && !(e && e->deleting)) {
        if (!e) e = do_ent_get(s, r->name);
        if (e) {
            if (!e->known) l2_adapter_notify_stored(&s->base, k, (uint64_t)r->content_length);
            e->known = true;
            e->size = (uint64_t)r->content_length;
            e->locks++;
            t->ok[r->idx] = 1;
            t->sizes[r->idx] = e->size;
        } else {
            job_fail(j, L2_ERR_NOMEM);
        }
    } else if (r->cc == CURLE_OK && r->http == 404 && e && !e->deleting && !e->locks) {
        do_ent_forget(s, e, k);
    }
    pthread_mutex_unlock(&s->map_mu);
    if (!found && !(r->cc == CURLE_OK && (r->http == 404 || r->http == 200)))
        job_fail(j, req_status(r));
    job_dec(s, j);
}

static void load_done(struct s3 *s, struct s3_req *r) {
    struct s3_job *j = r->owner;
    struct l2_task *t = j->t;
    const struct keys_object_key *k = &t->keys[r->idx];
    if (req_ok(r) && !r->overflow && r->dst_len == r->dst_cap) {
        t->ok[r->idx] = 1;
        t->bytes += r->dst_len;
        l2_adapter_notify_accessed(&s->base, k);
        job_dec(s, j);
        return;
    }
    if (r->cc == CURLE_OK && r->http == 404) {
        pthread_mutex_lock(&s->map_mu);
        struct s3_ent *e = do_ent_find(s, r->name);
        if (e && !e->deleting) {
            if (e->known) l2_adapter_notify_deleted(&s->base, k, e->size);
            e->known = false;
            do_ent_maybe_free(s, e);
        }
        pthread_mutex_unlock(&s->map_mu);
        job_fail(j, L2_ERR_NOT_FOUND);
    } else if (r->overflow || (req_ok(r) && r->dst_len != r->dst_cap)) {
        log_warn(s3_log(), "load %s: size mismatch (expected %" PRIu64 " bytes)", r->name,
                 r->dst_cap);
        job_fail(j, L2_ERR_IO);
    } else {
        job_fail(j, req_status(r));
    }
    job_dec(s, j);
}

static int s3_submit(struct l2_adapter *a, struct l2_task *t) {
    struct s3 *s = (struct s3 *)a;
    if (t->op != L2_OP_STORE && t->op != L2_OP_LOOKUP && t->op != L2_OP_LOAD) return L2_ERR_INVAL;
    if ((t->op != L2_OP_LOOKUP && !t->bufs) || (t->op == L2_OP_LOOKUP && !t->sizes))
        return L2_ERR_INVAL;
    struct s3_job *j = calloc(1, sizeof(*j) + t->n * sizeof(struct s3_req));
    struct s3_req **rs = calloc(t->n ? t->n : 1, sizeof(*rs));
    if (!j || !rs) {
        free(j);
        free(rs);
        return L2_ERR_NOMEM;
    }
    j->t = t;
    t->status = L2_OK;
    t->bytes = 0;
    memset(t->ok, 0, t->n);
    size_t nq = 0;
    int rc = L2_OK;
    for (size_t i = 0; i < t->n && rc == L2_OK; i++) {
        struct s3_req *r = &j->reqs[i];
        s3_done_fn fn = t->op == L2_OP_STORE  ? store_done
                        : t->op == L2_OP_LOAD ? load_done
                                              : lookup_done;
        enum s3_method m = t->op == L2_OP_STORE ? M_PUT : t->op == L2_OP_LOAD ? M_GET : M_HEAD;
        req_init(r, m, fn, j, i);
        if (keys_l2_name(&t->keys[i], r->name, sizeof(r->name)) < 0) {
            rc = L2_ERR_INVAL;
            break;
        }
        if (t->op == L2_OP_LOOKUP) { /* a known size answers without a HEAD */
            bool hit = false;
            pthread_mutex_lock(&s->map_mu);
            struct s3_ent *e = do_ent_find(s, r->name);
            if (e && e->known && !e->deleting) {
                e->locks++;
                t->sizes[i] = e->size;
                t->ok[i] = 1;
                hit = true;
            }
            pthread_mutex_unlock(&s->map_mu);
            if (hit) continue;
        } else if (t->op == L2_OP_STORE) {
            r->src = t->bufs[i].data;
            r->src_len = t->bufs[i].size;
        } else {
            r->dst = t->bufs[i].data;
            r->dst_cap = t->bufs[i].size;
        }
        if (!(r->url = object_url(s, r->name))) {
            rc = L2_ERR_NOMEM;
            break;
        }
        rs[nq++] = r;
    }
    if (rc == L2_OK) {
        atomic_store(&j->remaining, nq + 1);
        rc = enqueue(s, rs, nq);
    }
    if (rc != L2_OK) { /* not accepted: undo the lookup locks we took */
        if (t->op == L2_OP_LOOKUP) {
            pthread_mutex_lock(&s->map_mu);
            for (size_t i = 0; i < t->n; i++) {
                struct s3_ent *e = t->ok[i] ? do_ent_find(s, j->reqs[i].name) : NULL;
                if (e && e->locks) e->locks--;
                t->ok[i] = 0;
            }
            pthread_mutex_unlock(&s->map_mu);
        }
        for (size_t i = 0; i < t->n; i++) req_release(&j->reqs[i]);
        free(j);
        free(rs);
        return rc;
    }
    free(rs);
    job_dec(s, j); /* the guard: completes now if every key was answered from the cache */
    return L2_OK;
}

static void s3_unlock(struct l2_adapter *a, const struct keys_object_key *keys, size_t n) {
    struct s3 *s = (struct s3 *)a;
    char name[KEYS_L2_NAME_MAX];
    pthread_mutex_lock(&s->map_mu);
    for (size_t i = 0; i < n; i++) {
        if (keys_l2_name(&keys[i], name, sizeof(name)) < 0) continue;
        struct s3_ent *e = do_ent_find(s, name);
        if (e && e->locks) {
            e->locks--;
            do_ent_maybe_free(s, e);
        }
    }
    pthread_mutex_unlock(&s->map_mu);
}

/* ---- synchronous calls (delete, list) --------------------------------------------------------
 */

static void sync_dec(struct s3_sync *w) {
    pthread_mutex_lock(&w->mu);
    w->remaining--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

static void sync_wait(struct s3_sync *w) {
    pthread_mutex_lock(&w->mu);
    while (w->remaining) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

static int sync_init(struct s3_sync *w, size_t n) {
    w->remaining = n;
    if (pthread_mutex_init(&w->mu, NULL) != 0) return -1;
    if (pthread_cond_init(&w->cv, NULL) != 0) {
        pthread_mutex_destroy(&w->mu);
        return -1;
    }
    return 0;
}

static void sync_fini(struct s3_sync *w) {
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
}

struct s3_del {
    struct s3_sync w;
    const struct keys_object_key *keys;
    uint8_t *deleted;
    int status;
    struct s3_req reqs[];
};

static void delete_done(struct s3 *s, struct s3_req *r) {
    struct s3_del *d = r->owner;
    const struct keys_object_key *k = &d->keys[r->idx];
    if (r->phase == 0 && req_ok(r)) { /* HEAD found it: now DELETE it, remembering its size */
        r->size = r->content_length > 0 ? (uint64_t)r->content_length : 0;
        r->phase = 1;
        r->method = M_DELETE;
        r->started = false;
        r->cc = CURLE_OK;
        r->http = 0;
        sb_free(&r->body);
        r->next = s->pending_head; /* we are on the I/O thread */
        s->pending_head = r;
        if (!s->pending_tail) s->pending_tail = r;
        atomic_fetch_add(&s->queued, 1);
        return;
    }
    bool gone = r->phase == 1 && req_ok(r);
    bool absent = r->phase == 0 && r->cc == CURLE_OK && r->http == 404;
    pthread_mutex_lock(&s->map_mu);
    struct s3_ent *e = do_ent_find(s, r->name);
    if (e) {
        e->deleting = false;
        if (gone || absent) {
            if (gone) l2_adapter_notify_deleted(&s->base, k, e->known ? e->size : r->size);
            e->known = false;
            do_ent_maybe_free(s, e);
        }
    } else if (gone) {
        l2_adapter_notify_deleted(&s->base, k, r->size);
    }
    pthread_mutex_unlock(&s->map_mu);
    if (gone && d->deleted) d->deleted[r->idx] = 1;
    if (!gone && !absent && d->status == L2_OK) d->status = req_status(r);
    sync_dec(&d->w);
}

static int s3_delete_keys(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                          uint8_t *deleted, size_t *skipped) {
    struct s3 *s = (struct s3 *)a;
    if (deleted) memset(deleted, 0, n);
    if (skipped) *skipped = 0;
    if (n == 0) return L2_OK;
    struct s3_del *d = calloc(1, sizeof(*d) + n * sizeof(struct s3_req));
    struct s3_req **rs = calloc(n, sizeof(*rs));
    if (!d || !rs || sync_init(&d->w, 0) != 0) {
        free(d);
        free(rs);
        return L2_ERR_NOMEM;
    }
    d->keys = keys;
    d->deleted = deleted;
    size_t nq = 0, nskip = 0;
    int rc = L2_OK;
    for (size_t i = 0; i < n; i++) {
        struct s3_req *r = &d->reqs[i];
        req_init(r, M_HEAD, delete_done, d, i);
        if (keys_l2_name(&keys[i], r->name, sizeof(r->name)) < 0) {
            rc = L2_ERR_INVAL;
            continue;
        }
        pthread_mutex_lock(&s->map_mu);
        struct s3_ent *e = do_ent_get(s, r->name);
        bool skip = e && (e->locks > 0 || e->deleting);
        if (e && !skip) {
            e->deleting = true;
            if (e->known) { /* size known: skip the HEAD */
                r->phase = 1;
                r->method = M_DELETE;
                r->size = e->size;
            }
        }
        pthread_mutex_unlock(&s->map_mu);
        if (!e) {
            rc = L2_ERR_NOMEM;
            continue;
        }
        if (skip) {
            nskip++;
            continue;
        }
        if (!(r->url = object_url(s, r->name))) {
            pthread_mutex_lock(&s->map_mu);
            e = do_ent_find(s, r->name);
            if (e) {
                e->deleting = false;
                do_ent_maybe_free(s, e);
            }
            pthread_mutex_unlock(&s->map_mu);
            rc = L2_ERR_NOMEM;
            continue;
        }
        rs[nq++] = r;
    }
    if (nskip) {
        atomic_fetch_add(&s->base.c_delete_skipped, nskip);
        log_debug(s3_log(), "delete: %zu locked keys skipped", nskip);
    }
    if (skipped) *skipped = nskip;
    d->w.remaining = nq;
    int qrc = enqueue(s, rs, nq);
    if (qrc != L2_OK) {
        pthread_mutex_lock(&s->map_mu);
        for (size_t i = 0; i < nq; i++) {
            struct s3_ent *e = do_ent_find(s, rs[i]->name);
            if (e) {
                e->deleting = false;
                do_ent_maybe_free(s, e);
            }
        }
        pthread_mutex_unlock(&s->map_mu);
        d->w.remaining = 0;
        rc = qrc;
    }
    sync_wait(&d->w);
    if (rc == L2_OK) rc = d->status;
    size_t ndel = 0;
    for (size_t i = 0; deleted && i < n; i++) ndel += deleted[i];
    if (deleted) atomic_fetch_add(&s->base.c_deleted, ndel);
    for (size_t i = 0; i < n; i++) req_release(&d->reqs[i]);
    sync_fini(&d->w);
    free(d);
    free(rs);
    return rc;
}

static void list_done(struct s3 *s, struct s3_req *r) {
    (void)s;
    sync_dec(r->owner);
}

/* One ListObjectsV2 request. Returns L2_OK with the parsed page, or an error with a message. */
static int list_once(struct s3 *s, const char *prefix, const char *cont, size_t max_keys,
                     struct s3_xml_list *out, char *err, size_t errlen) {
    struct strbuf q = STRBUF_INIT;
    char enc[4 * L2_PAGE_TOKEN_MAX + 3 * (KEYS_MODEL_NAME_MAX + 1024) + 64];
    /* SigV4 wants the parameters sorted by name and RFC 3986-encoded; curl signs them as is. */
    sb_printf(&q, "%s%s?", s->base_url, s->virtual_host ? "/" : "");
    if (cont) {
        if (s3_uri_encode(cont, strlen(cont), false, enc, sizeof(enc)) < 0) {
            sb_free(&q);
            snprintf(err, errlen, "continuation token too long");
            return L2_ERR_BAD_TOKEN;
        }
        sb_printf(&q, "continuation-token=%s&", enc);
    }
    sb_printf(&q, "list-type=2&max-keys=%zu", max_keys);
    if (prefix[0]) {
        if (s3_uri_encode(prefix, strlen(prefix), false, enc, sizeof(enc)) < 0) {
            sb_free(&q);
            snprintf(err, errlen, "prefix too long");
            return L2_ERR_INVAL;
        }
        sb_printf(&q, "&prefix=%s", enc);
    }
    if (q.oom) {
        sb_free(&q);
        snprintf(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    struct s3_sync w;
    struct s3_req r;
    if (sync_init(&w, 1) != 0) {
        sb_free(&q);
        snprintf(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    req_init(&r, M_LIST, list_done, &w, 0);
    r.url = sb_detach(&q, NULL);
    struct s3_req *rp = &r;
    int rc = enqueue(s, &rp, 1);
    if (rc == L2_OK) sync_wait(&w);
    sync_fini(&w);
    if (rc != L2_OK) {
        snprintf(err, errlen, "adapter closed");
    } else if (req_ok(&r) && !r.overflow) {
        char xerr[160];
        if (s3_xml_parse_list(r.body.buf ? r.body.buf : "", r.body.len, out, xerr, sizeof(xerr)) !=
            0) {
            snprintf(err, errlen, "ListObjectsV2: unreadable answer: %s", xerr);
            rc = L2_ERR_IO;
        }
    } else if (r.rejected) {
        snprintf(err, errlen, "S3 unavailable (circuit breaker open): %s", s->endpoint);
        rc = L2_ERR_IO;
    } else if (r.cc != CURLE_OK) {
        snprintf(err, errlen, "ListObjectsV2 %s: %s", s->endpoint,
                 r.overflow ? "answer too large"
                            : (r.curl_err[0] ? r.curl_err : curl_easy_strerror(r.cc)));
        rc = r.closed ? L2_ERR_CLOSED : L2_ERR_IO;
    } else {
        char code[128], msg[256];
        s3_xml_parse_error(r.body.buf, r.body.len, code, sizeof(code), msg, sizeof(msg));
        snprintf(err, errlen, "ListObjectsV2 %s: HTTP %ld %s%s%s", s->endpoint, r.http, code,
                 msg[0] ? ": " : "", msg);
        /* S3 answers 400 InvalidArgument for a continuation token it cannot read */
        rc = cont && r.http == 400 ? L2_ERR_BAD_TOKEN : L2_ERR_IO;
    }
    req_release(&r);
    return rc;
}

static int s3_list(struct l2_adapter *a, const char *model_filter, size_t page_size,
                   const char *token, struct l2_list_page *out, char *err, size_t errlen) {
    struct s3 *s = (struct s3 *)a;
    memset(out, 0, sizeof(*out));
    char *cont = NULL;
    if (token && !(cont = s3_token_decode(token))) {
        snprintf(err, errlen, "malformed page token");
        return L2_ERR_BAD_TOKEN;
    }
    char prefix[S3_KEY_MAX + 2], mf[S3_KEY_MAX + 1] = "";
    if (model_filter && s3_key_escape(model_filter, mf, sizeof(mf)) < 0) {
        free(cont);
        snprintf(err, errlen, "model_name filter too long");
        return L2_ERR_INVAL;
    }
    snprintf(prefix, sizeof(prefix), "%s%s%s", s->prefix, mf, model_filter ? "@" : "");
    size_t plen = strlen(s->prefix);
    out->entries = calloc(page_size, sizeof(*out->entries));
    if (!out->entries) {
        free(cont);
        snprintf(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    int rc = L2_OK;
    /* Names that are not ours are skipped, so one S3 page may yield fewer entries than asked:
     * ask again (a bounded number of times) until the page is full or the listing ends. */
    for (int round = 0; round < S3_LIST_ROUNDS_MAX && out->count < page_size; round++) {
        struct s3_xml_list l;
        size_t want = page_size - out->count;
        rc = list_once(s, prefix, cont, want > 1000 ? 1000 : want, &l, err, errlen);
        if (rc != L2_OK) break;
        for (size_t i = 0; i < l.count && out->count < page_size; i++) {
            const char *key = l.items[i].key;
            char kerr[KEYS_ERR_MAX];
            if (strncmp(key, s->prefix, plen) != 0) continue;
            struct l2_list_entry *en = &out->entries[out->count];
            char name[KEYS_L2_NAME_MAX + 1];
            long nl = s3_key_unescape(key + plen, strlen(key + plen), name, sizeof(name));
            if (nl < 0 || keys_l2_name_parse(name, (size_t)nl, &en->key, kerr, sizeof(kerr)) != 0)
                continue;
            if (model_filter && strcmp(en->key.model_name, model_filter) != 0) continue;
            en->size = l.items[i].size;
            out->count++;
        }
        free(cont);
        cont = NULL;
        if (l.truncated && l.next_token) {
            cont = l.next_token;
            l.next_token = NULL;
        }
        s3_xml_list_free(&l);
        if (!cont) break;
    }
    if (rc == L2_OK && cont && !(out->next_token = s3_token_encode(cont))) {
        snprintf(err, errlen, "S3 continuation token too long for a page token");
        rc = L2_ERR_IO;
    }
    free(cont);
    if (rc != L2_OK) l2_list_page_free(out);
    return rc;
}

/* ---- I/O thread ----------------------------------------------------------------------------- */

static void pending_push(struct s3 *s, struct s3_req *r) {
    r->next = NULL;
    if (s->pending_tail)
        s->pending_tail->next = r;
    else
        s->pending_head = r;
    s->pending_tail = r;
}

static struct s3_req *pending_pop(struct s3 *s) {
    struct s3_req *r = s->pending_head;
    if (r) {
        s->pending_head = r->next;
        if (!s->pending_head) s->pending_tail = NULL;
        r->next = NULL;
    }
    return r;
}

static void probe_done(struct s3 *s, struct s3_req *r) {
    (void)r;
    s->probe_active = false;
    free(s->probe.url);
    s->probe.url = NULL;
    sb_free(&s->probe.body);
}

static void start_pending(struct s3 *s) {
    while (s->active < s->max_in_flight && s->pending_head) {
        struct s3_req *r = pending_pop(s);
        atomic_fetch_sub(&s->queued, 1);
        pthread_mutex_lock(&s->st_mu);
        bool allow = s3_breaker_allow(&s->br);
        pthread_mutex_unlock(&s->st_mu);
        if (!allow) {
            r->rejected = true;
            snprintf(r->curl_err, sizeof(r->curl_err), "circuit breaker open");
            req_finish(s, r);
            continue;
        }
        if (req_start(s, r) != 0) req_finish(s, r);
    }
}

static void maybe_probe(struct s3 *s) {
    if (s->probe_active) return;
    pthread_mutex_lock(&s->st_mu);
    bool due = s3_breaker_probe_due(&s->br, clock_mono_ns());
    pthread_mutex_unlock(&s->st_mu);
    if (!due) return;
    log_info(s3_log(), "circuit breaker half-open: probing %s", s->endpoint);
    req_init(&s->probe, M_PROBE, probe_done, NULL, 0);
    struct strbuf sb = STRBUF_INIT;
    sb_printf(&sb, "%s%s", s->base_url, s->virtual_host ? "/" : "");
    s->probe.url = sb_detach(&sb, NULL);
    s->probe_active = true;
    if (!s->probe.url || req_start(s, &s->probe) != 0) {
        s->probe.cc = CURLE_COULDNT_CONNECT; /* count it as failed, retry after the cooldown */
        req_finish(s, &s->probe);
    }
}

static void *io_main(void *arg) {
    struct s3 *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->q_mu);
        bool stop = s->stopping;
        struct s3_req *q = s->q_head;
        s->q_head = s->q_tail = NULL;
        pthread_mutex_unlock(&s->q_mu);
        while (q) {
            struct s3_req *next = q->next;
            pending_push(s, q);
            q = next;
        }
        if (stop) break;
        maybe_probe(s);
        start_pending(s);
        int running = 0;
        curl_multi_perform(s->multi, &running);
        CURLMsg *m;
        int left;
        while ((m = curl_multi_info_read(s->multi, &left))) {
            if (m->msg != CURLMSG_DONE) continue;
            struct s3_req *r = NULL;
            curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&r);
            CHECK(r != NULL);
            r->cc = m->data.result;
            req_finish(s, r);
        }
        start_pending(s);
        int timeout = s->pending_head && s->active < s->max_in_flight ? 0 : 100;
        curl_multi_poll(s->multi, NULL, 0, timeout, NULL);
    }
    /* Shutdown: every request still in the air completes with L2_ERR_CLOSED. */
    for (;;) {
        struct s3_req *r = pending_pop(s);
        if (!r) break;
        atomic_fetch_sub(&s->queued, 1);
        r->closed = true;
        req_finish(s, r);
    }
    while (s->active_head) {
        struct s3_req *r = s->active_head;
        r->closed = true;
        req_finish(s, r);
    }
    return NULL;
}

/* ---- status, destroy, create ---------------------------------------------------------------- */

static json_t *s3_status(struct l2_adapter *a) {
    struct s3 *s = (struct s3 *)a;
    json_t *o = json_object();
    if (!o) return NULL;
    pthread_mutex_lock(&s->st_mu);
    struct s3_breaker br = s->br;
    bool auth = s->auth_error;
    char last[S3_ERR_MAX];
    snprintf(last, sizeof(last), "%s", s->last_error);
    double last_at = s->last_error_at;
    uint64_t conn_fail = s->connection_failures, http_err = s->http_errors;
    pthread_mutex_unlock(&s->st_mu);
    pthread_mutex_lock(&s->map_mu);
    uint64_t nents = s->nents;
    pthread_mutex_unlock(&s->map_mu);
    struct l2_counters c;
    l2_adapter_counters(a, &c);
    json_object_set_new(o, "is_healthy", json_boolean(br.state == S3_BREAKER_CLOSED && !auth));
    json_object_set_new(o, "endpoint", json_string(s->endpoint));
    json_object_set_new(o, "bucket", json_string(s->bucket));
    json_object_set_new(o, "region", json_string(s->region));
    json_object_set_new(o, "addressing", json_string(s->virtual_host ? "virtual" : "path"));
    json_object_set_new(o, "prefix", json_string(s->prefix));
    json_object_set_new(o, "credentials", json_string(s->cred_source));
    json_object_set_new(o, "auth_error", json_boolean(auth));
    json_t *b = json_object();
    json_object_set_new(b, "state", json_string(s3_breaker_state_name(br.state)));
    json_object_set_new(b, "consecutive_failures", json_integer(br.failures));
    json_object_set_new(b, "threshold", json_integer(br.threshold));
    json_object_set_new(b, "opens", json_integer((json_int_t)br.opens));
    json_object_set_new(b, "cooldown_ms", json_integer((json_int_t)(br.cur_cooldown_ns / 1000000)));
    json_object_set_new(o, "circuit_breaker", b);
    json_object_set_new(o, "connection_failures", json_integer((json_int_t)conn_fail));
    json_object_set_new(o, "http_errors", json_integer((json_int_t)http_err));
    json_object_set_new(o, "in_flight_tasks", json_integer((json_int_t)c.in_flight));
    json_object_set_new(o, "queued_requests", json_integer(atomic_load(&s->queued)));
    json_object_set_new(o, "max_in_flight", json_integer(s->max_in_flight));
    json_object_set_new(o, "size_cache_entries", json_integer((json_int_t)nents));
    json_object_set_new(o, "last_error", last[0] ? json_string(last) : json_null());
    json_object_set_new(o, "last_error_at", last[0] ? json_real(last_at) : json_null());
    return o;
}

static void s3_free(struct s3 *s) {
    if (s->multi) curl_multi_cleanup(s->multi);
    for (long i = 0; i < s->npool; i++) curl_easy_cleanup(s->pool[i]);
    free(s->pool);
    if (s->ents) {
        for (size_t i = 0; i < S3_MAP_BUCKETS; i++) {
            struct s3_ent *e = s->ents[i];
            while (e) {
                struct s3_ent *next = e->next;
                free(e);
                e = next;
            }
        }
        free(s->ents);
    }
    free(s->endpoint);
    free(s->bucket);
    free(s->region);
    free(s->prefix);
    free(s->base_url);
    free(s->sigv4);
    free(s->akid);
    /* Credentials do not stay in freed memory. */
    if (s->secret) explicit_bzero(s->secret, strlen(s->secret));
    free(s->secret);
    if (s->token_hdr) explicit_bzero(s->token_hdr, strlen(s->token_hdr));
    free(s->token_hdr);
    pthread_mutex_destroy(&s->q_mu);
    pthread_mutex_destroy(&s->map_mu);
    pthread_mutex_destroy(&s->st_mu);
}

static void s3_destroy(struct l2_adapter *a) {
    struct s3 *s = (struct s3 *)a;
    if (s->thread_started) {
        pthread_mutex_lock(&s->q_mu);
        s->stopping = true;
        pthread_mutex_unlock(&s->q_mu);
        curl_multi_wakeup(s->multi);
        pthread_join(s->thread, NULL);
    }
    s3_free(s);
    l2_adapter_base_fini(a);
    free(s);
}

static const struct l2_adapter_ops s3_ops = {
    .type_name = S3_TYPE_NAME,
    .submit = s3_submit,
    .unlock = s3_unlock,
    .delete_keys = s3_delete_keys,
    .list = s3_list,
    .status = s3_status,
    .destroy = s3_destroy,
};

/* Optional string field: *out = strdup(value) or NULL when absent. */
static int cfg_str(const json_t *cfg, const char *field, char **out, char *err, size_t errlen) {
    *out = NULL;
    const json_t *v = json_object_get(cfg, field);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) {
        snprintf(err, errlen, "s3: \"%s\" must be a string", field);
        return -1;
    }
    if (!(*out = strdup(json_string_value(v)))) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    return 0;
}

static int cfg_int(const json_t *cfg, const char *field, long lo, long hi, long *out, char *err,
                   size_t errlen) {
    const json_t *v = json_object_get(cfg, field);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi) {
        snprintf(err, errlen, "s3: \"%s\" must be an integer in [%ld, %ld]", field, lo, hi);
        return -1;
    }
    *out = (long)json_integer_value(v);
    return 0;
}

static char *env_dup(const char *name) {
    const char *v = getenv(name);
    return v && v[0] ? strdup(v) : NULL;
}

static int s3_configure(struct s3 *s, const json_t *cfg, char *err, size_t errlen) {
    char *addressing = NULL, *akid = NULL, *secret = NULL, *token = NULL;
    int rc = -1;
    long threshold = 3, cooldown_ms = 1000, cooldown_max_ms = 30000;
    if (cfg_str(cfg, "bucket", &s->bucket, err, errlen) ||
        cfg_str(cfg, "endpoint", &s->endpoint, err, errlen) ||
        cfg_str(cfg, "region", &s->region, err, errlen) ||
        cfg_str(cfg, "prefix", &s->prefix, err, errlen) ||
        cfg_str(cfg, "addressing", &addressing, err, errlen) ||
        cfg_str(cfg, "access_key_id", &akid, err, errlen) ||
        cfg_str(cfg, "secret_access_key", &secret, err, errlen) ||
        cfg_str(cfg, "session_token", &token, err, errlen))
        goto out;
    s->max_in_flight = 64;
    s->connect_timeout_ms = 3000;
    s->request_timeout_ms = 30000;
    if (cfg_int(cfg, "max_in_flight", 1, 4096, &s->max_in_flight, err, errlen) ||
        cfg_int(cfg, "connect_timeout_ms", 1, 600000, &s->connect_timeout_ms, err, errlen) ||
        cfg_int(cfg, "request_timeout_ms", 1, 3600000, &s->request_timeout_ms, err, errlen) ||
        cfg_int(cfg, "breaker_threshold", 1, 1000000, &threshold, err, errlen) ||
        cfg_int(cfg, "breaker_cooldown_ms", 1, 3600000, &cooldown_ms, err, errlen) ||
        cfg_int(cfg, "breaker_cooldown_max_ms", 1, 3600000, &cooldown_max_ms, err, errlen))
        goto out;
    const json_t *sp = json_object_get(cfg, "sign_payload");
    if (sp && !json_is_boolean(sp)) {
        snprintf(err, errlen, "s3: \"sign_payload\" must be true or false");
        goto out;
    }
    s->sign_payload = !sp || json_is_true(sp);
    uint64_t cap = 0;
    if (l2_config_capacity(cfg, "max_capacity_gb", &cap, err, errlen) != L2_OK) goto out;
    s->base.capacity_bytes = cap;

    if (!s->bucket || !s->bucket[0]) {
        snprintf(err, errlen, "s3: \"bucket\" is required");
        goto out;
    }
    for (const char *c = s->bucket; *c; c++) {
        if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '-' || *c == '.' ||
              *c == '_')) {
            snprintf(err, errlen, "s3: bucket \"%s\" has a character S3 does not allow", s->bucket);
            goto out;
        }
    }
    if (!s->prefix && !(s->prefix = strdup(""))) goto oom;
    if (strlen(s->prefix) > 512) {
        snprintf(err, errlen, "s3: \"prefix\" is longer than 512 bytes");
        goto out;
    }
    if (!s->region && !(s->region = env_dup("AWS_REGION")) &&
        !(s->region = env_dup("AWS_DEFAULT_REGION")) && !(s->region = strdup("us-east-1")))
        goto oom;
    if (!s->region[0] || strpbrk(s->region, ":/ ")) {
        snprintf(err, errlen, "s3: region \"%s\" is not valid", s->region);
        goto out;
    }
    bool custom = s->endpoint != NULL;
    if (!custom) {
        struct strbuf sb = STRBUF_INIT;
        sb_printf(&sb, "https://s3.%s.amazonaws.com", s->region);
        if (sb.oom) goto oom;
        s->endpoint = sb_detach(&sb, NULL);
    }
    size_t el = strlen(s->endpoint);
    while (el > 0 && s->endpoint[el - 1] == '/') s->endpoint[--el] = '\0';
    const char *host = NULL;
    if (strncmp(s->endpoint, "http://", 7) == 0)
        host = s->endpoint + 7;
    else if (strncmp(s->endpoint, "https://", 8) == 0)
        host = s->endpoint + 8;
    if (!host || !host[0] || strpbrk(host, "?#@ ")) {
        snprintf(err, errlen, "s3: endpoint \"%s\" must be http://host[:port] or https://...",
                 s->endpoint);
        goto out;
    }
    if (!addressing)
        s->virtual_host = !custom;
    else if (strcmp(addressing, "path") == 0)
        s->virtual_host = false;
    else if (strcmp(addressing, "virtual") == 0)
        s->virtual_host = true;
    else {
        snprintf(err, errlen, "s3: \"addressing\" must be \"path\" or \"virtual\"");
        goto out;
    }
    struct strbuf sb = STRBUF_INIT;
    if (s->virtual_host)
        sb_printf(&sb, "%.*s%s.%s", (int)(host - s->endpoint), s->endpoint, s->bucket, host);
    else
        sb_printf(&sb, "%s/%s", s->endpoint, s->bucket);
    if (sb.oom) goto oom;
    s->base_url = sb_detach(&sb, NULL);
    sb_printf(&sb, "aws:amz:%s:s3", s->region);
    if (sb.oom) goto oom;
    s->sigv4 = sb_detach(&sb, NULL);

    if ((akid == NULL) != (secret == NULL)) {
        snprintf(err, errlen,
                 "s3: set both \"access_key_id\" and \"secret_access_key\", or "
                 "neither (then AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are used)");
        goto out;
    }
    if (akid) {
        s->cred_source = "config";
        s->akid = akid;
        s->secret = secret;
        akid = secret = NULL;
    } else {
        s->cred_source = "environment";
        s->akid = env_dup("AWS_ACCESS_KEY_ID");
        s->secret = env_dup("AWS_SECRET_ACCESS_KEY");
        if (!token) token = env_dup("AWS_SESSION_TOKEN");
        if (!s->akid || !s->secret) {
            snprintf(err, errlen,
                     "s3: no credentials: set \"access_key_id\" and "
                     "\"secret_access_key\", or AWS_ACCESS_KEY_ID and "
                     "AWS_SECRET_ACCESS_KEY");
            goto out;
        }
    }
    if (token && token[0]) {
        if (strpbrk(token, "\r\n")) {
            snprintf(err, errlen, "s3: \"session_token\" must be one line");
            goto out;
        }
        sb_printf(&sb, "x-amz-security-token: %s", token);
        if (sb.oom) goto oom;
        s->token_hdr = sb_detach(&sb, NULL);
    }
    s3_breaker_init(&s->br, (uint32_t)threshold, (uint64_t)cooldown_ms * 1000000u,
                    (uint64_t)cooldown_max_ms * 1000000u);
    rc = 0;
    goto out;
oom:
    snprintf(err, errlen, "out of memory");
out:
    free(addressing);
    free(akid);
    if (secret) explicit_bzero(secret, strlen(secret));
    free(secret);
    if (token) explicit_bzero(token, strlen(token));
    free(token);
    return rc;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

int s3_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen) {
    *out = NULL;
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc != CURLE_OK) {
        snprintf(err, errlen, "s3: curl_global_init: %s", curl_easy_strerror(curl_init_rc));
        return L2_ERR_IO;
    }
    struct s3 *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    int rc = l2_adapter_base_init(&s->base, &s3_ops, config, err, errlen);
    if (rc != L2_OK) {
        free(s);
        return rc;
    }
    if (pthread_mutex_init(&s->q_mu, NULL) != 0 || pthread_mutex_init(&s->map_mu, NULL) != 0 ||
        pthread_mutex_init(&s->st_mu, NULL) != 0) {
        snprintf(err, errlen, "pthread_mutex_init failed");
        l2_adapter_base_fini(&s->base);
        free(s);
        return L2_ERR_NOMEM;
    }
    rc = L2_ERR_INVAL;
    if (s3_configure(s, config, err, errlen) != 0) goto fail;
    rc = L2_ERR_NOMEM;
    s->ents = calloc(S3_MAP_BUCKETS, sizeof(*s->ents));
    s->pool = calloc((size_t)s->max_in_flight + 1, sizeof(*s->pool));
    s->multi = curl_multi_init();
    if (!s->ents || !s->pool || !s->multi) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    if (curl_multi_setopt(s->multi, CURLMOPT_MAXCONNECTS, s->max_in_flight) != CURLM_OK) {
        snprintf(err, errlen, "s3: curl_multi_setopt failed");
        goto fail;
    }
    int prc = pthread_create(&s->thread, NULL, io_main, s);
    if (prc != 0) {
        snprintf(err, errlen, "s3: pthread_create: %s", strerror(prc));
        rc = L2_ERR_IO;
        goto fail;
    }
    s->thread_started = true;
    log_info(s3_log(),
             "S3 adapter: %s bucket %s (%s-style, region %s, prefix \"%s\", %s credentials)",
             s->endpoint, s->bucket, s->virtual_host ? "virtual" : "path", s->region, s->prefix,
             s->cred_source);
    *out = &s->base;
    return L2_OK;
fail:
    s3_free(s);
    l2_adapter_base_fini(&s->base);
    free(s);
    return rc;
}
