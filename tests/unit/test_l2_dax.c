/* Unit tests for the Device-DAX L2 adapter on file-backed arenas in a temp dir: round trips,
 * placement, add/remove (migrate, evict, drain)/resize (grow, shrink with migrate and evict),
 * listing, validation of configs and reconfiguration bodies, Device-DAX size and alignment
 * discovery through a fake sysfs tree, and every operation under concurrent store/load threads
 * with every byte checked. */
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "server/l2/adapter.h"
#include "server/l2/dax.h"
#include "test_util.h"

#define SLOT (64 * 1024)

static char tmpdir[256];

static void path_of(char *out, size_t n, const char *name) {
    snprintf(out, n, "%s/%s", tmpdir, name);
}

static struct keys_object_key key_of(unsigned i) {
    struct keys_object_key k;
    memset(&k, 0, sizeof(k));
    for (unsigned b = 0; b < 32; b++) k.hash[b] = (uint8_t)(i * 7 + b);
    memcpy(k.hash, &i, sizeof(i));
    k.hash_len = 32;
    k.kv_rank = 0x01000100;
    snprintf(k.model_name, sizeof(k.model_name), "model-%u", i % 2);
    return k;
}

static uint64_t size_of(unsigned i) { return 1000 + (i * 4099u) % (SLOT - 1000); }

static void fill(uint8_t *p, uint64_t n, unsigned i, unsigned version) {
    uint32_t x = i * 2654435761u + version * 97u + 1;
    for (uint64_t j = 0; j < n; j++) {
        x = x * 1103515245u + 12345u;
        p[j] = (uint8_t)(x >> 16);
    }
}

static struct l2_adapter *make(const char *json) { return test_adapter_json(json); }

static struct l2_adapter *make2(const char *n0, const char *s0, const char *n1, const char *s1) {
    char p0[512], p1[512], json[2048];
    path_of(p0, sizeof(p0), n0);
    path_of(p1, sizeof(p1), n1);
    unlink(p0);
    unlink(p1);
    snprintf(json, sizeof(json),
             "{\"type\":\"dax\",\"slot_size\":\"64KiB\",\"devices\":["
             "{\"device_path\":\"%s\",\"size\":\"%s\"},{\"device_path\":\"%s\",\"size\":\"%s\"}]}",
             p0, s0, p1, s1);
    return make(json);
}

/* Synchronous helpers (one caller at a time). */
static int store(struct l2_adapter *a, unsigned i, unsigned version) {
    struct keys_object_key k = key_of(i);
    uint64_t n = size_of(i);
    uint8_t *buf = malloc(n), ok = 0;
    fill(buf, n, i, version);
    struct l2_buf b = {buf, n};
    struct l2_task t = {.op = L2_OP_STORE, .n = 1, .keys = &k, .bufs = &b, .ok = &ok};
    l2_adapter_run(a, &t);
    free(buf);
    return ok;
}

/* 1 = found with identical bytes, 0 = missing, -1 = wrong bytes. */
static int verify(struct l2_adapter *a, unsigned i, unsigned version) {
    struct keys_object_key k = key_of(i);
    uint64_t size = 0;
    uint8_t ok = 0;
    struct l2_task lt = {.op = L2_OP_LOOKUP, .n = 1, .keys = &k, .ok = &ok, .sizes = &size};
    l2_adapter_run(a, &lt);
    if (!ok) return 0;
    int res = -1;
    if (size == size_of(i)) {
        uint8_t *buf = malloc(size), *want = malloc(size);
        fill(want, size, i, version);
        struct l2_buf b = {buf, size};
        struct l2_task t = {.op = L2_OP_LOAD, .n = 1, .keys = &k, .bufs = &b, .ok = &ok};
        l2_adapter_run(a, &t);
        res = ok && memcmp(buf, want, size) == 0 ? 1 : -1;
        free(buf);
        free(want);
    }
    l2_adapter_unlock(a, &k, 1);
    return res;
}

static json_t *reconf(struct l2_adapter *a, const char *op, int *http, const char *fmt, ...) {
    char body[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof(body), fmt, ap);
    va_end(ap);
    json_t *b = json_loads(body, 0, NULL);
    assert_non_null(b);
    *http = 0;
    json_t *r = a->ops->reconfigure(a, op, b, http);
    json_decref(b);
    assert_non_null(r);
    return r;
}

static void expect(struct l2_adapter *a, const char *op, int want, const char *fmt, ...) {
    char body[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(body, sizeof(body), fmt, ap);
    va_end(ap);
    int http;
    json_t *r = reconf(a, op, &http, "%s", body);
    if (http != want) {
        char *s = json_dumps(r, 0);
        fail_msg("%s %s: %d (want %d): %s", op, body, http, want, s);
    }
    json_decref(r);
}

/* The keys held by device path p (from the status). */
static long dev_field(struct l2_adapter *a, const char *p, const char *field) {
    json_t *s = a->ops->reconfigure_status(a);
    long v = -1;
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(s, "devices"), i, d) {
        if (strcmp(json_string_value(json_object_get(d, "device_path")), p) == 0 &&
            strcmp(json_string_value(json_object_get(d, "state")), "removed") != 0) {
            json_t *f = json_object_get(d, field);
            v = json_is_integer(f) ? (long)json_integer_value(f) : -2;
        }
    }
    json_decref(s);
    return v;
}

static const char *dev_state(struct l2_adapter *a, const char *p) {
    static char st[32];
    json_t *s = a->ops->reconfigure_status(a);
    snprintf(st, sizeof(st), "absent");
    size_t i;
    json_t *d;
    json_array_foreach(json_object_get(s, "devices"), i, d) {
        if (strcmp(json_string_value(json_object_get(d, "device_path")), p) == 0)
            snprintf(st, sizeof(st), "%s", json_string_value(json_object_get(d, "state")));
    }
    json_decref(s);
    return st;
}

static int setup(void **state) {
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/lmcache-dax-test-XXXXXX");
    assert_non_null(mkdtemp(tmpdir));
    return 0;
}

static int teardown(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- tests ----------------------------------------------------------------------------------- */

static void test_round_trip_and_placement(void **state) {
    (void)state;
    struct l2_adapter *a = make2("rt0", "1MiB", "rt1", "1MiB");
    char p0[512], p1[512];
    path_of(p0, sizeof(p0), "rt0");
    path_of(p1, sizeof(p1), "rt1");
    /* 1 MiB - 4 KiB header = 15 slots of 64 KiB each */
    assert_int_equal(dev_field(a, p0, "slot_count"), 15);
    for (unsigned i = 0; i < 20; i++) assert_int_equal(store(a, i, 0), 1);
    /* least-full placement spreads the keys evenly */
    assert_int_equal(dev_field(a, p0, "keys"), 10);
    assert_int_equal(dev_field(a, p1, "keys"), 10);
    for (unsigned i = 0; i < 20; i++) assert_int_equal(verify(a, i, 0), 1);
    assert_int_equal(verify(a, 99, 0), 0);
    /* a present key is not rewritten: ok, and the old bytes stay */
    assert_int_equal(store(a, 3, 1), 1);
    assert_int_equal(verify(a, 3, 0), 1);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, 20);
    assert_int_equal(u.bytes_used, 20 * SLOT);
    assert_int_equal(u.capacity_bytes, 30 * SLOT);
    /* a load with the wrong size fails instead of returning torn data */
    struct keys_object_key k = key_of(1);
    uint8_t buf[100], ok = 1;
    struct l2_buf b = {buf, sizeof(buf)};
    struct l2_task t = {.op = L2_OP_LOAD, .n = 1, .keys = &k, .bufs = &b, .ok = &ok};
    l2_adapter_run(a, &t);
    assert_int_equal(ok, 0);
    /* an object larger than a slot is refused */
    uint8_t *big = calloc(1, SLOT + 1);
    struct keys_object_key kb = key_of(500);
    struct l2_buf bb = {big, SLOT + 1};
    struct l2_task st = {.op = L2_OP_STORE, .n = 1, .keys = &kb, .bufs = &bb, .ok = &ok};
    l2_adapter_run(a, &st);
    assert_int_equal(ok, 0);
    free(big);
    /* full: 30 slots, 30 keys fit, the 31st does not */
    for (unsigned i = 20; i < 30; i++) assert_int_equal(store(a, i, 0), 1);
    assert_int_equal(store(a, 30, 0), 0);
    /* delete skips locked keys */
    struct keys_object_key keys[2] = {key_of(0), key_of(1)};
    uint64_t sizes[2];
    uint8_t oks[2], del[2];
    struct l2_task lt = {.op = L2_OP_LOOKUP, .n = 1, .keys = keys, .ok = oks, .sizes = sizes};
    l2_adapter_run(a, &lt);
    size_t skipped = 0;
    assert_int_equal(l2_adapter_delete(a, keys, 2, del, &skipped), L2_OK);
    assert_int_equal(skipped, 1);
    assert_int_equal(del[0], 0);
    assert_int_equal(del[1], 1);
    l2_adapter_unlock(a, keys, 1);
    assert_int_equal(verify(a, 0, 0), 1);
    assert_int_equal(verify(a, 1, 0), 0);
    l2_adapter_destroy(a);
}

static void test_listing(void **state) {
    (void)state;
    struct l2_adapter *a = make2("ls0", "1MiB", "ls1", "1MiB");
    for (unsigned i = 0; i < 25; i++) assert_int_equal(store(a, i, 0), 1);
    size_t total = 0, model0 = 0;
    char *tok = NULL;
    char err[128];
    do {
        struct l2_list_page p;
        assert_int_equal(l2_adapter_list(a, NULL, 7, tok, &p, err, sizeof(err)), L2_OK);
        total += p.count;
        free(tok);
        tok = p.next_token ? strdup(p.next_token) : NULL;
        l2_list_page_free(&p);
    } while (tok);
    assert_int_equal(total, 25);
    struct l2_list_page p;
    assert_int_equal(l2_adapter_list(a, "model-0", 100, NULL, &p, err, sizeof(err)), L2_OK);
    model0 = p.count;
    l2_list_page_free(&p);
    assert_int_equal(model0, 13);
    assert_int_equal(l2_adapter_list(a, NULL, 10, "garbage", &p, err, sizeof(err)),
                     L2_ERR_BAD_TOKEN);
    l2_adapter_destroy(a);
}

static void test_remove_migrate(void **state) {
    (void)state;
    struct l2_adapter *a = make2("mg0", "1MiB", "mg1", "2MiB");
    char p0[512], p1[512];
    path_of(p0, sizeof(p0), "mg0");
    path_of(p1, sizeof(p1), "mg1");
    for (unsigned i = 0; i < 20; i++) assert_int_equal(store(a, i, 0), 1);
    long on0 = dev_field(a, p0, "keys");
    assert_true(on0 > 0);
    int http;
    json_t *r = reconf(a, "remove", &http, "{\"device_path\":\"%s\"}", p0);
    assert_int_equal(http, 200);
    assert_int_equal(json_integer_value(json_object_get(r, "moved_keys")), on0);
    assert_int_equal(json_integer_value(json_object_get(r, "deleted_keys")), 0);
    assert_string_equal(json_string_value(json_object_get(json_object_get(r, "device"), "state")),
                        "removed");
    assert_string_equal(json_string_value(json_object_get(r, "mode")), "migrate");
    json_decref(r);
    for (unsigned i = 0; i < 20; i++) assert_int_equal(verify(a, i, 0), 1);
    assert_int_equal(dev_field(a, p1, "keys"), 20);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, 20);
    /* removing the last device while data must migrate: 409, nothing changes */
    expect(a, "remove", 409, "{\"device_path\":\"%s\",\"mode\":\"migrate\"}", p1);
    assert_string_equal(dev_state(a, p1), "active");
    /* not attached any more */
    expect(a, "remove", 404, "{\"device_path\":\"%s\"}", p0);
    /* re-add the removed path, then it takes new keys again */
    expect(a, "add", 200, "{\"device_path\":\"%s\",\"size\":\"1MiB\"}", p0);
    assert_string_equal(dev_state(a, p0), "active");
    for (unsigned i = 20; i < 24; i++) assert_int_equal(store(a, i, 0), 1);
    assert_true(dev_field(a, p0, "keys") == 4);
    for (unsigned i = 0; i < 24; i++) assert_int_equal(verify(a, i, 0), 1);
    l2_adapter_destroy(a);
}

static _Atomic int deleted_events;
static _Atomic uint64_t deleted_bytes;
static void on_deleted(void *arg, int idx, const struct keys_object_key *k, uint64_t size) {
    (void)arg;
    (void)idx;
    (void)k;
    deleted_events++;
    deleted_bytes += size;
}

static void test_remove_evict(void **state) {
    (void)state;
    struct l2_adapter *a = make2("ev0", "1MiB", "ev1", "1MiB");
    struct l2_listener l = {.on_deleted = on_deleted};
    assert_int_equal(l2_adapter_add_listener(a, &l), L2_OK);
    deleted_events = 0;
    deleted_bytes = 0;
    char p0[512];
    path_of(p0, sizeof(p0), "ev0");
    for (unsigned i = 0; i < 20; i++) assert_int_equal(store(a, i, 0), 1);
    long on0 = dev_field(a, p0, "keys");
    /* a key on ev0 under a lookup lock blocks evict without force */
    unsigned locked = 0;
    json_t *s = a->ops->reconfigure_status(a);
    json_decref(s);
    struct keys_object_key k;
    for (unsigned i = 0; i < 20; i++) {
        /* find a key on device 0: evict the others first would be circular; lock all */
        k = key_of(i);
        uint64_t sz;
        uint8_t ok;
        struct l2_task lt = {.op = L2_OP_LOOKUP, .n = 1, .keys = &k, .ok = &ok, .sizes = &sz};
        l2_adapter_run(a, &lt);
        locked++;
    }
    expect(a, "remove", 409, "{\"device_path\":\"%s\",\"mode\":\"evict\"}", p0);
    assert_int_equal(dev_field(a, p0, "keys"), on0);
    for (unsigned i = 0; i < 20; i++) {
        k = key_of(i);
        l2_adapter_unlock(a, &k, 1);
    }
    int http;
    json_t *r = reconf(a, "remove", &http, "{\"device_path\":\"%s\",\"mode\":\"evict\"}", p0);
    assert_int_equal(http, 200);
    assert_int_equal(json_integer_value(json_object_get(r, "deleted_keys")), on0);
    json_decref(r);
    assert_int_equal(deleted_events, on0);
    assert_int_equal(deleted_bytes, (uint64_t)on0 * SLOT);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    assert_int_equal(u.objects, 20 - on0);
    unsigned present = 0;
    for (unsigned i = 0; i < 20; i++) {
        int v = verify(a, i, 0);
        assert_true(v >= 0);
        present += (unsigned)v;
    }
    assert_int_equal(present, 20 - on0);
    (void)locked;
    l2_adapter_destroy(a);
}

static void test_remove_evict_force_locked(void **state) {
    (void)state;
    struct l2_adapter *a = make2("ef0", "1MiB", "ef1", "1MiB");
    char p0[512];
    path_of(p0, sizeof(p0), "ef0");
    for (unsigned i = 0; i < 10; i++) assert_int_equal(store(a, i, 0), 1);
    struct keys_object_key keys[10];
    uint64_t sz[10];
    uint8_t ok[10];
    for (unsigned i = 0; i < 10; i++) keys[i] = key_of(i);
    struct l2_task lt = {.op = L2_OP_LOOKUP, .n = 10, .keys = keys, .ok = ok, .sizes = sz};
    l2_adapter_run(a, &lt);
    expect(a, "remove", 200, "{\"device_path\":\"%s\",\"mode\":\"evict\",\"force\":true}", p0);
    /* the locked readers now miss cleanly */
    unsigned present = 0;
    for (unsigned i = 0; i < 10; i++) present += (unsigned)verify(a, i, 0);
    assert_int_equal(present, 5);
    l2_adapter_unlock(a, keys, 10);
    l2_adapter_destroy(a);
}

static void test_drain(void **state) {
    (void)state;
    struct l2_adapter *a = make2("dr0", "1MiB", "dr1", "1MiB");
    char p0[512], p1[512];
    path_of(p0, sizeof(p0), "dr0");
    path_of(p1, sizeof(p1), "dr1");
    for (unsigned i = 0; i < 6; i++) assert_int_equal(store(a, i, 0), 1);
    int http;
    json_t *r = reconf(a, "remove", &http, "{\"device_path\":\"%s\",\"mode\":\"drain\"}", p0);
    assert_int_equal(http, 200);
    assert_string_equal(json_string_value(json_object_get(json_object_get(r, "device"), "state")),
                        "draining");
    json_decref(r);
    long before = dev_field(a, p0, "keys");
    for (unsigned i = 6; i < 16; i++) assert_int_equal(store(a, i, 0), 1);
    assert_int_equal(dev_field(a, p0, "keys"), before); /* no new writes */
    for (unsigned i = 0; i < 16; i++) assert_int_equal(verify(a, i, 0), 1);
    /* the other device drained as well: nothing is writable */
    expect(a, "remove", 200, "{\"device_path\":\"%s\",\"mode\":\"drain\"}", p1);
    assert_int_equal(store(a, 100, 0), 0);
    for (unsigned i = 0; i < 16; i++) assert_int_equal(verify(a, i, 0), 1);
    /* add with the same size re-activates */
    expect(a, "add", 200, "{\"device_path\":\"%s\",\"size\":\"1MiB\"}", p1);
    assert_string_equal(dev_state(a, p1), "active");
    assert_int_equal(store(a, 100, 0), 1);
    /* a different size is a conflict */
    expect(a, "add", 409, "{\"device_path\":\"%s\",\"size\":\"2MiB\"}", p1);
    l2_adapter_destroy(a);
}

static void test_resize(void **state) {
    (void)state;
    struct l2_adapter *a = make2("rs0", "2MiB", "rs1", "1MiB");
    char p0[512], p1[512];
    path_of(p0, sizeof(p0), "rs0");
    path_of(p1, sizeof(p1), "rs1");
    /* drain rs1 so that every key lands on rs0 */
    expect(a, "remove", 200, "{\"device_path\":\"%s\",\"mode\":\"drain\"}", p1);
    for (unsigned i = 0; i < 30; i++) assert_int_equal(store(a, i, 0), 1);
    assert_int_equal(dev_field(a, p0, "keys"), 30);
    expect(a, "add", 200, "{\"device_path\":\"%s\",\"size\":1048576}", p1);
    /* shrink with migrate: 30 keys in slots 0..29; slots 15..29 move to rs1 */
    int http;
    json_t *r = reconf(a, "resize", &http, "{\"device_path\":\"%s\",\"size\":\"1MiB\"}", p0);
    assert_int_equal(http, 200);
    assert_int_equal(json_integer_value(json_object_get(r, "old_size_bytes")), 2 << 20);
    assert_int_equal(json_integer_value(json_object_get(r, "new_size_bytes")), 1 << 20);
    assert_int_equal(json_integer_value(json_object_get(r, "moved_keys")), 15);
    json_decref(r);
    assert_int_equal(dev_field(a, p0, "slot_count"), 15);
    assert_int_equal(dev_field(a, p0, "keys"), 15);
    assert_int_equal(dev_field(a, p1, "keys"), 15);
    struct stat st;
    assert_int_equal(stat(p0, &st), 0);
    assert_int_equal(st.st_size, 1 << 20);
    for (unsigned i = 0; i < 30; i++) assert_int_equal(verify(a, i, 0), 1);
    /* both devices are full now: another shrink with migrate has nowhere to go */
    expect(a, "resize", 409, "{\"device_path\":\"%s\",\"size\":\"516KiB\"}", p0);
    l2_adapter_destroy(a);
}

static void test_resize_shrink_evict_and_grow(void **state) {
    (void)state;
    struct l2_adapter *a = make2("se0", "1MiB", "se1", "1MiB");
    struct l2_listener l = {.on_deleted = on_deleted};
    assert_int_equal(l2_adapter_add_listener(a, &l), L2_OK);
    deleted_events = 0;
    char p0[512], p1[512];
    path_of(p0, sizeof(p0), "se0");
    path_of(p1, sizeof(p1), "se1");
    for (unsigned i = 0; i < 30; i++) assert_int_equal(store(a, i, 0), 1);
    /* both full: shrinking with migrate has nowhere to go */
    expect(a, "resize", 409, "{\"device_path\":\"%s\",\"size\":\"516KiB\"}", p0);
    assert_int_equal(dev_field(a, p0, "slot_count"), 15);
    /* shrink with evict: 4 KiB header + 8 slots; 7 keys go */
    int http;
    json_t *r = reconf(a, "resize", &http,
                       "{\"device_path\":\"%s\",\"size\":\"516KiB\",\"mode\":\"evict\"}", p0);
    assert_int_equal(http, 200);
    assert_int_equal(json_integer_value(json_object_get(r, "deleted_keys")), 7);
    json_decref(r);
    assert_int_equal(deleted_events, 7);
    unsigned present = 0;
    for (unsigned i = 0; i < 30; i++) {
        int v = verify(a, i, 0);
        assert_true(v >= 0);
        present += (unsigned)v;
    }
    assert_int_equal(present, 23);
    /* grow: remap, new slots usable, old keys intact */
    expect(a, "resize", 200, "{\"device_path\":\"%s\",\"size\":\"4m\"}", p0);
    assert_int_equal(dev_field(a, p0, "slot_count"), 63);
    for (unsigned i = 100; i < 140; i++) assert_int_equal(store(a, i, 0), 1);
    for (unsigned i = 100; i < 140; i++) assert_int_equal(verify(a, i, 0), 1);
    l2_adapter_destroy(a);
}

static void test_bad_configs(void **state) {
    (void)state;
    const char *bad[] = {
        "{\"type\":\"dax\"}",
        "{\"type\":\"dax\",\"devices\":[],\"bogus\":1}",
        "{\"type\":\"dax\",\"devices\":[{\"device_path\":\"%s/x\"}]}",
        "{\"type\":\"dax\",\"devices\":[{\"device_path\":\"%s/x\",\"size\":\"12QiB\"}]}",
        "{\"type\":\"dax\",\"devices\":[{\"device_path\":\"%s/x\",\"size\":0}]}",
        "{\"type\":\"dax\",\"devices\":[{\"device_path\":\"%s/x\",\"size\":\"1MiB\",\"z\":1}]}",
        "{\"type\":\"dax\",\"slot_size\":\"2MiB\",\"devices\":[{\"device_path\":\"%s/x\","
        "\"size\":\"1MiB\"}]}",
        "{\"type\":\"dax\",\"devices\":[{\"device_path\":\"%s/notes\",\"size\":\"1MiB\"}]}",
        "{\"type\":\"dax\",\"devices\":[{\"device_path\":\"%s\",\"size\":\"1MiB\"}]}",
        "{\"type\":\"dax\",\"workers\":0,\"devices\":[]}",
    };
    char notes[512];
    path_of(notes, sizeof(notes), "notes");
    FILE *f = fopen(notes, "w");
    assert_non_null(f);
    fputs("precious data\n", f);
    fclose(f);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char json[1024];
        snprintf(json, sizeof(json), bad[i], tmpdir);
        json_t *cfg = json_loads(json, 0, NULL);
        assert_non_null(cfg);
        struct l2_adapter *a = NULL;
        char err[256] = "";
        int rc = l2_adapter_create(cfg, &a, err, sizeof(err));
        json_decref(cfg);
        if (rc == L2_OK) fail_msg("config %zu accepted: %s", i, json);
        assert_null(a);
        assert_true(err[0] != 0);
    }
    /* the existing file was left alone */
    struct stat st;
    assert_int_equal(stat(notes, &st), 0);
    assert_int_equal(st.st_size, 14);
    /* an adapter may start with no devices and get them at runtime */
    struct l2_adapter *a = make("{\"type\":\"dax\",\"devices\":[]}");
    assert_int_equal(store(a, 1, 0), 0);
    l2_adapter_destroy(a);
}

static void test_reconfigure_validation(void **state) {
    (void)state;
    struct l2_adapter *a = make2("va0", "1MiB", "va1", "1MiB");
    char p0[512];
    path_of(p0, sizeof(p0), "va0");
    expect(a, "add", 422, "{\"size\":\"1MiB\"}");
    expect(a, "add", 422, "{\"device_path\":\"%s/n\"}", tmpdir);
    expect(a, "add", 422, "{\"device_path\":\"%s/n\",\"size\":\"1MiB\",\"mode\":\"evict\"}",
           tmpdir);
    expect(a, "add", 422, "{\"device_path\":\"%s/n\",\"size\":[1]}", tmpdir);
    expect(a, "add", 422, "{\"device_path\":7,\"size\":\"1MiB\"}");
    expect(a, "add", 400, "{\"device_path\":\"%s/n\",\"size\":\"-1GiB\"}", tmpdir);
    expect(a, "add", 400, "{\"device_path\":\"%s/n\",\"size\":0}", tmpdir);
    expect(a, "add", 400, "{\"device_path\":\"%s/n\",\"size\":\"lots\"}", tmpdir);
    expect(a, "add", 400, "{\"device_path\":\"%s/n\",\"size\":\"1KiB\"}", tmpdir);
    expect(a, "add", 400, "{\"device_path\":\"/nonexistent-dir/x\",\"size\":\"1MiB\"}");
    expect(a, "remove", 422, "{\"device_path\":\"%s\",\"size\":\"1MiB\"}", p0);
    expect(a, "remove", 422, "{\"device_path\":\"%s\",\"mode\":\"shred\"}", p0);
    expect(a, "remove", 422, "{\"device_path\":\"%s\",\"force\":\"yes\"}", p0);
    expect(a, "resize", 422, "{\"device_path\":\"%s\",\"mode\":\"drain\",\"size\":1}", p0);
    expect(a, "resize", 422, "{\"device_path\":\"%s\"}", p0);
    expect(a, "resize", 400, "{\"device_path\":\"%s\",\"size\":\"0b\"}", p0);
    expect(a, "resize", 404, "{\"device_path\":\"%s/none\",\"size\":\"1MiB\"}", tmpdir);
    expect(a, "explode", 400, "{}");
    /* add of an attached device with the same size is idempotent; adapter_index is accepted */
    expect(a, "add", 200, "{\"device_path\":\"%s\",\"size\":\"1MiB\",\"adapter_index\":0}", p0);
    /* a new device from a size string */
    int http;
    json_t *r = reconf(a, "add", &http, "{\"device_path\":\"%s/va2\",\"size\":\"1.5MiB\"}", tmpdir);
    assert_int_equal(http, 200);
    assert_string_equal(json_string_value(json_object_get(r, "status")), "ok");
    assert_string_equal(json_string_value(json_object_get(r, "operation")), "add");
    assert_int_equal(json_integer_value(json_object_get(r, "adapter_index")), 0);
    json_t *d = json_object_get(r, "device");
    assert_string_equal(json_string_value(json_object_get(d, "state")), "active");
    assert_int_equal(json_integer_value(json_object_get(d, "size_bytes")), 3 << 19);
    json_decref(r);
    l2_adapter_destroy(a);
}

/* ---- Device-DAX through a fake sysfs --------------------------------------------------------- */

/* A fake Device-DAX device: <tmp>/sys/dev/char/<name>/{subsystem -> ../../../bus/<subsys>,
 * align, size} and a regular file <tmp>/dev/<name> of dev_size bytes standing in for the
 * character device (the adapter's LMCACHE_DAX_SYSFS_ROOT / LMCACHE_DAX_DEV_PREFIX seam). align 0
 * leaves the align file out. */
static void fake_devdax(const char *name, const char *subsys, uint64_t align, uint64_t dev_size,
                        char *dev, size_t devlen) {
    char p[1024];
    snprintf(p, sizeof(p), "mkdir -p '%s/sys/dev/char/%s' '%s/sys/bus/%s' '%s/dev'", tmpdir, name,
             tmpdir, subsys, tmpdir);
    assert_int_equal(system(p), 0);
    char link[64];
    snprintf(link, sizeof(link), "../../../bus/%s", subsys);
    snprintf(p, sizeof(p), "%s/sys/dev/char/%s/subsystem", tmpdir, name);
    unlink(p);
    assert_int_equal(symlink(link, p), 0);
    FILE *f;
    if (align) {
        snprintf(p, sizeof(p), "%s/sys/dev/char/%s/align", tmpdir, name);
        assert_non_null(f = fopen(p, "w"));
        fprintf(f, "%llu\n", (unsigned long long)align);
        fclose(f);
    }
    snprintf(p, sizeof(p), "%s/sys/dev/char/%s/size", tmpdir, name);
    assert_non_null(f = fopen(p, "w"));
    fprintf(f, "%llu\n", (unsigned long long)dev_size);
    fclose(f);
    snprintf(dev, devlen, "%s/dev/%s", tmpdir, name);
    assert_non_null(f = fopen(dev, "w"));
    assert_int_equal(ftruncate(fileno(f), (off_t)dev_size), 0);
    fclose(f);
}

static int create_err(const char *dev, const char *size, char *err, size_t errlen) {
    char json[1024];
    snprintf(json, sizeof(json),
             "{\"type\":\"dax\",\"slot_size\":\"64KiB\",\"devices\":[{\"device_path\":\"%s\","
             "\"size\":\"%s\"}]}",
             dev, size);
    json_t *cfg = json_loads(json, 0, NULL);
    assert_non_null(cfg);
    struct l2_adapter *a = NULL;
    err[0] = 0;
    int rc = l2_adapter_create(cfg, &a, err, errlen);
    json_decref(cfg);
    if (a) l2_adapter_destroy(a);
    return rc;
}

static void test_devdax_sysfs_size_and_alignment(void **state) {
    (void)state;
    char sys[512], prefix[512], dev[512], dev2[512], notdax[512], err[512];
    snprintf(sys, sizeof(sys), "%s/sys", tmpdir);
    snprintf(prefix, sizeof(prefix), "%s/dev/", tmpdir);
    fake_devdax("dax0.0", "dax", 2u << 20, 10u << 20, dev, sizeof(dev));
    fake_devdax("dax0.1", "dax", 0, 8u << 20, dev2, sizeof(dev2));
    fake_devdax("mem1", "mem", 4096, 8u << 20, notdax, sizeof(notdax));
    /* without the seam the stand-in is an ordinary non-empty file without an arena header */
    assert_int_equal(create_err(dev, "4MiB", err, sizeof(err)), L2_ERR_INVAL);
    assert_non_null(strstr(err, "not a DAX arena file"));
    assert_int_equal(setenv("LMCACHE_DAX_SYSFS_ROOT", sys, 1), 0);
    assert_int_equal(setenv("LMCACHE_DAX_DEV_PREFIX", prefix, 1), 0);

    /* the size is rounded down to the device's alignment (sysfs align: 2 MiB) */
    char json[1024];
    snprintf(json, sizeof(json),
             "{\"type\":\"dax\",\"slot_size\":\"64KiB\",\"devices\":[{\"device_path\":\"%s\","
             "\"size\":\"5MiB\"}]}",
             dev);
    struct l2_adapter *a = make(json);
    assert_int_equal(dev_field(a, dev, "size_bytes"), 4 << 20);
    assert_int_equal(dev_field(a, dev, "align_bytes"), 2 << 20);
    assert_int_equal(dev_field(a, dev, "slot_count"), 64); /* no header page on a device */
    json_t *st = a->ops->reconfigure_status(a);
    json_t *d0 = json_array_get(json_object_get(st, "devices"), 0);
    assert_string_equal(json_string_value(json_object_get(d0, "kind")), "devdax");
    json_decref(st);
    for (unsigned i = 0; i < 24; i++) assert_int_equal(store(a, i, 0), 1);
    for (unsigned i = 0; i < 24; i++) assert_int_equal(verify(a, i, 0), 1);
    /* a device is neither truncated nor given a file header */
    struct stat sb;
    assert_int_equal(stat(dev, &sb), 0);
    assert_int_equal(sb.st_size, 10 << 20);
    char head[8] = {0};
    FILE *f = fopen(dev, "r");
    assert_non_null(f);
    assert_int_equal(fread(head, 1, sizeof(head), f), sizeof(head));
    fclose(f);
    assert_true(memcmp(head, "LMCACHE-", 8) != 0);

    /* resize: beyond the sysfs size is refused, within it rounds down to the alignment */
    int http;
    json_t *r = reconf(a, "resize", &http, "{\"device_path\":\"%s\",\"size\":\"12MiB\"}", dev);
    assert_int_equal(http, 400);
    assert_non_null(strstr(json_string_value(json_object_get(r, "detail")), "exceeds the size"));
    json_decref(r);
    r = reconf(a, "resize", &http, "{\"device_path\":\"%s\",\"size\":\"9MiB\"}", dev);
    assert_int_equal(http, 200);
    assert_int_equal(json_integer_value(json_object_get(r, "new_size_bytes")), 8 << 20);
    json_decref(r);
    assert_int_equal(dev_field(a, dev, "slot_count"), 128);
    r = reconf(a, "resize", &http, "{\"device_path\":\"%s\",\"size\":\"3MiB\"}", dev);
    assert_int_equal(http, 200);
    assert_int_equal(json_integer_value(json_object_get(r, "new_size_bytes")), 2 << 20);
    json_decref(r);
    for (unsigned i = 0; i < 24; i++) assert_int_equal(verify(a, i, 0), 1); /* still readable */
    l2_adapter_destroy(a);

    /* larger than the device: refused at start */
    assert_int_equal(create_err(dev, "11MiB", err, sizeof(err)), L2_ERR_INVAL);
    assert_non_null(strstr(err, "exceeds the size"));
    /* no align file: the default Device-DAX alignment (2 MiB) applies */
    snprintf(json, sizeof(json),
             "{\"type\":\"dax\",\"slot_size\":\"64KiB\",\"devices\":[{\"device_path\":\"%s\","
             "\"size\":\"3MiB\"}]}",
             dev2);
    a = make(json);
    assert_int_equal(dev_field(a, dev2, "align_bytes"), 2 << 20);
    assert_int_equal(dev_field(a, dev2, "size_bytes"), 2 << 20);
    l2_adapter_destroy(a);
    /* a device of another subsystem is refused */
    assert_int_equal(create_err(notdax, "4MiB", err, sizeof(err)), L2_ERR_INVAL);
    assert_non_null(strstr(err, "not a Device-DAX device"));
    unsetenv("LMCACHE_DAX_SYSFS_ROOT");
    unsetenv("LMCACHE_DAX_DEV_PREFIX");
}

/* ---- concurrency ----------------------------------------------------------------------------- */

#define CKEYS    96
#define CTHREADS 3

struct cctx {
    struct l2_adapter *a;
    _Atomic int running, collecting;
    _Atomic uint64_t mismatches, loads_ok, stores_ok, ops;
    pthread_mutex_t mu; /* guards every task's done flag */
    pthread_cond_t cv;
};

struct waiter {
    int done;
};

/* The one thread that drains the adapter's completions and wakes the submitters. */
static void *collector(void *arg) {
    struct cctx *c = arg;
    while (c->collecting) {
        struct pollfd p = {.fd = l2_adapter_event_fd(c->a), .events = POLLIN};
        poll(&p, 1, 20);
        struct l2_task *t = l2_adapter_drain(c->a);
        if (!t) continue;
        pthread_mutex_lock(&c->mu);
        for (; t; t = t->next) ((struct waiter *)t->user)->done = 1;
        pthread_cond_broadcast(&c->cv);
        pthread_mutex_unlock(&c->mu);
    }
    return NULL;
}

static void run_task(struct cctx *c, struct l2_task *t) {
    struct waiter w = {0};
    t->user = &w;
    if (l2_adapter_submit(c->a, t) != L2_OK) return;
    pthread_mutex_lock(&c->mu);
    while (!w.done) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

static void *cworker(void *arg) {
    struct cctx *c = arg;
    unsigned seed = (unsigned)(uintptr_t)pthread_self();
    uint8_t *buf = malloc(SLOT), *want = malloc(SLOT);
    while (c->running) {
        unsigned i = (unsigned)rand_r(&seed) % CKEYS;
        struct keys_object_key k = key_of(i);
        uint64_t n = size_of(i);
        uint8_t ok = 0;
        c->ops++;
        if (rand_r(&seed) % 2) {
            fill(buf, n, i, 0);
            struct l2_buf b = {buf, n};
            struct l2_task t = {.op = L2_OP_STORE, .n = 1, .keys = &k, .bufs = &b, .ok = &ok};
            run_task(c, &t);
            if (ok) c->stores_ok++;
        } else {
            uint64_t sz = 0;
            struct l2_task lt = {.op = L2_OP_LOOKUP, .n = 1, .keys = &k, .ok = &ok, .sizes = &sz};
            run_task(c, &lt);
            if (!ok) continue;
            memset(buf, 0xee, n);
            struct l2_buf b = {buf, sz};
            struct l2_task t = {.op = L2_OP_LOAD, .n = 1, .keys = &k, .bufs = &b, .ok = &ok};
            run_task(c, &t);
            if (ok) {
                fill(want, n, i, 0);
                if (sz != n || memcmp(buf, want, n) != 0) c->mismatches++;
                c->loads_ok++;
            }
            l2_adapter_unlock(c->a, &k, 1);
        }
    }
    free(buf);
    free(want);
    return NULL;
}

/* Lets the workers make n more operations (progress, not time, paces the test). */
static void wait_progress(struct cctx *c, uint64_t n) {
    uint64_t start = c->ops;
    while (c->ops < start + n) usleep(100);
}

static void test_concurrent_reconfigure(void **state) {
    (void)state;
    struct l2_adapter *a = make2("cc0", "1MiB", "cc1", "2MiB");
    char p0[512], p1[512], p2[512];
    path_of(p0, sizeof(p0), "cc0");
    path_of(p1, sizeof(p1), "cc1");
    path_of(p2, sizeof(p2), "cc2");
    struct cctx c = {.a = a, .running = 1, .collecting = 1};
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    pthread_t th[CTHREADS], col;
    pthread_create(&col, NULL, collector, &c);
    for (int i = 0; i < CTHREADS; i++) pthread_create(&th[i], NULL, cworker, &c);
    int http;
    enum { NOPS = 9 };
    unsigned ok_by_op[NOPS] = {0};
    for (int round = 0; round < 20; round++) {
        const char *ops[NOPS][2] = {
            {"add", "{\"device_path\":\"%s\",\"size\":\"1MiB\"}"},
            {"resize", "{\"device_path\":\"%s\",\"size\":\"3MiB\"}"},
            {"remove", "{\"device_path\":\"%s\",\"mode\":\"drain\"}"},
            {"add", "{\"device_path\":\"%s\",\"size\":\"3MiB\"}"},
            {"resize", "{\"device_path\":\"%s\",\"size\":\"516KiB\",\"force\":true}"},
            {"remove", "{\"device_path\":\"%s\",\"force\":true}"},
            {"add", "{\"device_path\":\"%s\",\"size\":\"1MiB\"}"},
            {"resize", "{\"device_path\":\"%s\",\"size\":\"260KiB\",\"mode\":\"evict\","
                       "\"force\":true}"},
            {"remove", "{\"device_path\":\"%s\",\"mode\":\"evict\",\"force\":true}"},
        };
        const char *target = round % 3 == 0 ? p2 : round % 3 == 1 ? p0 : p1;
        for (size_t o = 0; o < sizeof(ops) / sizeof(ops[0]); o++) {
            wait_progress(&c, 200);
            json_t *r = reconf(a, ops[o][0], &http, ops[o][1], target);
            if (http != 200 && http != 409) {
                char *s = json_dumps(r, 0);
                fail_msg("%s on %s: %d %s", ops[o][0], target, http, s);
            }
            if (http == 200) ok_by_op[o]++;
            json_decref(r);
        }
        /* keep at least one device writable between rounds */
        json_decref(reconf(a, "add", &http, "{\"device_path\":\"%s\",\"size\":\"1MiB\"}", target));
    }
    c.running = 0;
    for (int i = 0; i < CTHREADS; i++) pthread_join(th[i], NULL);
    c.collecting = 0;
    pthread_join(col, NULL);
    print_message("concurrent: %llu stores, %llu verified loads\n", (unsigned long long)c.stores_ok,
                  (unsigned long long)c.loads_ok);
    assert_int_equal(c.mismatches, 0);
    assert_true(c.loads_ok > 0);
    assert_true(c.stores_ok > 0);
    /* a run where every operation was refused (409) proves nothing: each operation of the table
     * (add, grow, drain, shrink with migrate and evict, remove with migrate and evict) must have
     * been carried out under the load at least once */
    for (int o = 0; o < NOPS; o++) {
        print_message("op %d: %u of 20 succeeded\n", o, ok_by_op[o]);
        assert_true(ok_by_op[o] > 0);
    }
    /* every surviving key still reads back exactly */
    for (unsigned i = 0; i < CKEYS; i++) assert_true(verify(a, i, 0) >= 0);
    pthread_mutex_destroy(&c.mu);
    pthread_cond_destroy(&c.cv);
    l2_adapter_destroy(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip_and_placement),
        cmocka_unit_test(test_listing),
        cmocka_unit_test(test_remove_migrate),
        cmocka_unit_test(test_remove_evict),
        cmocka_unit_test(test_remove_evict_force_locked),
        cmocka_unit_test(test_drain),
        cmocka_unit_test(test_resize),
        cmocka_unit_test(test_resize_shrink_evict_and_grow),
        cmocka_unit_test(test_bad_configs),
        cmocka_unit_test(test_reconfigure_validation),
        cmocka_unit_test(test_devdax_sysfs_size_and_alignment),
        cmocka_unit_test(test_concurrent_reconfigure),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
