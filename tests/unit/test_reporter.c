/* The master reporter's internals (src/server/fleet/reporter.c, included): the full report
 * copies the table in bounded steps under the reporter mutex, and changes, inserts and table
 * growth between steps lose nothing. No master, no threads. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../../src/server/fleet/reporter.c"

static struct reporter *mk(void) {
    struct reporter *r = calloc(1, sizeof(*r));
    assert_non_null(r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    assert_int_equal(ptable_init(&r->tab), 0);
    return r;
}

static void hash_n(uint8_t h[32], uint64_t n) {
    memset(h, 0, 32);
    uint64_t v = n * 0x9e3779b97f4a7c15ull;
    memcpy(h, &v, 8);
    memcpy(h + 8, &n, 8);
}

static uint64_t num_of(const uint8_t h[32]) {
    uint64_t n;
    memcpy(&n, h + 8, 8);
    return n;
}

static struct entry *find_n(struct reporter *r, uint64_t n) {
    uint8_t h[32];
    hash_n(h, n);
    return do_find(r, h);
}

/* Regression: the full report held the mutex while it hex-encoded every hash, so the placement
 * listener (data-path threads, cache locks held) waited up to a quarter second at 2M hashes. */
static void test_full_report_copies_in_bounded_steps(void **st) {
    (void)st;
    struct reporter *r = mk();
    const uint64_t N = 10000, MORE = 30000, CAP = 1000;
    uint8_t h[32];
    for (uint64_t i = 0; i < N; i++) {
        hash_n(h, i);
        on_placement(r, h, ENGINE_TIER_DRAM, true);
    }
    size_t nb0 = ptable_nbuckets(&r->tab);
    struct synccopy sc = {.cap = CAP, .gen = 1};
    sc.hash = malloc(CAP * sizeof(*sc.hash));
    sc.mask = malloc(CAP);
    uint32_t *seen = calloc(N + MORE, sizeof(*seen));
    size_t b = 0, steps = 0;
    bool more = true;
    while (more) {
        more = take_sync_batch(r, &b, &sc);
        steps++;
        assert_true(sc.taken <= CAP);
        for (size_t i = 0; i < sc.n; i++) {
            uint64_t n = num_of(sc.hash[i]);
            assert_true(n < N + MORE);
            seen[n]++;
            assert_int_equal(sc.mask[i], 1);
        }
        if (steps == 2) {
            /* Between steps: the table grows (inserts), one copied entry and one not yet
             * copied lose their DRAM object, and a new hash joins. */
            for (uint64_t i = N; i < N + MORE; i++) {
                hash_n(h, i);
                on_placement(r, h, ENGINE_TIER_DRAM, true);
            }
            assert_true(ptable_nbuckets(&r->tab) > nb0);
            uint64_t copied = UINT64_MAX, pending = UINT64_MAX;
            for (uint64_t i = 0; i < N; i++) {
                if (seen[i] && copied == UINT64_MAX) copied = i;
                if (!seen[i] && find_n(r, i)->sync_gen != 1 && pending == UINT64_MAX) pending = i;
            }
            assert_true(copied != UINT64_MAX && pending != UINT64_MAX);
            hash_n(h, copied);
            on_placement(r, h, ENGINE_TIER_DRAM, false);
            hash_n(h, pending);
            on_placement(r, h, ENGINE_TIER_DRAM, false);
            /* Told DRAM by this report: a flush after it revokes it. */
            assert_int_equal(find_n(r, copied)->reported, 1);
            assert_true(find_n(r, copied)->queued);
            seen[pending] = 1000; /* must not be copied: nothing held */
        }
    }
    assert_true(steps >= N / CAP);
    /* Every hash held when the report began was copied exactly once, growth or not (the one
     * dropped before its step was not). */
    for (uint64_t i = 0; i < N; i++)
        if (seen[i] != 1000) assert_int_equal(seen[i], 1);
    /* The changes queued meanwhile: the copied-then-dropped hash is revoked, every hash added
     * during the report is reported unless the report already did (no double send). */
    struct hexbatch add[NT] = {0}, rev[NT] = {0};
    bool oom = false;
    take_queue(r, 0, add, rev, &oom);
    assert_false(oom);
    assert_int_equal(rev[T_DRAM].n, 1);
    assert_int_equal(add[T_SSD].n + rev[T_SSD].n, 0);
    size_t late = 0;
    for (uint64_t i = N; i < N + MORE; i++) late += seen[i] == 0;
    assert_int_equal(add[T_DRAM].n, late);
    for (int t = 0; t < NT; t++) {
        hb_free(&add[t]);
        hb_free(&rev[t]);
    }
    free(seen);
    free(sc.hash);
    free(sc.mask);
    ptable_fini(&r->tab, offsetof(struct entry, pe));
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_full_report_copies_in_bounded_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
