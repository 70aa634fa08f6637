/* The storage controller against a real L1 and a real fs adapter in a temporary directory:
 * write-through (default and skip_l1), prefetch (PREFIX and SPARSE), L2 eviction (LRU and
 * IsolatedLRU), restart. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "server/l2/controller.h"
#include "test_util.h"

#define OBJ 65536

struct env {
    char dir[64];
    struct l1 *l1;
    struct quota *q;
    struct l2ctl *c;
};

static void fill(uint8_t *p, size_t n, int seed) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed * 31 + i * 13 + (i >> 8));
}

static void env_open(struct env *e, const char *extra, enum l2ctl_store_policy pol) {
    char err[256];
    if (!e->l1) {
        struct l1_config lc = {.size_bytes = 64u << 20, .policy = L1_POLICY_LRU};
        assert_int_equal(l1_create(&lc, &e->l1, err, sizeof(err)), 0);
        e->q = quota_create();
    }
    char js[512];
    snprintf(js, sizeof(js), "[{\"type\":\"fs\",\"base_path\":\"%s\"%s}]", e->dir,
             extra ? extra : "");
    json_t *cfg = json_loads(js, 0, NULL);
    assert_non_null(cfg);
    struct l2ctl_config cc = {.l1 = e->l1, .quota = e->q, .store_policy = pol};
    int rc = l2ctl_create(&cc, cfg, &e->c, err, sizeof(err));
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, L2_OK);
    assert_int_equal(l2ctl_start(e->c, err, sizeof(err)), L2_OK);
    json_decref(cfg);
}

static void env_init(struct env *e, const char *extra, enum l2ctl_store_policy pol) {
    memset(e, 0, sizeof(*e));
    snprintf(e->dir, sizeof(e->dir), "/tmp/lmcache-l2c-XXXXXX");
    assert_non_null(mkdtemp(e->dir));
    env_open(e, extra, pol);
}

static void env_fini(struct env *e) {
    l2ctl_destroy(e->c);
    l1_destroy(e->l1);
    quota_destroy(e->q);
    test_rm_rf(e->dir);
}

static void mk(struct env *e, int i, const char *salt, struct keys_object_key *k,
               struct l1_key *lk) {
    char hex[65], err[KEYS_ERR_MAX];
    snprintf(hex, sizeof(hex), "%064x", i + 1);
    assert_int_equal(keys_object_key_init(k, hex, 64, "org/m", 5, 0x01000100u, 0, salt,
                                          strlen(salt), err, sizeof(err)),
                     0);
    assert_int_equal(l1_key_make(e->l1, k, lk), L1_OK);
}

/* Puts objects into L1 like a STORE would and hands them to the write-through queue. */
static void put(struct env *e, struct keys_object_key *k, struct l1_key *lk, int first, int n) {
    uint64_t now = clock_mono_ns();
    for (int i = first; i < first + n; i++) {
        struct l1_ref ref;
        assert_int_equal(l1_reserve_write(e->l1, &lk[i], OBJ, false, now, &ref), L1_OK);
        fill(ref.data, OBJ, i);
        assert_int_equal(l1_finish_write(e->l1, &lk[i], ref.token, 0, now), L1_OK);
    }
    assert_int_equal(l2ctl_store(e->c, k + first, lk + first, (size_t)n), (size_t)n);
}

/* Waits (bounded) until the write-through queue is idle. */
static void wait_stores(struct env *e) {
    for (int i = 0; i < 20000; i++) {
        struct l2ctl_stats st;
        l2ctl_stats(e->c, &st);
        if (st.store_completed_objects + st.store_failed_objects + st.store_dropped_objects >=
                st.store_submitted_objects &&
            st.store_queue_depth == 0 && st.store_in_flight == 0)
            return;
        usleep(1000);
    }
    fail_msg("write-through did not finish");
}

static int wait_prefetch(struct env *e, uint64_t id, struct l2ctl_prefetch_result *r) {
    for (int i = 0; i < 20000; i++) {
        int rc = l2ctl_prefetch_poll(e->c, id, r);
        if (rc != L2_ERR_BUSY) return rc;
        usleep(1000);
    }
    fail_msg("prefetch did not finish");
    return -1;
}

static void drop_l1(struct env *e, struct l1_key *lk, int n) {
    for (int i = 0; i < n; i++) l1_delete(e->l1, &lk[i], true, clock_mono_ns());
}

static void check_bytes(struct env *e, struct l1_key *lk, int i) {
    struct l1_ref ref;
    assert_int_equal(l1_read_locked(e->l1, &lk[i], clock_mono_ns(), &ref), L1_OK);
    uint8_t *x = malloc(OBJ);
    fill(x, OBJ, i);
    assert_int_equal(ref.size, OBJ);
    assert_memory_equal(ref.data, x, OBJ);
    free(x);
}

enum { N = 8 };

static void test_write_through_and_prefix(void **state) {
    (void)state;
    struct env e;
    env_init(&e, NULL, L2CTL_STORE_DEFAULT);
    struct keys_object_key k[N];
    struct l1_key lk[N];
    for (int i = 0; i < N; i++) mk(&e, i, "", &k[i], &lk[i]);
    put(&e, k, lk, 0, N);
    wait_stores(&e);
    struct l2ctl_stats st;
    l2ctl_stats(e.c, &st);
    assert_int_equal(st.store_completed_objects, N);
    assert_int_equal(l2ctl_usage_bytes(e.c), (uint64_t)N * OBJ);
    assert_int_equal(l2ctl_salt_usage_bytes(e.c, ""), (uint64_t)N * OBJ);
    /* L1 forgets everything; a PREFIX prefetch brings it back, read-locked, byte-identical */
    drop_l1(&e, lk, N);
    uint64_t id;
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_PREFIX, 1, true, NULL, NULL, &id), L2_OK);
    struct l2ctl_prefetch_result r;
    assert_int_equal(wait_prefetch(&e, id, &r), L2_OK);
    assert_int_equal(r.total, N);
    assert_int_equal(r.found, N);
    assert_int_equal(r.prefix, N);
    for (int i = 0; i < N; i++) {
        assert_int_equal(r.ready[i], 1);
        check_bytes(&e, lk, i);
    }
    /* exactly once */
    assert_int_equal(l2ctl_prefetch_poll(e.c, id, &r), L2_ERR_NOT_FOUND);
    /* temporary objects are freed by their last read */
    for (int i = 0; i < N; i++) l1_finish_read(e.l1, &lk[i], 1, clock_mono_ns());
    struct l1_stats ls;
    l1_get_stats(e.l1, clock_mono_ns(), &ls);
    assert_int_equal(ls.objects, 0);
    /* a gap at key 3: PREFIX stops there, SPARSE loads the rest */
    uint8_t del;
    size_t skipped;
    assert_int_equal(l2ctl_delete(e.c, 0, &k[3], 1, &del, &skipped), L2_OK);
    assert_int_equal(del, 1);
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_PREFIX, 1, true, NULL, NULL, &id), L2_OK);
    assert_int_equal(wait_prefetch(&e, id, &r), L2_OK);
    assert_int_equal(r.prefix, 3);
    assert_int_equal(r.found, 3);
    for (int i = 0; i < 3; i++) l1_finish_read(e.l1, &lk[i], 1, clock_mono_ns());
    l1_get_stats(e.l1, clock_mono_ns(), &ls);
    assert_int_equal(ls.objects, 0); /* nothing past the gap was left behind */
    /* warm prefetch: SPARSE, retained, no locks */
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &id), L2_OK);
    assert_int_equal(wait_prefetch(&e, id, &r), L2_OK);
    assert_int_equal(r.found, N - 1);
    assert_int_equal(r.ready[3], 0);
    l1_get_stats(e.l1, clock_mono_ns(), &ls);
    assert_int_equal(ls.objects, N - 1);
    assert_int_equal(ls.temporary_objects, 0);
    for (int i = 0; i < N; i++) {
        if (i == 3) continue;
        struct l1_ref ref;
        assert_int_equal(l1_reserve_read(e.l1, &lk[i], 1, clock_mono_ns(), &ref), L1_OK);
        check_bytes(&e, lk, i);
        l1_finish_read(e.l1, &lk[i], 1, clock_mono_ns());
    }
    /* already resident keys are skipped by a warm prefetch and not counted */
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &id), L2_OK);
    assert_int_equal(wait_prefetch(&e, id, &r), L2_OK);
    assert_int_equal(r.found, 0);
    assert_int_equal(l2ctl_prefetch_poll(e.c, 12345, &r), L2_ERR_NOT_FOUND);
    json_t *s = l2ctl_status(e.c);
    assert_true(json_is_true(json_object_get(s, "is_healthy")));
    assert_int_equal(json_array_size(json_object_get(s, "adapters")), 1);
    json_decref(s);
    json_t *ad = l2ctl_adapters_json(e.c);
    assert_string_equal(json_string_value(json_object_get(json_array_get(ad, 0), "type_name")),
                        "fs");
    json_decref(ad);
    assert_int_equal(l2ctl_find_adapter(e.c, NULL), 0);
    assert_int_equal(l2ctl_find_adapter(e.c, "fs"), 0);
    assert_int_equal(l2ctl_find_adapter(e.c, "s3"), -1);
    /* restart: the data is still served from the fs tier */
    l2ctl_destroy(e.c);
    drop_l1(&e, lk, N);
    env_open(&e, NULL, L2CTL_STORE_DEFAULT);
    assert_int_equal(l2ctl_usage_bytes(e.c), (uint64_t)(N - 1) * OBJ);
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, 3, L2CTL_TRIM_PREFIX, 1, true, NULL, NULL, &id), L2_OK);
    assert_int_equal(wait_prefetch(&e, id, &r), L2_OK);
    assert_int_equal(r.prefix, 3);
    for (int i = 0; i < 3; i++) {
        check_bytes(&e, lk, i);
        l1_finish_read(e.l1, &lk[i], 1, clock_mono_ns());
    }
    env_fini(&e);
}

struct cbres {
    int calls;
    size_t prefix;
};
static void on_done(void *arg, const struct l2ctl_prefetch_result *r) {
    struct cbres *c = arg;
    c->prefix = r->prefix;
    __atomic_add_fetch(&c->calls, 1, __ATOMIC_SEQ_CST);
}

static void test_skip_l1_and_callback(void **state) {
    (void)state;
    struct env e;
    env_init(&e, NULL, L2CTL_STORE_SKIP_L1);
    struct keys_object_key k[N];
    struct l1_key lk[N];
    for (int i = 0; i < N; i++) mk(&e, i, "s", &k[i], &lk[i]);
    put(&e, k, lk, 0, N);
    wait_stores(&e);
    struct l2ctl_stats st;
    l2ctl_stats(e.c, &st);
    assert_int_equal(st.skip_l1_deleted, N);
    struct l1_stats ls;
    l1_get_stats(e.l1, clock_mono_ns(), &ls);
    assert_int_equal(ls.objects, 0);
    struct cbres cr = {0};
    uint64_t id;
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_PREFIX, 2, true, on_done, &cr, &id), L2_OK);
    for (int i = 0; i < 20000 && !__atomic_load_n(&cr.calls, __ATOMIC_SEQ_CST); i++) usleep(1000);
    assert_int_equal(cr.calls, 1);
    assert_int_equal(cr.prefix, N);
    for (int i = 0; i < N; i++) l1_finish_read(e.l1, &lk[i], 2, clock_mono_ns());
    env_fini(&e);
}

static void test_evict_lru(void **state) {
    (void)state;
    struct env e;
    /* capacity 1 MiB = 16 objects; watermark 0.5 -> evict down to 0.25 MiB (4 objects) */
    env_init(&e,
             ",\"max_capacity_gb\":0.0009765625,\"eviction\":{\"eviction_policy\":\"LRU\","
             "\"trigger_watermark\":0.5,\"eviction_ratio\":0.5}",
             L2CTL_STORE_DEFAULT);
    enum { M = 10 };
    struct keys_object_key k[M];
    struct l1_key lk[M];
    for (int i = 0; i < M; i++) mk(&e, i, "", &k[i], &lk[i]);
    for (int i = 0; i < M; i++) { /* one at a time: completion order is recency order */
        put(&e, k, lk, i, 1);
        wait_stores(&e);
    }
    assert_int_equal(l2ctl_usage_bytes(e.c), (uint64_t)M * OBJ);
    /* touch key 0 in L2: a prefetch looks it up, and a lookup hit counts as an access */
    uint64_t id;
    struct l2ctl_prefetch_result r;
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, 1, L2CTL_TRIM_PREFIX, 0, false, NULL, NULL, &id), L2_OK);
    assert_int_equal(wait_prefetch(&e, id, &r), L2_OK);
    struct l2ctl_tick_report rep;
    assert_int_equal(l2ctl_evict_tick(e.c, clock_mono_ns(), &rep), L2_OK);
    assert_int_equal(rep.evicted_objects, 6);
    assert_int_equal(rep.evicted_bytes, 6u * OBJ);
    assert_int_equal(l2ctl_usage_bytes(e.c), 4u * OBJ);
    /* survivors: key 0 (accessed) and the three most recent */
    struct l2_list_page pg;
    char err[128];
    assert_int_equal(l2_adapter_list(l2ctl_adapter(e.c, 0), NULL, 100, NULL, &pg, err, sizeof(err)),
                     L2_OK);
    assert_int_equal(pg.count, 4);
    int alive[M] = {0};
    for (size_t i = 0; i < pg.count; i++) alive[pg.entries[i].key.hash[31] - 1] = 1;
    l2_list_page_free(&pg);
    assert_int_equal(alive[0], 1);
    for (int i = 1; i < 7; i++) assert_int_equal(alive[i], 0);
    for (int i = 7; i < M; i++) assert_int_equal(alive[i], 1);
    /* below the watermark: nothing more */
    assert_int_equal(l2ctl_evict_tick(e.c, clock_mono_ns(), &rep), L2_OK);
    assert_int_equal(rep.evicted_objects, 0);
    env_fini(&e);
}

static void test_evict_isolated(void **state) {
    (void)state;
    struct env e;
    env_init(&e,
             ",\"eviction\":{\"eviction_policy\":\"IsolatedLRU\",\"trigger_watermark\":1.0,"
             "\"eviction_ratio\":0.0}",
             L2CTL_STORE_DEFAULT);
    enum { M = 12 };
    struct keys_object_key k[M];
    struct l1_key lk[M];
    /* 0..5: salt a (quota 4 objects), 6..11: salt b (no quota -> limit 0) */
    for (int i = 0; i < M; i++) mk(&e, i, i < 6 ? "a" : "b", &k[i], &lk[i]);
    char err[128];
    assert_int_equal(quota_set(e.q, "a", 4u * OBJ, err, sizeof(err)), 0);
    put(&e, k, lk, 0, M);
    wait_stores(&e);
    assert_int_equal(l2ctl_salt_usage_bytes(e.c, "a"), 6u * OBJ);
    assert_int_equal(l2ctl_salt_usage_bytes(e.c, "b"), 6u * OBJ);
    struct l2ctl_tick_report rep;
    assert_int_equal(l2ctl_evict_tick(e.c, clock_mono_ns(), &rep), L2_OK);
    assert_int_equal(rep.evicted_objects, 8);
    assert_int_equal(l2ctl_salt_usage_bytes(e.c, "a"), 4u * OBJ);
    assert_int_equal(l2ctl_salt_usage_bytes(e.c, "b"), 0);
    env_fini(&e);
}

/* More objects than the eviction tracker's initial 1024 buckets, found on disk at start: they
 * join the tracker in listing order (its index grows past its first size) and one LRU pass
 * evicts exactly the oldest ones down to the target. */
static void test_evict_tracker_from_rescan(void **state) {
    (void)state;
    enum { M = 2000, SZ = 100 };
    struct env e;
    memset(&e, 0, sizeof(e));
    snprintf(e.dir, sizeof(e.dir), "/tmp/lmcache-l2c-XXXXXX");
    assert_non_null(mkdtemp(e.dir));
    struct keys_object_key *k = calloc(M, sizeof(*k));
    struct l2_buf *b = calloc(M, sizeof(*b));
    uint8_t *ok = calloc(M, 1), payload[SZ];
    assert_true(k && b && ok);
    memset(payload, 7, sizeof(payload));
    for (int i = 0; i < M; i++) {
        char hex[65], err[KEYS_ERR_MAX];
        snprintf(hex, sizeof(hex), "%064x", i + 1);
        assert_int_equal(keys_object_key_init(&k[i], hex, 64, "org/m", 5, 0x01000100u, 0, "", 0,
                                              err, sizeof(err)),
                         0);
        b[i] = (struct l2_buf){payload, SZ};
    }
    /* written by a standalone adapter, as a previous run would have */
    char js[256];
    snprintf(js, sizeof(js), "{\"type\":\"fs\",\"base_path\":\"%s\"}", e.dir);
    struct l2_adapter *a = test_adapter_json(js);
    struct l2_task t = {.op = L2_OP_STORE, .n = M, .keys = k, .bufs = b, .ok = ok};
    assert_int_equal(l2_adapter_run(a, &t), L2_OK);
    assert_int_equal(t.nok, M);
    l2_adapter_destroy(a);
    /* capacity 2^-12 GB = 262144 B; 200000 B used >= 0.5 of it: evict down to 65536 B, i.e.
     * 134464 B = 1345 objects of 100 B */
    env_open(&e,
             ",\"max_capacity_gb\":0.000244140625,\"eviction\":{\"eviction_policy\":\"LRU\","
             "\"trigger_watermark\":0.5,\"eviction_ratio\":0.5}",
             L2CTL_STORE_DEFAULT);
    assert_int_equal(l2ctl_usage_bytes(e.c), (uint64_t)M * SZ);
    struct l2ctl_tick_report rep;
    assert_int_equal(l2ctl_evict_tick(e.c, clock_mono_ns(), &rep), L2_OK);
    assert_int_equal(rep.evicted_objects, 1345);
    assert_int_equal(l2ctl_usage_bytes(e.c), (uint64_t)(M - 1345) * SZ);
    /* the survivors are the last in listing (name) order */
    struct l2_list_page pg;
    char lerr[128];
    char *tok = NULL;
    int alive = 0, first_alive = M;
    for (;;) {
        assert_int_equal(
            l2_adapter_list(l2ctl_adapter(e.c, 0), NULL, 1000, tok, &pg, lerr, sizeof(lerr)),
            L2_OK);
        free(tok);
        tok = pg.next_token ? strdup(pg.next_token) : NULL;
        for (size_t i = 0; i < pg.count; i++) {
            unsigned v = 0;
            for (int j = 28; j < 32; j++) v = v << 8 | pg.entries[i].key.hash[j];
            if ((int)v - 1 < first_alive) first_alive = (int)v - 1;
            alive++;
        }
        l2_list_page_free(&pg);
        if (!tok) break;
    }
    assert_int_equal(alive, M - 1345);
    assert_int_equal(first_alive, 1345);
    l2ctl_destroy(e.c);
    quota_destroy(e.q);
    l1_destroy(e.l1);
    test_rm_rf(e.dir);
    free(k);
    free(b);
    free(ok);
}

static void test_store_failure_counted(void **state) {
    (void)state;
    struct env e;
    env_init(&e, ",\"max_capacity_gb\":0.0001", L2CTL_STORE_DEFAULT); /* ~107 KB: 1 object */
    struct keys_object_key k[3];
    struct l1_key lk[3];
    for (int i = 0; i < 3; i++) mk(&e, i, "", &k[i], &lk[i]);
    put(&e, k, lk, 0, 3);
    wait_stores(&e);
    struct l2ctl_stats st;
    l2ctl_stats(e.c, &st);
    assert_int_equal(st.store_completed_objects, 1);
    assert_int_equal(st.store_failed_objects, 2);
    /* L1 keeps serving */
    for (int i = 0; i < 3; i++) {
        struct l1_ref ref;
        assert_int_equal(l1_reserve_read(e.l1, &lk[i], 1, clock_mono_ns(), &ref), L1_OK);
        l1_finish_read(e.l1, &lk[i], 1, clock_mono_ns());
    }
    env_fini(&e);
}

/* Prefetches are bounded by the keys they name together, queued or running: past the bound a
 * request is refused (L2_ERR_BUSY) without being queued, and a finished request gives its keys
 * back. Submitted before the controller starts, so none can finish meanwhile. */
static void test_prefetch_keys_bounded(void **state) {
    (void)state;
    struct env e;
    memset(&e, 0, sizeof(e));
    snprintf(e.dir, sizeof(e.dir), "/tmp/lmcache-l2c-XXXXXX");
    assert_non_null(mkdtemp(e.dir));
    char err[256], js[256];
    struct l1_config lc = {.size_bytes = 64u << 20, .policy = L1_POLICY_LRU};
    assert_int_equal(l1_create(&lc, &e.l1, err, sizeof(err)), 0);
    e.q = quota_create();
    snprintf(js, sizeof(js), "[{\"type\":\"fs\",\"base_path\":\"%s\"}]", e.dir);
    json_t *cfg = json_loads(js, 0, NULL);
    struct l2ctl_config cc = {.l1 = e.l1, .quota = e.q, .prefetch_max_keys = 10};
    assert_int_equal(l2ctl_create(&cc, cfg, &e.c, err, sizeof(err)), L2_OK);
    json_decref(cfg);
    struct keys_object_key k[N];
    struct l1_key lk[N];
    for (int i = 0; i < N; i++) mk(&e, i, "b", &k[i], &lk[i]);
    uint64_t a, b, x;
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &a), L2_OK);
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &x),
        L2_ERR_BUSY);
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, 2, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &b), L2_OK);
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, 1, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &x),
        L2_ERR_BUSY);
    struct l2ctl_stats st;
    l2ctl_stats(e.c, &st);
    assert_int_equal(st.prefetch_refused, 2);
    assert_int_equal(l2ctl_start(e.c, err, sizeof(err)), L2_OK);
    struct l2ctl_prefetch_result r;
    assert_int_equal(wait_prefetch(&e, a, &r), L2_OK);
    assert_int_equal(wait_prefetch(&e, b, &r), L2_OK);
    /* Both finished: the whole bound is free again. */
    assert_int_equal(
        l2ctl_prefetch_submit(e.c, k, lk, N, L2CTL_TRIM_SPARSE, 0, false, NULL, NULL, &a), L2_OK);
    assert_int_equal(wait_prefetch(&e, a, &r), L2_OK);
    env_fini(&e);
}

static void test_no_adapters(void **state) {
    (void)state;
    struct l1 *l1;
    char err[256];
    struct l1_config lc = {.size_bytes = 1u << 20};
    assert_int_equal(l1_create(&lc, &l1, err, sizeof(err)), 0);
    struct l2ctl_config cc = {.l1 = l1};
    struct l2ctl *c;
    json_t *empty = json_array();
    assert_int_equal(l2ctl_create(&cc, empty, &c, err, sizeof(err)), L2_OK);
    assert_int_equal(l2ctl_start(c, err, sizeof(err)), L2_OK);
    assert_int_equal(l2ctl_find_adapter(c, NULL), -1);
    uint64_t id;
    assert_int_equal(
        l2ctl_prefetch_submit(c, NULL, NULL, 0, L2CTL_TRIM_PREFIX, 1, true, NULL, NULL, &id),
        L2_ERR_NOT_FOUND);
    l2ctl_destroy(c);
    json_t *bad = json_loads("[{\"type\":\"fs\",\"base_path\":\"/tmp/x\",\"eviction\":{"
                             "\"eviction_policy\":\"FIFO\"}}]",
                             0, NULL);
    assert_int_not_equal(l2ctl_create(&cc, bad, &c, err, sizeof(err)), L2_OK);
    json_decref(bad);
    json_decref(empty);
    l1_destroy(l1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_write_through_and_prefix),
        cmocka_unit_test(test_skip_l1_and_callback),
        cmocka_unit_test(test_evict_lru),
        cmocka_unit_test(test_evict_isolated),
        cmocka_unit_test(test_evict_tracker_from_rescan),
        cmocka_unit_test(test_store_failure_counted),
        cmocka_unit_test(test_prefetch_keys_bounded),
        cmocka_unit_test(test_no_adapters),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
