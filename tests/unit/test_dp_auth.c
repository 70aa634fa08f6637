/* Unit tests for the data plane's authorization: shm_name rules, the checks of kvreg_register
 * (regular files only, owners, the proof of access, registrations per connection), the peer
 * credentials libzmq reports, and lookup sessions bound to their connection (and what releasing
 * one costs). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "server/kvctx.h"
#include "server/dataplane/dataplane.h"
#include "server/session.h"

static void test_shm_names(void **state) {
    (void)state;
    char err[256];
    const char *good[] = {"/a", "/vllm-kv.0_rank-1", "/A.b", "/..."};
    for (size_t i = 0; i < sizeof(good) / sizeof(good[0]); i++)
        assert_int_equal(kv_shm_name_check(good[i], err, sizeof(err)), 0);
    char longest[KV_SHM_NAME_MAX + 2], too_long[KV_SHM_NAME_MAX + 3];
    longest[0] = too_long[0] = '/';
    memset(longest + 1, 'a', KV_SHM_NAME_MAX);
    longest[KV_SHM_NAME_MAX + 1] = 0;
    memset(too_long + 1, 'a', KV_SHM_NAME_MAX + 1);
    too_long[KV_SHM_NAME_MAX + 2] = 0;
    assert_int_equal(kv_shm_name_check(longest, err, sizeof(err)), 0);
    const char *bad[] = {"",    "/",     "a",    "//a",  "/a/b",      "/.",
                         "/..", "/../x", "/a b", "/a\n", "/\xc3\xa9", too_long};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(kv_shm_name_check(bad[i], err, sizeof(err)), -1);
}

static void test_peercred(void **state) {
    (void)state;
    uint32_t uid = 9, gid = 9;
    int32_t pid = 9;
    assert_int_equal(dataplane_parse_peercred("localhost:1000:100:4242", &uid, &gid, &pid), 0);
    assert_int_equal(uid, 1000);
    assert_int_equal(gid, 100);
    assert_int_equal(pid, 4242);
    assert_int_equal(dataplane_parse_peercred(":0:0:1", &uid, &gid, &pid), 0);
    assert_int_equal(uid, 0);
    const char *bad[] = {"127.0.0.1",        "::1",      "localhost",        "x:1:2",
                         "x:1:2:",           "x::2:3",   "x:-1:2:3",         "x:1:+2:3",
                         "x:4294967296:0:1", "x:1:2:3a", "x:1:2:99999999999"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(dataplane_parse_peercred(bad[i], &uid, &gid, &pid), -1);
}

/* ---- kvreg_register ---- */

static struct kv_context tmpl(const char *name, int64_t id) {
    struct kv_context c;
    memset(&c, 0, sizeof(c));
    c.instance_id = id;
    snprintf(c.model_name, sizeof(c.model_name), "m");
    c.world_size = 1;
    snprintf(c.shm_name, sizeof(c.shm_name), "%s", name);
    c.layout = (struct kv_layout){.num_layers = 1,
                                  .num_blocks = 4,
                                  .tokens_per_block = 16,
                                  .bytes_per_token = 64,
                                  .kv_count = 2,
                                  .order = KV_LAYER_MAJOR};
    return c;
}

#define LAYOUT_BYTES (1u * 2 * 4 * 16 * 64)

static void make_object(char *name, size_t cap, size_t size) {
    snprintf(name, cap, "/lmc-unit-auth-%d-%d", (int)getpid(), rand());
    char path[300];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    int fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    close(fd);
}

static void remove_object(const char *name) {
    char path[300];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    unlink(path);
}

static struct kv_auth auth_for(unsigned char who, int need_proof) {
    struct kv_auth a;
    memset(&a, 0, sizeof(a));
    a.need_proof = need_proof;
    memset(a.peer, who, sizeof(a.peer));
    return a;
}

static void test_register_refuses_non_regular_files(void **state) {
    (void)state;
    struct kv_registry r;
    kvreg_init(&r);
    char name[64], err[256];
    unsigned char nonce[KV_PROOF_NONCE];
    uint64_t off;
    struct kv_auth a = auth_for(1, 0);
    snprintf(name, sizeof(name), "/lmc-unit-fifo-%d", (int)getpid());
    char path[300];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    assert_int_equal(mkfifo(path, 0600), 0);
    struct kv_context c = tmpl(name, 1);
    /* Regression: shm_open blocked forever on a FIFO. */
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "regular file"));
    unlink(path);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), -1);
    rmdir(path);
    char target[64];
    make_object(target, sizeof(target), LAYOUT_BYTES);
    char tpath[300];
    snprintf(tpath, sizeof(tpath), "/dev/shm%s", target);
    assert_int_equal(symlink(tpath, path), 0);
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "regular file"));
    unlink(path);
    remove_object(target);
    c = tmpl("/a/b", 1);
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), KV_REG_BAD_NAME);
    kvreg_destroy(&r);
}

static void test_register_checks_the_owner(void **state) {
    (void)state;
    struct kv_registry r;
    kvreg_init(&r);
    char name[64], err[256];
    unsigned char nonce[KV_PROOF_NONCE];
    uint64_t off;
    make_object(name, sizeof(name), LAYOUT_BYTES);
    struct kv_context c = tmpl(name, 1);
    uint32_t other = geteuid() + 1;
    /* tcp: the owner must be allowed (default: the daemon's euid) */
    struct kv_auth a = auth_for(1, 0);
    a.allowed_uids = &other;
    a.n_allowed_uids = 1;
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "owned by uid"));
    a.n_allowed_uids = 0;
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), 0);
    /* ipc: the peer's uid must own it (root may register anything) */
    struct kv_auth ipc = auth_for(2, 0);
    ipc.has_cred = 1;
    ipc.peer_uid = other;
    assert_int_equal(kvreg_register(&r, &c, &ipc, 1, nonce, &off, err, sizeof(err)), -1);
    ipc.peer_uid = geteuid();
    assert_int_equal(kvreg_register(&r, &c, &ipc, 1, nonce, &off, err, sizeof(err)), 0);
    /* prefixes */
    const char *pfx[] = {"/other-"};
    a.prefixes = pfx;
    a.n_prefixes = 1;
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "prefix"));
    remove_object(name);
    kvreg_destroy(&r);
}

static void test_proof_of_access_and_owners(void **state) {
    (void)state;
    struct kv_registry r;
    kvreg_init(&r);
    char name[64], err[256], path[300];
    unsigned char nonce[KV_PROOF_NONCE], nonce2[KV_PROOF_NONCE];
    uint64_t off = 0;
    make_object(name, sizeof(name), LAYOUT_BYTES);
    struct kv_context c = tmpl(name, 1);
    struct kv_auth a = auth_for(1, 1), b = auth_for(2, 1);
    /* too small for the proof page */
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "proof page"));
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, LAYOUT_BYTES + KV_PROOF_PAGE), 0);
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)),
                     KV_REG_NEED_PROOF);
    assert_int_equal(off, LAYOUT_BYTES);
    assert_int_equal(pwrite(fd, nonce, sizeof(nonce), (off_t)off), (ssize_t)sizeof(nonce));
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), 0);
    /* another connection's nonce differs, and the first one's does not count for it */
    struct kv_context c2 = tmpl(name, 2);
    assert_int_equal(kvreg_register(&r, &c2, &b, 1, nonce2, &off, err, sizeof(err)),
                     KV_REG_NEED_PROOF);
    assert_memory_not_equal(nonce, nonce2, sizeof(nonce));
    /* still valid one epoch (a minute) later, not two */
    uint64_t minute = 60ull * 1000000000ull;
    assert_int_equal(kvreg_register(&r, &c, &a, 1 + minute, nonce2, &off, err, sizeof(err)), 0);
    assert_int_equal(kvreg_register(&r, &c, &a, 1 + 2 * minute, nonce2, &off, err, sizeof(err)),
                     KV_REG_NEED_PROOF);
    close(fd);
    /* the registration is used only by its connection */
    struct kv_context *got = kvreg_get_for(&r, 1, a.peer, 5);
    assert_non_null(got);
    kvreg_put(got);
    assert_null(kvreg_get_for(&r, 1, b.peer, 5));
    assert_int_equal(kvreg_unregister(&r, 1, b.peer), -1);
    assert_int_equal(kvreg_unregister(&r, 1, a.peer), 0);
    remove_object(name);
    kvreg_destroy(&r);
}

/* ---- sessions ---- */

static struct session *new_session(const char *id, unsigned char who, struct l1_key key) {
    struct session *s = calloc(1, sizeof(*s));
    s->objs = calloc(1, sizeof(*s->objs));
    snprintf(s->id, sizeof(s->id), "%s", id);
    memset(s->owner, who, SESSION_OWNER);
    s->nchunks = s->locked_chunks = s->world_size = 1;
    s->objs[0].key = key;
    s->objs[0].locks = 2;
    s->job_ready = 1;
    s->hit_chunks = 1;
    return s;
}

static void count_release(const struct l1_key *key, uint32_t locks, void *arg) {
    (void)key;
    *(uint32_t *)arg += locks;
}

static void test_sessions_are_per_owner(void **state) {
    (void)state;
    struct session_table t;
    session_table_init(&t);
    struct l1_key key;
    memset(&key, 7, sizeof(key));
    uint8_t a[SESSION_OWNER], b[SESSION_OWNER];
    memset(a, 1, sizeof(a));
    memset(b, 2, sizeof(b));
    struct session *old = NULL;
    assert_int_equal(session_put(&t, new_session("r", 1, key), 0, 0, &old), 0);
    assert_null(old);
    uint32_t hits = 9, released = 0;
    /* another owner: unknown id, and nothing of a's is consumed */
    assert_int_equal(session_query(&t, b, "r", &hits), 1);
    assert_int_equal(hits, 0);
    assert_int_equal(session_take_lock(&t, b, "r", 0, 0, &key), 0);
    assert_int_equal(session_release_range(&t, b, "r", 0, 1, -1, count_release, &released), 0);
    assert_null(session_remove(&t, b, "r"));
    /* the same id from b is a session of its own, not a replacement */
    assert_int_equal(session_put(&t, new_session("r", 2, key), 0, 0, &old), 0);
    assert_null(old);
    size_t n, jobs;
    session_counts(&t, &n, &jobs);
    assert_int_equal(n, 2);
    assert_int_equal(session_query(&t, a, "r", &hits), 1);
    assert_int_equal(hits, 1);
    assert_int_equal(session_take_lock(&t, a, "r", 0, 0, &key), 1);
    assert_int_equal(session_release_range(&t, a, "r", 0, 1, -1, count_release, &released), 1);
    assert_int_equal(released, 1);
    struct session *s = session_remove(&t, a, "r");
    assert_non_null(s);
    session_free(s);
    s = session_remove(&t, b, "r");
    assert_non_null(s);
    session_free(s);
    session_table_destroy(&t);
}

/* session_objects: what releasing a session would cost (chunks x world_size of its range), per
 * owner, so the data socket's loop knows which releases to leave to a worker. */
static void test_session_objects(void **state) {
    (void)state;
    struct session_table t;
    session_table_init(&t);
    struct l1_key key;
    memset(&key, 7, sizeof(key));
    uint8_t a[SESSION_OWNER], b[SESSION_OWNER];
    memset(a, 1, sizeof(a));
    memset(b, 2, sizeof(b));
    struct session *s = new_session("r", 1, key), *old = NULL;
    s->nchunks = 300; /* only the first chunk locked: the range counts */
    s->world_size = 4;
    assert_int_equal(session_put(&t, s, 0, 0, &old), 0);
    assert_int_equal(session_objects(&t, a, "r"), 1200);
    assert_int_equal(session_objects(&t, b, "r"), 0);
    assert_int_equal(session_objects(&t, a, "other"), 0);
    s = session_remove(&t, a, "r");
    assert_non_null(s);
    session_free(s);
    assert_int_equal(session_objects(&t, a, "r"), 0);
    session_table_destroy(&t);
}

/* A connection's sessions are held to max_owner_bytes, all of them to max_bytes; replacing a
 * session of the same id counts only the difference; what leaves the table stops counting. */
static void test_session_memory_limits(void **state) {
    (void)state;
    struct session_table t;
    session_table_init(&t);
    struct l1_key key;
    memset(&key, 7, sizeof(key));
    struct session *probe = new_session("p", 1, key), *old = NULL;
    assert_int_equal(session_put(&t, probe, 0, 0, &old), 0);
    size_t one = probe->bytes; /* what one such session holds */
    session_free(session_remove(&t, probe->owner, "p"));
    assert_int_equal(t.bytes, 0);
    char id[8];
    for (int i = 0; i < 3; i++) { /* owner 1 may hold three */
        snprintf(id, sizeof(id), "a%d", i);
        assert_int_equal(session_put(&t, new_session(id, 1, key), 3 * one, 5 * one, &old), 0);
    }
    struct session *extra = new_session("a3", 1, key);
    assert_int_equal(session_put(&t, extra, 3 * one, 5 * one, &old), -1);
    session_free(extra);
    /* the same id replaces: within the limit */
    assert_int_equal(session_put(&t, new_session("a0", 1, key), 3 * one, 5 * one, &old), 0);
    assert_non_null(old);
    session_free(old);
    /* owner 2: two fit under the table's limit, a third does not */
    for (int i = 0; i < 2; i++) {
        snprintf(id, sizeof(id), "b%d", i);
        assert_int_equal(session_put(&t, new_session(id, 2, key), 3 * one, 5 * one, &old), 0);
    }
    extra = new_session("b2", 2, key);
    assert_int_equal(session_put(&t, extra, 3 * one, 5 * one, &old), -1);
    session_free(extra);
    /* once owner 1's sessions expire, there is room again */
    struct session *dead = session_expire(&t, UINT64_MAX);
    while (dead) {
        struct session *n = dead->next;
        session_free(dead);
        dead = n;
    }
    assert_int_equal(t.bytes, 0);
    assert_int_equal(session_put(&t, new_session("b2", 2, key), 3 * one, 5 * one, &old), 0);
    session_table_destroy(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_session_memory_limits),
        cmocka_unit_test(test_shm_names),
        cmocka_unit_test(test_peercred),
        cmocka_unit_test(test_register_refuses_non_regular_files),
        cmocka_unit_test(test_register_checks_the_owner),
        cmocka_unit_test(test_proof_of_access_and_owners),
        cmocka_unit_test(test_sessions_are_per_owner),
        cmocka_unit_test(test_session_objects),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
