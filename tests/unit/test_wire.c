/* Unit tests for the data-plane codec: the structure check that guards msgpack-c, typed field
 * access, and reply maps. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "server/dataplane/wire.h"

static void test_check_rejects_huge_declared_containers(void **state) {
    (void)state;
    /* Regression: a map32 header declaring 0xdededede entries made the decoder try to allocate
     * over 100 GiB before reading them. */
    const unsigned char map32[] = {0xdf, 0xde, 0xde, 0xde, 0xde, 0x01, 0x02};
    assert_int_equal(dp_msgpack_check(map32, sizeof(map32), DP_MAX_ELEMENTS), -1);
    const unsigned char arr16[] = {0xdc, 0x00, 0x03, 0x01, 0x02};
    assert_int_equal(dp_msgpack_check(arr16, sizeof(arr16), DP_MAX_ELEMENTS), -1);
    const unsigned char str_overrun[] = {0xdb, 0xff, 0xff, 0xff, 0xff, 'a'};
    assert_int_equal(dp_msgpack_check(str_overrun, sizeof(str_overrun), DP_MAX_ELEMENTS), -1);
    const unsigned char never_used[] = {0xc1};
    assert_int_equal(dp_msgpack_check(never_used, 1, DP_MAX_ELEMENTS), -1);
    const unsigned char ok[] = {0x82, 0xa1, 'a', 0x01, 0xa1, 'b', 0x93, 0x01, 0x02, 0xc3};
    assert_int_equal(dp_msgpack_check(ok, sizeof(ok), DP_MAX_ELEMENTS), 0);
    assert_int_equal(dp_msgpack_check(ok, sizeof(ok), 5), -1); /* 8 elements */
}

static void test_fields_and_reply(void **state) {
    (void)state;
    msgpack_sbuffer sb;
    msgpack_packer pk;
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "n", 1);
    msgpack_pack_int(&pk, -5);
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "s", 1);
    msgpack_pack_str(&pk, 2);
    msgpack_pack_str_body(&pk, "hi", 2);
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "a", 1);
    msgpack_pack_array(&pk, 2);
    msgpack_pack_uint32(&pk, 7);
    msgpack_pack_uint64(&pk, 1ULL << 40);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    struct dp_map m;
    struct dp_err err = {0};
    assert_int_equal(dp_decode(sb.data, sb.size, &up, &m, &err), 0);
    int64_t v;
    assert_int_equal(dp_int(&m, "n", 1, -10, 10, &v, &err), 0);
    assert_int_equal(v, -5);
    assert_int_equal(dp_int(&m, "n", 1, 0, 10, &v, &err), -1);
    assert_string_equal(err.code, DP_BAD_REQUEST);
    assert_int_equal(dp_int(&m, "missing", 0, 0, 10, &v, &err), 1);
    assert_int_equal(dp_int(&m, "missing", 1, 0, 10, &v, &err), -1);
    assert_non_null(strstr(err.message, "missing"));
    char buf[8];
    assert_int_equal(dp_cstr(&m, "s", 1, buf, sizeof(buf), &err), 0);
    assert_string_equal(buf, "hi");
    assert_int_equal(dp_int(&m, "s", 1, 0, 10, &v, &err), -1);
    uint32_t *arr = NULL, n = 0;
    assert_int_equal(dp_u32_array(&m, "a", 1, &arr, &n, &err), -1); /* 2^40 does not fit */
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);

    struct dp_reply r;
    dp_reply_init(&r);
    dp_put_int(&r, "x", 3);
    struct dp_err e2;
    dp_fail(&e2, DP_NOT_FOUND, "gone %d", 1);
    size_t len;
    const char *out = dp_finish(&r, 0, &e2, &len);
    msgpack_unpacked_init(&up);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&up, out, len, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(up.data.type, MSGPACK_OBJECT_MAP);
    assert_int_equal(up.data.via.map.size, 4); /* x, ok, code, message */
    msgpack_unpacked_destroy(&up);
    dp_reply_free(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_rejects_huge_declared_containers),
        cmocka_unit_test(test_fields_and_reply),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
