/* The copy pool. A job lives on its caller's stack; the pool's queue mutex (a leaf lock)
 * guards the list of jobs with pieces left, each job's count of attached helpers and the idle
 * count. Pieces are claimed without the lock, by atomic_fetch_add on the job's next index.
 *
 * Lifetime of a job: the caller queues it, wakes as many idle helpers as there are pieces
 * beyond its own first one, and runs pieces itself until the index passes the end. Then, under
 * the mutex, it unqueues the job (no helper can attach from then on) and waits until the
 * helpers attached to it have returned from their last piece. A helper attaches only under the
 * mutex while the job is queued, and detaches under it, so the job is never touched after its
 * caller returns. With every helper busy elsewhere the caller simply runs all pieces: the cost
 * over a plain loop is two lock round trips. */
#include "server/copypool.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/check.h"
#include "base/clock.h"
#include "base/errbuf.h"

#define COPYPOOL_MAGIC 0xc09e9001u
#define JOB_MAGIC      0xc09e90b5u

struct cp_job {
    unsigned magic;
    int (*fn)(void *arg, uint32_t i);
    void *arg;
    uint32_t n;
    _Atomic uint32_t next; /* next piece to claim */
    _Atomic int failed;
    /* under the pool mutex */
    unsigned helpers; /* helpers attached (running or about to run pieces) */
    int queued;
    pthread_cond_t done; /* helpers reached 0 */
    struct cp_job *prev, *succ;
};

struct copypool {
    unsigned magic;
    pthread_mutex_t mu; /* leaf: the queue, idle, stop, every queued job's helpers/queued */
    pthread_cond_t work;
    struct cp_job *head, *tail;
    unsigned idle;
    int stop;
    unsigned n;
    pthread_t *tids;
    /* the free-core gate (set before the first job) and its last answer */
    copypool_runnable_fn runnable;
    void *runnable_arg;
    unsigned ncpu;
    _Atomic uint64_t gate_next_ns; /* ask again from then on */
    _Atomic int gate_busy;
    _Atomic uint64_t jobs, helper_pieces, gated;
};

struct helper_arg {
    struct copypool *p;
    unsigned index;
};

static void do_unqueue(struct copypool *p, struct cp_job *j) {
    if (!j->queued) return;
    if (j->prev)
        j->prev->succ = j->succ;
    else
        p->head = j->succ;
    if (j->succ)
        j->succ->prev = j->prev;
    else
        p->tail = j->prev;
    j->prev = j->succ = NULL;
    j->queued = 0;
}

/* Claims and runs pieces until none is left; returns how many this thread ran. */
static uint32_t run_pieces(struct cp_job *j) {
    uint32_t ran = 0;
    for (;;) {
        uint32_t i = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (i >= j->n) break;
        if (atomic_load_explicit(&j->failed, memory_order_relaxed)) continue;
        if (j->fn(j->arg, i) != 0) atomic_store_explicit(&j->failed, 1, memory_order_relaxed);
        ran++;
    }
    return ran;
}

static void *helper_main(void *arg) {
    struct helper_arg ha = *(struct helper_arg *)arg;
    free(arg);
    struct copypool *p = ha.p;
    char name[16];
    snprintf(name, sizeof(name), "dp-copy-%u", ha.index);
    pthread_setname_np(pthread_self(), name);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && !p->head) {
            p->idle++;
            pthread_cond_wait(&p->work, &p->mu);
            p->idle--;
        }
        if (p->stop) break;
        struct cp_job *j = p->head;
        CHECK(j->magic == JOB_MAGIC);
        if (atomic_load_explicit(&j->next, memory_order_relaxed) >= j->n) {
            do_unqueue(p, j); /* every piece claimed: nothing to help with */
            continue;
        }
        j->helpers++;
        pthread_mutex_unlock(&p->mu);
        uint32_t ran = run_pieces(j);
        atomic_fetch_add_explicit(&p->helper_pieces, ran, memory_order_relaxed);
        pthread_mutex_lock(&p->mu);
        do_unqueue(p, j); /* its index ran past the end */
        if (--j->helpers == 0) pthread_cond_signal(&j->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

struct copypool *copypool_start(unsigned nthreads, char *err, size_t errlen) {
    struct copypool *p = calloc(1, sizeof(*p));
    if (!p || (nthreads && !(p->tids = calloc(nthreads, sizeof(*p->tids))))) {
        free(p);
        errbuf_set(err, errlen, "copy pool: out of memory");
        return NULL;
    }
    p->magic = COPYPOOL_MAGIC;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    for (unsigned i = 0; i < nthreads; i++) {
        struct helper_arg *ha = malloc(sizeof(*ha));
        if (ha) {
            ha->p = p;
            ha->index = i;
        }
        int rc = ha ? pthread_create(&p->tids[i], NULL, helper_main, ha) : ENOMEM;
        if (rc != 0) {
            free(ha);
            errbuf_set(err, errlen, "copy pool: cannot start thread %u: %s", i, strerror(rc));
            copypool_stop(p);
            return NULL;
        }
        p->n++;
    }
    return p;
}

void copypool_stop(struct copypool *p) {
    if (!p) return;
    CHECK(p->magic == COPYPOOL_MAGIC);
    pthread_mutex_lock(&p->mu);
    CHECK(p->head == NULL);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (unsigned i = 0; i < p->n; i++) pthread_join(p->tids[i], NULL);
    pthread_cond_destroy(&p->work);
    pthread_mutex_destroy(&p->mu);
    p->magic = 0;
    free(p->tids);
    free(p);
}

unsigned copypool_threads(const struct copypool *p) { return p ? p->n : 0; }

void copypool_set_gate(struct copypool *p, copypool_runnable_fn runnable, void *arg,
                       unsigned ncpu) {
    p->runnable = runnable;
    p->runnable_arg = arg;
    p->ncpu = ncpu;
    atomic_store(&p->gate_next_ns, 0);
}

int copypool_runnable_proc(void *arg) {
    (void)arg;
    char buf[128];
    int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    int running = -1;
    if (sscanf(buf, "%*s %*s %*s %d/", &running) != 1) return -1;
    return running;
}

/* 1 when the gate says no core is free. Racing callers may both ask; either answer is fine. */
static int no_free_core(struct copypool *p) {
    if (!p->runnable) return 0;
    uint64_t now = clock_mono_ns();
    if (now >= atomic_load_explicit(&p->gate_next_ns, memory_order_relaxed)) {
        atomic_store_explicit(&p->gate_next_ns, now + COPYPOOL_GATE_NS, memory_order_relaxed);
        int r = p->runnable(p->runnable_arg);
        atomic_store_explicit(&p->gate_busy, r >= 0 && (unsigned)r >= p->ncpu,
                              memory_order_relaxed);
    }
    return atomic_load_explicit(&p->gate_busy, memory_order_relaxed);
}

int copypool_run(struct copypool *p, uint32_t n, int (*fn)(void *arg, uint32_t i), void *arg) {
    int gated = p && p->n && n >= 2 && no_free_core(p);
    if (gated) atomic_fetch_add_explicit(&p->gated, 1, memory_order_relaxed);
    if (!p || p->n == 0 || n < 2 || gated) {
        for (uint32_t i = 0; i < n; i++)
            if (fn(arg, i) != 0) return -1;
        return 0;
    }
    CHECK(p->magic == COPYPOOL_MAGIC);
    struct cp_job j;
    memset(&j, 0, sizeof(j));
    j.magic = JOB_MAGIC;
    j.fn = fn;
    j.arg = arg;
    j.n = n;
    atomic_init(&j.next, 0);
    atomic_init(&j.failed, 0);
    pthread_cond_init(&j.done, NULL);

    pthread_mutex_lock(&p->mu);
    j.prev = p->tail;
    if (p->tail)
        p->tail->succ = &j;
    else
        p->head = &j;
    p->tail = &j;
    j.queued = 1;
    unsigned wake = p->idle < n - 1 ? p->idle : n - 1;
    if (wake == p->idle)
        pthread_cond_broadcast(&p->work);
    else
        for (unsigned k = 0; k < wake; k++) pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
    atomic_fetch_add_explicit(&p->jobs, 1, memory_order_relaxed);

    run_pieces(&j);

    pthread_mutex_lock(&p->mu);
    do_unqueue(p, &j);
    while (j.helpers) pthread_cond_wait(&j.done, &p->mu);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_destroy(&j.done);
    j.magic = 0;
    return atomic_load(&j.failed) ? -1 : 0;
}

uint64_t copypool_piece_bytes(const struct copypool *p, uint64_t bytes, uint32_t *pieces) {
    unsigned t = copypool_threads(p);
    if (t == 0 || bytes < COPYPOOL_MIN_BYTES) {
        *pieces = 1;
        return bytes ? bytes : 1;
    }
    /* About four pieces per thread (the caller included): a helper that wakes late or is
     * busy elsewhere leaves its share to the others. */
    uint64_t piece = bytes / (4ull * (t + 1));
    if (piece < COPYPOOL_MIN_PIECE) piece = COPYPOOL_MIN_PIECE;
    if (piece > COPYPOOL_MAX_PIECE) piece = COPYPOOL_MAX_PIECE;
    piece = (piece + 4095) & ~4095ull;
    uint64_t n = (bytes + piece - 1) / piece;
    if (n > UINT32_MAX) { /* absurd sizes: fewer, larger pieces */
        n = UINT32_MAX;
        piece = (bytes + n - 1) / n;
    }
    *pieces = (uint32_t)n;
    return piece;
}

struct memcpy_job {
    unsigned char *dst;
    const unsigned char *src;
    size_t n, piece;
};

static int memcpy_piece(void *arg, uint32_t i) {
    const struct memcpy_job *m = arg;
    size_t off = (size_t)i * m->piece;
    size_t len = m->n - off < m->piece ? m->n - off : m->piece;
    memcpy(m->dst + off, m->src + off, len);
    return 0;
}

/* Several copies as one job: each split into pieces of the same size (pieces never straddle
 * two copies), every piece claimed by whoever is free. */
struct memcpy_many_job {
    unsigned char *const *dsts;
    const unsigned char *const *srcs;
    const size_t *lens;
    const uint32_t *first; /* first[j]: index of copy j's first piece; first[n]: all pieces */
    uint32_t n;
    size_t piece;
};

static int memcpy_many_piece(void *arg, uint32_t i) {
    const struct memcpy_many_job *m = arg;
    uint32_t lo = 0, hi = m->n; /* the copy whose pieces hold i: first[j] <= i < first[j+1] */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (m->first[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    size_t off = (size_t)(i - m->first[lo]) * m->piece, len = m->lens[lo] - off;
    if (len > m->piece) len = m->piece;
    memcpy(m->dsts[lo] + off, m->srcs[lo] + off, len);
    return 0;
}

void copypool_memcpy_many(struct copypool *p, void *const *dsts, const void *const *srcs,
                          const size_t *lens, uint32_t n) {
    uint64_t total = 0;
    for (uint32_t j = 0; j < n; j++) total += lens[j];
    uint32_t pieces = 0;
    uint64_t piece = copypool_piece_bytes(p, total, &pieces);
    uint32_t first[COPYPOOL_MANY_MAX + 1];
    if (pieces <= 1 || n > COPYPOOL_MANY_MAX) {
        for (uint32_t j = 0; j < n; j++) copypool_memcpy(p, dsts[j], srcs[j], lens[j]);
        return;
    }
    uint64_t np = 0;
    for (uint32_t j = 0; j < n; j++) {
        first[j] = (uint32_t)np;
        np += (lens[j] + piece - 1) / piece;
    }
    first[n] = (uint32_t)np;
    if (np > UINT32_MAX) { /* absurd sizes: one copy at a time */
        for (uint32_t j = 0; j < n; j++) copypool_memcpy(p, dsts[j], srcs[j], lens[j]);
        return;
    }
    struct memcpy_many_job m = {(unsigned char *const *)dsts,
                                (const unsigned char *const *)srcs,
                                lens,
                                first,
                                n,
                                (size_t)piece};
    copypool_run(p, (uint32_t)np, memcpy_many_piece, &m);
}

void copypool_memcpy(struct copypool *p, void *dst, const void *src, size_t n) {
    uint32_t pieces;
    uint64_t piece = copypool_piece_bytes(p, n, &pieces);
    if (pieces <= 1) {
        memcpy(dst, src, n);
        return;
    }
    struct memcpy_job m = {dst, src, n, (size_t)piece};
    copypool_run(p, pieces, memcpy_piece, &m);
}

void copypool_get_stats(const struct copypool *p, struct copypool_stats *out) {
    memset(out, 0, sizeof(*out));
    if (!p) return;
    out->jobs = atomic_load_explicit(&p->jobs, memory_order_relaxed);
    out->helper_pieces = atomic_load_explicit(&p->helper_pieces, memory_order_relaxed);
    out->gated = atomic_load_explicit(&p->gated, memory_order_relaxed);
}
