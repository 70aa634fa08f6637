/* Relayed metrics registry (src/master/mrelay.c): names, escaping, histogram shape, number
 * formatting, family collisions and the memory cap. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "base/strbuf.h"
#include "master/mrelay.h"

static char *render(struct mrelay *r) {
    struct strbuf sb = STRBUF_INIT;
    assert_int_equal(mrelay_render(r, &sb), 0);
    return sb_detach(&sb, NULL);
}

static void test_names(void **st) {
    (void)st;
    assert_true(mrelay_metric_name_ok("a:b_c9"));
    assert_true(mrelay_metric_name_ok(":x"));
    assert_false(mrelay_metric_name_ok(""));
    assert_false(mrelay_metric_name_ok("9a"));
    assert_false(mrelay_metric_name_ok("a-b"));
    assert_false(mrelay_metric_name_ok("a\nb"));
    assert_true(mrelay_label_name_ok("_x9"));
    assert_false(mrelay_label_name_ok("a:b"));
    assert_false(mrelay_label_name_ok("__name__"));
    assert_false(mrelay_label_name_ok("__x"));
    assert_false(mrelay_label_name_ok(""));
}

static void test_fmt_double(void **st) {
    (void)st;
    char b[32];
    assert_string_equal(mrelay_fmt_double(123456789, b, sizeof(b)), "123456789");
    assert_string_equal(mrelay_fmt_double(0.1, b, sizeof(b)), "0.1");
    assert_string_equal(mrelay_fmt_double(9007199254740993.0, b, sizeof(b)), "9007199254740992");
    assert_string_equal(mrelay_fmt_double(1.0 / 3, b, sizeof(b)), "0.3333333333333333");
    assert_string_equal(mrelay_fmt_double(NAN, b, sizeof(b)), "NaN");
    assert_string_equal(mrelay_fmt_double(-INFINITY, b, sizeof(b)), "-Inf");
    const double vs[] = {0.1 + 0.2, 1e-300, 5e-324, 1.7976931348623157e308, -123.456};
    for (size_t i = 0; i < sizeof(vs) / sizeof(vs[0]); i++)
        assert_true(strtod(mrelay_fmt_double(vs[i], b, sizeof(b)), NULL) == vs[i]);
}

static void test_hist_defect(void **st) {
    (void)st;
    const double b[] = {1, 2, 4};
    const uint64_t ok[] = {1, 1, 3}, dec[] = {2, 1, 3};
    assert_null(mrelay_hist_defect(b, 3, ok, 3, 3));
    assert_null(mrelay_hist_defect(NULL, 0, NULL, 0, 5));
    assert_non_null(mrelay_hist_defect(b, 3, ok, 2, 3));  /* shape */
    assert_non_null(mrelay_hist_defect(b, 3, dec, 3, 3)); /* not cumulative */
    assert_non_null(mrelay_hist_defect(b, 3, ok, 3, 2));  /* above count */
    const double unsorted[] = {1, 4, 2}, inf[] = {1, 2, INFINITY};
    assert_non_null(mrelay_hist_defect(unsorted, 3, ok, 3, 3));
    assert_non_null(mrelay_hist_defect(inf, 3, ok, 3, 3));
}

static void test_escaping_and_labels(void **st) {
    (void)st;
    struct mrelay *r = mrelay_new();
    const char *why;
    struct mrelay_label l[] = {{"k", "a\"b\\c\nd"}, {"bad:name", "x"}, {"k", "dup"}, {"__n", "y"}};
    assert_int_equal(mrelay_gauge_set(r, "g", "help\\ and\nmore", l, 4, 123456789, &why), 0);
    char *t = render(r);
    assert_non_null(strstr(t, "# HELP g help\\\\ and\\nmore\n"));
    assert_non_null(strstr(t, "g{k=\"a\\\"b\\\\c\\nd\"} 123456789\n"));
    free(t);
    mrelay_free(r);
}

static void test_collisions(void **st) {
    (void)st;
    struct mrelay *r = mrelay_new();
    const char *why;
    const double b[] = {1};
    const uint64_t c[] = {1};
    assert_int_equal(mrelay_reserve(r, "own_count"), 0);
    assert_int_equal(mrelay_gauge_set(r, "own_count", "", NULL, 0, 1, &why), -1);
    assert_int_equal(mrelay_hist_merge(r, "own", "", NULL, 0, b, 1, c, 1, 1, 1, &why), -1);
    assert_int_equal(mrelay_hist_merge(r, "h", "", NULL, 0, b, 1, c, 1, 1, 1, &why), 0);
    assert_int_equal(mrelay_gauge_set(r, "h_sum", "", NULL, 0, 1, &why), -1);
    assert_int_equal(mrelay_counter_add(r, "h_bucket", "", NULL, 0, 1, &why), -1);
    assert_int_equal(mrelay_gauge_set(r, "x_count", "", NULL, 0, 1, &why), 0);
    assert_int_equal(mrelay_hist_merge(r, "x", "", NULL, 0, b, 1, c, 1, 1, 1, &why), -1);
    assert_int_equal(mrelay_counter_add(r, "h", "", NULL, 0, 1, &why), -1); /* type */
    const double b2[] = {2};
    assert_int_equal(mrelay_hist_merge(r, "h", "", NULL, 0, b2, 1, c, 1, 1, 1, &why), -1);
    mrelay_free(r);
}

/* Series with big labels stop at MRELAY_MAX_BYTES, well before the series cap. */
static void test_byte_cap(void **st) {
    (void)st;
    struct mrelay *r = mrelay_new();
    const char *why = NULL;
    size_t vl = 16384;
    char *v = malloc(vl + 16);
    memset(v, 'v', vl);
    size_t ok = 0;
    for (size_t i = 0; i < MRELAY_MAX_SERIES; i++) {
        snprintf(v + vl, 16, "%zu", i);
        struct mrelay_label l = {"k", v};
        if (mrelay_gauge_set(r, "big", "", &l, 1, 1, &why)) break;
        ok++;
    }
    assert_true(ok < MRELAY_MAX_SERIES);
    assert_true(ok * vl <= MRELAY_MAX_BYTES);
    assert_true((ok + 2) * (vl + 32) > MRELAY_MAX_BYTES);
    assert_string_equal(why, "relayed metrics memory limit reached");
    free(v);
    mrelay_free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),       cmocka_unit_test(test_fmt_double),
        cmocka_unit_test(test_hist_defect), cmocka_unit_test(test_escaping_and_labels),
        cmocka_unit_test(test_collisions),  cmocka_unit_test(test_byte_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
