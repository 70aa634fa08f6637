/* dataplane/connguard: the per-connection estimate of bytes libzmq holds, and the limit. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "server/dataplane/connguard.h"

#define MS 1000000ull

static void test_received_minus_delivered(void **state) {
    (void)state;
    /* 1 MB received, 600 KB of it delivered (credited with framing): 400 KB less framing */
    uint64_t h = connguard_estimate(0, 0, 1000000, 600000 + 10 * CONNGUARD_FRAME_SLACK, 0);
    assert_int_equal(h, 400000 - 10 * CONNGUARD_FRAME_SLACK);
    /* the rest arrives and is delivered */
    h = connguard_estimate(h, 1000000, 1500000, 900000, 0);
    assert_int_equal(h, 0);
}

static void test_credit_cannot_be_banked(void **state) {
    (void)state;
    /* Many tiny frames credited far more than they weighed on the wire: the estimate stops at
     * zero, so the next interval's flood counts in full. */
    uint64_t h = connguard_estimate(0, 0, 3000, 1000 * (3 + CONNGUARD_FRAME_SLACK), 50 * MS);
    assert_int_equal(h, 0);
    h = connguard_estimate(h, 3000, 3000 + (50u << 20), 0, 50 * MS);
    assert_true(h >= (50u << 20) - 64);
}

static void test_never_above_the_truth(void **state) {
    (void)state;
    /* The true figure follows received - actual wire bytes of the delivered frames; credits are
     * never below those, whatever the order of arrivals and deliveries. */
    uint64_t est = 0, truth = 0, prev = 0, received = 0;
    uint32_t x = 12345;
    for (int i = 0; i < 10000; i++) {
        x = x * 1103515245u + 12345u;
        uint64_t in = (x >> 8) % 100000;
        received += in;
        truth += in;
        uint64_t frames = (x >> 4) % 8, wire = 0;
        for (uint64_t f = 0; f < frames && truth > wire; f++) {
            uint64_t sz = ((x >> (f + 3)) % 20000) + 2;
            if (wire + sz > truth) sz = truth - wire;
            wire += sz;
        }
        truth -= wire;
        uint64_t credit = wire + frames * CONNGUARD_FRAME_SLACK;
        est = connguard_estimate(est, prev, received, credit, 50 * MS);
        prev = received;
        assert_true(est <= truth);
    }
}

static void test_heartbeats_and_reused_descriptors(void **state) {
    (void)state;
    /* a second of age forgives CONNGUARD_HEARTBEAT_PER_S bytes that were never delivered */
    assert_int_equal(connguard_estimate(0, 0, 5000, 0, 1000 * MS),
                     5000 - CONNGUARD_HEARTBEAT_PER_S);
    assert_int_equal(connguard_estimate(0, 0, 1000, 0, 1000 * MS), 0);
    /* a counter that went backwards (another connection on the descriptor) adds nothing */
    assert_int_equal(connguard_estimate(7000, 9000, 100, 0, 0), 7000);
}

static void test_limit(void **state) {
    (void)state;
    uint64_t mb = 1u << 20;
    uint64_t l = connguard_limit(1, mb);
    /* two messages of 1 MiB and their framing, the handshake */
    assert_true(l >= 2 * mb + CONNGUARD_BASE_SLACK);
    assert_true(l < 3 * mb);
    assert_int_equal(connguard_limit(16, 1024 * mb),
                     17 * (1024 * mb + 64 * mb + (64u << 10)) + CONNGUARD_BASE_SLACK);
    /* the largest settings do not overflow */
    assert_true(connguard_limit(100000, 65536 * mb) > 65536 * mb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_received_minus_delivered),
        cmocka_unit_test(test_credit_cannot_be_banked),
        cmocka_unit_test(test_never_above_the_truth),
        cmocka_unit_test(test_heartbeats_and_reused_descriptors),
        cmocka_unit_test(test_limit),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
