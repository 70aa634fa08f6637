/* Unit tests for the L1 arena allocator: edge cases, uniform fill, and a random soak that checks
 * the allocator invariants and that live objects never overlap. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/l1/arena.h"

#define MiB (1ull << 20)

static struct arena *mk(uint64_t size, uint32_t unit, bool huge) {
    struct arena_config cfg = {.size_bytes = size, .unit = unit, .use_hugepages = huge};
    struct arena *a = NULL;
    char err[160];
    assert_int_equal(arena_create(&cfg, &a, err, sizeof(err)), 0);
    return a;
}

static void check(struct arena *a) {
    char err[160] = "";
    if (arena_check(a, err, sizeof(err)) != 0) fail_msg("arena invariant: %s", err);
}

static void test_create_errors(void **state) {
    (void)state;
    struct arena *a = NULL;
    char err[160];
    struct arena_config cfg = {.size_bytes = 100};
    assert_int_equal(arena_create(&cfg, &a, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "at least one"));
    cfg.size_bytes = MiB;
    cfg.unit = 1000;
    assert_int_equal(arena_create(&cfg, &a, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "power of two"));
}

static void test_basic(void **state) {
    (void)state;
    struct arena *a = mk(MiB, 0, false);
    assert_int_equal(arena_total_bytes(a), MiB);
    assert_int_equal((uintptr_t)arena_base(a) % 4096, 0);
    uint64_t o1, o2, o3;
    assert_int_equal(arena_alloc(a, 1, &o1), 0);
    assert_int_equal(arena_alloc(a, 4097, &o2), 0);
    assert_int_equal(o1 % 4096, 0);
    assert_int_equal(o2 % 4096, 0);
    assert_int_equal(arena_used_bytes(a), 3 * 4096);
    assert_int_equal(arena_rounded(a, 4097), 8192);
    check(a);
    assert_int_equal(arena_alloc(a, 0, &o3), -1);
    assert_int_equal(arena_alloc(a, 2 * MiB, &o3), -1);
    /* Wrong size, misaligned, double free: refused, nothing changes. */
    assert_int_equal(arena_free(a, o2, 4096), -1);
    assert_int_equal(arena_free(a, o2 + 1, 4097), -1);
    assert_int_equal(arena_free(a, o2, 4097), 0);
    assert_int_equal(arena_free(a, o2, 4097), -1);
    check(a);
    assert_int_equal(arena_free(a, o1, 1), 0);
    check(a);
    struct arena_stats st;
    arena_get_stats(a, &st);
    assert_int_equal(st.used_bytes, 0);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.largest_free_bytes, MiB);
    /* Whole arena in one object. */
    assert_int_equal(arena_alloc(a, MiB, &o3), 0);
    assert_int_equal(o3, 0);
    assert_int_equal(arena_alloc(a, 1, &o1), -1);
    arena_reset(a);
    check(a);
    assert_int_equal(arena_used_bytes(a), 0);
    arena_destroy(a);
}

/* Objects of one layout (the common L1 load) fill the arena completely, in any free order. */
static void test_uniform_fill(void **state) {
    (void)state;
    const uint64_t obj = 9 * 4096 + 100; /* 10 units, not a power of two */
    struct arena *a = mk(64 * MiB, 0, false);
    uint64_t n = 64 * MiB / (10 * 4096), offs[2000];
    assert_true(n <= 2000);
    for (uint64_t i = 0; i < n; i++) assert_int_equal(arena_alloc(a, obj, &offs[i]), 0);
    check(a);
    uint64_t x;
    /* 64 MiB / 40 KiB leaves 6 units: a 10-unit object no longer fits. */
    assert_int_equal(arena_alloc(a, obj, &x), -1);
    srand(7);
    for (int round = 0; round < 20; round++) {
        /* Free a random half, allocate them back: always fits. */
        int freed[2000], nf = 0;
        for (uint64_t i = 0; i < n; i++)
            if (rand() & 1) {
                assert_int_equal(arena_free(a, offs[i], obj), 0);
                freed[nf++] = (int)i;
            }
        check(a);
        for (int j = 0; j < nf; j++) assert_int_equal(arena_alloc(a, obj, &offs[freed[j]]), 0);
        check(a);
    }
    arena_destroy(a);
}

struct live {
    uint64_t off, size;
    uint8_t pat;
};

/* Random alloc/free mix with data patterns: objects never overlap, invariants always hold. */
static void test_soak(void **state) {
    (void)state;
    const uint64_t total = 256 * MiB;
    struct arena *a = mk(total, 0, false);
    char *base = arena_base(a);
    enum { MAXLIVE = 4096, OPS = 200000 };
    struct live *lv = calloc(MAXLIVE, sizeof(*lv));
    assert_non_null(lv);
    int nlive = 0, fails = 0;
    uint64_t live_bytes = 0;
    double worst_ratio = 1.0;
    srand(12345);
    for (int op = 0; op < OPS; op++) {
        bool do_alloc = nlive == 0 || (nlive < MAXLIVE && (rand() % 100) < 55);
        if (do_alloc) {
            /* Sizes from 1 byte to 2 MiB, skewed small, plus exact chunk-like sizes. */
            uint64_t sz = (rand() % 4 == 0) ? (uint64_t)(1 + rand() % 8) * 262144
                                            : 1 + (uint64_t)rand() % (512 * 1024);
            uint64_t off;
            if (arena_alloc(a, sz, &off) != 0) {
                fails++;
                struct arena_stats st;
                arena_get_stats(a, &st);
                /* A refusal must be honest: no free block of the rounded size exists. */
                uint64_t r = arena_rounded(a, sz);
                assert_true(st.largest_free_bytes < r + r / 16 + 4096);
                continue;
            }
            assert_int_equal(off % 4096, 0);
            assert_true(off + sz <= total);
            uint8_t pat = (uint8_t)(op & 0xff);
            /* Stamp the first and last byte: an overlap would overwrite a neighbour's stamp. */
            base[off] = (char)pat;
            base[off + sz - 1] = (char)pat;
            lv[nlive++] = (struct live){off, sz, pat};
            live_bytes += arena_rounded(a, sz);
        } else {
            int i = rand() % nlive;
            assert_int_equal((uint8_t)base[lv[i].off], lv[i].pat);
            assert_int_equal((uint8_t)base[lv[i].off + lv[i].size - 1], lv[i].pat);
            assert_int_equal(arena_free(a, lv[i].off, lv[i].size), 0);
            live_bytes -= arena_rounded(a, lv[i].size);
            lv[i] = lv[--nlive];
        }
        assert_int_equal(arena_used_bytes(a), live_bytes);
        if (op % 5000 == 0) {
            check(a);
            struct arena_stats st;
            arena_get_stats(a, &st);
            if (st.free_bytes > total / 4) {
                double r = (double)st.largest_free_bytes / (double)st.free_bytes;
                if (r < worst_ratio) worst_ratio = r;
            }
        }
    }
    check(a);
    print_message("soak: %d refusals, worst largest-free/free ratio %.3f\n", fails, worst_ratio);
    for (int i = 0; i < nlive; i++) assert_int_equal(arena_free(a, lv[i].off, lv[i].size), 0);
    check(a);
    struct arena_stats st;
    arena_get_stats(a, &st);
    assert_int_equal(st.free_blocks, 1);
    assert_int_equal(st.allocated_objects, 0);
    free(lv);
    arena_destroy(a);
}

static void test_hugepages_fallback(void **state) {
    (void)state;
    /* With or without a huge page pool the arena comes up and works. */
    struct arena *a = mk(4 * MiB, 0, true);
    uint64_t off;
    assert_int_equal(arena_alloc(a, 4096, &off), 0);
    memset(arena_ptr(a, off), 1, 4096);
    assert_int_equal(arena_free(a, off, 4096), 0);
    arena_destroy(a);
}

static void test_large_unit(void **state) {
    (void)state;
    struct arena *a = mk(8 * MiB + 100, 65536, false);
    assert_int_equal(arena_total_bytes(a), 8 * MiB);
    uint64_t off;
    assert_int_equal(arena_alloc(a, 1, &off), 0);
    assert_int_equal(arena_used_bytes(a), 65536);
    assert_int_equal(arena_free(a, off, 1), 0);
    check(a);
    arena_destroy(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_errors),      cmocka_unit_test(test_basic),
        cmocka_unit_test(test_uniform_fill),       cmocka_unit_test(test_soak),
        cmocka_unit_test(test_hugepages_fallback), cmocka_unit_test(test_large_unit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
