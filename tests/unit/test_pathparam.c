/* Unit tests of the admin path decoder (an encoded NUL never cuts a parameter short) and of the
 * UTF-8 / control-character check of decoded path parameters. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "server/admin/pathparam.h"

static void test_decode_keeps_nul_visible(void **state) {
    (void)state;
    char buf[64] = "/quota/a%00b";
    size_t n = pathparam_unescape(NULL, NULL, buf);
    assert_int_equal(n, strlen(buf));
    assert_memory_equal(buf,
                        "/quota/a\xC0\x80"
                        "b",
                        n);
    char err[128];
    assert_int_equal(pathparam_check_text(buf, n, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "NUL"));
}

static void test_decode_plain_and_malformed_escapes(void **state) {
    (void)state;
    char out[64];
    assert_int_equal(pathparam_decode("caf%C3%a9", 9, out), 5);
    assert_string_equal(out, "caf\xC3\xA9");
    /* A '%' without two hex digits stays as it is. */
    assert_int_equal(pathparam_decode("a%zz%4", 6, out), 6);
    assert_string_equal(out, "a%zz%4");
    assert_int_equal(pathparam_decode("%", 1, out), 1);
    assert_string_equal(out, "%");
}

static void test_check_text(void **state) {
    (void)state;
    char err[128];
    const char *ok[] = {"alice", "caf\xC3\xA9", "\xF0\x9F\x98\x80", "a b~", ""};
    for (size_t i = 0; i < sizeof(ok) / sizeof(*ok); i++)
        assert_int_equal(pathparam_check_text(ok[i], strlen(ok[i]), err, sizeof(err)), 0);
    const char *bad[] = {
        "zz\xFFzz",         "a\x01", "\x7F",     "\xC2\x85", "\xE0\x80\x80", "\xED\xA0\x80",
        "\xF4\x90\x80\x80", "\xC3",  "\xE2\x82", "\x80"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++)
        assert_int_equal(pathparam_check_text(bad[i], strlen(bad[i]), err, sizeof(err)), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_keeps_nul_visible),
        cmocka_unit_test(test_decode_plain_and_malformed_escapes),
        cmocka_unit_test(test_check_text),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
