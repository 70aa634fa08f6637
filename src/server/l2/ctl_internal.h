/* Private to the storage controller's files (controller.c: thread, life cycle, admin, status;
 * ctl_store.c: write-through; ctl_prefetch.c: prefetch; ctl_evict.c: eviction trackers). */
#ifndef LMCACHE_SERVER_L2_CTL_INTERNAL_H
#define LMCACHE_SERVER_L2_CTL_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "server/l2/controller.h"

#define MAX_STORE_BATCHES 4 /* store batches in flight at once */

/* The first member of both adapter-task owners (t->user), so the thread can tell them apart. */
enum { KIND_STORE = 1, KIND_PREFETCH = 2 };

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
    struct ctl_evictor **ev; /* per adapter; NULL = no eviction config */
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
    size_t pf_keys; /* keys of the prefetches queued or running (under q_mu) */
    /* stats */
    _Atomic uint64_t s_submitted, s_dropped, s_req_done, s_obj_done, s_obj_failed, s_bytes,
        s_skip_l1, p_req, p_refused, p_done, p_lookup, p_found, l_ok, l_failed, l_bytes, p_oom,
        p_nf, g_store_inflight, g_pf_active, g_pf_queued, g_results, e_obj, e_bytes, e_ticks,
        e_skipped;
};

#define ADD(f, v) atomic_fetch_add_explicit(&c->f, (v), memory_order_relaxed)

/* Wakes the controller thread (an eventfd). */
void ctl_signal(int fd);

/* ---- write-through (ctl_store.c; controller thread) ---- */
/* Takes up to store_batch queued objects, read-locks them in L1, submits a store task to every
 * adapter. */
void ctl_store_start(struct l2ctl *c);
/* One adapter finished its task of batch b; the last one finishes the batch. */
void ctl_store_done(struct l2ctl *c, struct store_batch *b, struct l2_task *t);

/* ---- prefetch (ctl_prefetch.c; controller thread) ---- */
/* Moves a queued request into its lookup phase (one lookup task per adapter). */
void ctl_pf_start(struct l2ctl *c, struct pf_req *r);
/* One adapter task of r finished: the last lookup plans the loads, the last load finalizes. */
void ctl_pf_done(struct l2ctl *c, struct pf_req *r);
/* Publishes a finished (or abandoned) request: callback, or the results list for polling. */
void ctl_pf_publish(struct l2ctl *c, struct pf_req *r);
void ctl_pf_free(struct pf_req *r);

/* ---- eviction trackers (ctl_evict.c) ----
 * One tracker per adapter with an "eviction" config: the adapter's objects in recency order
 * (one list, or one per salt for IsolatedLRU), fed by the adapter's listener callbacks. */
struct ctl_evictor;
/* Reads cfg's "eviction" object. *out = NULL when there is none or it says "noop". */
int ctl_ev_parse(const json_t *cfg, struct ctl_evictor **out, char *err, size_t errlen);
void ctl_ev_free(struct ctl_evictor *ev);
/* Registers ev as a listener of a and enters the objects a already holds (an fs rescan), in
 * listing order. */
void ctl_ev_attach(struct ctl_evictor *ev, struct l2_adapter *a);
/* One eviction pass over adapter a (see l2ctl_evict_tick); quota may be NULL. Adds to *rep. */
void ctl_ev_evict(struct ctl_evictor *ev, struct l2_adapter *a, struct quota *quota,
                  struct l2ctl_tick_report *rep);
/* Fills the "eviction" object of GET /status for a tracker (ev may be NULL: policy "none"). */
void ctl_ev_describe(const struct ctl_evictor *ev, json_t *out);

#endif
