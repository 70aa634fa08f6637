/* base/utf8: strict UTF-8 with the NUL and control-character bans, against known vectors, and
 * against the data plane's and the admin API's checkers over every short string built from the
 * bytes where UTF-8 rules change (they must agree before they are switched over to it). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "base/utf8.h"
#include "master/mwire.h"
#include "server/admin/pathparam.h"
#include "server/dataplane/wire.h"

struct vec {
    const char *s;
    size_t len;
    unsigned flags;
    size_t prefix;
    enum utf8_reason reason;
    size_t at;
};

#define V(lit, fl, pre, why, off)                                                                  \
    { lit, sizeof(lit) - 1, fl, pre, why, off }

static void test_utf8_vectors(void **state) {
    (void)state;
    static const struct vec v[] = {
        V("", 0, 0, UTF8_OK, 0),
        V("plain ascii", 0, 11, UTF8_OK, 11),
        V("caf\xc3\xa9", 0, 5, UTF8_OK, 5),
        V("\xe2\x82\xac\xf0\x9f\x98\x80", 0, 7, UTF8_OK, 7), /* U+20AC U+1F600 */
        V("\xf4\x8f\xbf\xbf", 0, 4, UTF8_OK, 4),             /* U+10FFFF */
        V("a\0b", 0, 3, UTF8_OK, 3),
        V("a\0b", UTF8_NO_NUL, 1, UTF8_NUL, 1),
        V("a\0b", UTF8_NO_CONTROL, 1, UTF8_CONTROL, 1),
        V("a\0b", UTF8_NO_NUL | UTF8_NO_CONTROL, 1, UTF8_NUL, 1),
        V("tab\there", 0, 8, UTF8_OK, 8),
        V("tab\there", UTF8_NO_CONTROL, 3, UTF8_CONTROL, 3),
        V("del\x7f", UTF8_NO_CONTROL, 3, UTF8_CONTROL, 3),
        V("c1\xc2\x85", UTF8_NO_CONTROL, 2, UTF8_CONTROL, 2), /* U+0085 */
        V("c1\xc2\x85", UTF8_NO_NUL, 4, UTF8_OK, 4),
        V("nbsp\xc2\xa0", UTF8_NO_CONTROL, 6, UTF8_OK, 6),
        V("x\xc0\x80y", 0, 1, UTF8_ENCODED_NUL, 1),
        V("x\xc1\xbf", 0, 1, UTF8_INVALID, 1),        /* overlong U+007F */
        V("\xe0\x80\xaf", 0, 0, UTF8_INVALID, 0),     /* overlong '/' */
        V("\xf0\x8f\xbf\xbf", 0, 0, UTF8_INVALID, 0), /* overlong U+FFFF */
        V("ab\xed\xa0\x80", 0, 2, UTF8_INVALID, 2),   /* surrogate U+D800 */
        V("\xf4\x90\x80\x80", 0, 0, UTF8_INVALID, 0), /* U+110000 */
        V("\xf5\x80\x80\x80", 0, 0, UTF8_INVALID, 0),
        V("\xff", 0, 0, UTF8_INVALID, 0),
        V("ok\x80", 0, 2, UTF8_INVALID, 2), /* lone continuation */
        V("\xe2\x82", 0, 0, UTF8_TRUNCATED, 0),
        V("z\xe2\x28\xa1", 0, 1, UTF8_INVALID, 2), /* the bad continuation byte */
        V("\xf0\x9f\x98\x41", 0, 0, UTF8_INVALID, 3),
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        struct utf8_error e = {UTF8_INVALID, 99};
        size_t got = utf8_check(v[i].s, v[i].len, v[i].flags, &e);
        if (got != v[i].prefix || e.reason != v[i].reason || e.at != v[i].at)
            fail_msg("vector %zu: prefix %zu reason %d at %zu, want %zu %d %zu", i, got,
                     (int)e.reason, e.at, v[i].prefix, (int)v[i].reason, v[i].at);
        assert_int_equal(utf8_check(v[i].s, v[i].len, v[i].flags, NULL), v[i].prefix);
    }
    assert_string_equal(utf8_reason_str(UTF8_CONTROL), "a control character");
}

/* The master's string-field check is utf8_check with UTF8_NO_NUL. */
static void test_mwire_text_check_uses_it(void **state) {
    (void)state;
    assert_int_equal(mwire_text_check("node-1", 6), MWIRE_TEXT_OK);
    assert_int_equal(mwire_text_check("tab\tok", 6), MWIRE_TEXT_OK);
    assert_int_equal(mwire_text_check("victim\0x", 8), MWIRE_TEXT_NUL);
    assert_int_equal(mwire_text_check("x\xc0\x80", 3), MWIRE_TEXT_UTF8);
    assert_int_equal(mwire_text_check("\xed\xa0\x80", 3), MWIRE_TEXT_UTF8);
    assert_int_equal(mwire_text_check("\xe2\x82", 2), MWIRE_TEXT_UTF8);
}

static const unsigned char ALPHA[] = {0x00, 0x1f, 0x41, 0x7f, 0x80, 0x8f, 0x90, 0x9f,
                                      0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf, 0xe0, 0xed,
                                      0xef, 0xf0, 0xf4, 0xf5, 0xf8, 0xff};
enum { NA = sizeof(ALPHA), MAXLEN = 4 };

/* Every string of up to four bytes over ALPHA: dp_text_check and pathparam_check_text give the
 * same verdict (and pathparam the same offset) as utf8_check with UTF8_NO_CONTROL. */
static void test_agrees_with_dataplane_and_pathparam(void **state) {
    (void)state;
    size_t checked = 0, valid = 0;
    for (size_t len = 0; len <= MAXLEN; len++) {
        size_t total = 1;
        for (size_t k = 0; k < len; k++) total *= NA;
        for (size_t code = 0; code < total; code++) {
            char s[MAXLEN];
            size_t c = code;
            for (size_t k = 0; k < len; k++, c /= NA) s[k] = (char)ALPHA[c % NA];
            struct utf8_error e;
            size_t pre = utf8_check(s, len, UTF8_NO_CONTROL, &e);
            size_t dp = dp_text_check(s, len);
            if (dp != pre) fail_msg("dp_text_check %zu, utf8_check %zu (len %zu)", dp, pre, len);
            char err[128] = "", want[32];
            int pp = pathparam_check_text(s, len, err, sizeof(err));
            if ((pp == 0) != (pre == len))
                fail_msg("pathparam %d, utf8_check %zu/%zu", pp, pre, len);
            if (pp != 0) {
                snprintf(want, sizeof(want), "byte %zu)", e.at);
                if (!strstr(err, want)) fail_msg("pathparam said \"%s\", utf8 at %zu", err, e.at);
            }
            valid += pre == len;
            checked++;
        }
    }
    print_message("%zu strings, %zu valid\n", checked, valid);
    assert_true(checked > 200000);
    assert_true(valid > 100);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_vectors),
        cmocka_unit_test(test_mwire_text_check_uses_it),
        cmocka_unit_test(test_agrees_with_dataplane_and_pathparam),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
