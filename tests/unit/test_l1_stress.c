/* Multi-threaded stress of the L1 table: threads store, read, delete, touch and evict
 * overlapping keys of several salts in a small arena while one thread runs the evictor tick.
 * Every read under a read lock checks the object's bytes, so an entry freed or reused while
 * locked shows up as a mismatch; ThreadSanitizer runs this test (scripts/test-extra.sh).
 *
 * The fake clock follows the workers: each publishes the time its current operation started,
 * and the ticker never moves the clock more than half a lease past the slowest of them, so a
 * worker slowed down (TSan, a loaded machine) can never see its lease run out under it; a
 * mismatch is then always a bug. Each worker also checks that promise after every operation. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/l1/l1.h"

#define NKEYS          192
#define NTHREADS       4
#define OPS_PER_THREAD 100000
#define SEC            1000000000ull
#define TTL            (60 * SEC)
#define IDLE           UINT64_MAX /* a worker between runs or done */

struct ctx {
    struct l1 *l1;
    struct l1_key keys[NKEYS];
    _Atomic uint64_t clock;             /* fake time, advanced by the ticking thread */
    _Atomic uint64_t started[NTHREADS]; /* the clock at the start of each worker's operation */
    _Atomic int running;
    _Atomic uint64_t mismatches, stores, reads, nomem, overruns, ticks;
};

struct worker_arg {
    struct ctx *c;
    int id;
};

static uint64_t obj_size(unsigned i) { return 4096u * (1 + i % 7) + (i % 3) * 100; }

static void fill(void *p, uint64_t size, unsigned i) {
    uint64_t tag = 0xfeed000000000000ull | i;
    memcpy(p, &tag, sizeof(tag));
    memset((char *)p + 8, (int)(i & 0xff), size - 8);
}

static bool check(const void *p, uint64_t size, unsigned i) {
    uint64_t tag;
    memcpy(&tag, p, sizeof(tag));
    const unsigned char *c = p;
    return tag == (0xfeed000000000000ull | i) && c[8] == (i & 0xff) && c[size - 1] == (i & 0xff);
}

static void *worker(void *arg) {
    struct ctx *c = ((struct worker_arg *)arg)->c;
    int id = ((struct worker_arg *)arg)->id;
    unsigned seed = (unsigned)(uintptr_t)pthread_self();
    for (int op = 0; op < OPS_PER_THREAD; op++) {
        unsigned i = (unsigned)rand_r(&seed) % NKEYS;
        const struct l1_key *k = &c->keys[i];
        /* Published before use: the ticker bounds the clock by this value (or an older, smaller
         * one it read before), so every lease taken at `now` outlives the operation. */
        uint64_t now = atomic_load(&c->clock);
        atomic_store(&c->started[id], now);
        int what = rand_r(&seed) % 100;
        struct l1_ref r;
        if (what < 40) {
            int rc = l1_reserve_write(c->l1, k, obj_size(i), (what % 10) == 0, now, &r);
            if (rc == L1_OK) {
                fill(r.data, r.size, i);
                bool locked = (what % 5) == 0; /* prefetch-like: admit with a read lock */
                if (l1_finish_write(c->l1, k, r.token, locked ? 1 : 0, now) == L1_OK && locked) {
                    struct l1_ref r2;
                    if (l1_read_locked(c->l1, k, now, &r2) != L1_OK || !check(r2.data, r2.size, i))
                        atomic_fetch_add(&c->mismatches, 1);
                    l1_finish_read(c->l1, k, 1, now);
                }
                atomic_fetch_add(&c->stores, 1);
            } else if (rc == L1_ERR_NOMEM) {
                atomic_fetch_add(&c->nomem, 1);
            }
        } else if (what < 80) {
            if (l1_reserve_read(c->l1, k, 1, now, &r) == L1_OK) {
                if (r.size != obj_size(i) || !check(r.data, r.size, i))
                    atomic_fetch_add(&c->mismatches, 1);
                struct l1_ref r2;
                if (l1_read_locked(c->l1, k, now, &r2) != L1_OK || r2.data != r.data)
                    atomic_fetch_add(&c->mismatches, 1);
                l1_finish_read(c->l1, k, 1, now);
                atomic_fetch_add(&c->reads, 1);
            }
        } else if (what < 90) {
            l1_delete(c->l1, k, false, now);
        } else if (what < 97) {
            l1_touch(c->l1, k, now);
        } else if (what < 98) {
            if (rand_r(&seed) % 20 == 0) l1_clear(c->l1, false, now);
        } else {
            struct l1_stats st;
            l1_get_stats(c->l1, now, &st);
        }
        if (atomic_load(&c->clock) - now >= TTL / 2) atomic_fetch_add(&c->overruns, 1);
    }
    atomic_store(&c->started[id], IDLE);
    return NULL;
}

static void *ticker(void *arg) {
    struct ctx *c = arg;
    while (atomic_load(&c->running)) {
        /* 10 ms of fake time per tick, but never more than TTL / 2 past the start of any
         * worker's current operation: leases (60 s) never expire under a live copy. */
        uint64_t slowest = IDLE;
        for (int w = 0; w < NTHREADS; w++) {
            uint64_t t = atomic_load(&c->started[w]);
            if (t < slowest) slowest = t;
        }
        uint64_t now = atomic_load(&c->clock), next = now + 10000000ull;
        if (slowest != IDLE && next > slowest + TTL / 2 - 1) next = slowest + TTL / 2 - 1;
        if (next > now) {
            atomic_store(&c->clock, next);
            now = next;
            atomic_fetch_add(&c->ticks, 1);
        }
        struct l1_tick_report rep;
        l1_evict_tick(c->l1, now, &rep);
        l1_quota_changed(c->l1);
        sched_yield();
    }
    return NULL;
}

static void run(enum l1_policy pol) {
    struct quota *q = quota_create();
    char err[160];
    assert_int_equal(quota_set(q, "a", 256 * 1024, err, sizeof(err)), 0);
    assert_int_equal(quota_set(q, "", 512 * 1024, err, sizeof(err)), 0);
    struct l1_config cfg = {.size_bytes = 2 << 20,
                            .policy = pol,
                            .read_ttl_ns = TTL,
                            .write_ttl_ns = TTL,
                            .touch_interval_ns = 1000000,
                            .stripes = 16,
                            .alloc_evict_max = 256,
                            .quota = q};
    struct ctx *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    assert_int_equal(l1_create(&cfg, &c->l1, err, sizeof(err)), 0);
    const char *salts[3] = {"", "a", "b"};
    for (unsigned i = 0; i < NKEYS; i++) {
        struct keys_object_key k;
        char hex[9];
        snprintf(hex, sizeof(hex), "%08x", i / 3);
        const char *s = salts[i % 3];
        assert_int_equal(keys_object_key_init(&k, hex, 8, "model", 5, 0x01000100, i % 2, s,
                                              strlen(s), err, sizeof(err)),
                         0);
        assert_int_equal(l1_key_make(c->l1, &k, &c->keys[i]), L1_OK);
    }
    atomic_store(&c->clock, SEC);
    for (int i = 0; i < NTHREADS; i++) atomic_store(&c->started[i], SEC);
    atomic_store(&c->running, 1);
    pthread_t th[NTHREADS], tk;
    struct worker_arg wa[NTHREADS];
    assert_int_equal(pthread_create(&tk, NULL, ticker, c), 0);
    for (int i = 0; i < NTHREADS; i++) {
        wa[i] = (struct worker_arg){c, i};
        assert_int_equal(pthread_create(&th[i], NULL, worker, &wa[i]), 0);
    }
    for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
    atomic_store(&c->running, 0);
    pthread_join(tk, NULL);

    struct l1_stats st;
    uint64_t now = atomic_load(&c->clock);
    l1_get_stats(c->l1, now, &st);
    print_message("policy %d: %llu stores, %llu reads, %llu nomem, %llu evicted, usage %.2f\n",
                  (int)pol, (unsigned long long)atomic_load(&c->stores),
                  (unsigned long long)atomic_load(&c->reads),
                  (unsigned long long)atomic_load(&c->nomem), (unsigned long long)st.evicted_chunks,
                  st.usage_ratio);
    assert_int_equal(atomic_load(&c->overruns), 0);
    assert_int_equal(atomic_load(&c->mismatches), 0);
    assert_true(atomic_load(&c->ticks) > 0);
    assert_true(atomic_load(&c->stores) > 0);
    assert_true(atomic_load(&c->reads) > 0);
    assert_true(st.bytes_used <= st.bytes_total);
    /* Everything comes back: a forced clear leaves an empty arena and zero usage per salt. */
    l1_clear(c->l1, true, now);
    l1_get_stats(c->l1, now, &st);
    assert_int_equal(st.bytes_used, 0);
    assert_int_equal(st.objects + st.staging_objects, 0);
    for (int i = 0; i < 3; i++) assert_int_equal(l1_salt_usage_bytes(c->l1, salts[i]), 0);
    l1_destroy(c->l1);
    quota_destroy(q);
    free(c);
}

static void test_stress_lru(void **state) {
    (void)state;
    run(L1_POLICY_LRU);
}

static void test_stress_isolated_lru(void **state) {
    (void)state;
    run(L1_POLICY_ISOLATED_LRU);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stress_lru),
        cmocka_unit_test(test_stress_isolated_lru),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
