/* The `kv-warm` thread: faults an engine's registered shared memory in after registration,
 * off the data-plane worker.
 *
 * Why: the first access to each page of a new mapping costs a fault, and on a shadow-paged VM a
 * hypervisor exit per 4 KiB page (architecture.md): ~3 s per GiB measured there. Done inside
 * register_kv_cache it held the client's worker, and every other client hashed to that worker,
 * for as long; done by the first copies it slowed the engine's first requests. Here it runs on
 * one thread of its own, 64 MiB at a time, and registration answers at once (its reply says
 * `warming`; `ping` tells when it is over).
 *
 * What it touches: never a page the object does not hold, so a registration does not allocate
 * the client's shared memory on its behalf (a sparse 100 GiB object costs a mincore walk, not
 * 100 GiB charged to the daemon). Before each step it reads the object's allocated size
 * (fstat): a fully allocated object (the clients' posix_fallocate) is faulted in whole; any
 * other only where mincore reports written pages (tmpfs reports fallocated pages that were
 * never written as absent). A hole punched after the check costs at most one step. A client
 * that shrinks its object meanwhile gets a failed warm-up, not a dead daemon: every range runs
 * under the SIGBUS guard. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/prefault.h"
#include "server/kvctx.h"

#define WARM_PAGE 4096u
#define WARM_STEP (64ull << 20) /* between checks of the stop and retired flags */

const char *kv_warm_state_name(int state) {
    switch (state) {
    case KV_WARM_QUEUED:
        return "warming";
    case KV_WARM_DONE:
        return "warm";
    case KV_WARM_FAILED:
        return "failed";
    case KV_WARM_DROPPED:
        return "dropped";
    default:
        return "off";
    }
}

struct warm_run {
    unsigned char *p;
    size_t len;
    int rc;
};

static void warm_run_cb(void *arg) {
    struct warm_run *w = arg;
    w->rc = prefault_range(w->p, w->len, 1);
}

/* One run of resident pages, guarded: a shrink between mincore and the reads is a SIGBUS. */
static int warm_run(unsigned char *p, size_t len) {
    struct warm_run w = {p, len, 0};
    if (kv_guarded(warm_run_cb, &w) < 0) return -1;
    return w.rc;
}

int kv_warm_range(const struct kv_context *c, uint64_t off, uint64_t len, int whole,
                  uint64_t *warmed) {
    if (off >= c->map_size) return 0;
    if (len > c->map_size - off) len = c->map_size - off;
    if (whole) {
        if (warm_run(c->base + off, (size_t)len) != 0) return -1;
        *warmed += len;
        return 0;
    }
    /* The mapping starts on a page; off is a multiple of the page in every caller but tests. */
    uint64_t first = off / WARM_PAGE, last = (off + len + WARM_PAGE - 1) / WARM_PAGE;
    size_t npages = (size_t)(last - first);
    if (npages == 0) return 0;
    unsigned char *vec = malloc(npages);
    if (!vec) return 0; /* nothing warmed: the copies will fault the pages in */
    unsigned char *lo = c->base + first * WARM_PAGE;
    int rc = 0;
    if (mincore(lo, npages * WARM_PAGE, vec) != 0) {
        rc = errno == ENOMEM ? -1 : 0; /* ENOMEM: not mapped any more */
        free(vec);
        return rc;
    }
    size_t i = 0;
    while (i < npages && rc == 0) {
        if (!(vec[i] & 1)) {
            i++;
            continue;
        }
        size_t j = i;
        while (j < npages && (vec[j] & 1)) j++;
        uint64_t a = (first + i) * WARM_PAGE, b = (first + j) * WARM_PAGE;
        if (b > c->map_size) b = c->map_size;
        if (warm_run(c->base + a, (size_t)(b - a)) != 0)
            rc = -1;
        else
            *warmed += b - a;
        i = j;
    }
    free(vec);
    return rc;
}

static int stopping(struct kv_warmer *w) {
    pthread_mutex_lock(&w->mu);
    int s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

static void warm_one(struct kv_warmer *w, struct kv_context *c) {
    struct logger *lg = log_get("lmcache.zmq");
    double t0 = clock_mono();
    uint64_t warmed = 0;
    int state = KV_WARM_DONE;
    for (uint64_t off = 0; off < c->map_size; off += WARM_STEP) {
        if (atomic_load(&c->retired) || stopping(w)) {
            state = KV_WARM_DROPPED;
            break;
        }
        struct stat st;
        if (fstat(c->warm_fd, &st) != 0 || (uint64_t)st.st_size < c->map_size) {
            state = KV_WARM_FAILED; /* shrunk below the layout */
            break;
        }
        int whole = (uint64_t)st.st_blocks * 512 >= (uint64_t)st.st_size;
        if (kv_warm_range(c, off, WARM_STEP, whole, &warmed) < 0) {
            state = KV_WARM_FAILED;
            break;
        }
        atomic_store(&c->warm_bytes, warmed);
    }
    close(c->warm_fd);
    c->warm_fd = -1;
    atomic_store(&c->warm_state, state);
    double dt = clock_mono() - t0;
    if (state == KV_WARM_FAILED)
        log_warn(lg,
                 "KV cache of instance %lld (shm %s): the object shrank while it was faulted in "
                 "(%llu MiB done); its copies fail with shm_error",
                 (long long)c->instance_id, c->shm_name, (unsigned long long)(warmed >> 20));
    else
        log_info(lg, "KV cache of instance %lld (shm %s): %llu of %llu MiB faulted in, %.2f s%s",
                 (long long)c->instance_id, c->shm_name, (unsigned long long)(warmed >> 20),
                 (unsigned long long)(c->map_size >> 20), dt,
                 state == KV_WARM_DROPPED ? " (stopped: unregistered or shutting down)" : "");
}

static void *warm_main(void *arg) {
    struct kv_warmer *w = arg;
    pthread_setname_np(pthread_self(), "kv-warm");
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->stop && !w->head) pthread_cond_wait(&w->cv, &w->mu);
        if (w->stop) break;
        struct kv_context *c = w->head;
        w->head = c->warm_next;
        if (!w->head) w->tail = NULL;
        c->warm_next = NULL;
        pthread_mutex_unlock(&w->mu);
        warm_one(w, c);
        kvreg_put(c);
        pthread_mutex_lock(&w->mu);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

int kvwarm_start(struct kv_registry *r) {
    struct kv_warmer *w = &r->warm;
    pthread_mutex_lock(&w->mu);
    w->stop = 0;
    int e = w->running ? 0 : pthread_create(&w->tid, NULL, warm_main, w);
    if (!e) w->running = 1;
    pthread_mutex_unlock(&w->mu);
    if (e) {
        errno = e;
        return -1;
    }
    return 0;
}

void kvwarm_stop(struct kv_registry *r) {
    struct kv_warmer *w = &r->warm;
    pthread_mutex_lock(&w->mu);
    int running = w->running;
    w->stop = 1;
    w->running = 0;
    struct kv_context *q = w->head;
    w->head = w->tail = NULL;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (running) pthread_join(w->tid, NULL);
    while (q) {
        struct kv_context *n = q->warm_next;
        close(q->warm_fd);
        q->warm_fd = -1;
        atomic_store(&q->warm_state, KV_WARM_DROPPED);
        kvreg_put(q);
        q = n;
    }
}

void kvwarm_queue(struct kv_registry *r, struct kv_context *c, int fd) {
    struct kv_warmer *w = &r->warm;
    pthread_mutex_lock(&w->mu);
    if (!w->running || w->stop || (c->warm_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0)) < 0) {
        pthread_mutex_unlock(&w->mu);
        c->warm_fd = -1;
        atomic_store(&c->warm_state, KV_WARM_OFF);
        return;
    }
    atomic_store(&c->warm_state, KV_WARM_QUEUED);
    atomic_fetch_add(&c->refs, 1);
    c->warm_next = NULL;
    if (w->tail)
        w->tail->warm_next = c;
    else
        w->head = c;
    w->tail = c;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}
