/* The Redis store's read cache (src/master/mcache.c): hits and misses, the fill tickets that
 * forbid a stale fill, flush and the off state, the byte budget and CLOCK eviction, and a
 * threaded run where every fill races invalidations. */
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "master/mcache.h"

static int get(struct mcache *c, const char *k, char *val, size_t vcap, uint64_t *ticket) {
    struct mcache_buf b = {0};
    int rc = mcache_get(c, 'x', k, strlen(k), mcache_hash('x', k, strlen(k)), &b, ticket);
    if (rc == 1) snprintf(val, vcap, "%.*s", (int)b.n, (const char *)b.p);
    free(b.p);
    return rc;
}

static void fill(struct mcache *c, const char *k, uint64_t t, const char *v) {
    mcache_fill(c, 'x', k, strlen(k), mcache_hash('x', k, strlen(k)), t, v, strlen(v));
}

static void test_off_until_enabled(void **st) {
    (void)st;
    struct mcache *c = mcache_new(1 << 20);
    assert_non_null(c);
    char v[64];
    uint64_t t = 0;
    assert_int_equal(get(c, "a", v, sizeof(v), &t), -1);
    mcache_enable(c);
    assert_int_equal(get(c, "a", v, sizeof(v), &t), 0);
    fill(c, "a", t, "v1");
    assert_int_equal(get(c, "a", v, sizeof(v), &t), 1);
    assert_string_equal(v, "v1");
    /* The same key of another kind is another entry. */
    struct mcache_buf b = {0};
    assert_int_equal(mcache_get(c, 'p', "a", 1, mcache_hash('p', "a", 1), &b, &t), 0);
    free(b.p);
    mcache_free(c);
}

static void test_invalidation_between_miss_and_fill_drops_the_fill(void **st) {
    (void)st;
    struct mcache *c = mcache_new(1 << 20);
    mcache_enable(c);
    char v[64];
    uint64_t t = 0;
    assert_int_equal(get(c, "k", v, sizeof(v), &t), 0);
    mcache_invalidate(c, 'x', "k", 1); /* the write's invalidation overtakes the fill */
    fill(c, "k", t, "old");
    assert_int_equal(get(c, "k", v, sizeof(v), &t), 0);
    fill(c, "k", t, "new");
    assert_int_equal(get(c, "k", v, sizeof(v), &t), 1);
    assert_string_equal(v, "new");
    /* An invalidation after the fill drops the entry. */
    mcache_invalidate(c, 'x', "k", 1);
    assert_int_equal(get(c, "k", v, sizeof(v), &t), 0);
    struct mcache_stats s;
    mcache_stats(c, &s);
    assert_int_equal(s.invalidations, 2);
    assert_int_equal(s.fills_dropped, 1);
    assert_int_equal(s.hits, 1);
    mcache_free(c);
}

static void test_flush_and_disable_void_pending_fills(void **st) {
    (void)st;
    struct mcache *c = mcache_new(1 << 20);
    mcache_enable(c);
    char v[64];
    uint64_t t1 = 0, t2 = 0;
    assert_int_equal(get(c, "a", v, sizeof(v), &t1), 0);
    fill(c, "a", t1, "1");
    assert_int_equal(get(c, "b", v, sizeof(v), &t2), 0);
    mcache_flush(c);
    assert_int_equal(get(c, "a", v, sizeof(v), &t1), 0);
    fill(c, "b", t2, "stale");
    assert_int_equal(get(c, "b", v, sizeof(v), &t2), 0);
    /* Disable: off, flushed; a fill of a ticket from before never lands, even once back on. */
    mcache_disable(c);
    assert_false(mcache_enabled(c));
    fill(c, "b", t2, "stale");
    mcache_enable(c);
    assert_int_equal(get(c, "b", v, sizeof(v), &t2), 0);
    struct mcache_stats s;
    mcache_stats(c, &s);
    assert_int_equal(s.flushes, 2);
    assert_int_equal(s.entries, 0);
    assert_int_equal(s.bytes, 0);
    mcache_free(c);
}

static void test_budget_evicts_what_was_not_read(void **st) {
    (void)st;
    /* 256 stripes x 1 KiB: ~9 entries of 100 bytes per stripe. */
    struct mcache *c = mcache_new(256 * 1024);
    mcache_enable(c);
    char k[32], v[64], val[21];
    memset(val, 'v', 20);
    val[20] = 0;
    uint64_t t = 0;
    for (int i = 0; i < 20000; i++) {
        snprintf(k, sizeof(k), "key%d", i);
        assert_int_equal(get(c, k, v, sizeof(v), &t), 0);
        fill(c, k, t, val);
        if (i == 0) continue;
        /* key0 stays: it is read before every insert, so never the least recent. */
        assert_int_equal(get(c, "key0", v, sizeof(v), &t), 1);
    }
    struct mcache_stats s;
    mcache_stats(c, &s);
    assert_true(s.bytes <= 256 * 1024);
    assert_true(s.entries > 1000);
    assert_true(s.evictions > 10000);
    /* A value over a stripe's share is not cached. */
    char *big = calloc(1, 4096);
    memset(big, 'b', 4095);
    assert_int_equal(get(c, "big", v, sizeof(v), &t), 0);
    fill(c, "big", t, big);
    assert_int_equal(get(c, "big", v, sizeof(v), &t), 0);
    free(big);
    mcache_free(c);
}

/* The writer bumps a key's version (the write), invalidates it, then publishes the version
 * as acknowledged; readers miss, read the current version (the read), fill. A hit must never
 * return a version older than one acknowledged before the lookup began. */
#define NKEYS 64
static _Atomic uint64_t g_ver[NKEYS], g_acked[NKEYS];
static _Atomic int g_stop;
static struct mcache *g_c;

static void *writer(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    for (int n = 0; n < 200000; n++) {
        int k = (int)(rand_r(&seed) % NKEYS);
        char key[16];
        snprintf(key, sizeof(key), "%d", k);
        uint64_t v = atomic_fetch_add(&g_ver[k], 1) + 1;
        mcache_invalidate(g_c, 'x', key, strlen(key));
        atomic_store(&g_acked[k], v);
    }
    atomic_store(&g_stop, 1);
    return NULL;
}

static void *reader(void *arg) {
    unsigned seed = (unsigned)(uintptr_t)arg;
    uintptr_t bad = 0;
    struct mcache_buf b = {0};
    while (!atomic_load(&g_stop)) {
        int k = (int)(rand_r(&seed) % NKEYS);
        char key[16];
        snprintf(key, sizeof(key), "%d", k);
        uint64_t before = atomic_load(&g_acked[k]), t = 0;
        uint64_t hv = mcache_hash('x', key, strlen(key));
        b.n = 0;
        int rc = mcache_get(g_c, 'x', key, strlen(key), hv, &b, &t);
        if (rc == 1) {
            uint64_t got;
            memcpy(&got, b.p, sizeof(got));
            if (got < before) bad++;
        } else if (rc == 0) {
            uint64_t v = atomic_load(&g_ver[k]); /* "the read" */
            mcache_fill(g_c, 'x', key, strlen(key), hv, t, &v, sizeof(v));
        }
    }
    free(b.p);
    return (void *)bad;
}

static void test_threaded_fills_never_stale(void **st) {
    (void)st;
    g_c = mcache_new(1 << 20);
    mcache_enable(g_c);
    pthread_t w, r[2];
    for (int i = 0; i < 2; i++) pthread_create(&r[i], NULL, reader, (void *)(uintptr_t)(i + 1));
    pthread_create(&w, NULL, writer, (void *)(uintptr_t)7);
    pthread_join(w, NULL);
    uintptr_t bad = 0;
    for (int i = 0; i < 2; i++) {
        void *ret;
        pthread_join(r[i], &ret);
        bad += (uintptr_t)ret;
    }
    assert_int_equal(bad, 0);
    mcache_free(g_c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_off_until_enabled),
        cmocka_unit_test(test_invalidation_between_miss_and_fill_drops_the_fill),
        cmocka_unit_test(test_flush_and_disable_void_pending_fills),
        cmocka_unit_test(test_budget_evicts_what_was_not_read),
        cmocka_unit_test(test_threaded_fills_never_stale),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
