/* The storage controller's prefetch state machine: a request is queued, looks its keys up in every
 * adapter, plans one source per key with L1 space reserved, loads, then publishes its result
 * (callback or poll). */
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "server/l2/ctl_internal.h"

void ctl_pf_free(struct pf_req *r) {
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
        ctl_pf_free(r);
        return L2_ERR_NOMEM;
    }
    if (n) {
        memcpy(r->keys, keys, n * sizeof(*keys));
        memcpy(r->l1keys, l1keys, n * sizeof(*l1keys));
    }
    pthread_mutex_lock(&c->q_mu);
    if (c->stopping) {
        pthread_mutex_unlock(&c->q_mu);
        ctl_pf_free(r);
        return L2_ERR_CLOSED;
    }
    if (m > c->cfg.prefetch_max_keys || c->pf_keys > c->cfg.prefetch_max_keys - m) {
        pthread_mutex_unlock(&c->q_mu);
        ctl_pf_free(r);
        ADD(p_refused, 1);
        return L2_ERR_BUSY;
    }
    c->pf_keys += m; /* until published */
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
    ctl_signal(c->sub_fd);
    return L2_OK;
}

void ctl_pf_publish(struct l2ctl *c, struct pf_req *r) {
    r->phase = PF_DONE;
    pthread_mutex_lock(&c->q_mu);
    c->pf_keys -= r->n ? r->n : 1; /* what submit counted */
    pthread_mutex_unlock(&c->q_mu);
    ADD(p_done, 1);
    if (r->cb) {
        struct l2ctl_prefetch_result res = {.id = r->id,
                                            .total = r->n,
                                            .found = r->found,
                                            .prefix = r->prefix,
                                            .l1_oom = r->l1_oom,
                                            .ready = r->ready};
        r->cb(r->cb_arg, &res);
        ctl_pf_free(r);
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
        ctl_pf_free(dropped);
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
        ctl_pf_free(c->last_polled);
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

void ctl_pf_start(struct l2ctl *c, struct pf_req *r) {
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
    ctl_pf_publish(c, r);
}

void ctl_pf_done(struct l2ctl *c, struct pf_req *r) {
    if (--r->pending) return;
    if (r->phase == PF_LOOKUP)
        pf_plan(c, r);
    else
        pf_finalize(c, r);
}
