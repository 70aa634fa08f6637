/* Unit tests for the data-plane codec: the structure check that guards msgpack-c, typed field
 * access, and reply maps. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
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

static void test_text_check_accepts_utf8_text_only(void **state) {
    (void)state;
    static const struct {
        const char *s;
        size_t bad; /* expected result; SIZE_MAX = the whole string is fine */
    } cases[] = {
        {"", SIZE_MAX},
        {"plain-salt_1.2", SIZE_MAX},
        {"caf\xc3\xa9 \xe7\xa7\x9f \xf0\x9f\x98\x80", SIZE_MAX}, /* 2-, 3- and 4-byte forms */
        {"\xff\xfe", 0},
        {"ab\x80", 2},           /* lone continuation byte */
        {"\xc0\xaf", 0},         /* overlong '/' */
        {"\xe0\x80\xaf", 0},     /* overlong, 3 bytes */
        {"\xed\xa0\x80", 0},     /* UTF-16 surrogate */
        {"\xf4\x90\x80\x80", 0}, /* above U+10FFFF */
        {"a\xe7\xa7", 1},        /* truncated */
        {"a\nb", 1},             /* C0 control */
        {"\x1b[31m", 0},         /* escape sequence */
        {"x\x7f", 1},            /* DEL */
        {"\xc2\x85", 0},         /* C1 control (NEL) */
        {"\xc2\xa0", SIZE_MAX},  /* U+00A0 is text */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t len = strlen(cases[i].s);
        size_t want = cases[i].bad == SIZE_MAX ? len : cases[i].bad;
        assert_int_equal(dp_text_check(cases[i].s, len), want);
    }
}

static void test_str_field_rejects_invalid_utf8(void **state) {
    (void)state;
    /* Regression: a cache_salt of 0xff 0xfe reached the metric labels and broke /metrics. */
    const unsigned char body[] = {0x81, 0xaa, 'c', 'a', 'c',  'h',  'e', '_',
                                  's',  'a',  'l', 't', 0xa2, 0xff, 0xfe};
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    struct dp_map m;
    struct dp_err err = {0};
    assert_int_equal(dp_decode(body, sizeof(body), &up, &m, &err), 0);
    char out[16];
    assert_int_equal(dp_cstr(&m, "cache_salt", 0, out, sizeof(out), &err), -1);
    assert_string_equal(err.code, DP_BAD_REQUEST);
    assert_non_null(strstr(err.message, "cache_salt"));
    msgpack_unpacked_destroy(&up);
}

/* ---- integer arrays read in place ---- */

static void pack_key(msgpack_packer *pk, const char *k) {
    msgpack_pack_str(pk, strlen(k));
    msgpack_pack_str_body(pk, k, strlen(k));
}

/* A token value of every plain form (fixint, uint8, uint16, uint32). */
static uint32_t token(uint32_t i) {
    static const uint32_t forms[] = {5, 200, 70000, 4000000000u, 127, 128, 65535, 65536};
    return forms[i % 8] + (i % 8 == 3 ? i : 0);
}

static void test_large_integer_arrays_are_read_in_place(void **state) {
    (void)state;
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 4);
    pack_key(&pk, "model_name");
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "m", 1);
    pack_key(&pk, "token_ids");
    msgpack_pack_array(&pk, 1000);
    for (uint32_t i = 0; i < 1000; i++) msgpack_pack_uint32(&pk, token(i));
    pack_key(&pk, "block_ids");
    msgpack_pack_array(&pk, 70);
    for (uint32_t i = 0; i < 70; i++) msgpack_pack_uint64(&pk, i * 3);
    pack_key(&pk, "start");
    msgpack_pack_int(&pk, 256);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    struct dp_map m;
    struct dp_err err = {0};
    assert_int_equal(dp_decode(sb.data, sb.size, &up, &m, &err), 0);
    assert_int_equal(m.nraw, 2);
    const msgpack_object *t = dp_get(&m, "token_ids");
    assert_non_null(t);
    assert_int_equal(t->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(t->via.array.size, 1000);
    uint32_t *v = NULL, n = 0;
    assert_int_equal(dp_u32_array(&m, "token_ids", 1, &v, &n, &err), 0);
    assert_int_equal(n, 1000);
    for (uint32_t i = 0; i < n; i++) assert_int_equal(v[i], token(i));
    free(v);
    /* converted by dp_decode and handed over: asked again, the bytes are read again */
    assert_null(dp_raw(&m, "token_ids")->vals);
    assert_int_equal(dp_u32_array(&m, "token_ids", 1, &v, &n, &err), 0);
    assert_int_equal(n, 1000);
    for (uint32_t i = 0; i < n; i++) assert_int_equal(v[i], token(i));
    uint32_t *again = malloc(1000 * sizeof(*again));
    assert_non_null(again);
    dp_raw_u32(dp_raw(&m, "token_ids"), again);
    assert_memory_equal(again, v, 1000 * sizeof(*v));
    free(again);
    free(v);
    const struct dp_rawarr *b = dp_raw(&m, "block_ids");
    assert_non_null(b);
    uint32_t ids[70];
    dp_raw_u32(b, ids);
    for (uint32_t i = 0; i < 70; i++) assert_int_equal(ids[i], i * 3);
    /* the other fields as before */
    char model[8];
    int64_t start = 0;
    assert_int_equal(dp_cstr(&m, "model_name", 1, model, sizeof(model), &err), 0);
    assert_string_equal(model, "m");
    assert_int_equal(dp_int(&m, "start", 1, 0, 1000, &start, &err), 0);
    assert_int_equal(start, 256);
    /* no element objects: dp_array says so instead of handing out none */
    const msgpack_object *arr;
    assert_int_equal(dp_array(&m, "block_ids", 1, &arr, &n, &err), -1);
    dp_map_free(&m);
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
}

/* Whatever the in-place reader does not take is decoded whole by msgpack-c, so its errors and
 * values stay what they were. */
static void test_unusual_arrays_are_decoded_whole(void **state) {
    (void)state;
    for (int which = 0; which < 6; which++) {
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, which == 3 ? 2 : 1);
        pack_key(&pk, "token_ids");
        uint32_t n = which == 0 ? DP_RAW_MIN - 1 : 100;
        msgpack_pack_array(&pk, n);
        for (uint32_t i = 0; i < n; i++) {
            if (i == 50 && which == 1)
                msgpack_pack_uint64(&pk, 1ULL << 33); /* does not fit */
            else if (i == 50 && which == 2)
                msgpack_pack_int(&pk, -1);
            else if (i == 50 && which == 4)
                msgpack_pack_str(&pk, 0);
            else
                msgpack_pack_uint32(&pk, i);
        }
        if (which == 3) { /* the key twice: msgpack-c's first one counts */
            pack_key(&pk, "token_ids");
            msgpack_pack_array(&pk, 0);
        }
        if (which == 5) msgpack_pack_nil(&pk); /* a trailing byte */
        msgpack_unpacked up;
        msgpack_unpacked_init(&up);
        struct dp_map m;
        struct dp_err err = {0};
        int rc = dp_decode(sb.data, sb.size, &up, &m, &err);
        if (which == 5) {
            assert_int_equal(rc, -1);
            assert_non_null(strstr(err.message, "trailing"));
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(m.nraw, 0);
            uint32_t *v = NULL, got = 0;
            rc = dp_u32_array(&m, "token_ids", 1, &v, &got, &err);
            if (which == 0 || which == 3) {
                assert_int_equal(rc, 0);
                assert_int_equal(got, n);
                free(v);
            } else {
                assert_int_equal(rc, -1);
                assert_non_null(strstr(err.message, "token_ids'[50]"));
            }
        }
        dp_map_free(&m);
        msgpack_unpacked_destroy(&up);
        msgpack_sbuffer_destroy(&sb);
    }
    /* A truncated array (the payload ends inside it) is refused. */
    unsigned char cut[3 + 9 + 3 + 70];
    size_t k = 0;
    cut[k++] = 0x81;
    cut[k++] = 0xa9;
    memcpy(cut + k, "token_ids", 9);
    k += 9;
    cut[k++] = 0xdc;
    cut[k++] = 0;
    cut[k++] = 100; /* 100 elements declared, 70 present */
    memset(cut + k, 1, 70);
    k += 70;
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    struct dp_map m;
    struct dp_err err = {0};
    assert_int_equal(dp_decode(cut, k, &up, &m, &err), -1);
    assert_string_equal(err.code, DP_BAD_REQUEST);
    dp_map_free(&m);
    msgpack_unpacked_destroy(&up);
}

/* Regression: a store_bytes payload (its chunks in the map) with token ids read in place had
 * all its other fields copied for msgpack-c, chunks included: a 256 MiB copy per request, 0.11
 * GB/s. A large rest is decoded whole, in place, the chunks referenced where they lie. */
static void test_large_other_fields_are_not_copied(void **state) {
    (void)state;
    for (int big = 0; big < 2; big++) {
        size_t chunk = big ? 2 * DP_RAW_REST_MAX : 1000;
        char *data = malloc(chunk);
        assert_non_null(data);
        memset(data, 0x5a, chunk);
        msgpack_sbuffer sb;
        msgpack_sbuffer_init(&sb);
        msgpack_packer pk;
        msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
        msgpack_pack_map(&pk, 2);
        pack_key(&pk, "token_ids");
        msgpack_pack_array(&pk, 256);
        for (uint32_t i = 0; i < 256; i++) msgpack_pack_uint32(&pk, token(i));
        pack_key(&pk, "chunks");
        msgpack_pack_array(&pk, 1);
        msgpack_pack_bin(&pk, chunk);
        msgpack_pack_bin_body(&pk, data, chunk);
        msgpack_unpacked up;
        msgpack_unpacked_init(&up);
        struct dp_map m;
        struct dp_err err = {0};
        assert_int_equal(dp_decode(sb.data, sb.size, &up, &m, &err), 0);
        assert_int_equal(m.nraw, big ? 0 : 1);
        assert_true(big ? m.rest == NULL : m.rest != NULL);
        const msgpack_object *c = dp_get(&m, "chunks");
        assert_non_null(c);
        assert_int_equal(c->via.array.size, 1);
        const msgpack_object_bin *bin = &c->via.array.ptr[0].via.bin;
        assert_int_equal(bin->size, chunk);
        assert_memory_equal(bin->ptr, data, chunk);
        if (big) /* where it lies in the payload */
            assert_true(bin->ptr > sb.data && bin->ptr + chunk <= sb.data + sb.size);
        uint32_t *v = NULL, n = 0;
        assert_int_equal(dp_u32_array(&m, "token_ids", 1, &v, &n, &err), 0);
        assert_int_equal(n, 256);
        for (uint32_t i = 0; i < n; i++) assert_int_equal(v[i], token(i));
        free(v);
        dp_map_free(&m);
        msgpack_unpacked_destroy(&up);
        msgpack_sbuffer_destroy(&sb);
        free(data);
    }
}

static int released;
static void count_release(void *data, void *hint) {
    (void)data;
    released += (int)(intptr_t)hint;
}

/* Frames a reply still owns (never handed to the socket) are released with it: each one's
 * callback runs once (an L1 reply pin would otherwise never be released). */
static void test_reply_free_releases_its_frames(void **state) {
    (void)state;
    struct dp_reply r;
    dp_reply_init(&r);
    assert_null(r.frames);
    assert_int_equal(r.nframes, 0);
    r.frames = calloc(2, sizeof(*r.frames));
    assert_non_null(r.frames);
    r.frames[0] = (struct dp_frame){NULL, 0, count_release, (void *)(intptr_t)1};
    r.frames[1] = (struct dp_frame){NULL, 0, count_release, (void *)(intptr_t)10};
    r.nframes = 2;
    released = 0;
    dp_reply_free(&r);
    assert_int_equal(released, 11);
    assert_null(r.frames);
    assert_int_equal(r.nframes, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_check_rejects_huge_declared_containers),
        cmocka_unit_test(test_fields_and_reply),
        cmocka_unit_test(test_text_check_accepts_utf8_text_only),
        cmocka_unit_test(test_str_field_rejects_invalid_utf8),
        cmocka_unit_test(test_reply_free_releases_its_frames),
        cmocka_unit_test(test_large_integer_arrays_are_read_in_place),
        cmocka_unit_test(test_unusual_arrays_are_decoded_whole),
        cmocka_unit_test(test_large_other_fields_are_not_copied),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
