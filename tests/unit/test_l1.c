/* Unit tests for the L1 table: state machine, leases (injected clock), LRU order, evict on
 * allocate, the background tick, IsolatedLRU quotas, clear, temporaries and stats. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "server/l1/l1.h"

#define SEC 1000000000ull
#define OBJ 65536u /* 16 units */

static struct l1 *create(const struct l1_config *cfg) {
    struct l1 *l1 = NULL;
    char err[160];
    if (l1_create(cfg, &l1, err, sizeof(err)) != 0) fail_msg("l1_create: %s", err);
    return l1;
}

static struct l1 *mk(uint64_t size, enum l1_policy pol, struct quota *q) {
    struct l1_config cfg = {.size_bytes = size,
                            .policy = pol,
                            .read_ttl_ns = 300 * SEC,
                            .write_ttl_ns = 600 * SEC,
                            .stripes = 8,
                            .quota = q};
    return create(&cfg);
}

/* The ObjectKey of object i of model "m" in salt (NULL: ""). */
static struct keys_object_key object_key(unsigned i, const char *salt) {
    struct keys_object_key k;
    char hex[17], err[KEYS_ERR_MAX];
    snprintf(hex, sizeof(hex), "%016x", i);
    assert_int_equal(keys_object_key_init(&k, hex, 16, "m", 1, 0x01000100, 0, salt,
                                          salt ? strlen(salt) : 0, err, sizeof(err)),
                     0);
    return k;
}

static struct l1_key key(struct l1 *l1, unsigned i, const char *salt) {
    struct keys_object_key k = object_key(i, salt);
    struct l1_key out;
    assert_int_equal(l1_key_make(l1, &k, &out), L1_OK);
    return out;
}

/* Stores one object with a byte pattern; returns the reserve status. */
static int store(struct l1 *l1, const struct l1_key *k, uint64_t now, uint8_t pat) {
    struct l1_ref r;
    int rc = l1_reserve_write(l1, k, OBJ, false, now, &r);
    if (rc != L1_OK) return rc;
    memset(r.data, pat, OBJ);
    assert_int_equal(l1_finish_write(l1, k, r.token, 0, now), L1_OK);
    return L1_OK;
}

static void test_state_machine(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_LRU, NULL);
    struct l1_key k = key(l1, 1, NULL);
    struct l1_ref w, r;
    uint64_t now = 1000 * SEC;
    /* Absent: nothing to read, delete or finish. */
    assert_int_equal(l1_reserve_read(l1, &k, 1, now, &r), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_delete(l1, &k, false, now), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_finish_write(l1, &k, 5, 0, now), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_write(l1, &k, 0, false, now, &w), L1_ERR_INVAL);
    /* Staging: invisible to readers, a second writer is refused. */
    assert_int_equal(l1_reserve_write(l1, &k, 5000, false, now, &w), L1_OK);
    assert_int_equal((uintptr_t)w.data % 4096, 0);
    assert_int_equal(w.size, 5000);
    assert_int_equal(l1_reserve_read(l1, &k, 1, now, &r), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_write(l1, &k, 5000, false, now, &r), L1_ERR_BUSY);
    assert_int_equal(l1_delete(l1, &k, false, now), L1_ERR_BUSY);
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.staging_objects, 1);
    assert_int_equal(st.write_locked_objects, 1);
    assert_int_equal(st.bytes_used, 8192);
    memset(w.data, 0xab, 5000);
    assert_int_equal(l1_finish_write(l1, &k, w.token + 1, 0, now), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_finish_write(l1, &k, w.token, 0, now), L1_OK);
    /* Resident: storing again succeeds without copying. */
    assert_int_equal(l1_reserve_write(l1, &k, 5000, false, now, &r), L1_EXISTS);
    /* Read path: no lock -> not readable; lock -> readable; release -> not readable. */
    assert_int_equal(l1_read_locked(l1, &k, now, &r), L1_ERR_NOT_READABLE);
    assert_int_equal(l1_reserve_read(l1, &k, 2, now, &r), L1_OK);
    assert_ptr_equal(r.data, w.data);
    assert_int_equal(((uint8_t *)r.data)[4999], 0xab);
    assert_int_equal(l1_read_locked(l1, &k, now, &r), L1_OK);
    assert_int_equal(l1_delete(l1, &k, false, now), L1_ERR_BUSY);
    assert_int_equal(l1_finish_read(l1, &k, 1, now), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, now, &r), L1_OK);
    assert_int_equal(l1_finish_read(l1, &k, 1, now), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, now, &r), L1_ERR_NOT_READABLE);
    assert_int_equal(l1_finish_read(l1, &k, 1, now), L1_OK); /* extra release is harmless */
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.objects, 1);
    assert_int_equal(st.staging_objects, 0);
    assert_int_equal(st.locked_objects, 0);
    assert_int_equal(st.write_chunks, 1);
    assert_int_equal(st.read_chunks, 1);
    assert_int_equal(l1_delete(l1, &k, false, now), L1_OK);
    assert_int_equal(l1_delete(l1, &k, false, now), L1_ERR_NOT_FOUND);
    /* Abort discards a staging write. */
    assert_int_equal(l1_reserve_write(l1, &k, 100, false, now, &w), L1_OK);
    assert_int_equal(l1_abort_write(l1, &k, w.token), L1_OK);
    assert_int_equal(l1_abort_write(l1, &k, w.token), L1_ERR_NOT_FOUND);
    /* finish_write with read locks (prefetch completion). */
    assert_int_equal(l1_reserve_write(l1, &k, 100, false, now, &w), L1_OK);
    assert_int_equal(l1_finish_write(l1, &k, w.token, 3, now), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, now, &r), L1_OK);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.read_locked_objects, 1);
    assert_int_equal(st.bytes_used, 4096);
    assert_string_equal(l1_strerror(L1_ERR_BUSY), "locked by another holder");
    l1_destroy(l1);
}

static void test_leases(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_LRU, NULL);
    struct l1_key k = key(l1, 1, NULL), k2 = key(l1, 2, NULL);
    struct l1_ref w, w2, r;
    uint64_t t0 = 10 * SEC;
    /* Write lease: expires after 600 s; finish then fails, a new writer takes the entry. */
    assert_int_equal(l1_reserve_write(l1, &k, 100, false, t0, &w), L1_OK);
    assert_int_equal(l1_reserve_write(l1, &k, 100, false, t0 + 599 * SEC, &w2), L1_ERR_BUSY);
    assert_int_equal(l1_finish_write(l1, &k, w.token, 0, t0 + 600 * SEC), L1_ERR_EXPIRED);
    assert_int_equal(l1_delete(l1, &k, false, t0 + 600 * SEC), L1_OK); /* expired: reclaimable */
    assert_int_equal(l1_reserve_write(l1, &k, 100, false, t0, &w), L1_OK);
    assert_int_equal(l1_reserve_write(l1, &k, 100, false, t0 + 601 * SEC, &w2), L1_OK);
    assert_int_not_equal(w.token, w2.token);
    assert_int_equal(l1_finish_write(l1, &k, w.token, 0, t0 + 601 * SEC), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_finish_write(l1, &k, w2.token, 0, t0 + 601 * SEC), L1_OK);
    /* Read lease: expires after 300 s; the object becomes unreadable and evictable. */
    uint64_t t1 = 1000 * SEC;
    assert_int_equal(l1_reserve_read(l1, &k, 1, t1, &r), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, t1 + 299 * SEC, &r), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, t1 + 300 * SEC, &r), L1_ERR_NOT_READABLE);
    assert_int_equal(l1_delete(l1, &k, false, t1 + 299 * SEC), L1_ERR_BUSY);
    /* A new reserve renews the lease for all holders. */
    assert_int_equal(l1_reserve_read(l1, &k, 1, t1 + 200 * SEC, &r), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, t1 + 450 * SEC, &r), L1_OK);
    assert_int_equal(l1_delete(l1, &k, false, t1 + 500 * SEC), L1_OK);
    /* The tick reclaims expired staging entries. */
    assert_int_equal(l1_reserve_write(l1, &k2, 100, false, t0, &w), L1_OK);
    struct l1_tick_report rep;
    l1_evict_tick(l1, t0 + 599 * SEC, &rep);
    assert_int_equal(rep.reclaimed_staging, 0);
    l1_evict_tick(l1, t0 + 600 * SEC, &rep);
    assert_int_equal(rep.reclaimed_staging, 1);
    struct l1_stats st;
    l1_get_stats(l1, t0, &st);
    assert_int_equal(st.staging_objects, 0);
    assert_int_equal(st.bytes_used, 0);
    l1_destroy(l1);
}

static void test_temporary(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_LRU, NULL);
    struct l1_key k = key(l1, 1, NULL);
    struct l1_ref w;
    uint64_t now = SEC;
    assert_int_equal(l1_reserve_write(l1, &k, 100, true, now, &w), L1_OK);
    assert_int_equal(l1_finish_write(l1, &k, w.token, 2, now), L1_OK);
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.temporary_objects, 1);
    assert_int_equal(l1_finish_read(l1, &k, 1, now), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k, now, &w), L1_OK);
    assert_int_equal(l1_finish_read(l1, &k, 1, now), L1_OK); /* last read: freed */
    assert_int_equal(l1_reserve_read(l1, &k, 1, now, &w), L1_ERR_NOT_FOUND);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.objects, 0);
    assert_int_equal(st.temporary_objects, 0);
    assert_int_equal(st.bytes_used, 0);
    l1_destroy(l1);
}

/* 16 objects of 64 KiB fill a 1 MiB arena; the 17th evicts the least recently used. */
static void test_lru_order_and_evict_on_allocate(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_LRU, NULL);
    struct l1_key k[20];
    uint64_t now = SEC;
    for (unsigned i = 0; i < 20; i++) k[i] = key(l1, i, NULL);
    for (unsigned i = 0; i < 16; i++) assert_int_equal(store(l1, &k[i], now, (uint8_t)i), L1_OK);
    /* Access 0 and 1 (MRU), read-lock 2 (not evictable). */
    assert_int_equal(l1_touch(l1, &k[0], now), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &k[1], 1, now, NULL), L1_OK);
    assert_int_equal(l1_finish_read(l1, &k[1], 1, now), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &k[2], 1, now, NULL), L1_OK);
    assert_int_equal(store(l1, &k[16], now, 16), L1_OK); /* evicts 3 */
    assert_int_equal(l1_reserve_read(l1, &k[3], 1, now, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(store(l1, &k[17], now, 17), L1_OK); /* evicts 4 */
    assert_int_equal(l1_reserve_read(l1, &k[4], 1, now, NULL), L1_ERR_NOT_FOUND);
    for (unsigned i = 0; i < 3; i++) {
        struct l1_ref r;
        assert_int_equal(l1_reserve_read(l1, &k[i], 1, now, &r), L1_OK);
        assert_int_equal(((uint8_t *)r.data)[OBJ - 1], i); /* data intact */
    }
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.evicted_chunks, 2);
    assert_int_equal(st.objects, 16);
    /* Everything read-locked: nothing evictable, the store fails and is counted. */
    for (unsigned i = 0; i < 18; i++) l1_reserve_read(l1, &k[i], 1, now, NULL);
    assert_int_equal(store(l1, &k[18], now, 18), L1_ERR_NOMEM);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.alloc_failures, 1);
    /* Once the leases expire the store evicts again. */
    assert_int_equal(store(l1, &k[18], now + 301 * SEC, 18), L1_OK);
    l1_destroy(l1);
}

static void test_noop_policy_never_evicts(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_NOOP, NULL);
    for (unsigned i = 0; i < 16; i++) {
        struct l1_key k = key(l1, i, NULL);
        assert_int_equal(store(l1, &k, SEC, 1), L1_OK);
    }
    struct l1_key k = key(l1, 99, NULL);
    assert_int_equal(store(l1, &k, SEC, 1), L1_ERR_NOMEM);
    struct l1_tick_report rep;
    l1_evict_tick(l1, SEC, &rep);
    assert_int_equal(rep.evicted_objects, 0);
    l1_destroy(l1);
}

static void test_tick_watermark(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_LRU, NULL); /* watermark 0.8, ratio 0.1 */
    uint64_t now = SEC;
    struct l1_key k[16];
    for (unsigned i = 0; i < 12; i++) {
        k[i] = key(l1, i, NULL);
        assert_int_equal(store(l1, &k[i], now, 1), L1_OK);
    }
    struct l1_tick_report rep;
    l1_evict_tick(l1, now, &rep); /* 12/16 = 0.75: below */
    assert_false(rep.triggered);
    assert_int_equal(rep.evicted_objects, 0);
    k[12] = key(l1, 12, NULL);
    assert_int_equal(store(l1, &k[12], now, 1), L1_OK);
    l1_evict_tick(l1, now, &rep); /* 13/16 = 0.8125 -> down to 0.72 = 11.52 objects -> 11 */
    assert_true(rep.triggered);
    assert_int_equal(rep.evicted_objects, 2);
    assert_int_equal(rep.evicted_bytes, 2 * OBJ);
    assert_int_equal(l1_reserve_read(l1, &k[0], 1, now, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_read(l1, &k[1], 1, now, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_read(l1, &k[2], 1, now, NULL), L1_OK);
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.eviction_ticks, 2);
    assert_int_equal(st.eviction_triggered, 1);
    assert_true(st.usage_ratio < 0.72);
    l1_destroy(l1);
}

struct salt_seen {
    int n;
    uint64_t bytes[8];
    char names[8][16];
};
static void salt_cb(const char *salt, const struct l1_salt_stats *st, void *arg) {
    struct salt_seen *s = arg;
    snprintf(s->names[s->n], 16, "%s", salt);
    s->bytes[s->n++] = st->bytes;
}

static void test_isolated_lru_quota(void **state) {
    (void)state;
    struct quota *q = quota_create();
    char err[160];
    assert_int_equal(quota_set(q, "alice", 4 * OBJ, err, sizeof(err)), 0);
    assert_int_equal(quota_set(q, "", 2 * OBJ, err, sizeof(err)), 0);
    assert_int_equal(quota_set(q, "a/b", 1, err, sizeof(err)), -1);
    struct l1 *l1 = mk(4 << 20, L1_POLICY_ISOLATED_LRU, q);
    uint64_t now = SEC;
    struct l1_key a[8], b[8], d[8];
    for (unsigned i = 0; i < 6; i++) {
        a[i] = key(l1, i, "alice");
        b[i] = key(l1, i, "bob"); /* no quota: limit 0 */
        d[i] = key(l1, i, NULL);  /* the empty salt */
        assert_int_equal(store(l1, &a[i], now, 1), L1_OK);
        assert_int_equal(store(l1, &b[i], now, 2), L1_OK);
        assert_int_equal(store(l1, &d[i], now, 3), L1_OK);
    }
    assert_int_equal(l1_salt_usage_bytes(l1, "alice"), 6 * OBJ);
    assert_int_equal(l1_salt_usage_bytes(l1, "nobody"), 0);
    /* Same hash under different salts are different objects. A salt without quota may not
     * read-lock (it would pin memory its eviction must reclaim); one with a quota may. */
    assert_int_equal(l1_reserve_read(l1, &b[0], 1, now, NULL), L1_ERR_OVER_QUOTA);
    assert_int_equal(l1_reserve_read(l1, &d[0], 1, now, NULL), L1_OK); /* locked: survives */
    assert_int_equal(l1_finish_read(l1, &d[0], 0, now), L1_OK);
    l1_touch(l1, &a[0], now); /* alice's MRU: a[1], a[2] are her oldest */
    struct l1_tick_report rep;
    l1_evict_tick(l1, now, &rep);
    assert_false(rep.triggered);
    assert_int_equal(rep.quota_evicted_objects, 2 + 6 + 4);
    assert_int_equal(l1_salt_usage_bytes(l1, "alice"), 4 * OBJ);
    assert_int_equal(l1_salt_usage_bytes(l1, "bob"), 0);
    assert_int_equal(l1_salt_usage_bytes(l1, ""), 2 * OBJ);
    assert_int_equal(l1_reserve_read(l1, &d[0], 1, now, NULL), L1_OK); /* survived */
    assert_int_equal(l1_finish_read(l1, &d[0], 2, now), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &a[1], 1, now, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_read(l1, &a[2], 1, now, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_read(l1, &a[0], 1, now, NULL), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &d[5], 1, now, NULL), L1_OK);
    /* Removing a quota evicts the salt on the next tick; raising one stops eviction. */
    assert_true(quota_remove(q, "alice"));
    l1_evict_tick(l1, now, &rep);
    assert_int_equal(l1_salt_usage_bytes(l1, "alice"), OBJ); /* a[0] is read-locked */
    assert_int_equal(quota_set(q, "bob", 100 * OBJ, err, sizeof(err)), 0);
    l1_quota_changed(l1);
    for (unsigned i = 0; i < 6; i++) assert_int_equal(store(l1, &b[i], now, 2), L1_OK);
    l1_evict_tick(l1, now + 400 * SEC, &rep);
    assert_int_equal(l1_salt_usage_bytes(l1, "bob"), 6 * OBJ);
    assert_int_equal(l1_salt_usage_bytes(l1, "alice"), 0); /* lease expired */
    struct salt_seen seen = {0};
    l1_salt_foreach(l1, salt_cb, &seen);
    assert_int_equal(seen.n, 3);
    assert_string_equal(seen.names[0], "alice");
    assert_string_equal(seen.names[1], "bob");
    assert_string_equal(seen.names[2], "");
    assert_int_equal(seen.bytes[1], 6 * OBJ);
    l1_destroy(l1);
    quota_destroy(q);
}

/* Under IsolatedLRU a full arena evicts the salt furthest over its quota first. */
static void test_isolated_evict_on_allocate(void **state) {
    (void)state;
    struct quota *q = quota_create();
    char err[160];
    assert_int_equal(quota_set(q, "alice", 100 * OBJ, err, sizeof(err)), 0);
    struct l1 *l1 = mk(1 << 20, L1_POLICY_ISOLATED_LRU, q);
    l1_quota_changed(l1);
    uint64_t now = SEC;
    struct l1_key a[16], b[8];
    for (unsigned i = 0; i < 8; i++) {
        a[i] = key(l1, i, "alice");
        b[i] = key(l1, i, "bob");
        assert_int_equal(store(l1, &a[i], now, 1), L1_OK);
        assert_int_equal(store(l1, &b[i], now, 1), L1_OK);
    }
    l1_quota_changed(l1); /* bob is now known, limit 0 */
    for (unsigned i = 8; i < 16; i++) {
        a[i] = key(l1, i, "alice");
        assert_int_equal(store(l1, &a[i], now, 1), L1_OK);
    }
    assert_int_equal(l1_salt_usage_bytes(l1, "alice"), 16 * OBJ);
    assert_int_equal(l1_salt_usage_bytes(l1, "bob"), 0);
    l1_destroy(l1);
    quota_destroy(q);
}

static void test_clear(void **state) {
    (void)state;
    struct l1 *l1 = mk(1 << 20, L1_POLICY_LRU, NULL);
    uint64_t now = SEC;
    struct l1_key k[4];
    for (unsigned i = 0; i < 4; i++) k[i] = key(l1, i, NULL);
    assert_int_equal(store(l1, &k[0], now, 1), L1_OK);
    assert_int_equal(store(l1, &k[1], now, 1), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &k[1], 1, now, NULL), L1_OK);
    struct l1_ref w;
    assert_int_equal(l1_reserve_write(l1, &k[2], 10, false, now, &w), L1_OK);
    assert_int_equal(l1_clear(l1, false, now), 1); /* only the unlocked resident */
    assert_int_equal(l1_clear(l1, true, now), 2);  /* forced: locked and staging too */
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.objects + st.staging_objects, 0);
    /* Their holders still copy: both are doomed, not freed, until they finish. */
    assert_int_equal(st.doomed_objects, 2);
    assert_int_equal(st.bytes_used, OBJ + 4096);
    assert_int_equal(l1_reserve_read(l1, &k[1], 1, now, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_finish_write(l1, &k[2], w.token, 0, now), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_finish_read(l1, &k[1], 1, now), L1_OK);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 0);
    assert_int_equal(st.bytes_used, 0);
    l1_destroy(l1);
}

/* Each of the 8 stripe tables starts with 16 buckets and grows far past it: every key stays
 * reachable with its own bytes, deletes find theirs, and clear walks every chain. */
static void test_table_grows_and_keeps_every_entry(void **state) {
    (void)state;
    enum { N = 2000 };
    struct l1 *l1 = mk((uint64_t)N * 4096, L1_POLICY_NOOP, NULL);
    uint64_t now = SEC;
    for (unsigned i = 0; i < N; i++) {
        struct l1_key k = key(l1, i, NULL);
        struct l1_ref w;
        assert_int_equal(l1_reserve_write(l1, &k, 8, false, now, &w), L1_OK);
        memcpy(w.data, &i, sizeof(i));
        assert_int_equal(l1_finish_write(l1, &k, w.token, 0, now), L1_OK);
    }
    for (unsigned i = 0; i < N; i++) {
        struct l1_key k = key(l1, i, NULL);
        struct l1_ref r;
        assert_int_equal(l1_reserve_read(l1, &k, 1, now, &r), L1_OK);
        unsigned got;
        memcpy(&got, r.data, sizeof(got));
        assert_int_equal(got, i);
        assert_int_equal(l1_finish_read(l1, &k, 1, now), L1_OK);
    }
    for (unsigned i = 0; i < N; i += 2) {
        struct l1_key k = key(l1, i, NULL);
        assert_int_equal(l1_delete(l1, &k, false, now), L1_OK);
    }
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.objects, N / 2);
    assert_int_equal(l1_clear(l1, false, now), N / 2);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.objects, 0);
    assert_int_equal(st.bytes_used, 0);
    l1_destroy(l1);
}

static void test_prefix_lookup_and_names(void **state) {
    (void)state;
    struct l1 *l1 = mk(4 << 20, L1_POLICY_LRU, NULL);
    struct l1_key k[8];
    for (unsigned i = 0; i < 8; i++) k[i] = key(l1, i, "s");
    for (unsigned i = 0; i < 8; i++)
        if (i != 5) assert_int_equal(store(l1, &k[i], SEC, 1), L1_OK);
    assert_int_equal(l1_reserve_read_prefix(l1, k, 8, 2, SEC), 5);
    assert_int_equal(l1_read_locked(l1, &k[4], SEC, NULL), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k[6], SEC, NULL), L1_ERR_NOT_READABLE);
    assert_string_equal(l1_model_name(l1, k[0].model_id), "m");
    assert_string_equal(l1_salt_name(l1, k[0].salt_id), "s");
    assert_null(l1_salt_name(l1, 999));
    assert_true(l1_entry_overhead_bytes() <= 128);
    l1_destroy(l1);
}

/* A forced clear while a lookup's locks are held: the holder still reads its object's bytes
 * (not another object's) and its release frees the doomed entry; a store of the same key
 * waits until then instead of producing a second entry the release could hit. */
static void test_forced_clear_defers_locked_free(void **state) {
    (void)state;
    struct l1 *l1 = mk(2 * OBJ, L1_POLICY_LRU, NULL); /* room for two objects */
    uint64_t now = SEC;
    struct l1_key k[3];
    for (unsigned i = 0; i < 3; i++) k[i] = key(l1, i, NULL);
    assert_int_equal(store(l1, &k[0], now, 0xaa), L1_OK);
    assert_int_equal(l1_reserve_read_prefix(l1, &k[0], 1, 2, now), 1); /* a lookup, 2 readers */
    struct l1_ref w;
    assert_int_equal(l1_reserve_write(l1, &k[1], OBJ, false, now, &w), L1_OK);
    assert_int_equal(l1_clear(l1, true, now), 2);
    /* Both blocks are still in use: a new object cannot take either. */
    assert_int_equal(store(l1, &k[2], now, 0xcc), L1_ERR_NOMEM);
    assert_int_equal(l1_reserve_write(l1, &k[0], OBJ, false, now, &w), L1_ERR_BUSY);
    assert_int_equal(l1_reserve_read(l1, &k[0], 1, now, NULL), L1_ERR_NOT_FOUND);
    struct l1_ref r;
    assert_int_equal(l1_read_locked(l1, &k[0], now, &r), L1_OK);
    assert_int_equal(((unsigned char *)r.data)[0], 0xaa);
    assert_int_equal(((unsigned char *)r.data)[OBJ - 1], 0xaa);
    /* The writer of k[1] finishes: its entry was cleared, its block is freed now. */
    assert_int_equal(l1_finish_write(l1, &k[1], w.token, 0, now), L1_ERR_NOT_FOUND);
    assert_int_equal(store(l1, &k[2], now, 0xcc), L1_OK);
    assert_int_equal(l1_finish_read(l1, &k[0], 1, now), L1_OK);
    assert_int_equal(l1_read_locked(l1, &k[0], now, &r), L1_OK); /* one reader left */
    assert_int_equal(((unsigned char *)r.data)[0], 0xaa);
    assert_int_equal(l1_finish_read(l1, &k[0], 1, now), L1_OK);
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 0);
    assert_int_equal(st.bytes_used, OBJ);
    assert_int_equal(store(l1, &k[0], now, 0xbb), L1_OK); /* the key is free again */
    /* A forced delete of a locked object dooms it the same way; a lapsed lease frees it at the
     * next tick. */
    assert_int_equal(l1_reserve_read(l1, &k[0], 1, now, NULL), L1_OK);
    assert_int_equal(l1_delete(l1, &k[0], true, now), L1_OK);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 1);
    struct l1_tick_report rep;
    l1_evict_tick(l1, now, &rep);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 1);
    l1_evict_tick(l1, now + 301 * SEC, &rep);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 0);
    assert_int_equal(store(l1, &k[0], now + 301 * SEC, 0xbb), L1_OK);
    l1_destroy(l1);
}

/* IsolatedLRU: a salt without quota that read-locks its own objects cannot pin the arena; a
 * salt within its quota can still store. Locks are capped at the quota, not refused outright. */
static void test_isolated_locks_capped_by_quota(void **state) {
    (void)state;
    struct quota *q = quota_create();
    char err[160];
    assert_int_equal(quota_set(q, "bob", 8 * OBJ, err, sizeof(err)), 0);
    assert_int_equal(quota_set(q, "carol", 2 * OBJ, err, sizeof(err)), 0);
    struct l1 *l1 = mk(16 * OBJ, L1_POLICY_ISOLATED_LRU, q);
    uint64_t now = SEC;
    struct l1_key m[16], b[8], c[3];
    for (unsigned i = 0; i < 16; i++) {
        m[i] = key(l1, i, "mallory"); /* no quota */
        assert_int_equal(store(l1, &m[i], now, 1), L1_OK);
        l1_reserve_read_prefix(l1, &m[i], 1, 1, now); /* a lookup that never retrieves */
    }
    for (unsigned i = 0; i < 8; i++) {
        b[i] = key(l1, i, "bob");
        assert_int_equal(store(l1, &b[i], now, 2), L1_OK);
    }
    assert_int_equal(l1_salt_usage_bytes(l1, "bob"), 8 * OBJ);
    /* carol may lock up to her quota; a release makes room for another lock. */
    for (unsigned i = 0; i < 3; i++) {
        c[i] = key(l1, i, "carol");
        assert_int_equal(store(l1, &c[i], now, 3), L1_OK);
    }
    assert_int_equal(l1_reserve_read(l1, &c[0], 1, now, NULL), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &c[1], 4, now, NULL), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &c[0], 1, now, NULL), L1_OK); /* already counted */
    assert_int_equal(l1_reserve_read(l1, &c[2], 1, now, NULL), L1_ERR_OVER_QUOTA);
    assert_int_equal(l1_finish_read(l1, &c[1], 4, now), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &c[2], 1, now, NULL), L1_OK);
    /* A store admitted with read locks over the quota is stored without them. */
    struct l1_key c3 = key(l1, 3, "carol");
    struct l1_ref w;
    assert_int_equal(l1_reserve_write(l1, &c3, OBJ, false, now, &w), L1_OK);
    assert_int_equal(l1_finish_write(l1, &c3, w.token, 1, now), L1_ERR_OVER_QUOTA);
    assert_int_equal(l1_read_locked(l1, &c3, now, NULL), L1_ERR_NOT_READABLE);
    l1_destroy(l1);
    quota_destroy(q);
}

static struct l1 *mk_names(uint32_t max_salts) {
    struct l1_config cfg = {.size_bytes = 1 << 20, .stripes = 8, .max_salts = max_salts};
    return create(&cfg);
}

static struct l1_key lookup_key(struct l1 *l1, unsigned i, const char *salt) {
    struct keys_object_key k = object_key(i, salt);
    struct l1_key out;
    assert_int_equal(l1_key_lookup(l1, &k, &out), L1_OK);
    return out;
}

static int make(struct l1 *l1, unsigned i, const char *salt, struct l1_key *out) {
    struct keys_object_key k = object_key(i, salt);
    return l1_key_make(l1, &k, out);
}

/* Reads never add names; a full table drops names no object uses instead of refusing every new
 * name for good, and a key made before its name was dropped never reaches the new name. */
static void test_names_released_and_reused(void **state) {
    (void)state;
    struct l1 *l1 = mk_names(4);
    char salt[16];
    for (unsigned i = 0; i < 100; i++) { /* lookups with fresh salts */
        snprintf(salt, sizeof(salt), "fresh%u", i);
        struct l1_key k = lookup_key(l1, i, salt);
        assert_int_equal(l1_reserve_read(l1, &k, 1, SEC, NULL), L1_ERR_NOT_FOUND);
        assert_int_equal(l1_finish_read(l1, &k, 1, SEC), L1_ERR_NOT_FOUND);
        assert_int_equal(l1_reserve_write(l1, &k, OBJ, false, SEC, NULL), L1_ERR_INVAL);
    }
    struct l1_key k[6];
    for (unsigned i = 0; i < 4; i++) {
        snprintf(salt, sizeof(salt), "t%u", i);
        assert_int_equal(make(l1, 7, salt, &k[i]), L1_OK);
        assert_int_equal(store(l1, &k[i], SEC, (uint8_t)i), L1_OK);
    }
    /* Every name is used by an object: a fifth is refused, a known one still works. */
    assert_int_equal(make(l1, 7, "t4", &k[4]), L1_ERR_TOO_MANY_NAMES);
    assert_int_equal(make(l1, 8, "t0", &k[5]), L1_OK);
    /* t1's only object goes: its name is dropped for t4, which gets t1's id. */
    assert_int_equal(l1_delete(l1, &k[1], false, SEC), L1_OK);
    assert_int_equal(make(l1, 7, "t4", &k[4]), L1_OK);
    assert_int_equal(k[4].salt_id, k[1].salt_id);
    assert_true(k[4].salt_gen != k[1].salt_gen);
    assert_int_equal(store(l1, &k[4], SEC, 4), L1_OK);
    assert_string_equal(l1_salt_name(l1, k[4].salt_id), "t4");
    /* The old t1 key (same hash) neither reads t4's object nor stores under t4's id. */
    assert_int_equal(l1_reserve_read(l1, &k[1], 1, SEC, NULL), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_write(l1, &k[1], OBJ, false, SEC, NULL), L1_ERR_TOO_MANY_NAMES);
    assert_int_equal(l1_salt_usage_bytes(l1, "t1"), 0);
    assert_int_equal(l1_salt_usage_bytes(l1, "t4"), OBJ);
    /* A clear frees every name for new ones. */
    l1_clear(l1, true, SEC);
    for (unsigned i = 0; i < 4; i++) {
        snprintf(salt, sizeof(salt), "u%u", i);
        assert_int_equal(make(l1, 7, salt, &k[0]), L1_OK);
        assert_int_equal(store(l1, &k[0], SEC, 5), L1_OK);
    }
    l1_destroy(l1);
}

static struct l1 *mk_pins(uint64_t size, uint64_t pin_max) {
    struct l1_config cfg = {.size_bytes = size,
                            .policy = L1_POLICY_LRU,
                            .read_ttl_ns = 300 * SEC,
                            .write_ttl_ns = 600 * SEC,
                            .stripes = 8,
                            .pin_max_bytes = pin_max};
    return create(&cfg);
}

/* Pins a stored object the way a reply does: read lock, pin, release the read lock. */
static struct l1_pin *pin_one(struct l1 *l1, const struct l1_key *k, uint64_t now) {
    struct l1_ref r;
    struct l1_pin *p = NULL;
    assert_int_equal(l1_reserve_read(l1, k, 1, now, &r), L1_OK);
    assert_int_equal(l1_pin(l1, k, now, &p), L1_OK);
    assert_int_equal(l1_finish_read(l1, k, 1, now), L1_OK);
    return p;
}

/* A pin needs a live read lock, outlives the read lease, keeps the object from eviction and
 * from a non-forced delete; the last unpin of a resident object leaves it cached. */
static void test_pin_holds_past_lease_and_eviction(void **state) {
    (void)state;
    struct l1 *l1 = mk_pins(1 << 20, 1 << 20);
    struct l1_key k[17];
    struct l1_pin *p = NULL;
    uint64_t now = SEC;
    for (unsigned i = 0; i < 17; i++) k[i] = key(l1, i, NULL);
    assert_int_equal(store(l1, &k[0], now, 0xa0), L1_OK);
    assert_int_equal(l1_pin(l1, &k[0], now, &p), L1_ERR_NOT_READABLE); /* no read lock */
    struct l1_pin *p0 = pin_one(l1, &k[0], now);
    struct l1_ref r;
    assert_int_equal(l1_reserve_read(l1, &k[0], 1, now, &r), L1_OK);
    uint8_t *data = r.data;
    assert_int_equal(l1_finish_read(l1, &k[0], 1, now), L1_OK);
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.pins, 1);
    assert_int_equal(st.pinned_objects, 1);
    assert_int_equal(st.pinned_bytes, OBJ);
    /* Far past every lease: still not evictable, not deletable without force. */
    now += 10000 * SEC;
    for (unsigned i = 1; i < 17; i++) assert_int_equal(store(l1, &k[i], now, (uint8_t)i), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &k[0], 1, now, &r), L1_OK); /* k[0] survived */
    assert_int_equal(l1_finish_read(l1, &k[0], 1, now), L1_OK);
    assert_int_equal(data[0], 0xa0);
    assert_int_equal(data[OBJ - 1], 0xa0);
    assert_int_equal(l1_delete(l1, &k[0], false, now), L1_ERR_BUSY);
    struct l1_tick_report rep;
    l1_evict_tick(l1, now, &rep);
    assert_int_equal(l1_reserve_read(l1, &k[0], 1, now, &r), L1_OK);
    assert_int_equal(l1_finish_read(l1, &k[0], 1, now), L1_OK);
    l1_unpin(p0, now);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.pins, 0);
    assert_int_equal(st.pinned_objects, 0);
    assert_int_equal(st.pinned_bytes, 0);
    assert_int_equal(l1_delete(l1, &k[0], false, now), L1_OK);
    l1_destroy(l1);
}

/* Forced delete and clear doom a pinned object (its memory is not reused while a reply may
 * still send it); the last unpin frees it, and the key can be stored again. */
static void test_pin_doomed_by_clear_freed_by_unpin(void **state) {
    (void)state;
    struct l1 *l1 = mk_pins(1 << 20, 1 << 20);
    struct l1_key a = key(l1, 1, NULL), b = key(l1, 2, NULL);
    uint64_t now = SEC;
    assert_int_equal(store(l1, &a, now, 1), L1_OK);
    assert_int_equal(store(l1, &b, now, 2), L1_OK);
    struct l1_pin *pa1 = pin_one(l1, &a, now), *pa2 = pin_one(l1, &a, now);
    struct l1_pin *pb = pin_one(l1, &b, now);
    assert_int_equal(l1_delete(l1, &b, true, now), L1_OK);
    assert_int_equal(l1_clear(l1, true, now), 1);
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.objects, 0);
    assert_int_equal(st.doomed_objects, 2);
    assert_int_equal(st.bytes_used, 2 * OBJ);
    /* Gone for readers and writers; neither the tick nor a second clear frees them. */
    struct l1_ref r;
    assert_int_equal(l1_reserve_read(l1, &a, 1, now, &r), L1_ERR_NOT_FOUND);
    assert_int_equal(l1_reserve_write(l1, &a, OBJ, false, now, &r), L1_ERR_BUSY);
    now += 10000 * SEC;
    l1_evict_tick(l1, now, NULL);
    l1_clear(l1, true, now);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 2);
    l1_unpin(pb, now);
    l1_unpin(pa1, now);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 1);
    assert_int_equal(st.bytes_used, OBJ);
    l1_unpin(pa2, now);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 0);
    assert_int_equal(st.bytes_used, 0);
    assert_int_equal(st.pins, 0);
    assert_int_equal(st.pinned_bytes, 0);
    assert_int_equal(store(l1, &a, now, 3), L1_OK);
    l1_destroy(l1);
}

/* A temporary object (prefetched from L2) whose last read lock goes while it is pinned is freed
 * by the last unpin; the cap refuses pins past pin_max_bytes and counts the refusals. */
static void test_pin_temporary_and_cap(void **state) {
    (void)state;
    struct l1 *l1 = mk_pins(1 << 20, OBJ + OBJ / 2);
    struct l1_key t = key(l1, 1, NULL), c = key(l1, 2, NULL);
    struct l1_ref w;
    uint64_t now = SEC;
    assert_int_equal(l1_reserve_write(l1, &t, OBJ, true, now, &w), L1_OK);
    assert_int_equal(l1_finish_write(l1, &t, w.token, 1, now), L1_OK);
    struct l1_pin *pt = NULL, *pc = NULL;
    assert_int_equal(l1_pin(l1, &t, now, &pt), L1_OK);
    assert_int_equal(l1_finish_read(l1, &t, 1, now), L1_OK); /* last read lock: doomed */
    struct l1_stats st;
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.temporary_objects, 0);
    assert_int_equal(st.doomed_objects, 1);
    assert_int_equal(st.bytes_used, OBJ);
    /* The cap: a second object would pass it. */
    assert_int_equal(store(l1, &c, now, 7), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &c, 1, now, &w), L1_OK);
    assert_int_equal(l1_pin(l1, &c, now, &pc), L1_ERR_PIN_CAP);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.pins_refused, 1);
    l1_unpin(pt, now);
    l1_get_stats(l1, now, &st);
    assert_int_equal(st.doomed_objects, 0);
    assert_int_equal(st.bytes_used, OBJ); /* c only */
    assert_int_equal(l1_pin(l1, &c, now, &pc), L1_OK);
    assert_int_equal(l1_finish_read(l1, &c, 1, now), L1_OK);
    l1_unpin(pc, now);
    l1_destroy(l1);
    /* pin_max_bytes 0: no pins at all. */
    l1 = mk(1 << 20, L1_POLICY_LRU, NULL);
    c = key(l1, 2, NULL);
    assert_int_equal(store(l1, &c, now, 7), L1_OK);
    assert_int_equal(l1_reserve_read(l1, &c, 1, now, &w), L1_OK);
    assert_int_equal(l1_pin(l1, &c, now, &pc), L1_ERR_PIN_CAP);
    l1_destroy(l1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_state_machine),
        cmocka_unit_test(test_leases),
        cmocka_unit_test(test_temporary),
        cmocka_unit_test(test_lru_order_and_evict_on_allocate),
        cmocka_unit_test(test_noop_policy_never_evicts),
        cmocka_unit_test(test_tick_watermark),
        cmocka_unit_test(test_isolated_lru_quota),
        cmocka_unit_test(test_isolated_evict_on_allocate),
        cmocka_unit_test(test_clear),
        cmocka_unit_test(test_table_grows_and_keeps_every_entry),
        cmocka_unit_test(test_prefix_lookup_and_names),
        cmocka_unit_test(test_forced_clear_defers_locked_free),
        cmocka_unit_test(test_isolated_locks_capped_by_quota),
        cmocka_unit_test(test_names_released_and_reused),
        cmocka_unit_test(test_pin_holds_past_lease_and_eviction),
        cmocka_unit_test(test_pin_doomed_by_clear_freed_by_unpin),
        cmocka_unit_test(test_pin_temporary_and_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
