/* The "s3" L2 adapter: every KV object is one S3 object named by keys_l2_name() (DESIGN §5).
 * This file holds the adapter itself: tasks, the size cache, delete, status, create and destroy.
 * Beside it: s3_transport.c (I/O thread, retries, breaker), s3_sign.c (SigV4, keys and URLs),
 * s3_list.c (ListObjectsV2, page tokens), s3_config.c (config and credentials), s3_xml.c.
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
#include "server/l2/s3_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/hash.h"
#include "base/log.h"

struct logger *s3_log(void) {
    static struct logger *lg;
    if (!lg) lg = log_get("lmcache.l2.s3");
    return lg;
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

/* ---- tasks ---------------------------------------------------------------------------------- */

static void job_dec(struct s3 *s, struct s3_job *j) {
    if (atomic_fetch_sub(&j->remaining, 1) != 1) return;
    struct l2_task *t = j->t;
    t->status = j->status;
    for (size_t i = 0; i < t->n; i++) s3_req_release(&j->reqs[i]);
    free(j);
    l2_adapter_complete(&s->base, t);
}

static void job_fail(struct s3_job *j, int status) {
    if (j->status == L2_OK) j->status = status;
}

static void store_done(struct s3 *s, struct s3_req *r) {
    struct s3_job *j = r->owner;
    struct l2_task *t = j->t;
    if (s3_req_ok(r)) {
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
        job_fail(j, s3_req_status(r) == L2_ERR_NOT_FOUND ? L2_ERR_IO : s3_req_status(r));
    }
    job_dec(s, j);
}

static void lookup_done(struct s3 *s, struct s3_req *r) {
    struct s3_job *j = r->owner;
    struct l2_task *t = j->t;
    const struct keys_object_key *k = &t->keys[r->idx];
    bool found = s3_req_ok(r) && r->content_length > 0;
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
        job_fail(j, s3_req_status(r));
    job_dec(s, j);
}

static void load_done(struct s3 *s, struct s3_req *r) {
    struct s3_job *j = r->owner;
    struct l2_task *t = j->t;
    const struct keys_object_key *k = &t->keys[r->idx];
    if (s3_req_ok(r) && !r->overflow && r->dst_len == r->dst_cap) {
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
    } else if (r->overflow || (s3_req_ok(r) && r->dst_len != r->dst_cap)) {
        log_warn(s3_log(), "load %s: size mismatch (expected %" PRIu64 " bytes)", r->name,
                 r->dst_cap);
        job_fail(j, L2_ERR_IO);
    } else {
        job_fail(j, s3_req_status(r));
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
        s3_req_init(r, m, fn, j, i);
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
        if (!(r->url = s3_object_url(s, r->name))) {
            rc = L2_ERR_NOMEM;
            break;
        }
        rs[nq++] = r;
    }
    if (rc == L2_OK) {
        atomic_store(&j->remaining, nq + 1);
        rc = s3_enqueue(s, rs, nq);
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
        for (size_t i = 0; i < t->n; i++) s3_req_release(&j->reqs[i]);
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

/* ---- delete ---------------------------------------------------------------------------------- */

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
    if (r->phase == 0 && s3_req_ok(r)) { /* HEAD found it: now DELETE it, remembering its size */
        r->size = r->content_length > 0 ? (uint64_t)r->content_length : 0;
        r->phase = 1;
        r->method = M_DELETE;
        r->started = false;
        r->cc = CURLE_OK;
        r->http = 0;
        sb_free(&r->body);
        s3_requeue_local(s, r); /* we are on the I/O thread */
        return;
    }
    bool gone = r->phase == 1 && s3_req_ok(r);
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
    if (!gone && !absent && d->status == L2_OK) d->status = s3_req_status(r);
    s3_sync_dec(&d->w);
}

static int s3_delete_keys(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                          uint8_t *deleted, size_t *skipped) {
    struct s3 *s = (struct s3 *)a;
    if (deleted) memset(deleted, 0, n);
    if (skipped) *skipped = 0;
    if (n == 0) return L2_OK;
    struct s3_del *d = calloc(1, sizeof(*d) + n * sizeof(struct s3_req));
    struct s3_req **rs = calloc(n, sizeof(*rs));
    if (!d || !rs || s3_sync_init(&d->w, 0) != 0) {
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
        s3_req_init(r, M_HEAD, delete_done, d, i);
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
        if (!(r->url = s3_object_url(s, r->name))) {
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
    int qrc = s3_enqueue(s, rs, nq);
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
    s3_sync_wait(&d->w);
    if (rc == L2_OK) rc = d->status;
    size_t ndel = 0;
    for (size_t i = 0; deleted && i < n; i++) ndel += deleted[i];
    if (deleted) atomic_fetch_add(&s->base.c_deleted, ndel);
    for (size_t i = 0; i < n; i++) s3_req_release(&d->reqs[i]);
    s3_sync_fini(&d->w);
    free(d);
    free(rs);
    return rc;
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

void s3_free(struct s3 *s) {
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

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc;
static void curl_init(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

int s3_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen) {
    *out = NULL;
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc != CURLE_OK) {
        errbuf_set(err, errlen, "s3: curl_global_init: %s", curl_easy_strerror(curl_init_rc));
        return L2_ERR_IO;
    }
    struct s3 *s = calloc(1, sizeof(*s));
    if (!s) {
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    int rc = l2_adapter_base_init(&s->base, &s3_ops, config, err, errlen);
    if (rc != L2_OK) {
        free(s);
        return rc;
    }
    if (pthread_mutex_init(&s->q_mu, NULL) != 0 || pthread_mutex_init(&s->map_mu, NULL) != 0 ||
        pthread_mutex_init(&s->st_mu, NULL) != 0) {
        errbuf_set(err, errlen, "pthread_mutex_init failed");
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
        errbuf_set(err, errlen, "out of memory");
        goto fail;
    }
    if (curl_multi_setopt(s->multi, CURLMOPT_MAXCONNECTS, s->max_in_flight) != CURLM_OK) {
        errbuf_set(err, errlen, "s3: curl_multi_setopt failed");
        goto fail;
    }
    int prc = pthread_create(&s->thread, NULL, s3_io_main, s);
    if (prc != 0) {
        errbuf_set(err, errlen, "s3: pthread_create: %s", strerror(prc));
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
