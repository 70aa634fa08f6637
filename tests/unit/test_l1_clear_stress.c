/* Forced clears racing with copies: threads store and read (checking every byte) a few keys in a
 * small arena while one thread runs forced clears and forced deletes in a loop. A forced removal
 * may drop objects but must never hand memory a reader or writer still copies to a new object:
 * a reader that saw another key's bytes (or a writer whose bytes landed in another object)
 * shows up as a mismatch. Leases never lapse here (the clock stands still), so every mismatch is
 * memory freed under a live lease. A second test churns more salts than the name table holds,
 * so names are dropped and their ids reused while readers hold keys made earlier: no read may
 * return another salt's bytes. ThreadSanitizer runs this binary (scripts/test-extra.sh). */
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

#include <cmocka.h>

#include "server/l1/l1.h"

#define NKEYS    24
#define NWRITERS 2
#define NREADERS 3
#define OPS      20000
#define OBJ      8192u
#define SEC      1000000000ull

struct ctx {
    struct l1 *l1;
    struct l1_key keys[NKEYS];
    _Atomic int running;      /* the clearer runs while set */
    _Atomic int writers_left; /* readers run until the writers are done */
    _Atomic uint64_t mismatches, reads, stores, clears;
};

/* Every byte of key i's object is (i * 37 + 11) & 0xff, so bytes of another key differ. */
static unsigned char pat(unsigned i) { return (unsigned char)((i * 37 + 11) & 0xff); }

static bool check(const void *p, uint64_t size, unsigned i) {
    const unsigned char *c = p;
    if (size != OBJ) return false;
    for (uint64_t j = 0; j < size; j++)
        if (c[j] != pat(i)) return false;
    return true;
}

static void *writer(void *arg) {
    struct ctx *c = arg;
    unsigned seed = (unsigned)(uintptr_t)&seed;
    for (int op = 0; op < OPS; op++) {
        unsigned i = (unsigned)rand_r(&seed) % NKEYS;
        struct l1_ref r;
        if (l1_reserve_write(c->l1, &c->keys[i], OBJ, false, SEC, &r) != L1_OK) continue;
        /* Two halves with a yield between: a clear lands in the middle of many copies. */
        memset(r.data, pat(i), OBJ / 2);
        sched_yield();
        memset((char *)r.data + OBJ / 2, pat(i), OBJ / 2);
        if (l1_finish_write(c->l1, &c->keys[i], r.token, 0, SEC) == L1_OK)
            atomic_fetch_add(&c->stores, 1);
    }
    atomic_fetch_sub(&c->writers_left, 1);
    return NULL;
}

static void *reader(void *arg) {
    struct ctx *c = arg;
    unsigned seed = (unsigned)(uintptr_t)&seed;
    uint64_t bad = 0, reads = 0;
    for (int op = 0; op < OPS || atomic_load(&c->writers_left) > 0; op++) {
        unsigned i = (unsigned)rand_r(&seed) % NKEYS;
        const struct l1_key *k = &c->keys[i];
        struct l1_ref r;
        if (op % 2) {
            /* A copy under its own lock (retrieve, retrieve_bytes). */
            if (l1_reserve_read(c->l1, k, 1, SEC, &r) != L1_OK) continue;
        } else {
            /* A lookup's lock, then the retrieve that reads through it. */
            if (l1_reserve_read_prefix(c->l1, k, 1, 1, SEC) != 1) continue;
            sched_yield();
            if (l1_read_locked(c->l1, k, SEC, &r) != L1_OK) {
                bad++; /* the lock is held: the object must still be readable */
                l1_finish_read(c->l1, k, 1, SEC);
                continue;
            }
        }
        sched_yield();
        if (!check(r.data, r.size, i)) bad++;
        reads++;
        l1_finish_read(c->l1, k, 1, SEC);
    }
    atomic_fetch_add(&c->mismatches, bad);
    atomic_fetch_add(&c->reads, reads);
    return NULL;
}

static void *clearer(void *arg) {
    struct ctx *c = arg;
    unsigned seed = 7;
    while (atomic_load(&c->running)) {
        if (rand_r(&seed) % 4)
            l1_clear(c->l1, true, SEC);
        else
            l1_delete(c->l1, &c->keys[rand_r(&seed) % NKEYS], true, SEC);
        if (rand_r(&seed) % 8 == 0) l1_evict_tick(c->l1, SEC, NULL);
        atomic_fetch_add(&c->clears, 1);
        for (int y = 0; y < 8; y++) sched_yield(); /* let some objects live a little */
    }
    return NULL;
}

static void test_forced_clear_never_reuses_memory_in_use(void **state) {
    (void)state;
    /* Room for fewer objects than keys, so freed blocks are reused at once. */
    struct l1_config cfg = {.size_bytes = 16 * OBJ,
                            .policy = L1_POLICY_LRU,
                            .read_ttl_ns = 60 * SEC,
                            .write_ttl_ns = 60 * SEC,
                            .stripes = 4};
    struct ctx *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    char err[160];
    assert_int_equal(l1_create(&cfg, &c->l1, err, sizeof(err)), 0);
    for (unsigned i = 0; i < NKEYS; i++) {
        struct keys_object_key k;
        char hex[9];
        snprintf(hex, sizeof(hex), "%08x", i);
        assert_int_equal(
            keys_object_key_init(&k, hex, 8, "m", 1, 0x01000100, 0, "s", 1, err, sizeof(err)), 0);
        assert_int_equal(l1_key_make(c->l1, &k, &c->keys[i]), L1_OK);
    }
    atomic_store(&c->running, 1);
    atomic_store(&c->writers_left, NWRITERS);
    pthread_t w[NWRITERS], r[NREADERS], cl;
    assert_int_equal(pthread_create(&cl, NULL, clearer, c), 0);
    for (int i = 0; i < NWRITERS; i++) assert_int_equal(pthread_create(&w[i], NULL, writer, c), 0);
    for (int i = 0; i < NREADERS; i++) assert_int_equal(pthread_create(&r[i], NULL, reader, c), 0);
    for (int i = 0; i < NWRITERS; i++) pthread_join(w[i], NULL);
    for (int i = 0; i < NREADERS; i++) pthread_join(r[i], NULL);
    atomic_store(&c->running, 0);
    pthread_join(cl, NULL);
    print_message("%llu stores, %llu verified reads, %llu clears\n",
                  (unsigned long long)atomic_load(&c->stores),
                  (unsigned long long)atomic_load(&c->reads),
                  (unsigned long long)atomic_load(&c->clears));
    assert_int_equal(atomic_load(&c->mismatches), 0);
    assert_true(atomic_load(&c->reads) > 0);
    assert_true(atomic_load(&c->clears) > 0);
    /* Every holder is done: nothing is left doomed and a clear empties the arena. */
    l1_clear(c->l1, true, SEC);
    struct l1_stats st;
    l1_get_stats(c->l1, SEC, &st);
    assert_int_equal(st.bytes_used, 0);
    l1_destroy(c->l1);
    free(c);
}

/* ---- name churn ---- */

#define NSALTS    16 /* salts in use over the run */
#define MAX_SALTS 6  /* what the table holds at once */
#define NHASHES   6

struct churn {
    struct l1 *l1;
    _Atomic int writers_left;
    _Atomic uint64_t mismatches, reads, stored[NSALTS];
};

static unsigned char churn_pat(unsigned salt, unsigned h) {
    return (unsigned char)(((salt * NHASHES + h) * 7 + 3) & 0xff);
}

static void churn_key(unsigned salt, unsigned h, struct keys_object_key *k) {
    char hex[9], name[8], err[KEYS_ERR_MAX];
    snprintf(hex, sizeof(hex), "%08x", h);
    int n = snprintf(name, sizeof(name), "t%u", salt);
    if (keys_object_key_init(k, hex, 8, "m", 1, 0x01000100, 0, name, (size_t)n, err, sizeof(err)) !=
        0)
        abort();
}

static bool check_pat(const void *p, uint64_t size, unsigned char want) {
    const unsigned char *c = p;
    if (size != OBJ) return false;
    for (uint64_t j = 0; j < size; j++)
        if (c[j] != want) return false;
    return true;
}

static void *churn_writer(void *arg) {
    struct churn *c = arg;
    unsigned seed = (unsigned)(uintptr_t)&seed;
    for (int op = 0; op < OPS; op++) {
        unsigned salt = (unsigned)rand_r(&seed) % NSALTS, h = (unsigned)rand_r(&seed) % NHASHES;
        struct keys_object_key ok;
        struct l1_key k;
        struct l1_ref r;
        churn_key(salt, h, &ok);
        if (l1_key_make(c->l1, &ok, &k) != L1_OK) continue;
        sched_yield(); /* the name may be dropped right here */
        if (l1_reserve_write(c->l1, &k, OBJ, false, SEC, &r) != L1_OK) continue;
        memset(r.data, churn_pat(salt, h), OBJ);
        if (l1_finish_write(c->l1, &k, r.token, 0, SEC) == L1_OK)
            atomic_fetch_add(&c->stored[salt], 1);
        if (rand_r(&seed) % 3 == 0) l1_delete(c->l1, &k, false, SEC); /* names run out of objects */
    }
    atomic_fetch_sub(&c->writers_left, 1);
    return NULL;
}

static void *churn_reader(void *arg) {
    struct churn *c = arg;
    unsigned seed = (unsigned)(uintptr_t)&seed;
    uint64_t bad = 0, reads = 0;
    for (int op = 0; op < OPS || atomic_load(&c->writers_left) > 0; op++) {
        unsigned salt = (unsigned)rand_r(&seed) % NSALTS, h = (unsigned)rand_r(&seed) % NHASHES;
        struct keys_object_key ok;
        struct l1_key k;
        struct l1_ref r;
        churn_key(salt, h, &ok);
        l1_key_lookup(c->l1, &ok, &k);
        /* The key is kept across a store's lifetime or more, as a lookup session keeps its keys:
         * by the time it is used its salt may have been dropped and the id given to another. */
        for (int y = 0; y < 1 + rand_r(&seed) % 16; y++) sched_yield();
        for (int round = 0; round < 2; round++) {
            if (l1_reserve_read(c->l1, &k, 1, SEC, &r) != L1_OK) break;
            if (!check_pat(r.data, r.size, churn_pat(salt, h))) bad++;
            reads++;
            l1_finish_read(c->l1, &k, 1, SEC);
            sched_yield();
        }
    }
    atomic_fetch_add(&c->mismatches, bad);
    atomic_fetch_add(&c->reads, reads);
    return NULL;
}

static void test_dropped_names_never_alias(void **state) {
    (void)state;
    struct l1_config cfg = {.size_bytes = 12 * OBJ,
                            .policy = L1_POLICY_LRU,
                            .read_ttl_ns = 60 * SEC,
                            .write_ttl_ns = 60 * SEC,
                            .stripes = 4,
                            .max_salts = MAX_SALTS};
    struct churn *c = calloc(1, sizeof(*c));
    assert_non_null(c);
    char err[160];
    assert_int_equal(l1_create(&cfg, &c->l1, err, sizeof(err)), 0);
    atomic_store(&c->writers_left, NWRITERS);
    pthread_t w[NWRITERS], r[NREADERS];
    for (int i = 0; i < NWRITERS; i++)
        assert_int_equal(pthread_create(&w[i], NULL, churn_writer, c), 0);
    for (int i = 0; i < NREADERS; i++)
        assert_int_equal(pthread_create(&r[i], NULL, churn_reader, c), 0);
    for (int i = 0; i < NWRITERS; i++) pthread_join(w[i], NULL);
    for (int i = 0; i < NREADERS; i++) pthread_join(r[i], NULL);
    unsigned salts_stored = 0;
    for (int i = 0; i < NSALTS; i++) salts_stored += atomic_load(&c->stored[i]) > 0;
    print_message("%u salts stored through a table of %u, %llu verified reads\n", salts_stored,
                  MAX_SALTS, (unsigned long long)atomic_load(&c->reads));
    assert_int_equal(atomic_load(&c->mismatches), 0);
    assert_true(salts_stored > MAX_SALTS); /* names were dropped and their ids reused */
    assert_true(atomic_load(&c->reads) > 0);
    l1_destroy(c->l1);
    free(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forced_clear_never_reuses_memory_in_use),
        cmocka_unit_test(test_dropped_names_never_alias),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
