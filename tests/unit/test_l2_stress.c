/* Multi-threaded stress of the L2 tier: worker threads store (write-through), drop from L1,
 * prefetch (PREFIX with read locks, SPARSE warm), delete and list overlapping keys through the
 * storage controller with a real L1 and an o_direct fs adapter in a temporary directory, while
 * one thread runs L2 eviction ticks against a small capacity. Every byte that reaches L1 from L2
 * is compared with what was stored, so a torn or misdirected load shows up as a mismatch. A final
 * single-threaded phase stores every key, which cannot all fit, so capacity refusals (NOSPC) and
 * an eviction pass down to its target are certain and asserted.
 * Bounded (a fixed number of operations; waits end when the controller stops making progress);
 * ThreadSanitizer runs it (scripts/test-extra.sh). */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <ftw.h>

#include "base/clock.h"
#include "server/l2/controller.h"
#include "test_util.h"

#define NKEYS          48
#define NTHREADS       4
#define OPS_PER_THREAD 1000
#define SPAN           4 /* keys per prefetch / delete */
/* A wait gives up (and counts the request as stuck) only after the controller's and the adapter's
 * work counters stood still for this many consecutive looks (one look every 256 yields). */
#define STALL_LOOKS 20000

struct ctx {
    struct l1 *l1;
    struct quota *q;
    struct l2ctl *c;
    struct keys_object_key keys[NKEYS];
    struct l1_key l1keys[NKEYS];
    _Atomic int running;
    _Atomic uint64_t verified, loaded, stored, deleted, listed;
    _Atomic uint64_t mismatches, bad_listing, stuck;
};

/* A signature of all the work the controller and its adapter have done so far: it changes
 * whenever a task or a request completes anywhere. */
static uint64_t progress(struct ctx *c) {
    struct l2ctl_stats st;
    l2ctl_stats(c->c, &st);
    struct l2_counters ac;
    l2_adapter_counters(l2ctl_adapter(c->c, 0), &ac);
    return st.store_completed_requests + st.store_dropped_objects + st.prefetch_completed +
           st.prefetch_lookup_objects + st.load_completed_objects + st.load_failed_objects +
           ac.store_tasks + ac.lookup_tasks + ac.load_tasks + ac.deleted_keys +
           ac.delete_skipped_locked;
}

/* Waits until done(c, arg); false when the controller stops making progress first. */
static bool wait_for(struct ctx *c, bool (*done)(struct ctx *, void *), void *arg) {
    uint64_t last = progress(c);
    for (long looks = 0, spins = 0; !done(c, arg); spins++) {
        sched_yield();
        if (spins % 256) continue;
        uint64_t now = progress(c);
        if (now != last) {
            last = now;
            looks = 0;
        } else if (++looks >= STALL_LOOKS) {
            return done(c, arg);
        }
    }
    return true;
}

/* Sizes cover 4 KiB multiples and remainders (the fs adapter's head/tail split). */
static uint64_t obj_size(unsigned i) { return 4096u * (1 + i % 5) + (i % 3) * 700; }

static void fill(uint8_t *p, uint64_t size, unsigned i) {
    for (uint64_t b = 0; b < size; b++) p[b] = (uint8_t)(i * 37 + b * 11 + (b >> 10));
}

static bool check(const uint8_t *p, uint64_t size, unsigned i) {
    for (uint64_t b = 0; b < size; b++)
        if (p[b] != (uint8_t)(i * 37 + b * 11 + (b >> 10))) return false;
    return true;
}

static void do_store(struct ctx *c, unsigned i) {
    uint64_t now = clock_mono_ns();
    struct l1_ref r;
    if (l1_reserve_write(c->l1, &c->l1keys[i], obj_size(i), false, now, &r) != L1_OK) return;
    fill(r.data, r.size, i);
    if (l1_finish_write(c->l1, &c->l1keys[i], r.token, 0, now) != L1_OK) return;
    atomic_fetch_add(&c->stored, l2ctl_store(c->c, &c->keys[i], &c->l1keys[i], 1));
}

/* Reads key i from L1 under one read lock the caller holds, checks it and releases the lock. */
static void verify_locked(struct ctx *c, unsigned i) {
    struct l1_ref r;
    if (l1_read_locked(c->l1, &c->l1keys[i], clock_mono_ns(), &r) == L1_OK) {
        if (r.size != obj_size(i) || !check(r.data, r.size, i))
            atomic_fetch_add(&c->mismatches, 1);
        else
            atomic_fetch_add(&c->verified, 1);
    }
    l1_finish_read(c->l1, &c->l1keys[i], 1, clock_mono_ns());
}

/* A PREFIX prefetch's result, copied by the callback on the controller thread (as the data
 * plane does: a polled result's `ready` is only valid until the next poll by any thread). */
struct pf_wait {
    _Atomic int done;
    size_t found;
    uint8_t ready[SPAN];
};

static void pf_cb(void *arg, const struct l2ctl_prefetch_result *r) {
    struct pf_wait *w = arg;
    w->found = r->found;
    memcpy(w->ready, r->ready, r->total);
    atomic_store_explicit(&w->done, 1, memory_order_release);
}

static bool pf_called(struct ctx *c, void *arg) {
    (void)c;
    return atomic_load_explicit(&((struct pf_wait *)arg)->done, memory_order_acquire);
}

struct pf_poll {
    uint64_t id;
    int rc;
    struct l2ctl_prefetch_result res;
};

static bool pf_polled(struct ctx *c, void *arg) {
    struct pf_poll *p = arg;
    p->rc = l2ctl_prefetch_poll(c->c, p->id, &p->res);
    return p->rc != L2_ERR_BUSY;
}

/* PREFIX with one read lock per ready key (the data plane's lookup miss): each ready key is
 * read under that lock and checked. */
static void do_prefetch_locked(struct ctx *c, unsigned first) {
    unsigned n = first + SPAN <= NKEYS ? SPAN : NKEYS - first;
    struct pf_wait *w = calloc(1, sizeof(*w));
    if (!w) return;
    uint64_t id;
    if (l2ctl_prefetch_submit(c->c, &c->keys[first], &c->l1keys[first], n, L2CTL_TRIM_PREFIX, 1,
                              true, pf_cb, w, &id) != L2_OK) {
        free(w);
        return;
    }
    if (!wait_for(c, pf_called, w)) {
        atomic_fetch_add(&c->stuck, 1); /* the callback may still come: w is left to it */
        return;
    }
    atomic_fetch_add(&c->loaded, w->found);
    for (unsigned k = 0; k < n; k++)
        if (w->ready[k]) verify_locked(c, first + k);
    free(w);
}

/* SPARSE warm prefetch polled like GET /cache/prefetches/{id} (counts only); then every key of
 * the span that is resident is read and checked, whoever put it there. */
static void do_prefetch_warm(struct ctx *c, unsigned first) {
    unsigned n = first + SPAN <= NKEYS ? SPAN : NKEYS - first;
    struct pf_poll pp = {0};
    if (l2ctl_prefetch_submit(c->c, &c->keys[first], &c->l1keys[first], n, L2CTL_TRIM_SPARSE, 0,
                              false, NULL, NULL, &pp.id) != L2_OK)
        return;
    if (!wait_for(c, pf_polled, &pp) || pp.rc != L2_OK) {
        atomic_fetch_add(&c->stuck, 1);
        return;
    }
    atomic_fetch_add(&c->loaded, pp.res.found);
    for (unsigned k = 0; k < n; k++)
        if (l1_reserve_read(c->l1, &c->l1keys[first + k], 1, clock_mono_ns(), NULL) == L1_OK)
            verify_locked(c, first + k);
}

static void do_delete(struct ctx *c, unsigned first) {
    unsigned n = first + SPAN <= NKEYS ? SPAN : NKEYS - first;
    uint8_t del[SPAN] = {0};
    size_t skipped = 0;
    if (l2ctl_delete(c->c, 0, &c->keys[first], n, del, &skipped) != L2_OK) return;
    for (unsigned k = 0; k < n; k++) atomic_fetch_add(&c->deleted, del[k]);
}

/* Pages through the whole listing; every entry must be one of our keys with its size. */
static void do_list(struct ctx *c) {
    struct l2_adapter *a = l2ctl_adapter(c->c, 0);
    char token[L2_PAGE_TOKEN_MAX + 1] = "";
    for (int page = 0; page < 1000; page++) {
        struct l2_list_page p = {0};
        char err[128];
        if (l2_adapter_list(a, NULL, 7, token[0] ? token : NULL, &p, err, sizeof(err)) != L2_OK) {
            atomic_fetch_add(&c->bad_listing, 1);
            return;
        }
        for (size_t e = 0; e < p.count; e++) {
            unsigned i = 0;
            const struct keys_object_key *lk = &p.entries[e].key;
            while (i < NKEYS && (lk->hash_len != c->keys[i].hash_len ||
                                 memcmp(lk->hash, c->keys[i].hash, lk->hash_len) != 0 ||
                                 strcmp(lk->cache_salt, c->keys[i].cache_salt) != 0))
                i++;
            if (i == NKEYS || p.entries[e].size != obj_size(i))
                atomic_fetch_add(&c->bad_listing, 1);
            else
                atomic_fetch_add(&c->listed, 1);
        }
        bool more = p.next_token != NULL;
        if (more) snprintf(token, sizeof(token), "%s", p.next_token);
        l2_list_page_free(&p);
        if (!more) return;
    }
}

static void *worker(void *arg) {
    struct ctx *c = arg;
    unsigned seed = (unsigned)(uintptr_t)pthread_self();
    for (int op = 0; op < OPS_PER_THREAD; op++) {
        unsigned i = (unsigned)rand_r(&seed) % NKEYS;
        int what = rand_r(&seed) % 100;
        if (what < 35) {
            do_store(c, i);
        } else if (what < 55) {
            l1_delete(c->l1, &c->l1keys[i], false, clock_mono_ns()); /* force the next miss */
        } else if (what < 75) {
            do_prefetch_locked(c, i);
        } else if (what < 85) {
            do_prefetch_warm(c, i);
        } else if (what < 93) {
            do_delete(c, i);
        } else if (what < 97) {
            do_list(c);
        } else {
            json_t *s = l2ctl_status(c->c);
            json_decref(s);
            (void)l2ctl_usage_bytes(c->c);
            (void)l2ctl_salt_usage_bytes(c->c, "");
        }
    }
    return NULL;
}

static void *evictor(void *arg) {
    struct ctx *c = arg;
    while (atomic_load(&c->running)) {
        struct l2ctl_tick_report rep;
        l2ctl_evict_tick(c->c, clock_mono_ns(), &rep);
        struct l2ctl_stats st;
        l2ctl_stats(c->c, &st);
        sched_yield();
    }
    return NULL;
}

/* Every write-through accepted so far has finished (stored, failed or dropped). */
static bool stores_settled(struct ctx *c, void *arg) {
    (void)arg;
    struct l2ctl_stats st;
    l2ctl_stats(c->c, &st);
    return st.store_completed_objects + st.store_failed_objects + st.store_dropped_objects >=
           st.store_submitted_objects;
}

/* Marks in_l2[i] for every key the adapter lists. */
static void listed_keys(struct ctx *c, bool *in_l2) {
    memset(in_l2, 0, NKEYS * sizeof(*in_l2));
    struct l2_adapter *a = l2ctl_adapter(c->c, 0);
    struct l2_list_page p = {0};
    char err[128];
    assert_int_equal(l2_adapter_list(a, NULL, L2_PAGE_SIZE_MAX, NULL, &p, err, sizeof(err)), L2_OK);
    assert_null(p.next_token);
    for (size_t e = 0; e < p.count; e++)
        for (unsigned i = 0; i < NKEYS; i++)
            if (p.entries[e].key.hash_len == c->keys[i].hash_len &&
                memcmp(p.entries[e].key.hash, c->keys[i].hash, c->keys[i].hash_len) == 0)
                in_l2[i] = true;
    l2_list_page_free(&p);
}

/* Single-threaded, after the workers: stores all NKEYS objects, more than the capacity holds, and
 * checks that the overflow was refused for want of room (NOSPC) and that one eviction pass brings
 * usage down to its target, after which a refused object fits. (Adapter tasks belong to the
 * controller thread here, so everything goes through the controller.) */
static void fill_and_evict(struct ctx *c) {
    assert_true(wait_for(c, stores_settled, NULL));
    struct l2ctl_stats before, after;
    l2ctl_stats(c->c, &before);
    struct l2_adapter *a = l2ctl_adapter(c->c, 0);
    json_t *fs = l2_adapter_status(a);
    json_int_t enospc_before = json_integer_value(json_object_get(fs, "enospc"));
    json_decref(fs);
    for (unsigned i = 0; i < NKEYS; i++) {
        l1_delete(c->l1, &c->l1keys[i], false, clock_mono_ns());
        do_store(c, i);
    }
    assert_true(wait_for(c, stores_settled, NULL));
    l2ctl_stats(c->c, &after);
    assert_true(after.store_failed_objects > before.store_failed_objects);
    /* refused with NOSPC (counted as "enospc"), not an I/O error: every key L2 lacks was
     * refused for room exactly once. (Whether it would fit now depends on what the stores in
     * flight beside it had reserved, so that is not checked per key.) */
    fs = l2_adapter_status(a);
    assert_int_equal(json_integer_value(json_object_get(fs, "write_errors")), 0);
    json_int_t enospc = json_integer_value(json_object_get(fs, "enospc")) - enospc_before;
    json_decref(fs);
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    bool in_l2[NKEYS];
    listed_keys(c, in_l2);
    unsigned missing = NKEYS, nmissing = 0;
    for (unsigned i = 0; i < NKEYS; i++) {
        if (in_l2[i]) continue;
        missing = i;
        nmissing++;
    }
    assert_true(missing < NKEYS);
    assert_int_equal(enospc, nmissing);
    /* full beyond the watermark: one pass evicts down to capacity * 0.8 * (1 - 0.3) */
    assert_true((double)u.bytes_used >= 0.8 * (double)u.capacity_bytes);
    struct l2ctl_tick_report rep;
    assert_int_equal(l2ctl_evict_tick(c->c, clock_mono_ns(), &rep), L2_OK);
    assert_true(rep.evicted_objects > 0);
    assert_true(rep.evicted_bytes > 0);
    l2_adapter_usage(a, &u);
    assert_true((double)u.bytes_used <= (double)u.capacity_bytes * 0.8 * 0.7);
    /* and a refused object fits now */
    l2ctl_stats(c->c, &before);
    l1_delete(c->l1, &c->l1keys[missing], false, clock_mono_ns());
    do_store(c, missing);
    assert_true(wait_for(c, stores_settled, NULL));
    l2ctl_stats(c->c, &after);
    assert_int_equal(after.store_completed_objects, before.store_completed_objects + 1);
    listed_keys(c, in_l2);
    assert_true(in_l2[missing]);
}

static void stress(const char *engine) {
    static struct ctx c;
    memset(&c, 0, sizeof(c));
    char dir[] = "/tmp/lmcache-l2-stress-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char err[256];
    struct l1_config lc = {.size_bytes = 8u << 20, .policy = L1_POLICY_LRU};
    assert_int_equal(l1_create(&lc, &c.l1, err, sizeof(err)), 0);
    c.q = quota_create();
    assert_non_null(c.q);
    /* room for about 30 of the 48 objects, so eviction and NOSPC both happen */
    char js[512];
    snprintf(js, sizeof(js),
             "[{\"type\":\"fs\",\"base_path\":\"%s\",\"o_direct\":true,\"queue_depth\":16,%s"
             "\"max_capacity_gb\":0.0004,\"eviction\":{\"eviction_policy\":\"LRU\","
             "\"trigger_watermark\":0.8,\"eviction_ratio\":0.3}}]",
             dir, engine);
    json_t *cfg = json_loads(js, 0, NULL);
    assert_non_null(cfg);
    struct l2ctl_config cc = {.l1 = c.l1, .quota = c.q, .prefetch_max_in_flight = 3};
    int rc = l2ctl_create(&cc, cfg, &c.c, err, sizeof(err));
    if (rc != L2_OK) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, L2_OK);
    json_decref(cfg);
    assert_int_equal(l2ctl_start(c.c, err, sizeof(err)), L2_OK);
    for (unsigned i = 0; i < NKEYS; i++) {
        char hex[65], kerr[KEYS_ERR_MAX];
        snprintf(hex, sizeof(hex), "%064x", i + 1);
        const char *salt = i % 2 ? "s1" : "";
        assert_int_equal(keys_object_key_init(&c.keys[i], hex, 64, "org/m", 5, 0x01000100u, 0, salt,
                                              strlen(salt), kerr, sizeof(kerr)),
                         0);
        assert_int_equal(l1_key_make(c.l1, &c.keys[i], &c.l1keys[i]), L1_OK);
    }
    atomic_store(&c.running, 1);
    pthread_t ev, th[NTHREADS];
    assert_int_equal(pthread_create(&ev, NULL, evictor, &c), 0);
    for (int t = 0; t < NTHREADS; t++)
        assert_int_equal(pthread_create(&th[t], NULL, worker, &c), 0);
    for (int t = 0; t < NTHREADS; t++) pthread_join(th[t], NULL);
    atomic_store(&c.running, 0);
    pthread_join(ev, NULL);
    struct l2ctl_stats st;
    l2ctl_stats(c.c, &st);
    fprintf(stderr,
            "stress: stored %llu, loaded %llu, verified %llu, deleted %llu, listed %llu, "
            "evicted %llu, store failures %llu\n",
            (unsigned long long)atomic_load(&c.stored), (unsigned long long)atomic_load(&c.loaded),
            (unsigned long long)atomic_load(&c.verified),
            (unsigned long long)atomic_load(&c.deleted), (unsigned long long)atomic_load(&c.listed),
            (unsigned long long)st.evicted_objects, (unsigned long long)st.store_failed_objects);
    assert_int_equal(atomic_load(&c.mismatches), 0);
    assert_int_equal(atomic_load(&c.bad_listing), 0);
    assert_int_equal(atomic_load(&c.stuck), 0);
    assert_true(atomic_load(&c.stored) > 0);
    assert_true(atomic_load(&c.verified) > 0);
    /* every request the workers waited for was published */
    assert_int_equal(st.prefetch_completed, st.prefetch_requests);
    fill_and_evict(&c);
    l2ctl_stats(c.c, &st);
    fprintf(stderr, "stress: after the fill, evicted %llu, store failures %llu\n",
            (unsigned long long)st.evicted_objects, (unsigned long long)st.store_failed_objects);
    l2ctl_destroy(c.c);
    l1_destroy(c.l1);
    quota_destroy(c.q);
    test_rm_rf(dir);
}

static void test_stress_uring(void **state) {
    (void)state;
    stress("");
}

static void test_stress_threads(void **state) {
    (void)state;
    stress("\"io_uring\":false,\"io_threads\":3,");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stress_uring),
        cmocka_unit_test(test_stress_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
