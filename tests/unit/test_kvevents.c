/* The KV-event publisher's internals (src/server/fleet/kvevents.c, included): block counts per
 * medium, AllBlocksCleared replacing the pending changes of an emptied node, the replay ring's
 * bounds (10000 batches, 64 MiB) and its look-up by sequence. No sockets, no threads. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "../../src/server/fleet/kvevents.c"

static struct kvevents *mk(void) {
    struct kvevents *k = calloc(1, sizeof(*k));
    assert_non_null(k);
    pthread_mutex_init(&k->mu, NULL);
    pthread_mutex_init(&k->rmu, NULL);
    pthread_cond_init(&k->cv, NULL);
    k->ring = malloc(QUEUE_MAX * sizeof(*k->ring));
    k->slots = calloc(REPLAY_BATCHES, sizeof(*k->slots));
    assert_non_null(k->ring);
    assert_non_null(k->slots);
    assert_int_equal(ptable_init(&k->tab), 0);
    return k;
}

static void hash_n(uint8_t h[32], int n) {
    memset(h, 0, 32);
    h[0] = (uint8_t)n;
    h[31] = (uint8_t)(n * 7);
}

static const struct ev *queued(struct kvevents *k, size_t i) {
    return &k->ring[(k->head + i) % QUEUE_MAX];
}

static void test_object_groups_are_one_block_per_medium(void **state) {
    (void)state;
    struct kvevents *k = mk();
    uint8_t a[32], b[32];
    hash_n(a, 1);
    hash_n(b, 2);
    on_placement(k, a, ENGINE_TIER_DRAM, true);
    on_placement(k, a, ENGINE_TIER_DRAM, true); /* a second object group of the chunk */
    on_placement(k, a, ENGINE_TIER_OBJ, true);
    on_placement(k, b, ENGINE_TIER_SSD, true);
    assert_int_equal(k->count, 3);
    assert_int_equal(queued(k, 0)->kind, K_STORED);
    assert_int_equal(queued(k, 0)->medium, M_CPU);
    assert_int_equal(queued(k, 1)->medium, M_OBJ);
    assert_int_equal(queued(k, 2)->medium, M_FS);
    on_placement(k, a, ENGINE_TIER_DRAM, false); /* one group left: still held */
    assert_int_equal(k->count, 3);
    on_placement(k, a, ENGINE_TIER_DRAM, false);
    assert_int_equal(k->count, 4);
    assert_int_equal(queued(k, 3)->kind, K_REMOVED);
    assert_int_equal(queued(k, 3)->medium, M_CPU);
    on_placement(k, a, ENGINE_TIER_DRAM, false); /* nothing left to remove: no event */
    assert_int_equal(k->count, 4);
    assert_int_equal(k->tracked, 2);
    /* Not empty (OBJ and FS copies): a clear leaves the queue alone. */
    on_cleared(k);
    assert_int_equal(k->count, 4);
    on_placement(k, a, ENGINE_TIER_OBJ, false);
    on_placement(k, b, ENGINE_TIER_SSD, false);
    assert_int_equal(k->tracked, 0);
    assert_int_equal(k->count, 6);
    /* Empty now: the pending changes net to nothing and one AllBlocksCleared replaces them. */
    on_cleared(k);
    assert_int_equal(k->count, 1);
    assert_int_equal(queued(k, 0)->kind, K_CLEARED);
    kvevents_free(k);
}

static void test_full_queue_drops(void **state) {
    (void)state;
    struct kvevents *k = mk();
    uint8_t h[32] = {0};
    for (uint32_t i = 0; i < QUEUE_MAX + 10; i++) {
        memcpy(h, &i, sizeof(i));
        on_placement(k, h, ENGINE_TIER_DRAM, true);
    }
    assert_int_equal(k->count, QUEUE_MAX);
    assert_int_equal(k->tracked, QUEUE_MAX + 10);
    /* The dropped events leave a gap in the sequence before the next batch, once. */
    struct ev *buf = malloc(BATCH_MAX * sizeof(*buf));
    assert_non_null(buf);
    assert_int_equal(k->seq, 0);
    assert_int_equal(take(k, buf), BATCH_MAX);
    assert_int_equal(k->seq, 1);
    assert_int_equal(take(k, buf), BATCH_MAX);
    assert_int_equal(k->seq, 1);
    free(buf);
    kvevents_free(k);
}

static void append(struct kvevents *k, uint64_t seq, size_t len) {
    char *d = malloc(len);
    assert_non_null(d);
    memset(d, (int)seq, len);
    ring_append(k, seq, d, len);
}

static void test_ring_keeps_the_last_10000_batches(void **state) {
    (void)state;
    struct kvevents *k = mk();
    for (uint64_t s = 0; s < REPLAY_BATCHES + 5; s++) append(k, s, 16);
    assert_int_equal(k->scount, REPLAY_BATCHES);
    assert_int_equal(k->sbytes, REPLAY_BATCHES * 16);
    uint64_t seq = 0;
    struct payload *p = ring_find(k, 0, UINT64_MAX, &seq); /* evicted: the oldest kept */
    assert_non_null(p);
    assert_int_equal(seq, 5);
    payload_unref(p);
    p = ring_find(k, 777, UINT64_MAX, &seq);
    assert_non_null(p);
    assert_int_equal(seq, 777);
    assert_int_equal((uint8_t)p->data[0], (uint8_t)777);
    payload_unref(p);
    assert_null(ring_find(k, REPLAY_BATCHES + 5, UINT64_MAX, &seq)); /* past the newest */
    assert_null(ring_find(k, UINT64_MAX, UINT64_MAX, &seq));
    assert_null(ring_find(k, 100, 100, &seq)); /* [from, end) empty */
    kvevents_free(k);
}

static void test_ring_keeps_at_most_64_mib(void **state) {
    (void)state;
    struct kvevents *k = mk();
    for (uint64_t s = 0; s < 80; s++) append(k, s, 1u << 20);
    assert_true(k->sbytes <= REPLAY_BYTES);
    assert_int_equal(k->scount, 64);
    /* A batch a replay still holds outlives its eviction. */
    uint64_t seq;
    struct payload *p = ring_find(k, 0, UINT64_MAX, &seq);
    assert_non_null(p);
    assert_int_equal(seq, 16);
    for (uint64_t s = 80; s < 200; s++) append(k, s, 1u << 20);
    assert_int_equal((uint8_t)p->data[0], 16);
    payload_unref(p);
    kvevents_free(k);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_object_groups_are_one_block_per_medium),
        cmocka_unit_test(test_full_queue_drops),
        cmocka_unit_test(test_ring_keeps_the_last_10000_batches),
        cmocka_unit_test(test_ring_keeps_at_most_64_mib),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
