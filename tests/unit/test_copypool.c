/* The copy pool: every piece runs exactly once whoever runs it, a busy or absent pool leaves
 * the work to the caller, a failing piece fails the run, and the pooled KV copies (split at
 * arbitrary byte offsets) move the same bytes as a token-by-token reference in both block
 * orders. */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "server/copypool.h"
#include "server/kvctx.h"

/* A bound on polling loops (iterations with sched_yield), far beyond any scheduling delay. */
#define SPIN_BOUND 200000000L

/* ---- piece bookkeeping ---- */

#define MAXN 4096

struct count_job {
    _Atomic int runs[MAXN];
    _Atomic int by_caller;
    pthread_t caller;
    uint32_t fail_at; /* UINT32_MAX: none */
};

static int count_piece(void *arg, uint32_t i) {
    struct count_job *c = arg;
    atomic_fetch_add(&c->runs[i], 1);
    if (pthread_equal(pthread_self(), c->caller)) atomic_fetch_add(&c->by_caller, 1);
    return i == c->fail_at ? -1 : 0;
}

static struct count_job *count_job_new(void) {
    struct count_job *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    c->caller = pthread_self();
    c->fail_at = UINT32_MAX;
    return c;
}

static void test_every_piece_once(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(3, err, sizeof(err));
    assert_non_null(p);
    assert_int_equal(copypool_threads(p), 3);
    const uint32_t sizes[] = {2, 3, 4, 7, 64, 1000, MAXN};
    for (int rep = 0; rep < 20; rep++)
        for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
            struct count_job *c = count_job_new();
            assert_int_equal(copypool_run(p, sizes[s], count_piece, c), 0);
            for (uint32_t i = 0; i < sizes[s]; i++) assert_int_equal(atomic_load(&c->runs[i]), 1);
            for (uint32_t i = sizes[s]; i < MAXN; i++)
                assert_int_equal(atomic_load(&c->runs[i]), 0);
            free(c);
        }
    copypool_stop(p);
}

static void test_off_runs_on_caller(void **state) {
    (void)state;
    char err[128];
    struct copypool *zero = copypool_start(0, err, sizeof(err));
    assert_non_null(zero);
    struct copypool *pools[] = {NULL, zero};
    for (int k = 0; k < 2; k++) {
        struct count_job *c = count_job_new();
        assert_int_equal(copypool_run(pools[k], 100, count_piece, c), 0);
        assert_int_equal(atomic_load(&c->by_caller), 100);
        for (uint32_t i = 0; i < 100; i++) assert_int_equal(atomic_load(&c->runs[i]), 1);
        free(c);
    }
    uint32_t pieces = 0;
    assert_int_equal(copypool_piece_bytes(zero, 64u << 20, &pieces), 64u << 20);
    assert_int_equal(pieces, 1);
    copypool_stop(zero);
}

static void test_failure_fails_run(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(2, err, sizeof(err));
    assert_non_null(p);
    for (uint32_t at = 0; at < 50; at += 7) {
        struct count_job *c = count_job_new();
        c->fail_at = at;
        assert_int_equal(copypool_run(p, 50, count_piece, c), -1);
        assert_int_equal(atomic_load(&c->runs[at]), 1);
        for (uint32_t i = 0; i < 50; i++) assert_true(atomic_load(&c->runs[i]) <= 1);
        free(c);
    }
    /* without a pool too */
    struct count_job *c = count_job_new();
    c->fail_at = 3;
    assert_int_equal(copypool_run(NULL, 10, count_piece, c), -1);
    free(c);
    copypool_stop(p);
}

/* ---- a busy pool: its one helper is held by another caller's piece ---- */

struct blocker {
    struct copypool *p;
    _Atomic int entered, release;
    int rc;
};

static int block_piece(void *arg, uint32_t i) {
    (void)i;
    struct blocker *b = arg;
    atomic_fetch_add(&b->entered, 1);
    for (long k = 0; k < SPIN_BOUND && !atomic_load(&b->release); k++) sched_yield();
    return 0;
}

static void *blocker_main(void *arg) {
    struct blocker *b = arg;
    b->rc = copypool_run(b->p, 2, block_piece, b);
    return NULL;
}

static void test_busy_pool_caller_does_all(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(1, err, sizeof(err));
    assert_non_null(p);
    struct blocker b = {.p = p};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, blocker_main, &b), 0);
    /* both pieces entered: one by the other caller, one by the pool's only helper */
    for (long k = 0; k < SPIN_BOUND && atomic_load(&b.entered) < 2; k++) sched_yield();
    assert_int_equal(atomic_load(&b.entered), 2);
    struct copypool_stats before, after;
    copypool_get_stats(p, &before);
    struct count_job *c = count_job_new();
    assert_int_equal(copypool_run(p, 500, count_piece, c), 0);
    copypool_get_stats(p, &after);
    assert_int_equal(atomic_load(&c->by_caller), 500);
    for (uint32_t i = 0; i < 500; i++) assert_int_equal(atomic_load(&c->runs[i]), 1);
    assert_int_equal(after.helper_pieces, before.helper_pieces);
    free(c);
    atomic_store(&b.release, 1);
    pthread_join(t, NULL);
    assert_int_equal(b.rc, 0);
    copypool_stop(p);
}

/* ---- an idle pool helps: the caller's first piece waits until another thread ran one ---- */

struct help_job {
    pthread_t caller;
    _Atomic int by_helper;
    _Atomic int runs[64];
};

static int help_piece(void *arg, uint32_t i) {
    struct help_job *h = arg;
    atomic_fetch_add(&h->runs[i], 1);
    if (!pthread_equal(pthread_self(), h->caller)) {
        atomic_fetch_add(&h->by_helper, 1);
        return 0;
    }
    for (long k = 0; k < SPIN_BOUND && !atomic_load(&h->by_helper); k++) sched_yield();
    return 0;
}

static void test_idle_pool_helps(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(2, err, sizeof(err));
    assert_non_null(p);
    struct help_job *h = calloc(1, sizeof(*h));
    assert_non_null(h);
    h->caller = pthread_self();
    assert_int_equal(copypool_run(p, 64, help_piece, h), 0);
    assert_true(atomic_load(&h->by_helper) >= 1);
    for (int i = 0; i < 64; i++) assert_int_equal(atomic_load(&h->runs[i]), 1);
    struct copypool_stats st;
    copypool_get_stats(p, &st);
    assert_int_equal(st.jobs, 1);
    assert_int_equal(st.helper_pieces, (uint64_t)atomic_load(&h->by_helper));
    free(h);
    copypool_stop(p);
}

/* ---- the free-core gate ---- */

struct gate {
    int runnable;
    int asked;
};

static int fake_runnable(void *arg) {
    struct gate *g = arg;
    g->asked++;
    return g->runnable;
}

static void test_gate_keeps_jobs_on_the_caller_when_no_core_is_free(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(2, err, sizeof(err));
    assert_non_null(p);
    struct gate g = {.runnable = 4};
    copypool_set_gate(p, fake_runnable, &g, 4); /* 4 runnable on 4 CPUs: none free */
    struct copypool_stats st;
    for (int k = 0; k < 3; k++) {
        struct count_job *c = count_job_new();
        assert_int_equal(copypool_run(p, 200, count_piece, c), 0);
        assert_int_equal(atomic_load(&c->by_caller), 200);
        for (uint32_t i = 0; i < 200; i++) assert_int_equal(atomic_load(&c->runs[i]), 1);
        free(c);
    }
    copypool_get_stats(p, &st);
    assert_int_equal(st.gated, 3);
    assert_int_equal(st.jobs, 0);
    assert_int_equal(st.helper_pieces, 0);
    assert_true(g.asked >= 1 && g.asked <= 3); /* the answer is kept for a while */
    /* a free core (or an unknown count): the helpers are woken and do help */
    const int free_counts[] = {3, -1};
    for (int k = 0; k < 2; k++) {
        g.runnable = free_counts[k];
        copypool_set_gate(p, fake_runnable, &g, 4);
        struct help_job *h = calloc(1, sizeof(*h));
        assert_non_null(h);
        h->caller = pthread_self();
        assert_int_equal(copypool_run(p, 64, help_piece, h), 0);
        assert_true(atomic_load(&h->by_helper) >= 1);
        for (int i = 0; i < 64; i++) assert_int_equal(atomic_load(&h->runs[i]), 1);
        free(h);
    }
    assert_true(copypool_runnable_proc(NULL) >= 1); /* this thread at least */
    copypool_stop(p);
}

/* ---- how copies are split ---- */

static void test_piece_sizes(void **state) {
    (void)state;
    char err[128];
    struct copypool *p1 = copypool_start(1, err, sizeof(err));
    struct copypool *p3 = copypool_start(3, err, sizeof(err));
    assert_non_null(p1);
    assert_non_null(p3);
    uint32_t n = 0;
    /* below the threshold: one piece, on the caller */
    assert_int_equal(copypool_piece_bytes(p3, COPYPOOL_MIN_BYTES - 1, &n), COPYPOOL_MIN_BYTES - 1);
    assert_int_equal(n, 1);
    /* about four pieces per thread, the caller included */
    assert_int_equal(copypool_piece_bytes(p1, 2u << 20, &n), 256u << 10);
    assert_int_equal(n, 8);
    /* never below the smallest piece, never above the largest */
    assert_int_equal(copypool_piece_bytes(p3, COPYPOOL_MIN_BYTES, &n), COPYPOOL_MIN_PIECE);
    assert_int_equal(n, COPYPOOL_MIN_BYTES / COPYPOOL_MIN_PIECE);
    assert_int_equal(copypool_piece_bytes(p1, 64u << 20, &n), COPYPOOL_MAX_PIECE);
    assert_int_equal(n, (64u << 20) / COPYPOOL_MAX_PIECE);
    /* a remainder makes one more, shorter piece */
    assert_int_equal(copypool_piece_bytes(p1, (64u << 20) + 1, &n), COPYPOOL_MAX_PIECE);
    assert_int_equal(n, (64u << 20) / COPYPOOL_MAX_PIECE + 1);
    copypool_stop(p1);
    copypool_stop(p3);
}

/* ---- pooled memcpy ---- */

static void test_memcpy_odd_size(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(3, err, sizeof(err));
    assert_non_null(p);
    size_t n = (3u << 20) + 17;
    unsigned char *src = malloc(n), *dst = calloc(1, n + 64);
    assert_non_null(src);
    assert_non_null(dst);
    for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 131 + (i >> 12));
    uint32_t pieces = 0;
    uint64_t piece = copypool_piece_bytes(p, n, &pieces);
    assert_true(pieces > 4); /* more pieces than threads */
    assert_int_equal(piece % 4096, 0);
    assert_true((uint64_t)pieces * piece >= n && (uint64_t)(pieces - 1) * piece < n);
    copypool_memcpy(p, dst + 1, src, n);
    assert_memory_equal(dst + 1, src, n);
    assert_int_equal(dst[0], 0);
    for (size_t i = n + 1; i < n + 64; i++) assert_int_equal(dst[i], 0);
    free(src);
    free(dst);
    copypool_stop(p);
}

/* Copies of mixed sizes (one of 3 MiB + 17 bytes, small and odd ones) as one job: every byte
 * lands in its own destination, nothing around them is touched, and it is one pool job. */
static void test_memcpy_many_one_job(void **state) {
    (void)state;
    char err[128];
    struct copypool *p = copypool_start(2, err, sizeof(err));
    assert_non_null(p);
    enum { N = 6 };
    const size_t lens[N] = {(3u << 20) + 17, 1, 4096, (512u << 10) - 3, 77777, 1u << 20};
    unsigned char *src[N], *dst[N];
    for (int j = 0; j < N; j++) {
        src[j] = malloc(lens[j]);
        dst[j] = calloc(1, lens[j] + 2);
        assert_non_null(src[j]);
        assert_non_null(dst[j]);
        for (size_t i = 0; i < lens[j]; i++)
            src[j][i] = (unsigned char)(i * 131 + j * 7 + (i >> 12));
    }
    void *d[N];
    const void *sv[N];
    for (int j = 0; j < N; j++) {
        d[j] = dst[j] + 1;
        sv[j] = src[j];
    }
    struct copypool_stats before, after;
    copypool_get_stats(p, &before);
    copypool_memcpy_many(p, d, sv, lens, N);
    copypool_get_stats(p, &after);
    assert_int_equal(after.jobs - before.jobs, 1);
    for (int j = 0; j < N; j++) {
        assert_memory_equal(dst[j] + 1, src[j], lens[j]);
        assert_int_equal(dst[j][0], 0);
        assert_int_equal(dst[j][lens[j] + 1], 0);
        free(src[j]);
        free(dst[j]);
    }
    copypool_stop(p);
}

/* ---- KV gather / scatter ---- */

/* Index of (layer, kv, block) in the engine cache, derived here from the layout's definition. */
static uint64_t ref_block_index(const struct kv_layout *l, uint32_t layer, uint32_t kv,
                                uint32_t block) {
    if (l->order == KV_LAYER_MAJOR)
        return ((uint64_t)layer * l->kv_count + kv) * l->num_blocks + block;
    return ((uint64_t)block * l->num_layers + layer) * l->kv_count + kv;
}

/* Token by token: object [kv][layer][token][bytes] <-> engine blocks. */
static void ref_copy(const struct kv_context *c, uint32_t cs, const uint32_t *ids,
                     unsigned char *obj, int gather, uint32_t skip) {
    const struct kv_layout *l = &c->layout;
    uint64_t bpt = l->bytes_per_token;
    for (uint32_t kv = 0; kv < l->kv_count; kv++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++)
            for (uint32_t t = 0; t < cs; t++) {
                unsigned char *o = obj + (((uint64_t)kv * l->num_layers + layer) * cs + t) * bpt;
                unsigned char *e =
                    c->base + (ref_block_index(l, layer, kv, ids[t / l->tokens_per_block]) *
                                   l->tokens_per_block +
                               t % l->tokens_per_block) *
                                  bpt;
                if (gather)
                    memcpy(o, e, bpt);
                else if (t >= skip)
                    memcpy(e, o, bpt);
            }
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x = x * 1103515245u + 12345u;
        p[i] = (unsigned char)(x >> 16);
    }
}

struct kv_case {
    enum kv_block_order order;
    uint32_t layers, blocks, tpb, kv_count, cs;
    uint64_t bpt;
};

static void check_case(const struct kv_case *k, struct copypool *p) {
    struct kv_context c;
    memset(&c, 0, sizeof(c));
    c.layout = (struct kv_layout){k->layers, k->blocks, k->tpb, k->bpt, k->kv_count, k->order, ""};
    size_t total = kv_layout_bytes(&c.layout), ob = kv_object_bytes(&c.layout, k->cs);
    uint32_t nb = k->cs / k->tpb;
    uint32_t *ids = malloc(nb * sizeof(*ids));
    unsigned char *base = malloc(total), *want = malloc(total), *obj = malloc(ob),
                  *ref = malloc(ob);
    assert_true(ids && base && want && obj && ref);
    for (uint32_t b = 0; b < nb; b++) ids[b] = (b * 7 + 3) % k->blocks; /* permuted, distinct */
    fill(base, total, 1);
    c.base = base;

    /* gather: pooled, and by arbitrary ranges */
    ref_copy(&c, k->cs, ids, ref, 1, 0);
    memset(obj, 0xEE, ob);
    assert_int_equal(kv_gather_pooled(p, &c, k->cs, ids, obj), 0);
    assert_memory_equal(obj, ref, ob);
    memset(obj, 0xEE, ob);
    for (uint64_t from = 0, step = 1; from < ob; step = step * 3 + 1) {
        uint64_t to = from + step > ob ? ob : from + step;
        kv_gather_range(&c, k->cs, ids, obj, from, to);
        from = to;
    }
    assert_memory_equal(obj, ref, ob);

    /* scatter of another object, with several skips: pooled, and by arbitrary ranges */
    fill(obj, ob, 2);
    const uint32_t skips[] = {0, 1, k->tpb, k->tpb + 1, k->cs - 1, k->cs};
    for (size_t s = 0; s < sizeof(skips) / sizeof(skips[0]); s++) {
        fill(base, total, 3 + (unsigned)s);
        memcpy(want, base, total);
        c.base = want;
        ref_copy(&c, k->cs, ids, obj, 0, skips[s]);
        c.base = base;
        assert_int_equal(kv_scatter_pooled(p, &c, k->cs, ids, obj, skips[s]), 0);
        assert_memory_equal(base, want, total);
        fill(base, total, 3 + (unsigned)s);
        for (uint64_t from = 0, step = 5; from < ob; step = step * 2 + 3) {
            uint64_t to = from + step > ob ? ob : from + step;
            kv_scatter_range(&c, k->cs, ids, obj, skips[s], from, to);
            from = to;
        }
        assert_memory_equal(base, want, total);
    }
    /* the guarded variants without a pool */
    ref_copy(&c, k->cs, ids, ref, 1, 0);
    memset(obj, 0, ob);
    assert_int_equal(kv_gather_guarded(&c, k->cs, ids, obj), 0);
    assert_memory_equal(obj, ref, ob);
    free(ids);
    free(base);
    free(want);
    free(obj);
    free(ref);
}

/* Several chunks as one job: every chunk's bytes as chunk by chunk (gather, and scatter with a
 * skip per chunk), one pool job for all of them. */
static void test_kv_many_chunks_one_job(void **state) {
    (void)state;
    char err[128];
    struct copypool *p1 = copypool_start(1, err, sizeof(err));
    assert_non_null(p1);
    struct copypool *pools[] = {NULL, p1};
    enum { N = 3 };
    const struct kv_case cases[] = {
        {KV_LAYER_MAJOR, 3, 48, 16, 2, 256, 2048}, /* 3 MiB objects */
        {KV_BLOCK_MAJOR, 37, 33, 3, 2, 9, 1000},   /* 666000-byte objects, odd units */
        {KV_LAYER_MAJOR, 2, 15, 2, 2, 4, 7},       /* small: on the caller */
    };
    for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++)
        for (size_t pi = 0; pi < 2; pi++) {
            const struct kv_case *k = &cases[ci];
            struct kv_context c;
            memset(&c, 0, sizeof(c));
            c.layout =
                (struct kv_layout){k->layers, k->blocks, k->tpb, k->bpt, k->kv_count, k->order, ""};
            size_t total = kv_layout_bytes(&c.layout), ob = kv_object_bytes(&c.layout, k->cs);
            uint32_t nb = k->cs / k->tpb;
            assert_true(N * nb <= k->blocks);
            uint32_t *ids = malloc((size_t)N * nb * sizeof(*ids));
            unsigned char *base = malloc(total), *want = malloc(total);
            unsigned char *objs[N], *refs[N];
            const uint32_t *idp[N];
            assert_true(ids && base && want);
            for (uint32_t b = 0; b < N * nb; b++) ids[b] = (b * 7 + 3) % k->blocks; /* distinct */
            for (int j = 0; j < N; j++) {
                objs[j] = malloc(ob);
                refs[j] = malloc(ob);
                assert_true(objs[j] && refs[j]);
                idp[j] = ids + (size_t)j * nb;
            }
            fill(base, total, 11);
            c.base = base;
            for (int j = 0; j < N; j++) {
                ref_copy(&c, k->cs, idp[j], refs[j], 1, 0);
                memset(objs[j], 0xEE, ob);
            }
            struct copypool_stats st0, st1;
            copypool_get_stats(pools[pi], &st0);
            uint32_t done = 99;
            assert_int_equal(kv_gather_many(pools[pi], &c, k->cs, idp, objs, N, &done), 0);
            assert_int_equal(done, N);
            copypool_get_stats(pools[pi], &st1);
            if (pools[pi] && (uint64_t)N * ob >= COPYPOOL_MIN_BYTES)
                assert_int_equal(st1.jobs - st0.jobs, 1); /* one job, not one per chunk */
            for (int j = 0; j < N; j++) assert_memory_equal(objs[j], refs[j], ob);

            const uint32_t skips[N] = {0, k->tpb + 1, k->cs};
            for (int j = 0; j < N; j++) fill(objs[j], ob, 20 + (unsigned)j);
            fill(base, total, 12);
            memcpy(want, base, total);
            c.base = want;
            for (int j = 0; j < N; j++) ref_copy(&c, k->cs, idp[j], objs[j], 0, skips[j]);
            c.base = base;
            done = 99;
            assert_int_equal(kv_scatter_many(pools[pi], &c, k->cs, idp,
                                             (const unsigned char *const *)objs, skips, N, &done),
                             0);
            assert_int_equal(done, N);
            assert_memory_equal(base, want, total);
            for (int j = 0; j < N; j++) {
                free(objs[j]);
                free(refs[j]);
            }
            free(ids);
            free(base);
            free(want);
        }
    copypool_stop(p1);
}

/* A mapping that shrank under chunk 1 of 3: the call fails naming chunk 1, chunk 0 is complete
 * (its pieces are never skipped for the fault of a later chunk). */
static void test_kv_many_fault_keeps_the_chunks_before(void **state) {
    (void)state;
    char err[128];
    assert_int_equal(kv_guard_init(), 0);
    struct copypool *p1 = copypool_start(1, err, sizeof(err));
    assert_non_null(p1);
    struct copypool *pools[] = {NULL, p1};
    for (size_t pi = 0; pi < 2; pi++) {
        struct kv_context c;
        memset(&c, 0, sizeof(c));
        /* layer-major, 1 layer, K only: block b is bytes [b * 64 KiB, (b + 1) * 64 KiB) */
        c.layout = (struct kv_layout){1, 48, 16, 4096, 1, KV_LAYER_MAJOR, ""};
        size_t total = kv_layout_bytes(&c.layout), ob = kv_object_bytes(&c.layout, 256);
        int fd = memfd_create("kvmany", 0);
        assert_true(fd >= 0);
        assert_int_equal(ftruncate(fd, (off_t)total), 0);
        unsigned char *m = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        assert_true(m != MAP_FAILED);
        fill(m, total / 2, 5);
        assert_int_equal(ftruncate(fd, (off_t)(total / 2)), 0); /* blocks 24.. are gone */
        c.base = m;
        uint32_t ids[3][16];
        for (uint32_t b = 0; b < 16; b++) {
            ids[0][b] = b;      /* mapped */
            ids[1][b] = 24 + b; /* beyond the end */
            ids[2][b] = b;      /* mapped again */
        }
        const uint32_t *idp[3] = {ids[0], ids[1], ids[2]};
        unsigned char *objs[3];
        for (int j = 0; j < 3; j++) {
            objs[j] = malloc(ob);
            assert_non_null(objs[j]);
            memset(objs[j], 0xEE, ob);
        }
        uint32_t done = 99;
        assert_int_equal(kv_gather_many(pools[pi], &c, 256, idp, objs, 3, &done), -1);
        assert_int_equal(done, 1);
        assert_memory_equal(objs[0], m, ob);
        for (int j = 0; j < 3; j++) free(objs[j]);
        munmap(m, total);
        close(fd);
    }
    copypool_stop(p1);
}

static void test_kv_copies_both_orders(void **state) {
    (void)state;
    char err[128];
    struct copypool *p1 = copypool_start(1, err, sizeof(err));
    struct copypool *p3 = copypool_start(3, err, sizeof(err));
    assert_non_null(p1);
    assert_non_null(p3);
    const struct kv_case cases[] = {
        /* objects above COPYPOOL_MIN_BYTES, units of odd sizes: pieces end mid-unit */
        {KV_LAYER_MAJOR, 37, 11, 3, 2, 9, 1000}, /* 666000-byte objects */
        {KV_BLOCK_MAJOR, 37, 11, 3, 2, 9, 1000},
        {KV_LAYER_MAJOR, 5, 9, 4, 1, 16, 12289}, /* MLA, 983120-byte objects */
        {KV_BLOCK_MAJOR, 5, 9, 4, 1, 16, 12289},
        {KV_BLOCK_MAJOR, 3, 40, 16, 2, 256, 2048}, /* the benchmark's shape, 6 MiB */
        /* small objects: on the caller */
        {KV_LAYER_MAJOR, 2, 5, 2, 2, 4, 7},
        {KV_BLOCK_MAJOR, 2, 5, 2, 2, 4, 7},
    };
    struct copypool *pools[] = {NULL, p1, p3};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        for (size_t k = 0; k < 3; k++) check_case(&cases[i], pools[k]);
    uint32_t pieces = 0;
    copypool_piece_bytes(p3, kv_object_bytes(&(struct kv_layout){37, 11, 3, 1000, 2, 0, ""}, 9),
                         &pieces);
    assert_true(pieces > 3); /* the first case really is split */
    copypool_stop(p1);
    copypool_stop(p3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_piece_once),
        cmocka_unit_test(test_memcpy_many_one_job),
        cmocka_unit_test(test_off_runs_on_caller),
        cmocka_unit_test(test_failure_fails_run),
        cmocka_unit_test(test_busy_pool_caller_does_all),
        cmocka_unit_test(test_idle_pool_helps),
        cmocka_unit_test(test_gate_keeps_jobs_on_the_caller_when_no_core_is_free),
        cmocka_unit_test(test_piece_sizes),
        cmocka_unit_test(test_memcpy_odd_size),
        cmocka_unit_test(test_kv_copies_both_orders),
        cmocka_unit_test(test_kv_many_chunks_one_job),
        cmocka_unit_test(test_kv_many_fault_keeps_the_chunks_before),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
