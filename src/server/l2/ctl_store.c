/* The storage controller's write-through: l2ctl_store queues retained L1 objects, the controller
 * thread batches them (read-locked in L1) into one store task per adapter and finishes them. */
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "server/l2/ctl_internal.h"

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
    if (took) ctl_signal(c->sub_fd);
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

void ctl_store_start(struct l2ctl *c) {
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
            if (c->cfg.store_done) c->cfg.store_done(c->cfg.store_done_arg, &it.l1key, 0);
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
    for (size_t i = 0; i < b->n; i++) {
        l1_finish_read(c->cfg.l1, &b->l1keys[i], 1, now);
        if (c->cfg.store_done) c->cfg.store_done(c->cfg.store_done_arg, &b->l1keys[i], 0);
    }
    ADD(s_obj_failed, b->n);
    store_batch_free(b);
}

void ctl_store_done(struct l2ctl *c, struct store_batch *b, struct l2_task *t) {
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
        if (c->cfg.store_done) c->cfg.store_done(c->cfg.store_done_arg, &b->l1keys[i], all);
    }
    ADD(s_req_done, 1);
    ADD(s_obj_done, ok_all);
    ADD(s_obj_failed, failed);
    store_batch_free(b);
}
