/* The copy pool: helper threads (`dp-copy-N`) that take pieces of a data-plane worker's copy
 * (the chunks of a store or retrieve, split into byte ranges) while they are idle, so one large
 * object is copied by more than one core. The caller always copies too and never waits for a
 * busy pool: pieces are handed out through one atomic index, whoever is free takes the next. */
#ifndef LMCACHE_SERVER_COPYPOOL_H
#define LMCACHE_SERVER_COPYPOOL_H

#include <stddef.h>
#include <stdint.h>

struct copypool;

/* Copies smaller than this stay on the caller (waking a helper costs more than it saves). */
#define COPYPOOL_MIN_BYTES (512u << 10)
/* Smallest piece handed out: large enough that a helper's wake-up and the per-piece guard are
 * noise next to the copy. */
#define COPYPOOL_MIN_PIECE (128u << 10)
/* Largest piece: a helper descheduled in the middle of a piece (another process took its core)
 * holds up its caller for at most one piece's copy once it runs again. */
#define COPYPOOL_MAX_PIECE (512u << 10)

/* Starts nthreads helpers named dp-copy-0..N-1 (0 is allowed: a pool whose caller does all the
 * work). NULL with a message when a thread cannot be started. */
struct copypool *copypool_start(unsigned nthreads, char *err, size_t errlen);
/* Stops and joins the helpers; no copypool_run may be in progress. NULL is a no-op. */
void copypool_stop(struct copypool *p);
unsigned copypool_threads(const struct copypool *p);

/* Runs fn(arg, i) exactly once for every i in [0, n), on the calling thread and on idle
 * helpers, and returns once all have returned (so whatever the caller holds, e.g. an L1 write
 * lease or read lock, covers every piece). Returns 0, or -1 when a piece returned non-zero;
 * once one failed, the pieces not yet started are skipped (counted as run, never run). p NULL:
 * every piece runs on the caller. fn must be safe to call concurrently for different i. */
int copypool_run(struct copypool *p, uint32_t n, int (*fn)(void *arg, uint32_t i), void *arg);

/* How a copy of `bytes` is split for this pool: the piece size (about four per thread, caller
 * included, within [COPYPOOL_MIN_PIECE, COPYPOOL_MAX_PIECE], a multiple of 4 KiB; or bytes
 * itself when the copy stays on the caller) and, in *pieces, how many. */
uint64_t copypool_piece_bytes(const struct copypool *p, uint64_t bytes, uint32_t *pieces);

/* memcpy split between the caller and the pool (below COPYPOOL_MIN_BYTES: a plain memcpy). */
void copypool_memcpy(struct copypool *p, void *dst, const void *src, size_t n);
/* Copies dsts[j] <- srcs[j] (lens[j] bytes) for j < n as one job: the pieces of all of them
 * shared between the caller and the pool (one wake-up and one wait instead of one per copy).
 * More than COPYPOOL_MANY_MAX copies go one by one. */
#define COPYPOOL_MANY_MAX 64u
void copypool_memcpy_many(struct copypool *p, void *const *dsts, const void *const *srcs,
                          const size_t *lens, uint32_t n);

/* Where cores are free: runnable(arg) tells how many threads are runnable on the machine now,
 * the caller included (or -1: unknown). While it is at least ncpu no core is free, a woken
 * helper would only take turns with its caller, and copypool_run keeps the whole job on the
 * caller. It is asked at most every COPYPOOL_GATE_NS (the answer is kept in between).
 * Without a gate (the default) helpers are always woken. Set it before the first job. */
#define COPYPOOL_GATE_NS (20ull * 1000 * 1000)
typedef int (*copypool_runnable_fn)(void *arg);
void copypool_set_gate(struct copypool *p, copypool_runnable_fn runnable, void *arg, unsigned ncpu);
/* The machine's runnable threads from /proc/loadavg (its fourth field, "R/T"); -1 on error. */
int copypool_runnable_proc(void *arg);

/* Counters since start: jobs handed to the helpers, pieces the helpers ran, jobs kept on their
 * caller because no core was free. */
struct copypool_stats {
    uint64_t jobs, helper_pieces, gated;
};
void copypool_get_stats(const struct copypool *p, struct copypool_stats *out);

#endif
