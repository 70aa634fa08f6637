/* Unit tests for the engine API the front ends call (engine.h): store, read, lookup sessions and
 * their release, and the L2 calls of an engine without L2 adapters. The engine runs without
 * threads or sockets (engine_create + engine_start_caches, as the fuzz drivers do). Time is the
 * monotonic clock: L1 compares the leases a store takes with the clock at its end. */
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"
#include "server/config.h"
#include "server/engine.h"

#define NCHUNKS 4
#define CHUNK   1000 /* bytes of a chunk's object in these tests */

static struct server_config cfg;
static struct engine eng;
static const uint8_t OWNER_A[ENGINE_OWNER_LEN] = {1};
static const uint8_t OWNER_B[ENGINE_OWNER_LEN] = {2};

static int setup(void **state) {
    (void)state;
    char err[256];
    char *argv[] = {"server", "--l1-size-gb",      "0.0625", "--chunk-size",
                    "16",     "--eviction-policy", "LRU"};
    log_set_level(log_get("lmcache"), LOG_CRITICAL);
    if (config_parse(&cfg, 7, argv, err, sizeof(err)) != 0 ||
        engine_create(&eng, &cfg, err, sizeof(err)) < 0 ||
        engine_start_caches(&eng, err, sizeof(err)) < 0) {
        fprintf(stderr, "set-up: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    engine_destroy(&eng); /* releases the locks of sessions still open */
    config_free(&cfg);
    return 0;
}

/* A prompt of NCHUNKS chunks whose hashes start with `tag`, covering chunks [from, to). */
struct prompt {
    uint8_t hashes[NCHUNKS][KEYS_HASH_LEN];
    uint8_t len[NCHUNKS];
    struct engine_prompt p;
};

static void prompt_init(struct prompt *pr, uint8_t tag, uint32_t from, uint32_t to) {
    memset(pr, 0, sizeof(*pr));
    for (uint32_t c = 0; c < NCHUNKS; c++) {
        pr->hashes[c][0] = tag;
        pr->hashes[c][1] = (uint8_t)c;
        pr->len[c] = KEYS_HASH_LEN;
    }
    pr->p.hashes = pr->hashes;
    pr->p.hash_len = pr->len;
    pr->p.start_chunk = from;
    pr->p.end_chunk = to;
}

/* Chunk i's bytes are its index plus a seed; fill fails from chunk fail_at on. */
struct src {
    uint8_t seed;
    uint32_t fail_at;
};

static uint64_t src_size(void *arg, uint32_t i) {
    (void)arg;
    (void)i;
    return CHUNK;
}

static int src_fill(void *arg, uint32_t i, void *dst) {
    const struct src *s = arg;
    if (i >= s->fail_at) return -1;
    memset(dst, s->seed + (int)i, CHUNK);
    return 0;
}

static int store(const struct prompt *pr, const char *model, uint32_t ws, uint32_t rank,
                 struct src *s, struct engine_store_result *res) {
    char err[256];
    struct engine_source es = {.size = src_size, .fill = src_fill, .arg = s};
    return engine_store(&eng, &pr->p, model, ws, rank, &es, clock_mono_ns(), res, err, sizeof(err));
}

/* ENGINE_OK when chunk c reads back as seed + (c - start); the lock is released again. */
static int read_back(const struct prompt *pr, uint32_t c, const char *model, uint32_t ws,
                     uint32_t rank, const uint8_t *owner, const char *rid, uint8_t want) {
    char err[256];
    struct engine_ref ref;
    int rc = engine_read(&eng, &pr->p, c, model, ws, rank, owner, rid, clock_mono_ns(), &ref, err,
                         sizeof(err));
    if (rc != ENGINE_OK) return rc;
    int same = ref.size == CHUNK;
    for (uint64_t i = 0; same && i < ref.size; i++) same = ((const uint8_t *)ref.data)[i] == want;
    engine_read_done(&eng, &ref, clock_mono_ns());
    return same ? ENGINE_OK : -100;
}

static void test_store_then_read(void **state) {
    (void)state;
    struct prompt pr;
    struct src s = {10, UINT32_MAX};
    struct engine_store_result res;
    prompt_init(&pr, 0xa0, 0, 3);
    assert_int_equal(store(&pr, "m", 1, 0, &s, &res), ENGINE_OK);
    assert_int_equal(res.stored, 3);
    assert_int_equal(res.skipped, 0);
    assert_int_equal(res.bytes, 3 * CHUNK);
    for (uint32_t c = 0; c < 3; c++)
        assert_int_equal(read_back(&pr, c, "m", 1, 0, OWNER_A, "", (uint8_t)(10 + c)), ENGINE_OK);
    assert_int_equal(read_back(&pr, 3, "m", 1, 0, OWNER_A, "", 0), ENGINE_ERR_NOT_FOUND);
    /* another model, rank or salt names other objects */
    assert_int_equal(read_back(&pr, 0, "other", 1, 0, OWNER_A, "", 10), ENGINE_ERR_NOT_FOUND);
    assert_int_equal(read_back(&pr, 0, "m", 2, 1, OWNER_A, "", 10), ENGINE_ERR_NOT_FOUND);
    struct prompt salted = pr;
    salted.p.hashes = salted.hashes;
    salted.p.hash_len = salted.len;
    snprintf(salted.p.salt, sizeof(salted.p.salt), "alice");
    assert_int_equal(read_back(&salted, 0, "m", 1, 0, OWNER_A, "", 10), ENGINE_ERR_NOT_FOUND);
    /* storing again skips what is cached */
    assert_int_equal(store(&pr, "m", 1, 0, &s, &res), ENGINE_OK);
    assert_int_equal(res.stored, 0);
    assert_int_equal(res.skipped, 3);
}

static void test_failed_source_keeps_the_chunks_before(void **state) {
    (void)state;
    struct prompt pr;
    struct src s = {50, 2};
    struct engine_store_result res;
    prompt_init(&pr, 0xb0, 0, 4);
    assert_int_equal(store(&pr, "m", 1, 0, &s, &res), ENGINE_ERR_SOURCE);
    assert_int_equal(res.stored, 2);
    assert_int_equal(read_back(&pr, 1, "m", 1, 0, OWNER_A, "", 51), ENGINE_OK);
    assert_int_equal(read_back(&pr, 2, "m", 1, 0, OWNER_A, "", 0), ENGINE_ERR_NOT_FOUND);
}

/* A source filling several chunks per call (as a pooled copy does). */
struct many_src {
    struct src s;
    uint64_t size;
    int calls;     /* fill_many calls */
    uint32_t most; /* most chunks in one call */
};

static uint64_t many_size(void *arg, uint32_t i) {
    (void)i;
    return ((const struct many_src *)arg)->size;
}

static int many_fill(void *arg, uint32_t i, void *dst) {
    struct many_src *m = arg;
    if (i >= m->s.fail_at) return -1;
    memset(dst, m->s.seed + (int)i, m->size);
    return 0;
}

static int many_fill_many(void *arg, const uint32_t *idx, void *const *dsts, uint32_t n,
                          uint32_t *done) {
    struct many_src *m = arg;
    m->calls++;
    if (n > m->most) m->most = n;
    for (uint32_t j = 0; j < n; j++) {
        if (idx[j] >= m->s.fail_at) {
            *done = j;
            return -1;
        }
        memset(dsts[j], m->s.seed + (int)idx[j], m->size);
    }
    *done = n;
    return 0;
}

static int store_many(const struct prompt *pr, struct many_src *m, struct engine_store_result *res,
                      char *err, size_t errlen) {
    struct engine_source es = {
        .size = many_size, .fill = many_fill, .arg = m, .fill_many = many_fill_many};
    return engine_store(&eng, &pr->p, "m", 1, 0, &es, clock_mono_ns(), res, err, errlen);
}

static void test_store_fills_chunks_in_one_batch(void **state) {
    (void)state;
    char err[256];
    struct prompt pr;
    struct many_src m = {{30, UINT32_MAX}, CHUNK, 0, 0};
    struct engine_store_result res;
    prompt_init(&pr, 0xe0, 0, 4);
    assert_int_equal(store_many(&pr, &m, &res, err, sizeof(err)), ENGINE_OK);
    assert_int_equal(res.stored, 4);
    assert_int_equal(res.bytes, 4 * CHUNK);
    assert_int_equal(m.calls, 1);
    assert_int_equal(m.most, 4);
    for (uint32_t c = 0; c < 4; c++)
        assert_int_equal(read_back(&pr, c, "m", 1, 0, OWNER_A, "", (uint8_t)(30 + c)), ENGINE_OK);
}

/* A source failing at chunk 2 of a batch of 4: chunks 0-1 stored, 2-3 not (their reservations
 * are dropped: a later store writes them). */
static void test_batch_failure_keeps_the_chunks_before(void **state) {
    (void)state;
    char err[256] = "";
    struct prompt pr;
    struct many_src m = {{40, 2}, CHUNK, 0, 0};
    struct engine_store_result res;
    prompt_init(&pr, 0xe1, 0, 4);
    assert_int_equal(store_many(&pr, &m, &res, err, sizeof(err)), ENGINE_ERR_SOURCE);
    assert_non_null(strstr(err, "chunk 2 "));
    assert_int_equal(res.stored, 2);
    assert_int_equal(read_back(&pr, 1, "m", 1, 0, OWNER_A, "", 41), ENGINE_OK);
    assert_int_equal(read_back(&pr, 2, "m", 1, 0, OWNER_A, "", 0), ENGINE_ERR_NOT_FOUND);
    assert_int_equal(read_back(&pr, 3, "m", 1, 0, OWNER_A, "", 0), ENGINE_ERR_NOT_FOUND);
    m.s.fail_at = UINT32_MAX;
    assert_int_equal(store_many(&pr, &m, &res, err, sizeof(err)), ENGINE_OK);
    assert_int_equal(res.stored, 2);
    assert_int_equal(res.skipped, 2);
    assert_int_equal(read_back(&pr, 3, "m", 1, 0, OWNER_A, "", 43), ENGINE_OK);
}

/* L1 (64 MiB) held but for 6 MiB by a read-locked object: a store of 2 MiB chunks needs the
 * space of the chunks it reserved itself; the reserved batch is filled and the reservation
 * retried (L1 evicts the earlier chunks), as chunk by chunk, instead of failing as full. */
static void test_batch_is_filled_when_l1_is_full(void **state) {
    (void)state;
    char err[256] = "";
    struct prompt big, pr;
    struct many_src hold = {{1, UINT32_MAX}, 58ull << 20, 0, 0};
    struct many_src m = {{60, UINT32_MAX}, 2ull << 20, 0, 0};
    struct engine_store_result res;
    prompt_init(&big, 0xe2, 0, 1);
    assert_int_equal(store_many(&big, &hold, &res, err, sizeof(err)), ENGINE_OK);
    assert_int_equal(res.stored, 1);
    struct engine_ref ref;
    assert_int_equal(engine_read(&eng, &big.p, 0, "m", 1, 0, OWNER_A, "", clock_mono_ns(), &ref,
                                 err, sizeof(err)),
                     ENGINE_OK);
    prompt_init(&pr, 0xe3, 0, 4);
    int rc = store_many(&pr, &m, &res, err, sizeof(err));
    engine_read_done(&eng, &ref, clock_mono_ns());
    assert_int_equal(rc, ENGINE_OK);
    assert_int_equal(res.stored, 4);
    assert_int_equal(res.bytes, 4 * (2ull << 20));
    assert_true(m.most >= 2); /* batches were used */
}

static void test_lookup_session_holds_and_releases(void **state) {
    (void)state;
    char err[256];
    struct prompt pr;
    struct src s = {70, UINT32_MAX};
    struct engine_store_result res;
    uint32_t hits = 99;
    prompt_init(&pr, 0xc0, 0, 2);
    assert_int_equal(store(&pr, "m", 1, 0, &s, &res), ENGINE_OK);
    prompt_init(&pr, 0xc0, 0, 4); /* two cached chunks of four */
    assert_int_equal(
        engine_lookup(&eng, OWNER_A, "r1", &pr.p, "m", 1, 1, clock_mono_ns(), err, sizeof(err)),
        ENGINE_OK);
    /* without L2 the job is ready at once, reported once */
    assert_int_equal(engine_lookup_status(&eng, OWNER_A, "r1", &hits), 1);
    assert_int_equal(hits, 2);
    assert_int_equal(engine_lookup_status(&eng, OWNER_A, "r1", &hits), 1);
    assert_int_equal(hits, 0);
    /* another connection does not see the session */
    assert_int_equal(read_back(&pr, 0, "m", 1, 0, OWNER_B, "r1", 70), ENGINE_ERR_NOT_FOUND);
    /* the session's lock on chunk 0 is consumed by one read */
    assert_int_equal(read_back(&pr, 0, "m", 1, 0, OWNER_A, "r1", 70), ENGINE_OK);
    assert_int_equal(read_back(&pr, 0, "m", 1, 0, OWNER_A, "r1", 70), ENGINE_ERR_NOT_FOUND);
    assert_int_equal(read_back(&pr, 2, "m", 1, 0, OWNER_A, "r1", 0), ENGINE_ERR_NOT_FOUND);
    /* free_lookup_locks hands back chunk 1's lock; end_session forgets the session */
    assert_int_equal(engine_lookup_release(&eng, OWNER_A, "r1", 0, 4, -1), 1);
    assert_int_equal(read_back(&pr, 1, "m", 1, 0, OWNER_A, "r1", 71), ENGINE_ERR_NOT_FOUND);
    engine_end_session(&eng, OWNER_A, "r1");
    engine_end_session(&eng, OWNER_A, "r1"); /* unknown: nothing happens */
    /* a cleared L1 holds nothing the session could have pinned */
    assert_int_equal(engine_clear_l1(&eng) >= 2, 1);
}

static void test_lookup_stops_at_the_first_chunk_missing_a_rank(void **state) {
    (void)state;
    char err[256];
    struct prompt pr;
    struct src s = {90, UINT32_MAX};
    struct engine_store_result res;
    uint32_t hits = 0;
    prompt_init(&pr, 0xd0, 0, 2);
    assert_int_equal(store(&pr, "m", 2, 0, &s, &res), ENGINE_OK); /* chunks 0, 1 of rank 0 */
    prompt_init(&pr, 0xd0, 0, 1);
    assert_int_equal(store(&pr, "m", 2, 1, &s, &res), ENGINE_OK); /* chunk 0 of rank 1 */
    prompt_init(&pr, 0xd0, 0, 2);
    assert_int_equal(
        engine_lookup(&eng, OWNER_A, "r2", &pr.p, "m", 2, 3, clock_mono_ns(), err, sizeof(err)),
        ENGINE_OK);
    assert_int_equal(engine_lookup_status(&eng, OWNER_A, "r2", &hits), 1);
    assert_int_equal(hits, 1);
    /* three readers: three locks on each rank of chunk 0 */
    assert_int_equal(engine_lookup_release(&eng, OWNER_A, "r2", 0, 2, 1), 3);
    assert_int_equal(engine_lookup_release(&eng, OWNER_A, "r2", 0, 2, -1), 3);
    /* left open on purpose: engine_destroy releases what a session still holds */
    assert_int_equal(
        engine_lookup(&eng, OWNER_A, "r3", &pr.p, "m", 2, 1, clock_mono_ns(), err, sizeof(err)),
        ENGINE_OK);
}

static void test_l2_calls_without_l2(void **state) {
    (void)state;
    char err[256];
    uint64_t id = 0, found, total;
    size_t nch = 7;
    uint32_t tokens[64] = {0};
    assert_int_equal(engine_l2_find(&eng, NULL), ENGINE_ERR_NO_L2);
    assert_int_equal(engine_reconfigurable_count(&eng, "dax"), 0);
    assert_null(engine_reconfigure_status(&eng, "dax", 0));
    assert_int_equal(engine_warm_prefetch_poll(&eng, 1, &found, &total), ENGINE_ERR_NOT_FOUND);
    /* no engine registered a layout for the model: that is reported first */
    assert_int_equal(
        engine_warm_prefetch(&eng, "m", 1, "", tokens, 64, &id, &nch, err, sizeof(err)),
        ENGINE_ERR_NO_LAYOUT);
    assert_int_equal(nch, 0);
}

/* Another request writing chunk 1 while a store of chunks [0, 2) runs: the store must not count
 * it as skipped while it is not resident. The writer here is the test itself, holding chunk 1's
 * write lease directly in L1 until the store has written chunk 0, then failing (abort). */
struct bg_store {
    struct prompt *pr;
    struct src *s;
    struct engine_store_result res;
    int rc;
};

static void *bg_store_main(void *arg) {
    struct bg_store *b = arg;
    b->rc = store(b->pr, "m", 1, 0, b->s, &b->res);
    return NULL;
}

static void chunk_key(const struct prompt *pr, uint32_t c, struct l1_key *out) {
    struct keys_object_key k;
    char err[128];
    memset(&k, 0, sizeof(k));
    memcpy(k.hash, pr->hashes[c], KEYS_HASH_LEN);
    k.hash_len = KEYS_HASH_LEN;
    assert_int_equal(keys_kv_rank_pack(1, 0, &k.kv_rank, err, sizeof(err)), 0);
    snprintf(k.model_name, sizeof(k.model_name), "m");
    assert_int_equal(l1_key_make(eng.l1, &k, out), L1_OK);
}

static void test_store_takes_over_a_chunk_whose_concurrent_writer_failed(void **state) {
    (void)state;
    struct prompt pr;
    struct src s = {40, UINT32_MAX};
    struct l1_key k1;
    struct l1_ref ref;
    prompt_init(&pr, 0xc0, 0, 2);
    chunk_key(&pr, 1, &k1);
    assert_int_equal(l1_reserve_write(eng.l1, &k1, CHUNK, false, clock_mono_ns(), &ref), L1_OK);
    struct bg_store b = {&pr, &s, {0}, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, bg_store_main, &b), 0);
    /* Once chunk 0 is resident the store has moved on to chunk 1 (bounded poll, no timing). */
    for (long i = 0; i < 100000000 && read_back(&pr, 0, "m", 1, 0, OWNER_A, "", 40) != ENGINE_OK;
         i++)
        sched_yield();
    assert_int_equal(l1_abort_write(eng.l1, &k1, ref.token), L1_OK);
    pthread_join(th, NULL);
    assert_int_equal(b.rc, ENGINE_OK);
    assert_int_equal(b.res.stored, 2);
    assert_int_equal(b.res.skipped, 0);
    assert_int_equal(b.res.pending, 0);
    assert_int_equal(read_back(&pr, 1, "m", 1, 0, OWNER_A, "", 41), ENGINE_OK);
}

/* The same with a writer that succeeds: the chunk counts as skipped, and it is resident. */
static void test_store_waits_for_a_concurrent_writer(void **state) {
    (void)state;
    struct prompt pr;
    struct src s = {50, UINT32_MAX};
    struct l1_key k1;
    struct l1_ref ref;
    prompt_init(&pr, 0xc1, 0, 2);
    chunk_key(&pr, 1, &k1);
    assert_int_equal(l1_reserve_write(eng.l1, &k1, CHUNK, false, clock_mono_ns(), &ref), L1_OK);
    memset(ref.data, 0x99, CHUNK);
    struct bg_store b = {&pr, &s, {0}, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, bg_store_main, &b), 0);
    for (long i = 0; i < 100000000 && read_back(&pr, 0, "m", 1, 0, OWNER_A, "", 50) != ENGINE_OK;
         i++)
        sched_yield();
    assert_int_equal(l1_finish_write(eng.l1, &k1, ref.token, 0, clock_mono_ns()), L1_OK);
    pthread_join(th, NULL);
    assert_int_equal(b.rc, ENGINE_OK);
    assert_int_equal(b.res.stored, 1);
    assert_int_equal(b.res.skipped, 1);
    assert_int_equal(b.res.pending, 0);
    assert_int_equal(read_back(&pr, 1, "m", 1, 0, OWNER_A, "", 0x99), ENGINE_OK);
}

/* A resumable store (engine_source.resume) does not wait for the concurrent writer: it parks at
 * that chunk with the counts so far, goes on from there when called again, and counts the chunk
 * as skipped once the writer finished. */
static int store_resumable(const struct prompt *pr, struct src *s, struct engine_store_state **st,
                           struct engine_store_result *res) {
    char err[256];
    struct engine_source es = {.size = src_size, .fill = src_fill, .arg = s, .resume = st};
    return engine_store(&eng, &pr->p, "m", 1, 0, &es, clock_mono_ns(), res, err, sizeof(err));
}

static void test_resumable_store_parks_instead_of_waiting(void **state) {
    (void)state;
    struct prompt pr;
    struct src s = {60, UINT32_MAX};
    struct l1_key k1;
    struct l1_ref ref;
    struct engine_store_state *st = NULL;
    struct engine_store_result res;
    prompt_init(&pr, 0xc2, 0, 3);
    chunk_key(&pr, 1, &k1);
    assert_int_equal(l1_reserve_write(eng.l1, &k1, CHUNK, false, clock_mono_ns(), &ref), L1_OK);
    memset(ref.data, 0x77, CHUNK);
    uint64_t t0 = clock_mono_ns();
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_AGAIN);
    assert_non_null(st);
    assert_int_equal(res.stored, 1); /* chunk 0, before the busy one */
    assert_int_equal(res.pending, 0);
    assert_true(engine_store_retry_at(st) > t0);
    assert_true(engine_store_retry_at(st) <= t0 + ENGINE_STORE_WAIT_NS + 1000000000ull);
    assert_int_equal(read_back(&pr, 0, "m", 1, 0, OWNER_A, "", 60), ENGINE_OK);
    /* Still busy: parked again, nothing counted twice. */
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_AGAIN);
    assert_int_equal(res.stored, 1);
    assert_int_equal(l1_finish_write(eng.l1, &k1, ref.token, 0, clock_mono_ns()), L1_OK);
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_OK);
    assert_null(st);
    assert_int_equal(res.stored, 2);
    assert_int_equal(res.skipped, 1);
    assert_int_equal(res.pending, 0);
    assert_int_equal(res.bytes, 2 * CHUNK);
    assert_int_equal(read_back(&pr, 1, "m", 1, 0, OWNER_A, "", 0x77), ENGINE_OK);
    assert_int_equal(read_back(&pr, 2, "m", 1, 0, OWNER_A, "", 62), ENGINE_OK);
}

/* A parked store told to wait no more counts the busy chunk as pending and stores the rest; one
 * abandoned keeps what it stored. */
static void test_parked_store_stops_waiting_or_is_abandoned(void **state) {
    (void)state;
    struct prompt pr, pr2;
    struct src s = {70, UINT32_MAX};
    struct l1_key k0, k1;
    struct l1_ref ref0, ref1;
    struct engine_store_state *st = NULL;
    struct engine_store_result res;
    prompt_init(&pr, 0xc3, 0, 3);
    chunk_key(&pr, 0, &k0);
    assert_int_equal(l1_reserve_write(eng.l1, &k0, CHUNK, false, clock_mono_ns(), &ref0), L1_OK);
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_AGAIN);
    assert_int_equal(res.stored, 0);
    engine_store_stop_waiting(st);
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_OK);
    assert_null(st);
    assert_int_equal(res.stored, 2);
    assert_int_equal(res.pending, 1);
    assert_int_equal(l1_abort_write(eng.l1, &k0, ref0.token), L1_OK);
    assert_int_equal(read_back(&pr, 0, "m", 1, 0, OWNER_A, "", 70), ENGINE_ERR_NOT_FOUND);

    prompt_init(&pr2, 0xc4, 0, 2);
    chunk_key(&pr2, 1, &k1);
    assert_int_equal(l1_reserve_write(eng.l1, &k1, CHUNK, false, clock_mono_ns(), &ref1), L1_OK);
    assert_int_equal(store_resumable(&pr2, &s, &st, &res), ENGINE_AGAIN);
    assert_int_equal(res.stored, 1);
    engine_store_abandon(&eng, st);
    assert_int_equal(read_back(&pr2, 0, "m", 1, 0, OWNER_A, "", 70), ENGINE_OK);
    assert_int_equal(l1_abort_write(eng.l1, &k1, ref1.token), L1_OK);
}

/* A resumed store whose range changed is refused (and its state freed). */
static void test_resumed_store_of_another_range_is_refused(void **state) {
    (void)state;
    struct prompt pr;
    struct src s = {80, UINT32_MAX};
    struct l1_key k1;
    struct l1_ref ref;
    struct engine_store_state *st = NULL;
    struct engine_store_result res;
    prompt_init(&pr, 0xc5, 0, 2);
    chunk_key(&pr, 1, &k1);
    assert_int_equal(l1_reserve_write(eng.l1, &k1, CHUNK, false, clock_mono_ns(), &ref), L1_OK);
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_AGAIN);
    pr.p.end_chunk = 3;
    assert_int_equal(store_resumable(&pr, &s, &st, &res), ENGINE_ERR_INVAL);
    assert_null(st);
    assert_int_equal(l1_abort_write(eng.l1, &k1, ref.token), L1_OK);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_store_then_read),
        cmocka_unit_test(test_failed_source_keeps_the_chunks_before),
        cmocka_unit_test(test_store_fills_chunks_in_one_batch),
        cmocka_unit_test(test_batch_failure_keeps_the_chunks_before),
        cmocka_unit_test(test_batch_is_filled_when_l1_is_full),
        cmocka_unit_test(test_lookup_session_holds_and_releases),
        cmocka_unit_test(test_lookup_stops_at_the_first_chunk_missing_a_rank),
        cmocka_unit_test(test_l2_calls_without_l2),
        cmocka_unit_test(test_resumable_store_parks_instead_of_waiting),
        cmocka_unit_test(test_parked_store_stops_waiting_or_is_abandoned),
        cmocka_unit_test(test_resumed_store_of_another_range_is_refused),
        cmocka_unit_test(test_store_takes_over_a_chunk_whose_concurrent_writer_failed),
        cmocka_unit_test(test_store_waits_for_a_concurrent_writer),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
