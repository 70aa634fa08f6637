/* S3 transport: the I/O thread driving a libcurl multi handle (bounded requests in flight,
 * pooled easy handles), retries of 5xx answers, the circuit breaker and its probes, health
 * bookkeeping and the waits of synchronous callers. */
#include "server/l2/s3_internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/check.h"
#include "base/clock.h"
#include "base/log.h"
#include "server/l2/s3_xml.h"

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

/* ---- errors and requests ----------------------------------------------------------------------
 */

void s3_set_error(struct s3 *s, bool auth, const char *fmt, ...) {
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

void s3_req_init(struct s3_req *r, enum s3_method m, s3_done_fn done, void *owner, size_t idx) {
    memset(r, 0, sizeof(*r));
    r->method = m;
    r->done = done;
    r->owner = owner;
    r->idx = idx;
    r->content_length = -1;
}

void s3_req_release(struct s3_req *r) {
    free(r->url);
    r->url = NULL;
    sb_free(&r->body);
    curl_slist_free_all(r->hdrs);
    r->hdrs = NULL;
}

/* Queues requests for the I/O thread. Returns L2_OK or L2_ERR_CLOSED (nothing was queued). */
int s3_enqueue(struct s3 *s, struct s3_req **rs, size_t n) {
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

static int req_start(struct s3 *s, struct s3_req *r) {
    CURL *e = easy_get(s);
    if (!e) return -1;
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
    SETOPT(e, CURLOPT_CONNECTTIMEOUT_MS, s->connect_timeout_ms);
    SETOPT(e, CURLOPT_TIMEOUT_MS, s->request_timeout_ms);
    SETOPT(e, CURLOPT_HEADERFUNCTION, on_header);
    SETOPT(e, CURLOPT_HEADERDATA, r);
    SETOPT(e, CURLOPT_WRITEFUNCTION, r->method == M_GET ? on_write_dst : on_write_body);
    SETOPT(e, CURLOPT_WRITEDATA, r);
    switch (r->method) {
    case M_PUT:
        SETOPT(e, CURLOPT_UPLOAD, 1L);
        SETOPT(e, CURLOPT_READFUNCTION, on_read);
        SETOPT(e, CURLOPT_READDATA, r);
        SETOPT(e, CURLOPT_INFILESIZE_LARGE, (curl_off_t)r->src_len);
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
    if (s3_sign_request(s, e, r, &h) != 0) goto fail;
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
        s3_set_error(s, false, "%s %s: %s (%s)", s3_method_name(r->method), s->endpoint,
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
        s3_set_error(s, true,
                     "%s %s: HTTP %ld %s%s%s: S3 rejected the request; check access_key_id, "
                     "secret_access_key, session_token and region (%s)",
                     s3_method_name(r->method), s->endpoint, r->http, code[0] ? code : "Forbidden",
                     msg[0] ? ": " : "", msg, s->cred_source);
    } else if (r->http >= 500 || (r->http >= 400 && r->http != 404 && r->method != M_PROBE)) {
        char code[128], msg[256];
        s3_xml_parse_error(r->body.buf, r->body.len, code, sizeof(code), msg, sizeof(msg));
        s3_set_error(s, false, "%s %s: HTTP %ld %s%s%s", s3_method_name(r->method), r->url, r->http,
                     code, msg[0] ? ": " : "", msg);
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
        if (s3_enqueue(s, &one, 1) == L2_OK) {
            log_debug(s3_log(), "%s %s: HTTP %ld, retrying (%d of %d)", s3_method_name(r->method),
                      r->url, was, r->attempts, S3_RETRIES);
            return;
        }
        r->http = was; /* shutting down: report the failure */
    }
    req_account(s, r);
    r->done(s, r);
}

bool s3_req_ok(const struct s3_req *r) {
    return !r->rejected && !r->closed && r->cc == CURLE_OK && r->http >= 200 && r->http < 300;
}

/* The status to report for a request that did not succeed. */
int s3_req_status(const struct s3_req *r) {
    if (r->closed) return L2_ERR_CLOSED;
    if (r->cc == CURLE_OK && r->http == 404) return L2_ERR_NOT_FOUND;
    return L2_ERR_IO;
}

void s3_requeue_local(struct s3 *s, struct s3_req *r) {
    r->next = s->pending_head; /* we are on the I/O thread */
    s->pending_head = r;
    if (!s->pending_tail) s->pending_tail = r;
    atomic_fetch_add(&s->queued, 1);
}

/* ---- synchronous calls (delete, list) --------------------------------------------------------
 */

void s3_sync_dec(struct s3_sync *w) {
    pthread_mutex_lock(&w->mu);
    w->remaining--;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

void s3_sync_wait(struct s3_sync *w) {
    pthread_mutex_lock(&w->mu);
    while (w->remaining) pthread_cond_wait(&w->cv, &w->mu);
    pthread_mutex_unlock(&w->mu);
}

int s3_sync_init(struct s3_sync *w, size_t n) {
    w->remaining = n;
    if (pthread_mutex_init(&w->mu, NULL) != 0) return -1;
    if (pthread_cond_init(&w->cv, NULL) != 0) {
        pthread_mutex_destroy(&w->mu);
        return -1;
    }
    return 0;
}

void s3_sync_fini(struct s3_sync *w) {
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
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
    s3_req_init(&s->probe, M_PROBE, probe_done, NULL, 0);
    struct strbuf sb = STRBUF_INIT;
    sb_printf(&sb, "%s%s", s->base_url, s->virtual_host ? "/" : "");
    s->probe.url = sb_detach(&sb, NULL);
    s->probe_active = true;
    if (!s->probe.url || req_start(s, &s->probe) != 0) {
        s->probe.cc = CURLE_COULDNT_CONNECT; /* count it as failed, retry after the cooldown */
        req_finish(s, &s->probe);
    }
}

void *s3_io_main(void *arg) {
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
