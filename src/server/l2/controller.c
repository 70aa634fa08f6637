/* The storage controller's core: the l2-controller thread that runs the write-through and
 * prefetch state machines, life cycle, admin calls, eviction ticks, stats and status. */
#include "server/l2/controller.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/errbuf.h"
#include "base/log.h"
#include "server/l2/ctl_internal.h"

void ctl_signal(int fd) {
    uint64_t one = 1;
    while (write(fd, &one, sizeof(one)) < 0 && errno == EINTR) {
    }
}

/* The l2-controller thread: finishes adapter tasks, starts waiting prefetches (up to
 * prefetch_max_in_flight) and store batches (up to MAX_STORE_BATCHES); on stop, abandons what
 * is still queued and leaves once nothing is in flight. */
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
                    ctl_store_done(c, t->user, t);
                else
                    ctl_pf_done(c, t->user);
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
                ctl_pf_publish(c, r);
                continue;
            }
            ctl_pf_start(c, r);
        }
        while (!stopping && sq > 0 && c->store_batches < MAX_STORE_BATCHES) {
            ctl_store_start(c);
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

int l2ctl_create(const struct l2ctl_config *cfg, const json_t *adapter_configs, struct l2ctl **out,
                 char *err, size_t errlen) {
    *out = NULL;
    if (!cfg->l1) {
        errbuf_set(err, errlen, "the storage controller needs L1");
        return L2_ERR_INVAL;
    }
    if (adapter_configs && !json_is_array(adapter_configs)) {
        errbuf_set(err, errlen, "L2 adapter configs must be a JSON array");
        return L2_ERR_INVAL;
    }
    struct l2ctl *c = calloc(1, sizeof(*c));
    if (!c) {
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    c->cfg = *cfg;
    if (!c->cfg.prefetch_max_in_flight) c->cfg.prefetch_max_in_flight = 8;
    if (!c->cfg.prefetch_max_keys) c->cfg.prefetch_max_keys = 262144;
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
        errbuf_set(err, errlen, "out of memory or file descriptors");
        l2ctl_destroy(c);
        return L2_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        const json_t *ac = json_array_get(adapter_configs, i);
        char aerr[256];
        int rc = ctl_ev_parse(ac, &c->ev[i], aerr, sizeof(aerr));
        if (rc == L2_OK) rc = l2_adapter_create(ac, &c->ad[i], aerr, sizeof(aerr));
        if (rc != L2_OK) {
            errbuf_set(err, errlen, "L2 adapter %zu: %s", i, aerr);
            l2ctl_destroy(c);
            return rc;
        }
        c->nad++;
        struct l2_adapter *a = c->ad[i];
        a->index = (int)i;
        l2_adapter_set_notify_fd(a, c->done_fd);
        if (c->ev[i]) ctl_ev_attach(c->ev[i], a);
    }
    *out = c;
    return L2_OK;
}

int l2ctl_start(struct l2ctl *c, char *err, size_t errlen) {
    int e = pthread_create(&c->thread, NULL, ctl_main, c);
    if (e != 0) {
        errbuf_set(err, errlen, "pthread_create: %s", strerror(e));
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
        ctl_signal(c->sub_fd);
        pthread_join(c->thread, NULL);
    }
    /* never started: queued prefetches still publish (callbacks fire) */
    for (struct pf_req *r = c->pf_head, *nx; r; r = nx) {
        nx = r->next;
        ctl_pf_publish(c, r);
    }
    c->pf_head = c->pf_tail = NULL;
    for (size_t i = 0; i < c->nad; i++) l2_adapter_destroy(c->ad[i]);
    for (size_t i = 0; c->ev && i < c->nslots; i++) ctl_ev_free(c->ev[i]);
    for (struct pf_req *r = c->results, *nx; r; r = nx) {
        nx = r->rnext;
        ctl_pf_free(r);
    }
    ctl_pf_free(c->last_polled);
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

int l2ctl_evict_tick(struct l2ctl *c, uint64_t now_ns, struct l2ctl_tick_report *out) {
    (void)now_ns; /* eviction order is recency order; no time-based rule yet */
    struct l2ctl_tick_report rep = {0};
    for (size_t a = 0; a < c->nad; a++)
        if (c->ev[a]) ctl_ev_evict(c->ev[a], c->ad[a], c->cfg.quota, &rep);
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
    o->prefetch_refused = LD(p_refused);
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
        ctl_ev_describe(c->ev[i], ev);
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
    F(prefetch_refused);
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
