/* The fs L2 adapter: round trip, restart rescan, corruption, ENOSPC, deletes racing loads,
 * listing, io_uring and thread engines. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/l2/adapter.h"
#include "server/l2/crc32c.h"
#include "server/l2/fs.h"
#include "test_util.h"

static void make_key(struct keys_object_key *k, const char *model, const char *salt, int i) {
    char hex[65];
    snprintf(hex, sizeof(hex), "%064x", i);
    char err[KEYS_ERR_MAX];
    assert_int_equal(keys_object_key_init(k, hex, 64, model, strlen(model), 0x01000100u, 0, salt,
                                          salt ? strlen(salt) : 0, err, sizeof(err)),
                     0);
}

static void fill(uint8_t *p, size_t n, int seed) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(seed * 131 + i * 7 + (i >> 9));
}

/* 0: test buffers come from malloc; else from posix_memalign(g_align) (the o_direct path that
 * moves the payload without a copy). */
static size_t g_align;

static void *buf_alloc(size_t sz) {
    void *p = NULL;
    if (!g_align) return malloc(sz);
    assert_int_equal(posix_memalign(&p, g_align, sz ? sz : 1), 0);
    return p;
}

static struct l2_adapter *open_fs(const char *dir, const char *extra) {
    char js[1024];
    snprintf(js, sizeof(js), "{\"type\":\"fs\",\"base_path\":\"%s\"%s}", dir, extra ? extra : "");
    return test_adapter_json(js);
}

/* Stores n objects of size sz (seeded by their index) synchronously; returns ok count. */
static size_t store_n(struct l2_adapter *a, struct keys_object_key *keys, size_t n, size_t sz,
                      int *status) {
    struct l2_buf *bufs = calloc(n, sizeof(*bufs));
    uint8_t *ok = calloc(n, 1);
    for (size_t i = 0; i < n; i++) {
        bufs[i].data = buf_alloc(sz);
        bufs[i].size = sz;
        fill(bufs[i].data, sz, (int)i);
    }
    struct l2_task t = {.op = L2_OP_STORE, .n = n, .keys = keys, .bufs = bufs, .ok = ok};
    int rc = l2_adapter_run(a, &t);
    if (status) *status = rc;
    size_t nok = 0;
    for (size_t i = 0; i < n; i++) nok += ok[i];
    assert_int_equal(nok, t.nok);
    for (size_t i = 0; i < n; i++) free(bufs[i].data);
    free(bufs);
    free(ok);
    return nok;
}

/* Lookup + load + unlock; returns the number of keys that loaded with the expected bytes.
 * Fails the test when a loaded key carries wrong bytes. */
static size_t load_n(struct l2_adapter *a, struct keys_object_key *keys, size_t n, size_t sz) {
    uint8_t *ok = calloc(n, 1), *lok = calloc(n, 1);
    uint64_t *sizes = calloc(n, sizeof(*sizes));
    struct l2_task lk = {.op = L2_OP_LOOKUP, .n = n, .keys = keys, .ok = ok, .sizes = sizes};
    assert_int_equal(l2_adapter_run(a, &lk), L2_OK);
    struct l2_buf *bufs = calloc(n, sizeof(*bufs));
    uint8_t *expect = malloc(sz);
    for (size_t i = 0; i < n; i++) {
        bufs[i].data = buf_alloc(sz);
        bufs[i].size = sz;
        if (ok[i]) assert_int_equal(sizes[i], sz);
    }
    struct l2_task ld = {.op = L2_OP_LOAD, .n = n, .keys = keys, .bufs = bufs, .ok = lok};
    l2_adapter_run(a, &ld);
    size_t good = 0;
    for (size_t i = 0; i < n; i++) {
        if (!lok[i]) continue;
        fill(expect, sz, (int)i);
        assert_memory_equal(bufs[i].data, expect, sz);
        good++;
    }
    for (size_t i = 0; i < n; i++)
        if (ok[i]) l2_adapter_unlock(a, &keys[i], 1);
    for (size_t i = 0; i < n; i++) free(bufs[i].data);
    free(bufs);
    free(expect);
    free(ok);
    free(lok);
    free(sizes);
    return good;
}

static char *tmpdir(void) {
    char *d = strdup("/tmp/lmcache-l2-XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

static void test_crc32c(void **state) {
    (void)state;
    /* the standard check value */
    assert_int_equal(crc32c(0, "123456789", 9), 0xE3069283u);
    uint8_t buf[1000];
    fill(buf, sizeof(buf), 3);
    assert_int_equal(crc32c(crc32c(0, buf, 333), buf + 333, 667), crc32c(0, buf, 1000));
}

static void round_trip(const char *extra, bool expect_uring) {
    char *dir = tmpdir();
    struct l2_adapter *a = open_fs(dir, extra);
    assert_int_equal(fs_adapter_uses_io_uring(a), expect_uring);
    enum { N = 24 };
    struct keys_object_key keys[N];
    for (int i = 0; i < N; i++) make_key(&keys[i], "org/model-A", i % 2 ? "alice" : "", i);
    size_t sz = 300000; /* not a multiple of 4 KiB */
    assert_int_equal(store_n(a, keys, N, sz, NULL), N);
    assert_int_equal(load_n(a, keys, N, sz), N);
    /* stores of present keys succeed without re-counting */
    assert_int_equal(store_n(a, keys, 2, sz, NULL), 2);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, N);
    assert_int_equal(u.bytes_used, (uint64_t)N * sz);
    assert_int_equal(l2_adapter_salt_bytes(a, "alice"), (uint64_t)N / 2 * sz);
    /* '/' in the model name did not create a directory */
    DIR *d = opendir(dir);
    struct dirent *de;
    int files = 0;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        assert_null(strchr(de->d_name, '/'));
        assert_true(de->d_type == DT_REG || de->d_type == DT_UNKNOWN);
        files++;
    }
    closedir(d);
    assert_int_equal(files, N);
    json_t *st = l2_adapter_status(a);
    assert_true(json_is_true(json_object_get(st, "is_healthy")));
    assert_string_equal(json_string_value(json_object_get(st, "io_engine")),
                        expect_uring ? "io_uring" : "threads");
    json_decref(st);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

static void test_round_trip_uring(void **state) {
    (void)state;
    round_trip(NULL, true);
}
static void test_round_trip_threads(void **state) {
    (void)state;
    round_trip(",\"io_uring\":false", false);
}
static void test_round_trip_odirect(void **state) {
    (void)state;
    round_trip(",\"o_direct\":true", true);
}
static void test_round_trip_env_fallback(void **state) {
    (void)state;
    setenv("LMCACHE_L2_FS_NO_IO_URING", "1", 1);
    round_trip(",\"o_direct\":true", false);
    unsetenv("LMCACHE_L2_FS_NO_IO_URING");
}

/* o_direct with 4 KiB-aligned buffers: the payload is written from and read into the caller's
 * buffer directly, the remainder goes through the tail. Sizes cover an exact multiple of 4 KiB,
 * a remainder, one byte over a block and less than a block; a byte flipped in the directly
 * written head or in the tail is a miss, and so is a torn (truncated) file after a restart. */
static void odirect_aligned(const char *extra, bool expect_uring) {
    static const size_t sizes[] = {64 * 4096, 300000, 4097, 100};
    g_align = 4096;
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
        size_t sz = sizes[si];
        char *dir = tmpdir();
        struct l2_adapter *a = open_fs(dir, extra);
        assert_int_equal(fs_adapter_uses_io_uring(a), expect_uring);
        enum { N = 6 };
        struct keys_object_key keys[N];
        for (int i = 0; i < N; i++) make_key(&keys[i], "org/m", "", i);
        assert_int_equal(store_n(a, keys, N, sz, NULL), N);
        assert_int_equal(load_n(a, keys, N, sz), N);
        char p[4096];
        struct stat st;
        /* key 1: a flipped payload byte near the start (head, or tail when sz < 4 KiB) */
        assert_int_equal(fs_adapter_object_path(a, &keys[1], p, sizeof(p)), 0);
        int fd = open(p, O_RDWR);
        assert_true(fd >= 0);
        uint8_t x;
        assert_int_equal(pread(fd, &x, 1, 10), 1);
        x ^= 0x40;
        assert_int_equal(pwrite(fd, &x, 1, 10), 1);
        close(fd);
        /* key 2: a flipped last payload byte (the tail when sz is not a 4 KiB multiple) */
        assert_int_equal(fs_adapter_object_path(a, &keys[2], p, sizeof(p)), 0);
        fd = open(p, O_RDWR);
        assert_true(fd >= 0);
        assert_int_equal(pread(fd, &x, 1, (off_t)sz - 1), 1);
        x ^= 0x01;
        assert_int_equal(pwrite(fd, &x, 1, (off_t)sz - 1), 1);
        close(fd);
        assert_int_equal(load_n(a, keys, N, sz), N - 2);
        /* key 3: torn while the adapter is down (the first half of the file only) */
        assert_int_equal(fs_adapter_object_path(a, &keys[3], p, sizeof(p)), 0);
        l2_adapter_destroy(a);
        assert_int_equal(stat(p, &st), 0);
        assert_int_equal(truncate(p, st.st_size / 2), 0);
        a = open_fs(dir, extra);
        struct l2_usage u;
        l2_adapter_usage(a, &u);
        assert_int_equal(u.objects, N - 3);
        assert_int_equal(load_n(a, keys, N, sz), N - 3);
        l2_adapter_destroy(a);
        test_rm_rf(dir);
        free(dir);
    }
    g_align = 0;
}

static void test_odirect_aligned_uring(void **state) {
    (void)state;
    odirect_aligned(",\"o_direct\":true", true);
}
static void test_odirect_aligned_threads(void **state) {
    (void)state;
    odirect_aligned(",\"o_direct\":true,\"io_uring\":false", false);
}

static void test_restart_rescan(void **state) {
    (void)state;
    char *dir = tmpdir();
    enum { N = 10 };
    struct keys_object_key keys[N];
    /* a model name long enough to force hashed file names for half of them */
    char longm[240];
    memset(longm, 'm', sizeof(longm) - 1);
    longm[sizeof(longm) - 1] = 0;
    for (int i = 0; i < N; i++) make_key(&keys[i], i < 5 ? "a/b" : longm, i % 3 ? "s1" : "", i);
    struct l2_adapter *a = open_fs(dir, NULL);
    assert_int_equal(store_n(a, keys, N, 5000, NULL), N);
    struct l2_usage u1;
    l2_adapter_usage(a, &u1);
    uint64_t s1 = l2_adapter_salt_bytes(a, "s1");
    l2_adapter_destroy(a);
    /* a leftover temporary file and a junk object file */
    char p[4096];
    snprintf(p, sizeof(p), "%s/.tmp-99.kv", dir);
    FILE *f = fopen(p, "w");
    fputs("partial", f);
    fclose(f);
    snprintf(p, sizeof(p), "%s/junk.kv", dir);
    f = fopen(p, "w");
    fputs("not an object", f);
    fclose(f);
    a = open_fs(dir, NULL);
    struct l2_usage u2;
    l2_adapter_usage(a, &u2);
    assert_int_equal(u2.objects, N);
    assert_int_equal(u2.bytes_used, u1.bytes_used);
    assert_int_equal(l2_adapter_salt_bytes(a, "s1"), s1);
    assert_int_equal(l2_adapter_salt_bytes(a, ""), u1.bytes_used - s1);
    assert_int_equal(load_n(a, keys, N, 5000), N);
    assert_int_equal(access(p, F_OK), -1);
    snprintf(p, sizeof(p), "%s/.tmp-99.kv", dir);
    assert_int_equal(access(p, F_OK), -1);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

static void test_corrupt_file(void **state) {
    (void)state;
    char *dir = tmpdir();
    struct l2_adapter *a = open_fs(dir, NULL);
    struct keys_object_key keys[3];
    for (int i = 0; i < 3; i++) make_key(&keys[i], "m", "", i);
    assert_int_equal(store_n(a, keys, 3, 8192, NULL), 3);
    char p[4096];
    assert_int_equal(fs_adapter_object_path(a, &keys[1], p, sizeof(p)), 0);
    int fd = open(p, O_WRONLY);
    assert_true(fd >= 0);
    uint8_t x = 0xEE;
    assert_int_equal(pwrite(fd, &x, 1, 100), 1);
    close(fd);
    /* key 1 loads as a miss (never wrong bytes), and its file is gone */
    uint8_t ok[3] = {0}, lok[3] = {0};
    uint64_t sizes[3];
    struct l2_task lk = {.op = L2_OP_LOOKUP, .n = 3, .keys = keys, .ok = ok, .sizes = sizes};
    assert_int_equal(l2_adapter_run(a, &lk), L2_OK);
    assert_int_equal(lk.nok, 3);
    struct l2_buf bufs[3];
    for (int i = 0; i < 3; i++) bufs[i] = (struct l2_buf){malloc(8192), 8192};
    struct l2_task ld = {.op = L2_OP_LOAD, .n = 3, .keys = keys, .bufs = bufs, .ok = lok};
    l2_adapter_run(a, &ld);
    assert_int_equal(lok[0], 1);
    assert_int_equal(lok[1], 0);
    assert_int_equal(lok[2], 1);
    l2_adapter_unlock(a, keys, 3);
    assert_int_equal(access(p, F_OK), -1);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, 2);
    json_t *st = l2_adapter_status(a);
    assert_int_equal(json_integer_value(json_object_get(st, "checksum_failures")), 1);
    json_decref(st);
    for (int i = 0; i < 3; i++) free(bufs[i].data);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

static void test_enospc(void **state) {
    (void)state;
    char *dir = tmpdir();
    struct l2_adapter *a = open_fs(dir, NULL);
    struct keys_object_key keys[4];
    for (int i = 0; i < 4; i++) make_key(&keys[i], "m", "", i);
    fs_adapter_inject_error(a, L2_OP_STORE, ENOSPC, 2);
    int status = 0;
    size_t ok = store_n(a, keys, 4, 4096, &status);
    assert_int_equal(ok, 2);
    assert_int_equal(status, L2_ERR_NOSPC);
    struct l2_counters c;
    l2_adapter_counters(a, &c);
    assert_int_equal(c.store_keys_failed, 2);
    assert_int_equal(c.in_flight, 0);
    json_t *st = l2_adapter_status(a);
    assert_int_equal(json_integer_value(json_object_get(st, "enospc")), 2);
    assert_true(json_is_true(json_object_get(st, "is_healthy")));
    json_decref(st);
    /* no temporary files left behind, and only the stored objects are accounted */
    DIR *d = opendir(dir);
    struct dirent *de;
    int files = 0;
    while ((de = readdir(d)) != NULL) files += strcmp(de->d_name, ".") && strcmp(de->d_name, "..");
    closedir(d);
    assert_int_equal(files, 2);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, 2);
    l2_adapter_destroy(a);
    /* max_capacity_gb: a store that would exceed it fails cleanly */
    test_rm_rf(dir);
    a = open_fs(dir, ",\"max_capacity_gb\":0.00001"); /* ~10.7 KB */
    ok = store_n(a, keys, 4, 4096, &status);
    assert_int_equal(ok, 2);
    assert_int_equal(status, L2_ERR_NOSPC);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

struct race {
    struct l2_adapter *a;
    struct keys_object_key *keys;
    size_t n, sz;
    int rounds;
    /* written by the loader thread, read by the test after the join (or polled: rounds_done) */
    _Atomic int rounds_done;
    size_t found, loaded, mismatches, failed_calls;
};

/* load_n without cmocka asserts, for a thread: counts instead of failing. */
static void *race_loader(void *arg) {
    struct race *r = arg;
    size_t n = r->n, sz = r->sz;
    uint8_t *ok = calloc(n, 1), *lok = calloc(n, 1), *expect = malloc(sz);
    uint64_t *sizes = calloc(n, sizeof(*sizes));
    struct l2_buf *bufs = calloc(n, sizeof(*bufs));
    for (size_t i = 0; bufs && i < n; i++) bufs[i] = (struct l2_buf){malloc(sz), sz};
    for (int round = 0; round < r->rounds; round++) {
        memset(ok, 0, n);
        memset(lok, 0, n);
        struct l2_task lk = {.op = L2_OP_LOOKUP, .n = n, .keys = r->keys, .ok = ok, .sizes = sizes};
        if (l2_adapter_run(r->a, &lk) != L2_OK) r->failed_calls++;
        for (size_t i = 0; i < n; i++) {
            r->found += ok[i];
            if (ok[i] && sizes[i] != sz) r->mismatches++;
        }
        struct l2_task ld = {.op = L2_OP_LOAD, .n = n, .keys = r->keys, .bufs = bufs, .ok = lok};
        l2_adapter_run(r->a, &ld); /* misses of keys deleted meanwhile are expected */
        for (size_t i = 0; i < n; i++) {
            if (!lok[i]) continue;
            r->loaded++;
            fill(expect, sz, (int)i);
            if (memcmp(bufs[i].data, expect, sz) != 0) r->mismatches++;
        }
        for (size_t i = 0; i < n; i++)
            if (ok[i]) l2_adapter_unlock(r->a, &r->keys[i], 1);
        atomic_fetch_add(&r->rounds_done, 1);
    }
    for (size_t i = 0; bufs && i < n; i++) free(bufs[i].data);
    free(bufs);
    free(ok);
    free(lok);
    free(expect);
    free(sizes);
    return NULL;
}

static void test_delete_races_load(void **state) {
    (void)state;
    char *dir = tmpdir();
    struct l2_adapter *a = open_fs(dir, NULL);
    enum { N = 16 };
    struct keys_object_key keys[N];
    for (int i = 0; i < N; i++) make_key(&keys[i], "m", "", i);
    enum { ROUNDS = 30 };
    struct race r = {.a = a, .keys = keys, .n = N, .sz = 65536, .rounds = ROUNDS};
    assert_int_equal(store_n(a, keys, N, r.sz, NULL), N);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, race_loader, &r), 0);
    for (int round = 0; round < ROUNDS; round++) {
        /* paced by the loader's progress: round k's delete starts once k+1 load rounds are
         * done, so the first load round sees every key and the others interleave */
        while (atomic_load(&r.rounds_done) <= round) sched_yield();
        uint8_t del[N] = {0};
        size_t skipped = 0, deleted = 0;
        assert_int_equal(l2_adapter_delete(a, keys, N, del, &skipped), L2_OK);
        for (int i = 0; i < N; i++) deleted += del[i];
        assert_int_equal(deleted + skipped, N); /* every key was there: deleted, or locked */
        assert_int_equal(store_n(a, keys, N, r.sz, NULL), N);
    }
    pthread_join(th, NULL);
    assert_int_equal(atomic_load(&r.rounds_done), ROUNDS);
    assert_int_equal(r.failed_calls, 0);
    assert_int_equal(r.mismatches, 0); /* no load ever returned bytes of another write */
    assert_true(r.found >= N);         /* the first round saw every key... */
    assert_true(r.loaded >= N);        /* ...and loaded every one */
    struct l2_counters c;
    l2_adapter_counters(a, &c);
    assert_int_equal(c.in_flight, 0);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

static void test_delete_skips_locked(void **state) {
    (void)state;
    char *dir = tmpdir();
    struct l2_adapter *a = open_fs(dir, NULL);
    struct keys_object_key keys[2];
    for (int i = 0; i < 2; i++) make_key(&keys[i], "m", "", i);
    assert_int_equal(store_n(a, keys, 2, 100, NULL), 2);
    uint8_t ok[1];
    uint64_t sz[1];
    struct l2_task lk = {.op = L2_OP_LOOKUP, .n = 1, .keys = keys, .ok = ok, .sizes = sz};
    assert_int_equal(l2_adapter_run(a, &lk), L2_OK);
    uint8_t del[2];
    size_t skipped = 0;
    assert_int_equal(l2_adapter_delete(a, keys, 2, del, &skipped), L2_OK);
    assert_int_equal(skipped, 1);
    assert_int_equal(del[0], 0);
    assert_int_equal(del[1], 1);
    l2_adapter_unlock(a, keys, 1);
    assert_int_equal(l2_adapter_delete(a, keys, 2, del, &skipped), L2_OK);
    assert_int_equal(del[0], 1);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, 0);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

static void test_listing(void **state) {
    (void)state;
    char *dir = tmpdir();
    struct l2_adapter *a = open_fs(dir, NULL);
    enum { N = 25 };
    struct keys_object_key keys[N];
    for (int i = 0; i < N; i++) make_key(&keys[i], i < 17 ? "org/A" : "B", i % 2 ? "x" : "", i);
    assert_int_equal(store_n(a, keys, N, 64, NULL), N);
    char err[256];
    struct l2_list_page pg;
    assert_int_equal(l2_adapter_list(a, NULL, 0, NULL, &pg, err, sizeof(err)), L2_ERR_INVAL);
    assert_int_equal(l2_adapter_list(a, NULL, 5001, NULL, &pg, err, sizeof(err)), L2_ERR_INVAL);
    assert_int_equal(l2_adapter_list(a, NULL, 5, "zz", &pg, err, sizeof(err)), L2_ERR_BAD_TOKEN);
    /* pages of 4 over model org/A: 17 keys, each once */
    int seen[N] = {0};
    size_t total = 0, pages = 0;
    char *tok = NULL, prev[KEYS_L2_NAME_MAX] = "", name[KEYS_L2_NAME_MAX];
    do {
        assert_int_equal(l2_adapter_list(a, "org/A", 4, tok, &pg, err, sizeof(err)), L2_OK);
        free(tok);
        tok = pg.next_token ? strdup(pg.next_token) : NULL;
        for (size_t i = 0; i < pg.count; i++) {
            /* in name order, within and across pages */
            assert_true(keys_l2_name(&pg.entries[i].key, name, sizeof(name)) > 0);
            assert_true(strcmp(prev, name) < 0);
            snprintf(prev, sizeof(prev), "%s", name);
            assert_string_equal(pg.entries[i].key.model_name, "org/A");
            assert_int_equal(pg.entries[i].size, 64);
            int idx = pg.entries[i].key.hash[31] | pg.entries[i].key.hash[30] << 8;
            assert_true(idx < 17);
            seen[idx]++;
        }
        total += pg.count;
        pages++;
        l2_list_page_free(&pg);
    } while (tok);
    assert_int_equal(total, 17);
    assert_int_equal(pages, 5);
    for (int i = 0; i < 17; i++) assert_int_equal(seen[i], 1);
    /* everything in one page */
    assert_int_equal(l2_adapter_list(a, NULL, 5000, NULL, &pg, err, sizeof(err)), L2_OK);
    assert_int_equal(pg.count, N);
    assert_null(pg.next_token);
    l2_list_page_free(&pg);
    l2_adapter_destroy(a);
    test_rm_rf(dir);
    free(dir);
}

static void test_bad_config(void **state) {
    (void)state;
    const char *bad[] = {"{\"type\":\"fs\"}",
                         "{\"type\":\"fs\",\"base_path\":\"/tmp/x\",\"o_direct\":1}",
                         "{\"type\":\"fs\",\"base_path\":\"/tmp/x\",\"max_capacity_gb\":-1}",
                         "{\"type\":\"nope\"}", "[]"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        json_t *cfg = json_loads(bad[i], 0, NULL);
        struct l2_adapter *a = NULL;
        char err[256] = "";
        assert_int_not_equal(l2_adapter_create(cfg, &a, err, sizeof(err)), L2_OK);
        assert_null(a);
        assert_true(err[0]);
        json_decref(cfg);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc32c),
        cmocka_unit_test(test_round_trip_uring),
        cmocka_unit_test(test_round_trip_threads),
        cmocka_unit_test(test_round_trip_odirect),
        cmocka_unit_test(test_round_trip_env_fallback),
        cmocka_unit_test(test_odirect_aligned_uring),
        cmocka_unit_test(test_odirect_aligned_threads),
        cmocka_unit_test(test_restart_rescan),
        cmocka_unit_test(test_corrupt_file),
        cmocka_unit_test(test_enospc),
        cmocka_unit_test(test_delete_races_load),
        cmocka_unit_test(test_delete_skips_locked),
        cmocka_unit_test(test_listing),
        cmocka_unit_test(test_bad_config),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
