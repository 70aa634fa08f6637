/* Unit tests for the S3 adapter's pure parts: SigV4 percent-encoding, the opaque page token, the
 * circuit breaker (time passed in) and the expat readers of ListObjectsV2 pages and S3 errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/l2/s3.h"
#include "server/l2/s3_xml.h"

static void test_uri_encode(void **state) {
    (void)state;
    char out[128];
    const char *k = "Org/Model A+b@01000100@0@ab@salt~x_y.z-";
    assert_true(s3_uri_encode(k, strlen(k), true, out, sizeof(out)) > 0);
    assert_string_equal(out, "Org/Model%20A%2Bb%4001000100%400%40ab%40salt~x_y.z-");
    assert_true(s3_uri_encode(k, strlen(k), false, out, sizeof(out)) > 0);
    assert_string_equal(out, "Org%2FModel%20A%2Bb%4001000100%400%40ab%40salt~x_y.z-");
    assert_true(s3_uri_encode("\xc3\xa9=&", 4, false, out, sizeof(out)) > 0);
    assert_string_equal(out, "%C3%A9%3D%26");
    assert_int_equal(s3_uri_encode("abc", 3, false, out, 3), -1);
    assert_int_equal(s3_uri_encode(" ", 1, false, out, 3), -1);
    assert_int_equal(s3_uri_encode(" ", 1, false, out, 4), 3);
}

static void test_token_roundtrip(void **state) {
    (void)state;
    const char *cases[] = {"a", "ab", "abc", "1/2+3==", "s3rver continuation token ~~~ ///"};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char *t = s3_token_encode(cases[i]);
        assert_non_null(t);
        assert_null(strpbrk(t, "+/="));
        char *back = s3_token_decode(t);
        assert_non_null(back);
        assert_string_equal(back, cases[i]);
        free(t);
        free(back);
    }
    assert_null(s3_token_decode(""));
    assert_null(s3_token_decode("!!!!"));
    assert_null(s3_token_decode("AAAA"));  /* version 0 */
    assert_null(s3_token_decode("AQ"));    /* version byte only */
    assert_null(s3_token_decode("AQAA"));  /* a NUL inside */
    assert_null(s3_token_decode("AQBhY")); /* 5 characters: impossible length */
    char big[1100];
    memset(big, 'x', sizeof(big) - 1);
    big[sizeof(big) - 1] = 0;
    assert_null(s3_token_encode(big)); /* longer than L2_PAGE_TOKEN_MAX once encoded */
    assert_null(s3_token_decode(big));
}

static void test_breaker(void **state) {
    (void)state;
    struct s3_breaker b;
    const uint64_t ms = 1000000;
    s3_breaker_init(&b, 3, 100 * ms, 400 * ms);
    assert_true(s3_breaker_allow(&b));
    s3_breaker_on_failure(&b, 0);
    s3_breaker_on_failure(&b, 0);
    s3_breaker_on_success(&b); /* not consecutive any more */
    s3_breaker_on_failure(&b, 0);
    s3_breaker_on_failure(&b, 0);
    assert_int_equal(b.state, S3_BREAKER_CLOSED);
    s3_breaker_on_failure(&b, 10 * ms);
    assert_int_equal(b.state, S3_BREAKER_OPEN);
    assert_false(s3_breaker_allow(&b));
    assert_int_equal(b.opens, 1);
    assert_false(s3_breaker_probe_due(&b, 50 * ms));
    assert_true(s3_breaker_probe_due(&b, 110 * ms));
    assert_int_equal(b.state, S3_BREAKER_HALF_OPEN);
    assert_false(s3_breaker_allow(&b));
    assert_false(s3_breaker_probe_due(&b, 500 * ms)); /* one probe at a time */
    s3_breaker_on_failure(&b, 120 * ms);              /* probe failed: cooldown doubles */
    assert_int_equal(b.state, S3_BREAKER_OPEN);
    assert_int_equal(b.cur_cooldown_ns, 200 * ms);
    assert_false(s3_breaker_probe_due(&b, 300 * ms));
    assert_true(s3_breaker_probe_due(&b, 320 * ms));
    s3_breaker_on_failure(&b, 320 * ms);
    assert_int_equal(b.cur_cooldown_ns, 400 * ms);
    assert_true(s3_breaker_probe_due(&b, 720 * ms));
    s3_breaker_on_failure(&b, 720 * ms);
    assert_int_equal(b.cur_cooldown_ns, 400 * ms); /* capped */
    assert_true(s3_breaker_probe_due(&b, 1120 * ms));
    s3_breaker_on_success(&b);
    assert_int_equal(b.state, S3_BREAKER_CLOSED);
    assert_int_equal(b.cur_cooldown_ns, 100 * ms);
    assert_true(s3_breaker_allow(&b));
    assert_int_equal(b.opens, 1);
    assert_string_equal(s3_breaker_state_name(S3_BREAKER_HALF_OPEN), "half_open");
}

static const char page[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    "<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
    "<Name>b</Name><Prefix>m@</Prefix><KeyCount>3</KeyCount><MaxKeys>3</MaxKeys>"
    "<IsTruncated>true</IsTruncated>"
    "<Contents><Key>m@01000100@0@aa</Key><LastModified>x</LastModified><Size>10</Size></Contents>"
    "<Contents><Key>a &amp; b</Key><Size>18446744073709551615</Size></Contents>"
    "<Contents><Key>no-size</Key></Contents>"
    "<Contents><Key>bad-size</Key><Size>-1</Size></Contents>"
    "<Contents><Size>5</Size></Contents>"
    "<NextContinuationToken>tok+/=</NextContinuationToken></ListBucketResult>";

static void test_xml_list(void **state) {
    (void)state;
    struct s3_xml_list l;
    char err[160];
    assert_int_equal(s3_xml_parse_list(page, strlen(page), &l, err, sizeof(err)), 0);
    assert_int_equal(l.count, 2);
    assert_string_equal(l.items[0].key, "m@01000100@0@aa");
    assert_int_equal(l.items[0].size, 10);
    assert_string_equal(l.items[1].key, "a & b");
    assert_true(l.items[1].size == UINT64_MAX);
    assert_true(l.truncated);
    assert_string_equal(l.next_token, "tok+/=");
    s3_xml_list_free(&l);

    const char *last = "<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>";
    assert_int_equal(s3_xml_parse_list(last, strlen(last), &l, err, sizeof(err)), 0);
    assert_int_equal(l.count, 0);
    assert_false(l.truncated);
    assert_null(l.next_token);
    s3_xml_list_free(&l);
}

static void test_xml_rejects(void **state) {
    (void)state;
    struct s3_xml_list l;
    char err[160];
    const char *bad[] = {
        "",
        "<ListBucketResult><Contents>",
        "<Error><Code>x</Code></Error>",
        "<!DOCTYPE x [<!ENTITY a \"aaaa\">]><ListBucketResult>&a;</ListBucketResult>",
        "not xml at all",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(s3_xml_parse_list(bad[i], strlen(bad[i]), &l, err, sizeof(err)), -1);
        assert_true(err[0] != 0);
        assert_int_equal(l.count, 0);
    }
    /* a key longer than S3 allows */
    size_t n = 2000;
    char *doc = malloc(n + 200);
    assert_non_null(doc);
    int off = sprintf(doc, "<ListBucketResult><Contents><Key>");
    memset(doc + off, 'k', n);
    sprintf(doc + off + n, "</Key><Size>1</Size></Contents></ListBucketResult>");
    assert_int_equal(s3_xml_parse_list(doc, strlen(doc), &l, err, sizeof(err)), -1);
    free(doc);
    /* deep nesting */
    char deep[2048] = "<ListBucketResult>";
    for (int i = 0; i < 100; i++) strcat(deep, "<a>");
    assert_int_equal(s3_xml_parse_list(deep, strlen(deep), &l, err, sizeof(err)), -1);
}

static void test_xml_error(void **state) {
    (void)state;
    char code[64], msg[64];
    const char *e = "<?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code>"
                    "<Message>The request signature we calculated does not match</Message>"
                    "<RequestId>1</RequestId></Error>";
    assert_int_equal(s3_xml_parse_error(e, strlen(e), code, sizeof(code), msg, sizeof(msg)), 0);
    assert_string_equal(code, "SignatureDoesNotMatch");
    assert_string_equal(msg, "The request signature we calculated does not match");
    assert_int_equal(s3_xml_parse_error(NULL, 0, code, sizeof(code), msg, sizeof(msg)), -1);
    assert_string_equal(code, "");
    assert_int_equal(s3_xml_parse_error("<html/>", 7, code, sizeof(code), msg, sizeof(msg)), -1);
    assert_int_equal(s3_xml_parse_error(page, strlen(page), code, sizeof(code), msg, sizeof(msg)),
                     -1);
}

/* Resolves dot segments of a path the way RFC 3986 (and libcurl, and file-system stores) do;
 * returns 0 when the result still starts with want, -1 when a ".." climbed above it. */
static int stays_under(const char *path, const char *want) {
    char segs[64][256];
    size_t n = 0;
    for (const char *p = path;;) {
        size_t l = strcspn(p, "/");
        if (l == 2 && p[0] == '.' && p[1] == '.') {
            if (n == 0) return -1;
            n--;
        } else if (!(l == 1 && p[0] == '.')) {
            snprintf(segs[n++], sizeof(segs[0]), "%.*s", (int)l, p);
        }
        if (!p[l]) break;
        p += l + 1;
    }
    char out[4096] = "";
    for (size_t i = 0; i < n; i++) {
        strcat(out, segs[i]);
        if (i + 1 < n) strcat(out, "/");
    }
    return strncmp(out, want, strlen(want)) == 0 ? 0 : -1;
}

static void test_key_escape_dot_segments(void **state) {
    (void)state;
    char key[S3_KEY_MAX + 1], back[S3_KEY_MAX + 1], path[3 * S3_KEY_MAX + 1];
    const char *name = "../../x@01000100@0@ab";
    long n = s3_key_escape(name, key, sizeof(key));
    assert_string_equal(key, "%2E%2E/%2E%2E/x@01000100@0@ab");
    assert_int_equal(s3_key_unescape(key, (size_t)n, back, sizeof(back)), strlen(name));
    assert_string_equal(back, name);
    /* The URL path: '%' of the key is itself encoded, and nothing resolves above the prefix. */
    assert_true(s3_object_path("p/q/", name, path, sizeof(path)) > 0);
    assert_string_equal(path, "p/q/%252E%252E/%252E%252E/x%4001000100%400%40ab");
    assert_int_equal(stays_under(path, "p/q/"), 0);
    /* Every mixture of dot segments, '%' and ordinary names round-trips and stays inside. */
    const char *names[] = {"./a@1",      "a/./b@1",         "a/../b@1", "..@1",
                           "a/..@1",     "...@1",           ".a/b.@1",  "%2E%2E@1",
                           "a%25/..%@1", "org/Model-3.5@1", "/../x@1",  "a//..@1"};
    for (size_t i = 0; i < sizeof(names) / sizeof(*names); i++) {
        n = s3_key_escape(names[i], key, sizeof(key));
        assert_true(n >= 0);
        assert_int_equal(s3_key_unescape(key, (size_t)n, back, sizeof(back)), strlen(names[i]));
        assert_string_equal(back, names[i]);
        char full[S3_KEY_MAX + 8];
        snprintf(full, sizeof(full), "p/%s", key);
        assert_int_equal(stays_under(full, "p/"), 0);
    }
    /* Plain names keep their key, as other S3 clients see it. */
    s3_key_escape("org/Model-3.5@01000100@0@ab@salt", key, sizeof(key));
    assert_string_equal(key, "org/Model-3.5@01000100@0@ab@salt");
    /* Keys the escaper cannot have produced are not ours. */
    const char *foreign[] = {"../x@1", "a/./b", "%41", "%2", "x%2E", "%2e%2e/x"};
    for (size_t i = 0; i < sizeof(foreign) / sizeof(*foreign); i++)
        assert_int_equal(s3_key_unescape(foreign[i], strlen(foreign[i]), back, sizeof(back)), -1);
    /* Too small an output buffer. */
    assert_int_equal(s3_key_escape("../x", key, 4), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_key_escape_dot_segments),
        cmocka_unit_test(test_uri_encode),
        cmocka_unit_test(test_token_roundtrip),
        cmocka_unit_test(test_breaker),
        cmocka_unit_test(test_xml_list),
        cmocka_unit_test(test_xml_rejects),
        cmocka_unit_test(test_xml_error),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
