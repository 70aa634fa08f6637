/* base/ratelimit: burst per window, suppressed count handed to the next allowed message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "base/ratelimit.h"

static void test_burst_then_suppressed_count(void **state) {
    (void)state;
    struct ratelimit rl = RATELIMIT_INIT(10.0, 3);
    unsigned long dropped = 99;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ratelimit_allow(&rl, 100.0 + i, &dropped), 1);
        assert_int_equal(dropped, 0);
    }
    for (int i = 0; i < 5; i++) {
        assert_int_equal(ratelimit_allow(&rl, 105.0, &dropped), 0);
        assert_int_equal(dropped, 0);
    }
    /* the next window: allowed again, and told that five were dropped */
    assert_int_equal(ratelimit_allow(&rl, 110.0, &dropped), 1);
    assert_int_equal(dropped, 5);
    assert_int_equal(ratelimit_allow(&rl, 111.0, &dropped), 1);
    assert_int_equal(dropped, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_burst_then_suppressed_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
