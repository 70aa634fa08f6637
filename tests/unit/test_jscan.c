/* base/jscan: the strict JSON scanner, against vectors and against jansson (the parser it
 * stands in for on the routing query) over every short value built from JSON's syntax bytes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "base/jscan.h"

struct seen {
    int n;
    char keys[8][32];
    char vals[8][64];
    int escaped[8];
};

static int collect(void *arg, const struct jscan_member *m) {
    struct seen *s = arg;
    if (s->n < 8) {
        snprintf(s->keys[s->n], sizeof(s->keys[0]), "%.*s", (int)m->key_len, m->key);
        snprintf(s->vals[s->n], sizeof(s->vals[0]), "%.*s", (int)m->val_len, m->val);
        s->escaped[s->n] = m->key_escaped;
    }
    s->n++;
    return 0;
}

static int scan(const char *txt, struct seen *s) {
    memset(s, 0, sizeof(*s));
    return jscan_object(txt, strlen(txt), 4, collect, s);
}

static void test_members_are_spans(void **state) {
    (void)state;
    struct seen s;
    assert_int_equal(
        scan(" {\"a\" : [1, 2 ,3] ,\"b\\u0041\":{\"x\":null},\"c\":\"s\\\"t\"} \n", &s), 0);
    assert_int_equal(s.n, 3);
    assert_string_equal(s.keys[0], "a");
    assert_string_equal(s.vals[0], "[1, 2 ,3]");
    assert_int_equal(s.escaped[0], 0);
    assert_string_equal(s.keys[1], "b\\u0041");
    assert_int_equal(s.escaped[1], 1);
    assert_string_equal(s.vals[1], "{\"x\":null}");
    assert_string_equal(s.vals[2], "\"s\\\"t\"");
    assert_int_equal(scan("{}", &s), 0);
    assert_int_equal(s.n, 0);
}

static void test_rejects(void **state) {
    (void)state;
    static const char *const bad[] = {
        "",
        "[]",
        "1",
        "{",
        "{\"a\"}",
        "{\"a\":}",
        "{\"a\":1,}",
        "{,}",
        "{\"a\":1}x",
        "{a:1}",
        "{\"a\":01}",
        "{\"a\":1.}",
        "{\"a\":.5}",
        "{\"a\":1e}",
        "{\"a\":-}",
        "{\"a\":+1}",
        "{\"a\":tru}",
        "{\"a\":nul}",
        "{\"a\":\"\\x\"}",
        "{\"a\":\"\\u12\"}",
        "{\"a\":\"\\ud800\"}",
        "{\"a\":\"\\udc00\"}",
        "{\"a\":\"\\ud800\\u0041\"}",
        "{\"a\":\"\t\"}",
        "{\"a\":\"\xc3\x28\"}",
        "{\"a\":\"\xed\xa0\x80\"}",
        "{\"a\":[1 2]}",
        "{\"a\":1 \"b\":2}",
        "{\"a\":\"x}",
    };
    struct seen s;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc = scan(bad[i], &s);
        if (rc != JSCAN_SYNTAX) fail_msg("accepted or misreported: %s (%d)", bad[i], rc);
    }
    /* nesting: the object counts as one level of the 4 allowed */
    assert_int_equal(scan("{\"a\":[[[1]]]}", &s), 0);
    assert_int_equal(scan("{\"a\":[[[[1]]]]}", &s), JSCAN_DEPTH);
    /* a raw NUL inside a string is a control character */
    assert_int_equal(jscan_object("{\"a\":\"\0\"}", 8, 4, collect, &s), JSCAN_SYNTAX);
    /* fn's code comes back and stops the walk */
    assert_int_equal(jscan_object("{\"a\":1,\"b\":2}", 13, 4, collect, &s), 0);
}

static int stop_at_b(void *arg, const struct jscan_member *m) {
    (*(int *)arg)++;
    return m->key_len == 1 && m->key[0] == 'b' ? 7 : 0;
}

static void test_callback_code_stops(void **state) {
    (void)state;
    int calls = 0;
    assert_int_equal(jscan_object("{\"a\":1,\"b\":2,\"c\":3}", 19, 4, stop_at_b, &calls), 7);
    assert_int_equal(calls, 2);
}

static void test_u32_array(void **state) {
    (void)state;
    uint32_t out[4];
    assert_int_equal(jscan_u32_array("[]", 2, out, 4), 0);
    assert_int_equal(jscan_u32_array("[ 0 , 7,4294967295 ]", 20, out, 4), 3);
    assert_int_equal(out[0], 0);
    assert_int_equal(out[1], 7);
    assert_int_equal(out[2], 4294967295u);
    static const char *const bad[] = {"[4294967296]",
                                      "[-1]",
                                      "[1.0]",
                                      "[1e2]",
                                      "[01]",
                                      "[\"1\"]",
                                      "[1,]",
                                      "[,1]",
                                      "1",
                                      "[1] ",
                                      "[99999999999999999999]",
                                      "[true]",
                                      "{}"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        if (jscan_u32_array(bad[i], strlen(bad[i]), out, 4) != -1) fail_msg("accepted %s", bad[i]);
    assert_int_equal(jscan_u32_array("[1,2,3,4,5]", 11, out, 4), -2);
}

/* Every value of up to four bytes from JSON's syntax alphabet, inside {"k": ...}: jscan and
 * jansson (which the routing query used before) agree on what is valid. */
static void test_agrees_with_jansson(void **state) {
    (void)state;
    static const char A[] = "{}[]\",:01-.e\\u a";
    const size_t na = sizeof(A) - 1;
    char body[32];
    long total = 0, valid = 0;
    for (int len = 0; len <= 4; len++) {
        long combos = 1;
        for (int i = 0; i < len; i++) combos *= (long)na;
        for (long c = 0; c < combos; c++) {
            char v[8];
            long x = c;
            for (int i = 0; i < len; i++, x /= (long)na) v[i] = A[x % (long)na];
            int n = snprintf(body, sizeof(body), "{\"k\":%.*s}", len, v);
            struct seen s;
            memset(&s, 0, sizeof(s));
            int ours = jscan_object(body, (size_t)n, 64, collect, &s) == 0;
            json_t *j = json_loadb(body, (size_t)n, 0, NULL);
            int theirs = json_is_object(j);
            json_decref(j);
            if (ours != theirs) fail_msg("disagree on %s: jscan %d jansson %d", body, ours, theirs);
            total++;
            valid += ours;
        }
    }
    assert_true(valid > 10 && total > 60000);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_members_are_spans),   cmocka_unit_test(test_rejects),
        cmocka_unit_test(test_callback_code_stops), cmocka_unit_test(test_u32_array),
        cmocka_unit_test(test_agrees_with_jansson),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
