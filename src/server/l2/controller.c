/* The storage controller: write-through store queue, prefetch state machine (lookup -> plan ->
 * load -> finalize), per-adapter eviction trackers. See controller.h. */
#include "server/l2/controller.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"

#define MAX_STORE_BATCHES 4 /* store batches in flight at once */
#define EVICT_MAX_VICTIMS 4096

enum { KIND_STORE = 1, KIND_PREFETCH = 2 };
enum { EV_NONE = 0, EV_LRU = 1, EV_ISOLATED = 2 };

/* ---- eviction tracker -------------------------------------------------------------------------
 */

struct ev_node {
    struct ev_node *hnext, *prev, *next;
    struct ev_list *list;
    uint64_t size;
    uint32_t h;
    struct keys_object_key key;
    char name[KEYS_L2_NAME_MAX];
};

struct ev_list {
    struct ev_node head; /* sentinel: head.next = LRU end, head.prev = MRU end */
    uint64_t bytes, objects;
    struct ev_list *snext; /* IsolatedLRU: next salt list */
    char salt[KEYS_SALT_MAX + 1];
};

struct evictor {
    int policy;
    double watermark, ratio;
    pthread_mutex_t mu;
    struct ev_node **b;
    size_t nb, count;
    struct ev_list global;
    struct ev_list *salts;
};

static void list_init(struct ev_list *l) {
    memset(l, 0, sizeof(*l));
    l->head.next = l->head.prev = &l->head;
}

static uint32_t str_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

static void do_unlink(struct ev_node *n) {
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->list->bytes -= n->size;
    n->list->objects--;
}

static void do_push_mru(struct ev_list *l, struct ev_node *n) {
    n->list = l;
    n->prev = l->head.prev;
    n->next = &l->head;
    l->head.prev->next = n;
    l->head.prev = n;
    l->bytes += n->size;
    l->objects++;
}

static struct ev_node *do_ev_find(struct evictor *ev, const char *name, uint32_t h) {
    for (struct ev_node *n = ev->b[h & (ev->nb - 1)]; n; n = n->hnext)
        if (n->h == h && strcmp(n->name, name) == 0) return n;
    return NULL;
}

static struct ev_list *do_list_for(struct evictor *ev, const char *salt) {
    if (ev->policy != EV_ISOLATED) return &ev->global;
    for (struct ev_list *l = ev->salts; l; l = l->snext)
        if (strcmp(l->salt, salt) == 0) return l;
    struct ev_list *l = malloc(sizeof(*l));
    if (!l) return NULL;
    list_init(l);
    snprintf(l->salt, sizeof(l->salt), "%s", salt);
    l->snext = ev->salts;
    ev->salts = l;
    return l;
}

static void ev_on_stored(void *arg, int idx, const struct keys_object_key *k, uint64_t size) {
    struct evictor *ev = arg;
    char name[KEYS_L2_NAME_MAX];
    if (keys_l2_name(k, name, sizeof(name)) < 0) return;
    uint32_t h = str_hash(name);
    pthread_mutex_lock(&ev->mu);
    struct ev_node *n = do_ev_find(ev, name, h);
    if (n) {
        do_unlink(n);
        n->size = size;
        do_push_mru(n->list, n);
    } else {
        struct ev_list *l = do_list_for(ev, k->cache_salt);
        n = l ? malloc(sizeof(*n)) : NULL;
        if (n) {
            n->size = size;
            n->h = h;
            n->key = *k;
            memcpy(n->name, name, strlen(name) + 1);
            if (ev->count >= ev->nb) {
                size_t nb = ev->nb * 2;
                struct ev_node **b = calloc(nb, sizeof(*b));
                if (b) {
                    for (size_t i = 0; i < ev->nb; i++)
                        for (struct ev_node *x = ev->b[i], *nx; x; x = nx) {
                            nx = x->hnext;
                            x->hnext = b[x->h & (nb - 1)];
                            b[x->h & (nb - 1)] = x;
                        }
                    free(ev->b);
                    ev->b = b;
                    ev->nb = nb;
                }
            }
            n->hnext = ev->b[h & (ev->nb - 1)];
            ev->b[h & (ev->nb - 1)] = n;
            ev->count++;
            do_push_mru(l, n);
        }
    }
    pthread_mutex_unlock(&ev->mu);
    (void)idx;
}

static void ev_touch_name(struct evictor *ev, const char *name) {
    uint32_t h = str_hash(name);
    pthread_mutex_lock(&ev->mu);
    struct ev_node *n = do_ev_find(ev, name, h);
    if (n) {
        struct ev_list *l = n->list;
        do_unlink(n);
        do_push_mru(l, n);
    }
    pthread_mutex_unlock(&ev->mu);
}

static void ev_on_accessed(void *arg, int idx, const struct keys_object_key *k) {
    char name[KEYS_L2_NAME_MAX];
    if (keys_l2_name(k, name, sizeof(name)) >= 0) ev_touch_name(arg, name);
    (void)idx;
}

static void ev_on_deleted(void *arg, int idx, const struct keys_object_key *k, uint64_t size) {
    struct evictor *ev = arg;
    char name[KEYS_L2_NAME_MAX];
    if (keys_l2_name(k, name, sizeof(name)) < 0) return;
    uint32_t h = str_hash(name);
    pthread_mutex_lock(&ev->mu);
    struct ev_node **pp = &ev->b[h & (ev->nb - 1)];
    while (*pp && !((*pp)->h == h && strcmp((*pp)->name, name) == 0)) pp = &(*pp)->hnext;
    struct ev_node *n = *pp;
    if (n) {
        *pp = n->hnext;
        do_unlink(n);
        ev->count--;
        free(n);
    }
    pthread_mutex_unlock(&ev->mu);
    (void)idx;
    (void)size;
}

static void ev_free(struct evictor *ev) {
    if (!ev) return;
    for (size_t i = 0; i < ev->nb; i++)
        for (struct ev_node *n = ev->b[i], *nx; n; n = nx) {
            nx = n->hnext;
            free(n);
        }
    for (struct ev_list *l = ev->salts, *nx; l; l = nx) {
        nx = l->snext;
        free(l);
    }
    free(ev->b);
    pthread_mutex_destroy(&ev->mu);
    free(ev);
}

static int ev_parse(const json_t *cfg, struct evictor **out, char *err, size_t errlen) {
    *out = NULL;
    json_t *e = json_object_get(cfg, "eviction");
    if (!e || json_is_null(e)) return L2_OK;
    if (!json_is_object(e)) {
        snprintf(err, errlen, "\"eviction\" must be an object");
        return L2_ERR_INVAL;
    }
    const char *pol = json_string_value(json_object_get(e, "eviction_policy"));
    int policy = EV_LRU;
    if (pol && strcmp(pol, "LRU") == 0)
        policy = EV_LRU;
    else if (pol && strcmp(pol, "IsolatedLRU") == 0)
        policy = EV_ISOLATED;
    else if (pol && strcmp(pol, "noop") == 0)
        return L2_OK;
    else if (pol || json_object_get(e, "eviction_policy")) {
        snprintf(err, errlen, "\"eviction_policy\" must be LRU, IsolatedLRU or noop");
        return L2_ERR_INVAL;
    }
    double wm = 0.8, ratio = 0.2;
    json_t *v = json_object_get(e, "trigger_watermark");
    if (v) wm = json_is_number(v) ? json_number_value(v) : -1;
    json_t *r = json_object_get(e, "eviction_ratio");
    if (r) ratio = json_is_number(r) ? json_number_value(r) : -1;
    if (!(wm > 0 && wm <= 1) || !(ratio >= 0 && ratio <= 1)) {
        snprintf(err, errlen,
                 "\"trigger_watermark\" must be in (0, 1], \"eviction_ratio\" in [0, 1]");
        return L2_ERR_INVAL;
    }
    struct evictor *ev = calloc(1, sizeof(*ev));
    if (ev) ev->b = calloc(1024, sizeof(*ev->b));
    if (!ev || !ev->b) {
        free(ev);
        snprintf(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    ev->nb = 1024;
    ev->policy = policy;
    ev->watermark = wm;
    ev->ratio = ratio;
    pthread_mutex_init(&ev->mu, NULL);
    list_init(&ev->global);
    *out = ev;
    return L2_OK;
}

/* ---- requests ---------------------------------------------------------------------------------
 */

struct store_item {
    struct keys_object_key key;
    struct l1_key l1key;
};

struct store_batch {
    int kind;
    size_t n;
    struct keys_object_key *keys;
    struct l1_key *l1keys;
    struct l2_buf *bufs;
    uint8_t *oks; /* nad * n */
    struct l2_task *tasks;
    size_t pending;
};

enum { PF_QUEUED, PF_LOOKUP, PF_LOAD, PF_DONE };
enum { S_NONE = 0, S_LOADING = 1, S_RESIDENT = 2, S_LOADED = 3 };

struct pf_req {
    int kind;
    struct pf_req *next;  /* submission queue */
    struct pf_req *rnext; /* results list (requests without a callback) */
    uint64_t id;
    int phase;
    bool published; /* under r_mu */
    size_t n;
    struct keys_object_key *keys;
    struct l1_key *l1keys;
    enum l2ctl_trim trim;
    uint32_t read_locks;
    bool temporary;
    l2ctl_prefetch_cb cb;
    void *cb_arg;
    size_t pending;
    struct l2_task *tasks; /* nad lookup tasks, then nad load tasks */
    uint8_t *lk_ok;        /* nad * n */
    uint64_t *lk_sizes;    /* nad * n */
    int *src;              /* n */
    uint8_t *state;        /* n */
    struct l1_ref *refs;   /* n */
    struct keys_object_key *ld_keys;
    struct l2_buf *ld_bufs;
    uint8_t *ld_ok;
    size_t *ld_idx;
    uint8_t *ready;
    size_t found, prefix, l1_oom;
};

struct l2ctl {
    struct l2ctl_config cfg;
    struct logger *lg;
    size_t nad, nslots;
    struct l2_adapter **ad;
    struct evictor **ev;
    int done_fd, sub_fd;
    pthread_t thread;
    bool started;
    /* queue */
    pthread_mutex_t q_mu;
    struct store_item *sq;
    size_t sq_head, sq_len, sq_cap;
    struct pf_req *pf_head, *pf_tail;
    bool stopping;
    uint64_t next_id;
    /* finished prefetches awaiting a poll */
    pthread_mutex_t r_mu;
    struct pf_req *results;
    struct pf_req *last_polled;
    /* controller-thread state */
    size_t store_batches, pf_active;
    /* stats */
    _Atomic uint64_t s_submitted, s_dropped, s_req_done, s_obj_done, s_obj_failed, s_bytes,
        s_skip_l1, p_req, p_done, p_lookup, p_found, l_ok, l_failed, l_bytes, p_oom, p_nf,
        g_store_inflight, g_pf_active, g_pf_queued, g_results, e_obj, e_bytes, e_ticks, e_skipped;
};

#define ADD(f, v) atomic_fetch_add_explicit(&c->f, (v), memory_order_relaxed)

static void pf_free(struct pf_req *r) {
    if (!r) return;
    free(r->keys);
    free(r->l1keys);
    free(r->tasks);
    free(r->lk_ok);
    free(r->lk_sizes);
    free(r->src);
    free(r->state);
    free(r->refs);
    free(r->ld_keys);
    free(r->ld_bufs);
    free(r->ld_ok);
    free(r->ld_idx);
    free(r->ready);
    free(r);
}

static void signal_fd(int fd) {
    uint64_t one = 1;
    while (write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
}

/* ---- write-through ----------------------------------------------------------------------------
 */

size_t l2ctl_store(struct l2ctl *c, const struct keys_object_key *keys, const struct l1_key *l1keys,
                   size_t n) {
    if (!c->nad || !n) return 0;
    size_t took = 0;
    pthread_mutex_lock(&c->q_mu);
    for (size_t i = 0; i < n && !c->stopping; i++) {
        if (c->sq_len >= c->cfg.store_queue_max) break;
        if (c->sq_len == c->sq_cap) {
            size_t ncap = c->sq_cap ? c->sq_cap * 2 : 256;
            if (ncap > c->cfg.store_queue_max) ncap = c->cfg.store_queue_max;
            struct store_item *nq = malloc(ncap * sizeof(*nq));
            if (!nq) break;
            for (size_t j = 0; j < c->sq_len; j++) nq[j] = c->sq[(c->sq_head + j) % c->sq_cap];
            free(c->sq);
            c->sq = nq;
            c->sq_cap = ncap;
            c->sq_head = 0;
        }
        struct store_item *it = &c->sq[(c->sq_head + c->sq_len) % c->sq_cap];
        it->key = keys[i];
        it->l1key = l1keys[i];
        c->sq_len++;
        took++;
    }
    pthread_mutex_unlock(&c->q_mu);
    ADD(s_submitted, took);
    ADD(s_dropped, n - took);
    if (took) signal_fd(c->sub_fd);
    return took;
}

static void store_batch_free(struct store_batch *b) {
    free(b->keys);
    free(b->l1keys);
    free(b->bufs);
    free(b->oks);
    free(b->tasks);
    free(b);
}

/* Controller thread: takes up to store_batch queued objects, read-locks them in L1 and submits
 * one store task per adapter. */
static void store_start(struct l2ctl *c) {
    size_t max = c->cfg.store_batch;
    struct store_batch *b = calloc(1, sizeof(*b));
    if (!b) return;
    b->kind = KIND_STORE;
    b->keys = calloc(max, sizeof(*b->keys));
    b->l1keys = calloc(max, sizeof(*b->l1keys));
    b->bufs = calloc(max, sizeof(*b->bufs));
    b->oks = calloc(max * c->nad, 1);
    b->tasks = calloc(c->nad, sizeof(*b->tasks));
    if (!b->keys || !b->l1keys || !b->bufs || !b->oks || !b->tasks) {
        store_batch_free(b);
        return;
    }
    uint64_t now = clock_mono_ns();
    size_t dropped = 0;
    while (b->n < max) {
        struct store_item it;
        pthread_mutex_lock(&c->q_mu);
        bool have = c->sq_len > 0;
        if (have) {
            it = c->sq[c->sq_head];
            c->sq_head = (c->sq_head + 1) % c->sq_cap;
            c->sq_len--;
        }
        pthread_mutex_unlock(&c->q_mu);
        if (!have) break;
        struct l1_ref ref;
        if (l1_reserve_read(c->cfg.l1, &it.l1key, 1, now, &ref) != L1_OK) {
            dropped++; /* evicted or deleted before its turn */
            continue;
        }
        b->keys[b->n] = it.key;
        b->l1keys[b->n] = it.l1key;
        b->bufs[b->n] = (struct l2_buf){ref.data, ref.size};
        b->n++;
    }
    ADD(s_dropped, dropped);
    if (!b->n) {
        store_batch_free(b);
        return;
    }
    c->store_batches++;
    b->pending = c->nad;
    for (size_t a = 0; a < c->nad; a++) {
        struct l2_task *t = &b->tasks[a];
        *t = (struct l2_task){.op = L2_OP_STORE,
                              .n = b->n,
                              .keys = b->keys,
                              .bufs = b->bufs,
                              .ok = b->oks + a * max,
                              .user = b};
        ADD(g_store_inflight, 1);
        if (l2_adapter_submit(c->ad[a], t) != L2_OK) {
            ADD(g_store_inflight, -1);
            t->status = L2_ERR_IO;
            b->pending--;
        }
    }
    if (b->pending) return;
    /* no adapter accepted the batch */
    c->store_batches--;
    for (size_t i = 0; i < b->n; i++) l1_finish_read(c->cfg.l1, &b->l1keys[i], 1, now);
    ADD(s_obj_failed, b->n);
    store_batch_free(b);
}

static void store_task_done(struct l2ctl *c, struct store_batch *b, struct l2_task *t) {
    (void)t;
    ADD(g_store_inflight, -1);
    if (--b->pending) return;
    c->store_batches--;
    uint64_t now = clock_mono_ns();
    size_t max = c->cfg.store_batch;
    size_t ok_all = 0, failed = 0;
    for (size_t i = 0; i < b->n; i++) {
        bool all = true;
        for (size_t a = 0; a < c->nad; a++) {
            if (b->oks[a * max + i]) {
                ADD(s_bytes, b->bufs[i].size);
            } else {
                all = false;
                failed++;
            }
        }
        l1_finish_read(c->cfg.l1, &b->l1keys[i], 1, now);
        if (all) ok_all++;
        if (all && c->cfg.store_policy == L2CTL_STORE_SKIP_L1 &&
            l1_delete(c->cfg.l1, &b->l1keys[i], false, now) == L1_OK)
            ADD(s_skip_l1, 1);
    }
    ADD(s_req_done, 1);
    ADD(s_obj_done, ok_all);
    ADD(s_obj_failed, failed);
    store_batch_free(b);
}

/* ---- prefetch ---------------------------------------------------------------------------------
 */

int l2ctl_prefetch_submit(struct l2ctl *c, const struct keys_object_key *keys,
                          const struct l1_key *l1keys, size_t n, enum l2ctl_trim trim,
                          uint32_t read_locks, bool temporary, l2ctl_prefetch_cb cb, void *cb_arg,
                          uint64_t *id) {
    if (!c->nad) return L2_ERR_NOT_FOUND;
    struct pf_req *r = calloc(1, sizeof(*r));
    if (!r) return L2_ERR_NOMEM;
    size_t m = n ? n : 1;
    r->kind = KIND_PREFETCH;
    r->n = n;
    r->trim = trim;
    r->read_locks = read_locks > 65535 ? 65535 : read_locks;
    r->temporary = temporary;
    r->cb = cb;
    r->cb_arg = cb_arg;
    r->keys = malloc(m * sizeof(*r->keys));
    r->l1keys = malloc(m * sizeof(*r->l1keys));
    r->tasks = calloc(2 * c->nad, sizeof(*r->tasks));
    r->lk_ok = calloc(m * c->nad, 1);
    r->lk_sizes = calloc(m * c->nad, sizeof(*r->lk_sizes));
    r->src = malloc(m * sizeof(*r->src));
    r->state = calloc(m, 1);
    r->refs = calloc(m, sizeof(*r->refs));
    r->ld_keys = malloc(m * sizeof(*r->ld_keys));
    r->ld_bufs = calloc(m, sizeof(*r->ld_bufs));
    r->ld_ok = calloc(m, 1);
    r->ld_idx = calloc(m, sizeof(*r->ld_idx));
    r->ready = calloc(m, 1);
    if (!r->keys || !r->l1keys || !r->tasks || !r->lk_ok || !r->lk_sizes || !r->src || !r->state ||
        !r->refs || !r->ld_keys || !r->ld_bufs || !r->ld_ok || !r->ld_idx || !r->ready) {
        pf_free(r);
        return L2_ERR_NOMEM;
    }
    if (n) {
        memcpy(r->keys, keys, n * sizeof(*keys));
        memcpy(r->l1keys, l1keys, n * sizeof(*l1keys));
    }
    pthread_mutex_lock(&c->q_mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->q_mu);
        pf_free(r);
        return L2_ERR_CLOSED;
    }
    /* r belongs to the controller thread once it is queued (a callback request is freed as soon
     * as it finishes), so the id is read here, under the lock */
    uint64_t rid = r->id = ++c->next_id;
    if (!cb) {
        pthread_mutex_lock(&c->r_mu);
        r->rnext = c->results;
        c->results = r;
        pthread_mutex_unlock(&c->r_mu);
    }
    if (c->pf_tail)
        c->pf_tail->next = r;
    else
        c->pf_head = r;
    c->pf_tail = r;
    pthread_mutex_unlock(&c->q_mu);
    *id = rid;
    ADD(p_req, 1);
    ADD(g_pf_queued, 1);
    signal_fd(c->sub_fd);
    return L2_OK;
}

/* Publishes a finished request: callback, or the results list for polling. */
static void pf_publish(struct l2ctl *c, struct pf_req *r) {
    r->phase = PF_DONE;
    ADD(p_done, 1);
    if (r->cb) {
        struct l2ctl_prefetch_result res = {.id = r->id,
                                            .total = r->n,
                                            .found = r->found,
                                            .prefix = r->prefix,
                                            .l1_oom = r->l1_oom,
                                            .ready = r->ready};
        r->cb(r->cb_arg, &res);
        pf_free(r);
        return;
    }
    /* Results nobody polls must not pile up: past L2CTL_MAX_UNREAD finished ones, the oldest
     * (the list is newest first) are dropped and their ids answer "unknown". */
    struct pf_req *dropped = NULL;
    size_t seen = 0;
    pthread_mutex_lock(&c->r_mu);
    r->published = true;
    for (struct pf_req **pp = &c->results; *pp;) {
        struct pf_req *x = *pp;
        if (x->published && ++seen > L2CTL_MAX_UNREAD) {
            *pp = x->rnext;
            x->rnext = dropped;
            dropped = x;
        } else {
            pp = &x->rnext;
        }
    }
    pthread_mutex_unlock(&c->r_mu);
    ADD(g_results, 1);
    while (dropped) {
        struct pf_req *n = dropped->rnext;
        pf_free(dropped);
        ADD(g_results, -1);
        dropped = n;
    }
}

int l2ctl_prefetch_poll(struct l2ctl *c, uint64_t id, struct l2ctl_prefetch_result *out) {
    pthread_mutex_lock(&c->r_mu);
    struct pf_req **pp = &c->results;
    while (*pp && (*pp)->id != id) pp = &(*pp)->rnext;
    struct pf_req *r = *pp;
    int rc = !r ? L2_ERR_NOT_FOUND : r->published ? L2_OK : L2_ERR_BUSY;
    if (rc == L2_OK) {
        *pp = r->rnext;
        pf_free(c->last_polled);
        c->last_polled = r;
        *out = (struct l2ctl_prefetch_result){.id = r->id,
                                              .total = r->n,
                                              .found = r->found,
                                              .prefix = r->prefix,
                                              .l1_oom = r->l1_oom,
                                              .ready = r->ready};
    }
    pthread_mutex_unlock(&c->r_mu);
    if (rc == L2_OK) ADD(g_results, -1);
    return rc;
}

static void pf_finalize(struct l2ctl *c, struct pf_req *r);
static void pf_plan(struct l2ctl *c, struct pf_req *r);

static void pf_lookup_start(struct l2ctl *c, struct pf_req *r) {
    r->phase = PF_LOOKUP;
    c->pf_active++;
    ADD(g_pf_active, 1);
    ADD(g_pf_queued, -1);
    ADD(p_lookup, r->n);
    r->pending = c->nad;
    for (size_t a = 0; a < c->nad; a++) {
        struct l2_task *t = &r->tasks[a];
        *t = (struct l2_task){.op = L2_OP_LOOKUP,
                              .n = r->n,
                              .keys = r->keys,
                              .ok = r->lk_ok + a * r->n,
                              .sizes = r->lk_sizes + a * r->n,
                              .user = r};
        if (l2_adapter_submit(c->ad[a], t) != L2_OK) r->pending--; /* all misses there */
    }
    if (r->pending == 0) pf_plan(c, r);
}

/* All lookups are back: choose a source per key, reserve L1 space, submit loads. */
static void pf_plan(struct l2ctl *c, struct pf_req *r) {
    uint64_t now = clock_mono_ns();
    size_t n = r->n;
    bool cut = false;
    for (size_t i = 0; i < n; i++) {
        r->src[i] = -1;
        for (size_t a = 0; a < c->nad; a++)
            if (r->lk_ok[a * n + i]) {
                r->src[i] = (int)a;
                break;
            }
        /* release the locks of every adapter but the source */
        for (size_t a = 0; a < c->nad; a++)
            if (r->lk_ok[a * n + i] && (int)a != r->src[i])
                l2_adapter_unlock(c->ad[a], &r->keys[i], 1);
        if (cut) {
            if (r->src[i] >= 0) l2_adapter_unlock(c->ad[r->src[i]], &r->keys[i], 1);
            r->src[i] = -1;
            continue;
        }
        if (r->src[i] < 0) {
            /* not in L2; under PREFIX it may have reached L1 meanwhile */
            if (r->trim == L2CTL_TRIM_PREFIX) {
                int rc = r->read_locks
                             ? l1_reserve_read(c->cfg.l1, &r->l1keys[i], r->read_locks, now, NULL)
                             : l1_touch(c->cfg.l1, &r->l1keys[i], now);
                if (rc == L1_OK)
                    r->state[i] = S_RESIDENT;
                else
                    cut = true;
            }
            if (!r->state[i]) ADD(p_nf, 1);
            continue;
        }
        ADD(p_found, 1);
        uint64_t size = r->lk_sizes[r->src[i] * n + i];
        int rc = l1_reserve_write(c->cfg.l1, &r->l1keys[i], size, r->temporary, now, &r->refs[i]);
        if (rc == L1_OK) {
            r->state[i] = S_LOADING;
            continue;
        }
        l2_adapter_unlock(c->ad[r->src[i]], &r->keys[i], 1);
        r->src[i] = -1;
        if (rc == L1_EXISTS && r->trim == L2CTL_TRIM_PREFIX) {
            int rr = r->read_locks
                         ? l1_reserve_read(c->cfg.l1, &r->l1keys[i], r->read_locks, now, NULL)
                         : L1_OK;
            if (rr == L1_OK) {
                r->state[i] = S_RESIDENT;
                continue;
            }
        }
        if (rc == L1_EXISTS && r->trim == L2CTL_TRIM_SPARSE) continue; /* not counted */
        if (rc == L1_ERR_NOMEM) {
            r->l1_oom++;
            ADD(p_oom, 1);
        }
        if (r->trim == L2CTL_TRIM_PREFIX) cut = true;
    }
    /* group the loads by source adapter */
    size_t k = 0;
    r->pending = 0;
    for (size_t a = 0; a < c->nad; a++) {
        size_t start = k;
        for (size_t i = 0; i < n; i++) {
            if (r->state[i] != S_LOADING || r->src[i] != (int)a) continue;
            r->ld_keys[k] = r->keys[i];
            r->ld_bufs[k] = (struct l2_buf){r->refs[i].data, r->refs[i].size};
            r->ld_idx[k] = i;
            k++;
        }
        if (k == start) continue;
        struct l2_task *t = &r->tasks[c->nad + a];
        *t = (struct l2_task){.op = L2_OP_LOAD,
                              .n = k - start,
                              .keys = r->ld_keys + start,
                              .bufs = r->ld_bufs + start,
                              .ok = r->ld_ok + start,
                              .user = r};
        r->pending++;
        if (l2_adapter_submit(c->ad[a], t) != L2_OK) {
            r->pending--;
            memset(r->ld_ok + start, 0, k - start);
        }
    }
    r->phase = PF_LOAD;
    if (r->pending == 0) pf_finalize(c, r);
}

/* Loads are back: publish loaded objects in L1, release adapter locks, compute the result. */
static void pf_finalize(struct l2ctl *c, struct pf_req *r) {
    uint64_t now = clock_mono_ns();
    size_t n = r->n;
    for (size_t k = 0; k < n; k++) {
        if (!r->ld_bufs[k].data) continue;
        size_t i = r->ld_idx[k];
        if (r->state[i] != S_LOADING) continue;
        l2_adapter_unlock(c->ad[r->src[i]], &r->keys[i], 1);
        if (r->ld_ok[k]) {
            ADD(l_ok, 1);
            ADD(l_bytes, r->refs[i].size);
            if (l1_finish_write(c->cfg.l1, &r->l1keys[i], r->refs[i].token, r->read_locks, now) ==
                L1_OK)
                r->state[i] = S_LOADED;
            else
                r->state[i] = S_NONE;
        } else {
            ADD(l_failed, 1);
            l1_abort_write(c->cfg.l1, &r->l1keys[i], r->refs[i].token);
            r->state[i] = S_NONE;
        }
    }
    /* keys whose load was never submitted (submit failure) */
    for (size_t i = 0; i < n; i++) {
        if (r->state[i] != S_LOADING) continue;
        l2_adapter_unlock(c->ad[r->src[i]], &r->keys[i], 1);
        l1_abort_write(c->cfg.l1, &r->l1keys[i], r->refs[i].token);
        r->state[i] = S_NONE;
    }
    if (r->trim == L2CTL_TRIM_PREFIX) {
        size_t p = 0;
        while (p < n && r->state[p] != S_NONE) p++;
        r->prefix = p;
        for (size_t i = 0; i < n; i++) {
            if (i < p) {
                r->ready[i] = 1;
                if (r->state[i] == S_LOADED) r->found++;
                continue;
            }
            /* beyond the prefix nobody will read it: give back the locks taken for it */
            if (r->state[i] == S_LOADED || r->state[i] == S_RESIDENT)
                l1_finish_read(c->cfg.l1, &r->l1keys[i], r->read_locks, now);
        }
    } else {
        for (size_t i = 0; i < n; i++) {
            r->ready[i] = r->state[i] == S_LOADED;
            r->found += r->ready[i];
        }
        size_t p = 0;
        while (p < n && r->ready[p]) p++;
        r->prefix = p;
    }
    c->pf_active--;
    ADD(g_pf_active, -1);
    pf_publish(c, r);
}

static void pf_task_done(struct l2ctl *c, struct pf_req *r) {
    if (--r->pending) return;
    if (r->phase == PF_LOOKUP)
        pf_plan(c, r);
    else
        pf_finalize(c, r);
}

/* ---- the controller thread --------------------------------------------------------------------
 */

static void *ctl_main(void *arg) {
    struct l2ctl *c = arg;
    struct pf_req *waiting = NULL, *waiting_tail = NULL;
    for (;;) {
        struct pollfd p[2] = {{.fd = c->sub_fd, .events = POLLIN},
                              {.fd = c->done_fd, .events = POLLIN}};
        if (poll(p, 2, 1000) < 0 && errno != EINTR) log_error(c->lg, "poll: %s", strerror(errno));
        uint64_t v;
        while (read(c->sub_fd, &v, sizeof(v)) < 0 && errno == EINTR) {
        }
        while (read(c->done_fd, &v, sizeof(v)) < 0 && errno == EINTR) {
        }
        for (size_t a = 0; a < c->nad; a++) {
            for (struct l2_task *t = l2_adapter_drain(c->ad[a]), *next; t; t = next) {
                next = t->next;
                int kind = *(int *)t->user;
                if (kind == KIND_STORE)
                    store_task_done(c, t->user, t);
                else
                    pf_task_done(c, t->user);
            }
        }
        pthread_mutex_lock(&c->q_mu);
        if (c->pf_head) {
            if (waiting_tail)
                waiting_tail->next = c->pf_head;
            else
                waiting = c->pf_head;
            waiting_tail = c->pf_tail;
            c->pf_head = c->pf_tail = NULL;
        }
        bool stopping = c->stopping;
        size_t sq = c->sq_len;
        pthread_mutex_unlock(&c->q_mu);
        while (waiting && c->pf_active < c->cfg.prefetch_max_in_flight) {
            struct pf_req *r = waiting;
            waiting = r->next;
            if (!waiting) waiting_tail = NULL;
            r->next = NULL;
            if (stopping) {
                ADD(g_pf_queued, -1);
                pf_publish(c, r);
                continue;
            }
            pf_lookup_start(c, r);
        }
        while (!stopping && sq > 0 && c->store_batches < MAX_STORE_BATCHES) {
            store_start(c);
            pthread_mutex_lock(&c->q_mu);
            sq = c->sq_len;
            pthread_mutex_unlock(&c->q_mu);
        }
        if (stopping && sq) {
            pthread_mutex_lock(&c->q_mu);
            ADD(s_dropped, c->sq_len);
            c->sq_len = 0;
            pthread_mutex_unlock(&c->q_mu);
        }
        if (stopping && !waiting && c->pf_active == 0 && c->store_batches == 0) break;
    }
    return NULL;
}

/* ---- lifecycle --------------------------------------------------------------------------------
 */

int l2ctl_create(const struct l2ctl_config *cfg, const json_t *adapter_configs, struct l2ctl **out,
                 char *err, size_t errlen) {
    *out = NULL;
    if (!cfg->l1) {
        snprintf(err, errlen, "the storage controller needs L1");
        return L2_ERR_INVAL;
    }
    if (adapter_configs && !json_is_array(adapter_configs)) {
        snprintf(err, errlen, "L2 adapter configs must be a JSON array");
        return L2_ERR_INVAL;
    }
    struct l2ctl *c = calloc(1, sizeof(*c));
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    c->cfg = *cfg;
    if (!c->cfg.prefetch_max_in_flight) c->cfg.prefetch_max_in_flight = 8;
    if (!c->cfg.store_queue_max) c->cfg.store_queue_max = 65536;
    if (!c->cfg.store_batch) c->cfg.store_batch = 32;
    c->lg = log_get("lmcache.l2");
    c->sub_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->done_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_init(&c->q_mu, NULL);
    pthread_mutex_init(&c->r_mu, NULL);
    size_t n = adapter_configs ? json_array_size(adapter_configs) : 0;
    c->ad = calloc(n ? n : 1, sizeof(*c->ad));
    c->ev = calloc(n ? n : 1, sizeof(*c->ev));
    c->nslots = c->ev ? n : 0;
    if (c->sub_fd < 0 || c->done_fd < 0 || !c->ad || !c->ev) {
        snprintf(err, errlen, "out of memory or file descriptors");
        l2ctl_destroy(c);
        return L2_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *ac = json_array_get(adapter_configs, i);
        char aerr[256];
        int rc = ev_parse(ac, &c->ev[i], aerr, sizeof(aerr));
        if (rc == L2_OK) rc = l2_adapter_create(ac, &c->ad[i], aerr, sizeof(aerr));
        if (rc != L2_OK) {
            snprintf(err, errlen, "L2 adapter %zu: %s", i, aerr);
            l2ctl_destroy(c);
            return rc;
        }
        c->nad++;
        struct l2_adapter *a = c->ad[i];
        a->index = (int)i;
        l2_adapter_set_notify_fd(a, c->done_fd);
        if (c->ev[i]) {
            struct l2_listener l = {ev_on_stored, ev_on_accessed, ev_on_deleted, c->ev[i]};
            l2_adapter_add_listener(a, &l);
            /* objects found on disk at start (fs rescan) join the tracker in listing order */
            struct l2_usage u;
            l2_adapter_usage(a, &u);
            char *tok = NULL;
            while (u.objects && l2_adapter_can_list(a)) {
                struct l2_list_page pg;
                if (l2_adapter_list(a, NULL, L2_PAGE_SIZE_MAX, tok, &pg, aerr, sizeof(aerr)) !=
                    L2_OK)
                    break;
                free(tok);
                tok = pg.next_token ? strdup(pg.next_token) : NULL;
                for (size_t k = 0; k < pg.count; k++)
                    ev_on_stored(c->ev[i], (int)i, &pg.entries[k].key, pg.entries[k].size);
                l2_list_page_free(&pg);
                if (!tok) break;
            }
            free(tok);
        }
    }
    *out = c;
    return L2_OK;
}

int l2ctl_start(struct l2ctl *c, char *err, size_t errlen) {
    int e = pthread_create(&c->thread, NULL, ctl_main, c);
    if (e != 0) {
        snprintf(err, errlen, "pthread_create: %s", strerror(e));
        return L2_ERR_NOMEM;
    }
    pthread_setname_np(c->thread, "l2-controller");
    c->started = true;
    return L2_OK;
}

void l2ctl_destroy(struct l2ctl *c) {
    if (!c) return;
    pthread_mutex_lock(&c->q_mu);
    c->stopping = true;
    pthread_mutex_unlock(&c->q_mu);
    if (c->started) {
        signal_fd(c->sub_fd);
        pthread_join(c->thread, NULL);
    }
    /* never started: queued prefetches still publish (callbacks fire) */
    for (struct pf_req *r = c->pf_head, *nx; r; r = nx) {
        nx = r->next;
        pf_publish(c, r);
    }
    c->pf_head = c->pf_tail = NULL;
    for (size_t i = 0; i < c->nad; i++) l2_adapter_destroy(c->ad[i]);
    for (size_t i = 0; c->ev && i < c->nslots; i++) ev_free(c->ev[i]);
    for (struct pf_req *r = c->results, *nx; r; r = nx) {
        nx = r->rnext;
        pf_free(r);
    }
    pf_free(c->last_polled);
    free(c->ad);
    free(c->ev);
    free(c->sq);
    if (c->sub_fd >= 0) close(c->sub_fd);
    if (c->done_fd >= 0) close(c->done_fd);
    pthread_mutex_destroy(&c->q_mu);
    pthread_mutex_destroy(&c->r_mu);
    free(c);
}

size_t l2ctl_adapter_count(const struct l2ctl *c) { return c->nad; }
struct l2_adapter *l2ctl_adapter(struct l2ctl *c, size_t i) {
    return i < c->nad ? c->ad[i] : NULL;
}

int l2ctl_find_adapter(struct l2ctl *c, const char *name) {
    if (!c->nad) return -1;
    if (!name || !*name) return 0;
    for (size_t i = 0; i < c->nad; i++)
        if (strcmp(l2_adapter_type_name(c->ad[i]), name) == 0) return (int)i;
    return -1;
}

int l2ctl_delete(struct l2ctl *c, int index, const struct keys_object_key *keys, size_t n,
                 uint8_t *deleted, size_t *skipped) {
    if (index < 0 || (size_t)index >= c->nad) return L2_ERR_NOT_FOUND;
    return l2_adapter_delete(c->ad[index], keys, n, deleted, skipped);
}

uint64_t l2ctl_salt_usage_bytes(struct l2ctl *c, const char *salt) {
    uint64_t b = 0;
    for (size_t i = 0; i < c->nad; i++) b += l2_adapter_salt_bytes(c->ad[i], salt);
    return b;
}

uint64_t l2ctl_usage_bytes(struct l2ctl *c) {
    uint64_t b = 0;
    for (size_t i = 0; i < c->nad; i++) {
        struct l2_usage u;
        l2_adapter_usage(c->ad[i], &u);
        b += u.bytes_used;
    }
    return b;
}

/* ---- eviction ---------------------------------------------------------------------------------
 */

/* Copies up to max keys from l's LRU end until `need` bytes are covered. Caller holds ev->mu. */
static size_t do_pick(struct ev_list *l, uint64_t need, struct keys_object_key *out, size_t max) {
    size_t k = 0;
    uint64_t got = 0;
    for (struct ev_node *n = l->head.next; n != &l->head && got < need && k < max; n = n->next) {
        out[k++] = n->key;
        got += n->size;
    }
    return k;
}

static void evict_adapter(struct l2ctl *c, size_t a, struct l2ctl_tick_report *rep) {
    struct evictor *ev = c->ev[a];
    struct keys_object_key *victims = malloc(EVICT_MAX_VICTIMS * sizeof(*victims));
    uint8_t *del = malloc(EVICT_MAX_VICTIMS);
    if (!victims || !del) {
        free(victims);
        free(del);
        return;
    }
    size_t nv = 0;
    struct l2_usage u;
    l2_adapter_usage(c->ad[a], &u);
    pthread_mutex_lock(&ev->mu);
    if (ev->policy == EV_LRU) {
        double cap = (double)u.capacity_bytes;
        if (cap > 0 && (double)u.bytes_used >= ev->watermark * cap) {
            double target = cap * ev->watermark * (1.0 - ev->ratio);
            uint64_t need = (uint64_t)ceil((double)u.bytes_used - target);
            nv = do_pick(&ev->global, need, victims, EVICT_MAX_VICTIMS);
        }
    } else {
        for (struct ev_list *l = ev->salts; l && nv < EVICT_MAX_VICTIMS; l = l->snext) {
            if (!l->bytes) continue;
            uint64_t limit = 0;
            if (c->cfg.quota) quota_get(c->cfg.quota, l->salt, &limit);
            if ((double)l->bytes < ev->watermark * (double)limit) continue;
            double target = limit ? (double)limit * ev->watermark * (1.0 - ev->ratio) : 0;
            uint64_t need = (uint64_t)ceil((double)l->bytes - target);
            nv += do_pick(l, need, victims + nv, EVICT_MAX_VICTIMS - nv);
        }
    }
    pthread_mutex_unlock(&ev->mu);
    if (nv) {
        struct l2_usage before;
        l2_adapter_usage(c->ad[a], &before);
        size_t skipped = 0;
        l2_adapter_delete(c->ad[a], victims, nv, del, &skipped);
        struct l2_usage after;
        l2_adapter_usage(c->ad[a], &after);
        for (size_t i = 0; i < nv; i++) {
            if (del[i]) {
                rep->evicted_objects++;
                continue;
            }
            char name[KEYS_L2_NAME_MAX];
            if (keys_l2_name(&victims[i], name, sizeof(name)) >= 0) ev_touch_name(ev, name);
        }
        rep->evicted_bytes +=
            before.bytes_used > after.bytes_used ? before.bytes_used - after.bytes_used : 0;
        rep->skipped_locked += skipped;
    }
    free(victims);
    free(del);
}

int l2ctl_evict_tick(struct l2ctl *c, uint64_t now_ns, struct l2ctl_tick_report *out) {
    (void)now_ns; /* eviction order is recency order; no time-based rule yet */
    struct l2ctl_tick_report rep = {0};
    for (size_t a = 0; a < c->nad; a++)
        if (c->ev[a]) evict_adapter(c, a, &rep);
    ADD(e_ticks, 1);
    ADD(e_obj, rep.evicted_objects);
    ADD(e_bytes, rep.evicted_bytes);
    ADD(e_skipped, rep.skipped_locked);
    if (out) *out = rep;
    return L2_OK;
}

/* ---- stats ------------------------------------------------------------------------------------
 */

void l2ctl_stats(struct l2ctl *c, struct l2ctl_stats *o) {
#define LD(f) atomic_load_explicit(&c->f, memory_order_relaxed)
    memset(o, 0, sizeof(*o));
    o->store_submitted_objects = LD(s_submitted);
    o->store_dropped_objects = LD(s_dropped);
    o->store_completed_requests = LD(s_req_done);
    o->store_completed_objects = LD(s_obj_done);
    o->store_failed_objects = LD(s_obj_failed);
    o->store_bytes = LD(s_bytes);
    o->skip_l1_deleted = LD(s_skip_l1);
    o->prefetch_requests = LD(p_req);
    o->prefetch_completed = LD(p_done);
    o->prefetch_lookup_objects = LD(p_lookup);
    o->prefetch_found_objects = LD(p_found);
    o->load_completed_objects = LD(l_ok);
    o->load_failed_objects = LD(l_failed);
    o->load_bytes = LD(l_bytes);
    o->prefetch_failure_l1_oom = LD(p_oom);
    o->prefetch_failure_not_found = LD(p_nf);
    pthread_mutex_lock(&c->q_mu);
    o->store_queue_depth = c->sq_len;
    pthread_mutex_unlock(&c->q_mu);
    o->store_in_flight = LD(g_store_inflight);
    o->prefetch_active = LD(g_pf_active);
    o->prefetch_queued = LD(g_pf_queued);
    o->prefetch_results_unread = LD(g_results);
    o->evicted_objects = LD(e_obj);
    o->evicted_bytes = LD(e_bytes);
    o->evict_ticks = LD(e_ticks);
    o->evict_skipped_locked = LD(e_skipped);
#undef LD
}

json_t *l2ctl_status(struct l2ctl *c) {
    json_t *s = json_object();
    json_t *arr = json_array();
    bool healthy = true;
    for (size_t i = 0; i < c->nad; i++) {
        json_t *as = l2_adapter_status(c->ad[i]);
        if (!json_is_true(json_object_get(as, "is_healthy"))) healthy = false;
        json_t *ev = json_object();
        struct evictor *e = c->ev[i];
        json_object_set_new(ev, "eviction_policy",
                            json_string(!e                    ? "none"
                                        : e->policy == EV_LRU ? "LRU"
                                                              : "IsolatedLRU"));
        if (e) {
            json_object_set_new(ev, "trigger_watermark", json_real(e->watermark));
            json_object_set_new(ev, "eviction_ratio", json_real(e->ratio));
        }
        json_object_set_new(as, "eviction", ev);
        json_array_append_new(arr, as);
    }
    json_object_set_new(s, "is_healthy", json_boolean(healthy));
    struct l2ctl_stats st;
    l2ctl_stats(c, &st);
    json_t *cj = json_object();
#define F(x) json_object_set_new(cj, #x, json_integer((json_int_t)st.x))
    F(store_submitted_objects);
    F(store_dropped_objects);
    F(store_completed_requests);
    F(store_completed_objects);
    F(store_failed_objects);
    F(store_bytes);
    F(skip_l1_deleted);
    F(prefetch_requests);
    F(prefetch_completed);
    F(prefetch_lookup_objects);
    F(prefetch_found_objects);
    F(load_completed_objects);
    F(load_failed_objects);
    F(load_bytes);
    F(prefetch_failure_l1_oom);
    F(prefetch_failure_not_found);
    F(store_queue_depth);
    F(store_in_flight);
    F(prefetch_active);
    F(prefetch_queued);
    F(evicted_objects);
    F(evicted_bytes);
    F(evict_ticks);
#undef F
    json_object_set_new(s, "controller", cj);
    json_object_set_new(
        s, "store_policy",
        json_string(c->cfg.store_policy == L2CTL_STORE_SKIP_L1 ? "skip_l1" : "default"));
    json_object_set_new(s, "prefetch_max_in_flight",
                        json_integer((json_int_t)c->cfg.prefetch_max_in_flight));
    json_object_set_new(s, "adapters", arr);
    return s;
}

json_t *l2ctl_adapters_json(struct l2ctl *c) {
    json_t *arr = json_array();
    for (size_t i = 0; i < c->nad; i++) {
        json_t *o = json_object();
        json_object_set_new(o, "index", json_integer((json_int_t)i));
        json_object_set_new(o, "type_name", json_string(l2_adapter_type_name(c->ad[i])));
        json_object_set_new(o, "tier", json_string("l2"));
        json_object_set_new(o, "primary", json_boolean(i == 0));
        json_object_set_new(o, "reconfigurable", json_boolean(l2_adapter_reconfigurable(c->ad[i])));
        json_array_append_new(arr, o);
    }
    return arr;
}
