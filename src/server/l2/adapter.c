/* The L2 adapter base: factory table, completion queue + eventfd, listener fan-out, byte
 * accounting (total and per cache_salt) and counters shared by every adapter type. */
#include "server/l2/adapter.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/errbuf.h"
#include "base/check.h"
#include "server/l2/dax.h"
#include "server/l2/fs.h"
#include "server/config.h"
#include "server/l2/s3.h"
#include "base/hash.h"

/* One row per adapter type. */
static const struct {
    const char *type;
    l2_adapter_factory create;
} factories[] = {
    {"fs", fs_adapter_create},
    {"s3", s3_adapter_create},
    {"dax", dax_adapter_create},
    {NULL, NULL}, /* sentinel */
};

const char *l2_strerror(int rc) {
    switch (rc) {
    case L2_OK:
        return "ok";
    case L2_ERR_INVAL:
        return "invalid argument";
    case L2_ERR_NOT_SUPPORTED:
        return "not supported by this adapter";
    case L2_ERR_BAD_TOKEN:
        return "malformed page token";
    case L2_ERR_NOSPC:
        return "no space left";
    case L2_ERR_IO:
        return "I/O error";
    case L2_ERR_NOMEM:
        return "out of memory";
    case L2_ERR_CLOSED:
        return "adapter closed";
    case L2_ERR_NOT_FOUND:
        return "not found";
    case L2_ERR_BUSY:
        return "busy";
    case L2_ERR_UNKNOWN_TYPE:
        return "unknown adapter type";
    default:
        return "unknown error";
    }
}

void l2_list_page_free(struct l2_list_page *p) {
    if (!p) return;
    free(p->entries);
    free(p->next_token);
    p->entries = NULL;
    p->next_token = NULL;
    p->count = 0;
}

/* ---- per-salt accounting ----------------------------------------------------------------------
 */

#define SALT_BUCKETS 256

struct salt_node {
    struct salt_node *next;
    uint64_t bytes, objects;
    char salt[KEYS_SALT_MAX + 1];
};

struct l2_salt_usage {
    struct salt_node *b[SALT_BUCKETS];
};

static unsigned salt_hash(const char *s) { return fnv1a32_str(s) % SALT_BUCKETS; }

/* Caller holds acct_mu. delta_bytes/delta_objects are signed; underflow clamps at 0. */
static void do_salt_add(struct l2_adapter *a, const char *salt, int64_t dbytes, int64_t dobj) {
    if (!a->salts) return;
    struct salt_node **pp = &a->salts->b[salt_hash(salt)];
    struct salt_node *n = *pp;
    while (n && strcmp(n->salt, salt) != 0) n = n->next;
    if (!n) {
        if (dbytes <= 0 && dobj <= 0) return;
        n = calloc(1, sizeof(*n));
        if (!n) return; /* accounting is best effort under OOM */
        snprintf(n->salt, sizeof(n->salt), "%s", salt);
        n->next = *pp;
        *pp = n;
    }
    n->bytes = dbytes < 0 && (uint64_t)(-dbytes) > n->bytes ? 0 : n->bytes + (uint64_t)dbytes;
    n->objects = dobj < 0 && (uint64_t)(-dobj) > n->objects ? 0 : n->objects + (uint64_t)dobj;
    if (n->objects == 0) {
        pp = &a->salts->b[salt_hash(salt)];
        while (*pp != n) pp = &(*pp)->next;
        *pp = n->next;
        free(n);
    }
}

/* ---- base ----------------------------------------------------------------------------------- */

int l2_adapter_base_init(struct l2_adapter *a, const struct l2_adapter_ops *ops,
                         const json_t *config, char *err, size_t errlen) {
    memset(a, 0, sizeof(*a));
    a->magic = L2_ADAPTER_MAGIC;
    a->ops = ops;
    a->index = -1;
    a->own_fd = -1;
    a->notify_fd = -1;
    a->salts = calloc(1, sizeof(*a->salts));
    if (!a->salts) {
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    a->own_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (a->own_fd < 0) {
        errbuf_set(err, errlen, "eventfd: %s", strerror(errno));
        free(a->salts);
        a->salts = NULL;
        return L2_ERR_IO;
    }
    a->notify_fd = a->own_fd;
    if (pthread_mutex_init(&a->cq_mu, NULL) != 0 || pthread_mutex_init(&a->acct_mu, NULL) != 0) {
        errbuf_set(err, errlen, "pthread_mutex_init failed");
        close(a->own_fd);
        free(a->salts);
        a->salts = NULL;
        return L2_ERR_NOMEM;
    }
    /* Kept for display only, so secrets are redacted here once (see config_redact). */
    a->config = config ? json_deep_copy(config) : json_object();
    config_redact(a->config);
    return L2_OK;
}

void l2_adapter_base_fini(struct l2_adapter *a) {
    if (!a || a->magic != L2_ADAPTER_MAGIC) return;
    if (a->salts) {
        for (size_t i = 0; i < SALT_BUCKETS; i++) {
            struct salt_node *n = a->salts->b[i];
            while (n) {
                struct salt_node *next = n->next;
                free(n);
                n = next;
            }
        }
        free(a->salts);
        a->salts = NULL;
    }
    if (a->own_fd >= 0) close(a->own_fd);
    a->own_fd = -1;
    pthread_mutex_destroy(&a->cq_mu);
    pthread_mutex_destroy(&a->acct_mu);
    json_decref(a->config);
    a->config = NULL;
    a->magic = 0;
}

static void signal_fd(int fd) {
    uint64_t one = 1;
    for (;;) {
        ssize_t w = write(fd, &one, sizeof(one));
        /* EAGAIN: the counter is saturated, a wakeup is pending anyway */
        if (w >= 0 || errno != EINTR) return;
    }
}

void l2_adapter_complete(struct l2_adapter *a, struct l2_task *t) {
    uint32_t nok = 0;
    for (size_t i = 0; i < t->n; i++) nok += t->ok[i] ? 1 : 0;
    t->nok = nok;
    size_t nfail = t->n - nok;
    switch (t->op) {
    case L2_OP_STORE:
        atomic_fetch_add_explicit(&a->c_store_ok, nok, memory_order_relaxed);
        atomic_fetch_add_explicit(&a->c_store_failed, nfail, memory_order_relaxed);
        atomic_fetch_add_explicit(&a->c_store_bytes, t->bytes, memory_order_relaxed);
        break;
    case L2_OP_LOOKUP:
        atomic_fetch_add_explicit(&a->c_lookup_hits, nok, memory_order_relaxed);
        atomic_fetch_add_explicit(&a->c_lookup_misses, nfail, memory_order_relaxed);
        break;
    case L2_OP_LOAD:
        atomic_fetch_add_explicit(&a->c_load_ok, nok, memory_order_relaxed);
        atomic_fetch_add_explicit(&a->c_load_failed, nfail, memory_order_relaxed);
        atomic_fetch_add_explicit(&a->c_load_bytes, t->bytes, memory_order_relaxed);
        break;
    }
    atomic_fetch_sub_explicit(&a->c_in_flight, 1, memory_order_relaxed);
    t->next = NULL;
    pthread_mutex_lock(&a->cq_mu);
    if (a->cq_tail)
        a->cq_tail->next = t;
    else
        a->cq_head = t;
    a->cq_tail = t;
    int fd = a->notify_fd;
    pthread_mutex_unlock(&a->cq_mu);
    signal_fd(fd);
}

static void fanout(struct l2_adapter *a, int kind, const struct keys_object_key *k, uint64_t size) {
    for (size_t i = 0; i < a->nlisteners; i++) {
        const struct l2_listener *l = &a->listeners[i];
        if (kind == 0 && l->on_stored) l->on_stored(l->arg, a->index, k, size);
        if (kind == 1 && l->on_accessed) l->on_accessed(l->arg, a->index, k);
        if (kind == 2 && l->on_deleted) l->on_deleted(l->arg, a->index, k, size);
    }
}

void l2_adapter_notify_stored(struct l2_adapter *a, const struct keys_object_key *k,
                              uint64_t size) {
    pthread_mutex_lock(&a->acct_mu);
    a->bytes_used += size;
    a->objects++;
    do_salt_add(a, k->cache_salt, (int64_t)size, 1);
    pthread_mutex_unlock(&a->acct_mu);
    fanout(a, 0, k, size);
}

void l2_adapter_notify_accessed(struct l2_adapter *a, const struct keys_object_key *k) {
    fanout(a, 1, k, 0);
}

void l2_adapter_notify_deleted(struct l2_adapter *a, const struct keys_object_key *k,
                               uint64_t size) {
    pthread_mutex_lock(&a->acct_mu);
    a->bytes_used = size > a->bytes_used ? 0 : a->bytes_used - size;
    a->objects = a->objects ? a->objects - 1 : 0;
    do_salt_add(a, k->cache_salt, -(int64_t)size, -1);
    pthread_mutex_unlock(&a->acct_mu);
    atomic_fetch_add_explicit(&a->c_deleted, 1, memory_order_relaxed);
    fanout(a, 2, k, size);
}

int l2_config_capacity(const json_t *config, const char *field, uint64_t *bytes, char *err,
                       size_t errlen) {
    *bytes = 0;
    json_t *v = json_object_get(config, field);
    if (!v || json_is_null(v)) return L2_OK;
    if (!json_is_number(v)) {
        errbuf_set(err, errlen, "\"%s\" must be a number", field);
        return L2_ERR_INVAL;
    }
    double gb = json_number_value(v);
    if (!isfinite(gb) || gb < 0 || gb > 1e9) {
        errbuf_set(err, errlen, "\"%s\" must be a finite non-negative number", field);
        return L2_ERR_INVAL;
    }
    *bytes = (uint64_t)(gb * 1024.0 * 1024.0 * 1024.0);
    return L2_OK;
}

/* ---- controller / engine side -----------------------------------------------------------------
 */

int l2_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen) {
    *out = NULL;
    if (!json_is_object(config)) {
        errbuf_set(err, errlen, "an L2 adapter config must be a JSON object");
        return L2_ERR_INVAL;
    }
    const char *type = json_string_value(json_object_get(config, "type"));
    if (!type) {
        errbuf_set(err, errlen, "an L2 adapter config needs a string \"type\"");
        return L2_ERR_INVAL;
    }
    for (size_t i = 0; factories[i].type; i++) {
        if (strcmp(factories[i].type, type) != 0) continue;
        int rc = factories[i].create(config, out, err, errlen);
        if (rc == L2_OK) CHECK(*out && (*out)->magic == L2_ADAPTER_MAGIC);
        return rc;
    }
    errbuf_set(err, errlen, "unknown L2 adapter type \"%s\"", type);
    return L2_ERR_UNKNOWN_TYPE;
}

void l2_adapter_destroy(struct l2_adapter *a) {
    if (!a) return;
    CHECK(a->magic == L2_ADAPTER_MAGIC);
    a->ops->destroy(a);
}

int l2_adapter_submit(struct l2_adapter *a, struct l2_task *t) {
    CHECK(a && a->magic == L2_ADAPTER_MAGIC);
    if (!t || (t->n && (!t->keys || !t->ok))) return L2_ERR_INVAL;
    if ((t->op == L2_OP_STORE || t->op == L2_OP_LOAD) && t->n && !t->bufs) return L2_ERR_INVAL;
    if (t->op == L2_OP_LOOKUP && t->n && !t->sizes) return L2_ERR_INVAL;
    if (t->op != L2_OP_STORE && t->op != L2_OP_LOOKUP && t->op != L2_OP_LOAD) return L2_ERR_INVAL;
    memset(t->ok, 0, t->n);
    t->status = L2_OK;
    t->bytes = 0;
    t->nok = 0;
    t->next = NULL;
    switch (t->op) {
    case L2_OP_STORE:
        atomic_fetch_add_explicit(&a->c_store_tasks, 1, memory_order_relaxed);
        break;
    case L2_OP_LOOKUP:
        atomic_fetch_add_explicit(&a->c_lookup_tasks, 1, memory_order_relaxed);
        break;
    case L2_OP_LOAD:
        atomic_fetch_add_explicit(&a->c_load_tasks, 1, memory_order_relaxed);
        break;
    }
    atomic_fetch_add_explicit(&a->c_in_flight, 1, memory_order_relaxed);
    int rc = a->ops->submit(a, t);
    if (rc != L2_OK) atomic_fetch_sub_explicit(&a->c_in_flight, 1, memory_order_relaxed);
    return rc;
}

struct l2_task *l2_adapter_drain(struct l2_adapter *a) {
    if (a->notify_fd == a->own_fd) {
        uint64_t v;
        while (read(a->own_fd, &v, sizeof(v)) < 0 && errno == EINTR) {
        }
    }
    pthread_mutex_lock(&a->cq_mu);
    struct l2_task *h = a->cq_head;
    a->cq_head = a->cq_tail = NULL;
    pthread_mutex_unlock(&a->cq_mu);
    return h;
}

int l2_adapter_add_listener(struct l2_adapter *a, const struct l2_listener *l) {
    if (a->nlisteners >= L2_MAX_LISTENERS) return L2_ERR_BUSY;
    a->listeners[a->nlisteners++] = *l;
    return L2_OK;
}

void l2_adapter_set_notify_fd(struct l2_adapter *a, int fd) {
    pthread_mutex_lock(&a->cq_mu);
    a->notify_fd = fd >= 0 ? fd : a->own_fd;
    pthread_mutex_unlock(&a->cq_mu);
}

int l2_adapter_event_fd(const struct l2_adapter *a) { return a->notify_fd; }

int l2_adapter_run(struct l2_adapter *a, struct l2_task *t) {
    int rc = l2_adapter_submit(a, t);
    if (rc != L2_OK) return rc;
    for (;;) {
        struct pollfd p = {.fd = a->own_fd, .events = POLLIN};
        pthread_mutex_lock(&a->cq_mu);
        int have = a->cq_head != NULL;
        pthread_mutex_unlock(&a->cq_mu);
        if (!have && poll(&p, 1, 100) < 0 && errno != EINTR) return L2_ERR_IO;
        /* Tasks of other waiters are put back at once (holding them would deadlock two
         * waiters that drained each other's task). */
        struct l2_task *others = NULL, *others_tail = NULL;
        int done = 0;
        for (struct l2_task *c = l2_adapter_drain(a), *next; c; c = next) {
            next = c->next;
            c->next = NULL;
            if (c == t) {
                done = 1;
                continue;
            }
            if (others_tail)
                others_tail->next = c;
            else
                others = c;
            others_tail = c;
        }
        if (others) {
            pthread_mutex_lock(&a->cq_mu);
            others_tail->next = a->cq_head;
            a->cq_head = others;
            if (!a->cq_tail) a->cq_tail = others_tail;
            pthread_mutex_unlock(&a->cq_mu);
            signal_fd(a->notify_fd);
        }
        if (done) return t->status;
        if (others) sched_yield();
    }
}

int l2_adapter_unlock(struct l2_adapter *a, const struct keys_object_key *keys, size_t n) {
    if (n) a->ops->unlock(a, keys, n);
    return L2_OK;
}

int l2_adapter_delete(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                      uint8_t *deleted, size_t *skipped) {
    size_t sk = 0;
    if (deleted) memset(deleted, 0, n);
    int rc = n ? a->ops->delete_keys(a, keys, n, deleted, &sk) : L2_OK;
    atomic_fetch_add_explicit(&a->c_delete_skipped, sk, memory_order_relaxed);
    if (skipped) *skipped = sk;
    return rc;
}

int l2_adapter_list(struct l2_adapter *a, const char *model_filter, size_t page_size,
                    const char *token, struct l2_list_page *out, char *err, size_t errlen) {
    memset(out, 0, sizeof(*out));
    if (!a->ops->list) {
        errbuf_set(err, errlen, "adapter %s does not support listing", a->ops->type_name);
        return L2_ERR_NOT_SUPPORTED;
    }
    if (page_size < 1 || page_size > L2_PAGE_SIZE_MAX) {
        errbuf_set(err, errlen, "page_size must be in [1, %d]", L2_PAGE_SIZE_MAX);
        return L2_ERR_INVAL;
    }
    return a->ops->list(a, model_filter, page_size, token, out, err, errlen);
}

void l2_adapter_usage(struct l2_adapter *a, struct l2_usage *out) {
    pthread_mutex_lock(&a->acct_mu);
    out->bytes_used = a->bytes_used;
    out->objects = a->objects;
    out->capacity_bytes = a->capacity_bytes;
    pthread_mutex_unlock(&a->acct_mu);
}

uint64_t l2_adapter_salt_bytes(struct l2_adapter *a, const char *salt) {
    uint64_t b = 0;
    pthread_mutex_lock(&a->acct_mu);
    if (a->salts) {
        for (struct salt_node *n = a->salts->b[salt_hash(salt)]; n; n = n->next)
            if (strcmp(n->salt, salt) == 0) b = n->bytes;
    }
    pthread_mutex_unlock(&a->acct_mu);
    return b;
}

void l2_adapter_salt_foreach(struct l2_adapter *a,
                             void (*fn)(const char *salt, uint64_t bytes, uint64_t objects,
                                        void *arg),
                             void *arg) {
    pthread_mutex_lock(&a->acct_mu);
    if (a->salts)
        for (size_t i = 0; i < SALT_BUCKETS; i++)
            for (struct salt_node *n = a->salts->b[i]; n; n = n->next)
                fn(n->salt, n->bytes, n->objects, arg);
    pthread_mutex_unlock(&a->acct_mu);
}

void l2_adapter_counters(struct l2_adapter *a, struct l2_counters *o) {
#define LD(x) atomic_load_explicit(&a->x, memory_order_relaxed)
    o->store_tasks = LD(c_store_tasks);
    o->store_keys_ok = LD(c_store_ok);
    o->store_keys_failed = LD(c_store_failed);
    o->store_bytes = LD(c_store_bytes);
    o->lookup_tasks = LD(c_lookup_tasks);
    o->lookup_hits = LD(c_lookup_hits);
    o->lookup_misses = LD(c_lookup_misses);
    o->load_tasks = LD(c_load_tasks);
    o->load_keys_ok = LD(c_load_ok);
    o->load_keys_failed = LD(c_load_failed);
    o->load_bytes = LD(c_load_bytes);
    o->deleted_keys = LD(c_deleted);
    o->delete_skipped_locked = LD(c_delete_skipped);
    o->in_flight = LD(c_in_flight);
#undef LD
}

json_t *l2_adapter_status(struct l2_adapter *a) {
    json_t *s = a->ops->status ? a->ops->status(a) : NULL;
    if (!s) s = json_object();
    if (!json_object_get(s, "is_healthy")) json_object_set_new(s, "is_healthy", json_true());
    json_object_set_new(s, "type", json_string(a->ops->type_name));
    json_object_set_new(s, "index", json_integer(a->index));
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    json_t *uj = json_object();
    json_object_set_new(uj, "bytes_used", json_integer((json_int_t)u.bytes_used));
    json_object_set_new(uj, "objects", json_integer((json_int_t)u.objects));
    json_object_set_new(uj, "capacity_bytes", json_integer((json_int_t)u.capacity_bytes));
    json_object_set_new(s, "usage", uj);
    struct l2_counters c;
    l2_adapter_counters(a, &c);
    json_t *cj = json_object();
#define F(x) json_object_set_new(cj, #x, json_integer((json_int_t)c.x))
    F(store_tasks);
    F(store_keys_ok);
    F(store_keys_failed);
    F(store_bytes);
    F(lookup_tasks);
    F(lookup_hits);
    F(lookup_misses);
    F(load_tasks);
    F(load_keys_ok);
    F(load_keys_failed);
    F(load_bytes);
    F(deleted_keys);
    F(delete_skipped_locked);
    F(in_flight);
#undef F
    json_object_set_new(s, "counters", cj);
    config_redact(s); /* an adapter's status must never show a credential */
    return s;
}
