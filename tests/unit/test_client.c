/* Unit tests for liblmcache-client's pure logic: the msgpack request encoder, the reply decoder,
 * error-code mapping, request ids and the KV layout arithmetic. No sockets. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "client/client_codec.h"

/* Decodes a finished lmcc_map into `up`; returns the map object. */
static const msgpack_object *decode(struct lmcc_map *m, msgpack_unpacked *up) {
    assert_int_equal(lmcc_map_finish(m), 0);
    size_t off = 0;
    msgpack_unpacked_init(up);
    assert_int_equal(msgpack_unpack_next(up, m->buf.data, m->buf.size, &off),
                     MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, m->buf.size);
    assert_int_equal(up->data.type, MSGPACK_OBJECT_MAP);
    return &up->data;
}

static void assert_str_field(const msgpack_object *map, const char *k, const char *v) {
    const msgpack_object *o = lmcc_map_get(map, k);
    assert_non_null(o);
    assert_int_equal(o->type, MSGPACK_OBJECT_STR);
    assert_int_equal(o->via.str.size, strlen(v));
    assert_memory_equal(o->via.str.ptr, v, strlen(v));
}

static void assert_int_field(const msgpack_object *map, const char *k, int64_t v) {
    const msgpack_object *o = lmcc_map_get(map, k);
    assert_non_null(o);
    if (v >= 0) {
        assert_int_equal(o->type, MSGPACK_OBJECT_POSITIVE_INTEGER);
        assert_int_equal(o->via.u64, (uint64_t)v);
    } else {
        assert_int_equal(o->type, MSGPACK_OBJECT_NEGATIVE_INTEGER);
        assert_int_equal(o->via.i64, v);
    }
}

static void test_empty_map(void **state) {
    (void)state;
    struct lmcc_map m;
    lmcc_map_init(&m);
    msgpack_unpacked up;
    const msgpack_object *map = decode(&m, &up);
    assert_int_equal(map->via.map.size, 0);
    msgpack_unpacked_destroy(&up);
    lmcc_map_destroy(&m);
}

static void test_scalar_fields(void **state) {
    (void)state;
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_str(&m, "request_id", "req-1");
    lmcc_put_int(&m, "instance_id", 7);
    lmcc_put_int(&m, "neg", -3);
    lmcc_put_int(&m, "big", (int64_t)1 << 40);
    lmcc_put_bool(&m, "flag", true);
    int64_t ids[3] = {0, 5, 70000};
    lmcc_put_i64_array(&m, "block_ids", ids, 3);
    msgpack_unpacked up;
    const msgpack_object *map = decode(&m, &up);
    assert_int_equal(map->via.map.size, 6);
    assert_str_field(map, "request_id", "req-1");
    assert_int_field(map, "instance_id", 7);
    assert_int_field(map, "neg", -3);
    assert_int_field(map, "big", (int64_t)1 << 40);
    const msgpack_object *f = lmcc_map_get(map, "flag");
    assert_non_null(f);
    assert_int_equal(f->type, MSGPACK_OBJECT_BOOLEAN);
    assert_true(f->via.boolean);
    const msgpack_object *a = lmcc_map_get(map, "block_ids");
    assert_non_null(a);
    assert_int_equal(a->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(a->via.array.size, 3);
    assert_int_equal(a->via.array.ptr[2].via.u64, 70000);
    assert_null(lmcc_map_get(map, "absent"));
    msgpack_unpacked_destroy(&up);
    lmcc_map_destroy(&m);
}

/* token_ids are written without the packer: byte for byte what msgpack_pack_uint32 writes, for
 * every form (fixint, uint8, uint16, uint32) and across the buffer's growth. */
static void test_token_ids_encoding_matches_the_packer(void **state) {
    (void)state;
    enum { N = 40000 };
    uint32_t *v = malloc(N * sizeof(*v));
    assert_non_null(v);
    const uint32_t edges[] = {0, 1, 127, 128, 255, 256, 65535, 65536, 0xffffffffu, 0x12345678};
    for (uint32_t i = 0; i < N; i++)
        v[i] = i < 10 ? edges[i] : (uint32_t)(i * 2654435761u) >> (i % 32);
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_u32_array(&m, "token_ids", v, N);
    assert_int_equal(m.failed, 0);
    msgpack_sbuffer ref;
    msgpack_sbuffer_init(&ref);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &ref, msgpack_sbuffer_write);
    static const char hdr[5] = {(char)0xdf, 0, 0, 0, 0};
    msgpack_sbuffer_write(&ref, hdr, sizeof(hdr));
    msgpack_pack_str(&pk, 9);
    msgpack_pack_str_body(&pk, "token_ids", 9);
    msgpack_pack_array(&pk, N);
    for (uint32_t i = 0; i < N; i++) msgpack_pack_uint32(&pk, v[i]);
    assert_int_equal(m.buf.size, ref.size);
    assert_memory_equal(m.buf.data, ref.data, ref.size);
    msgpack_sbuffer_destroy(&ref);
    lmcc_map_destroy(&m);
    free(v);
}

static void test_chunks_tokens(void **state) {
    (void)state;
    uint32_t toks[4] = {1, 2, 0xdeadbeef, 4};
    lmc_chunks ch = {
        .token_ids = toks, .num_tokens = 4, .start = 256, .end = 512, .cache_salt = "alice"};
    struct lmcc_map m;
    lmc_error e;
    lmcc_map_init(&m);
    assert_int_equal(lmcc_put_chunks(&m, &ch, &e), LMC_OK);
    msgpack_unpacked up;
    const msgpack_object *map = decode(&m, &up);
    const msgpack_object *t = lmcc_map_get(map, "token_ids");
    assert_non_null(t);
    assert_int_equal(t->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(t->via.array.size, 4);
    assert_int_equal(t->via.array.ptr[2].via.u64, 0xdeadbeefu);
    assert_int_field(map, "start", 256);
    assert_int_field(map, "end", 512);
    assert_str_field(map, "cache_salt", "alice");
    assert_null(lmcc_map_get(map, "chunk_hashes"));
    msgpack_unpacked_destroy(&up);
    lmcc_map_destroy(&m);
}

static void test_chunks_defaults_omitted(void **state) {
    (void)state;
    uint32_t toks[1] = {9};
    lmc_chunks ch = {.token_ids = toks, .num_tokens = 1, .end = -1};
    struct lmcc_map m;
    lmcc_map_init(&m);
    assert_int_equal(lmcc_put_chunks(&m, &ch, NULL), LMC_OK);
    msgpack_unpacked up;
    const msgpack_object *map = decode(&m, &up);
    assert_int_equal(map->via.map.size, 1);
    msgpack_unpacked_destroy(&up);
    lmcc_map_destroy(&m);
}

static void test_chunks_hashes(void **state) {
    (void)state;
    uint8_t h[2 * 32];
    for (int i = 0; i < 64; i++) h[i] = (uint8_t)i;
    lmc_chunks ch = {.chunk_hashes = h, .num_chunk_hashes = 2, .hash_len = 32, .end = -1};
    struct lmcc_map m;
    lmcc_map_init(&m);
    assert_int_equal(lmcc_put_chunks(&m, &ch, NULL), LMC_OK);
    msgpack_unpacked up;
    const msgpack_object *map = decode(&m, &up);
    const msgpack_object *a = lmcc_map_get(map, "chunk_hashes");
    assert_non_null(a);
    assert_int_equal(a->via.array.size, 2);
    assert_int_equal(a->via.array.ptr[1].type, MSGPACK_OBJECT_BIN);
    assert_int_equal(a->via.array.ptr[1].via.bin.size, 32);
    assert_memory_equal(a->via.array.ptr[1].via.bin.ptr, h + 32, 32);
    msgpack_unpacked_destroy(&up);
    lmcc_map_destroy(&m);
}

static void test_chunks_invalid(void **state) {
    (void)state;
    uint32_t toks[1] = {1};
    uint8_t h[32] = {0};
    lmc_error e;
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmc_chunks neither = {.end = -1};
    assert_int_equal(lmcc_put_chunks(&m, &neither, &e), LMC_ERR_INVALID_ARGUMENT);
    assert_string_equal(e.code, "invalid_argument");
    lmc_chunks both = {.token_ids = toks,
                       .num_tokens = 1,
                       .chunk_hashes = h,
                       .num_chunk_hashes = 1,
                       .hash_len = 32};
    assert_int_equal(lmcc_put_chunks(&m, &both, &e), LMC_ERR_INVALID_ARGUMENT);
    lmc_chunks long_hash = {.chunk_hashes = h, .num_chunk_hashes = 1, .hash_len = 33};
    assert_int_equal(lmcc_put_chunks(&m, &long_hash, &e), LMC_ERR_INVALID_ARGUMENT);
    assert_int_equal(lmcc_put_chunks(&m, NULL, &e), LMC_ERR_INVALID_ARGUMENT);
    lmcc_map_destroy(&m);
}

static void test_layout_fields(void **state) {
    (void)state;
    lmc_kv_layout l = {.num_layers = 32,
                       .num_blocks = 100,
                       .tokens_per_block = 16,
                       .bytes_per_token = 2048,
                       .block_order = LMC_BLOCK_MAJOR,
                       .dtype = "bfloat16"};
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_layout(&m, &l);
    msgpack_unpacked up;
    const msgpack_object *map = decode(&m, &up);
    assert_int_field(map, "num_layers", 32);
    assert_int_field(map, "num_blocks", 100);
    assert_int_field(map, "tokens_per_block", 16);
    assert_int_field(map, "bytes_per_token", 2048);
    assert_int_field(map, "kv_count", 2); /* 0 means 2 */
    assert_str_field(map, "block_order", "block_major");
    assert_str_field(map, "dtype", "bfloat16");
    msgpack_unpacked_destroy(&up);
    lmcc_map_destroy(&m);
}

/* Packs a reply map from (key, kind, value) triples with msgpack directly. */
static void pack_reply(msgpack_sbuffer *sb, bool ok, const char *code, const char *message) {
    msgpack_packer pk;
    msgpack_sbuffer_init(sb);
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, code ? 3 : 1);
    msgpack_pack_str_with_body(&pk, "ok", 2);
    if (ok)
        msgpack_pack_true(&pk);
    else
        msgpack_pack_false(&pk);
    if (code) {
        msgpack_pack_str_with_body(&pk, "code", 4);
        msgpack_pack_str_with_body(&pk, code, strlen(code));
        msgpack_pack_str_with_body(&pk, "message", 7);
        msgpack_pack_str_with_body(&pk, message, strlen(message));
    }
}

static void test_decode_ok(void **state) {
    (void)state;
    msgpack_sbuffer sb;
    pack_reply(&sb, true, NULL, NULL);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    const msgpack_object *map;
    lmc_error e;
    assert_int_equal(lmcc_decode_reply(sb.data, sb.size, &up, &map, &e), LMC_OK);
    assert_int_equal(lmcc_reply_error(map, &e), LMC_OK);
    assert_int_equal(e.status, LMC_OK);
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
}

static void test_decode_malformed(void **state) {
    (void)state;
    msgpack_unpacked up;
    const msgpack_object *map;
    lmc_error e;
    /* Not msgpack at all (0xc1 is never used). */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\xc1", 1, &up, &map, &e), LMC_ERR_PROTOCOL);
    msgpack_unpacked_destroy(&up);
    /* A msgpack array, not a map. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\x90", 1, &up, &map, &e), LMC_ERR_PROTOCOL);
    assert_string_equal(e.code, "protocol");
    msgpack_unpacked_destroy(&up);
    /* An empty map: no ok. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\x80", 1, &up, &map, &e), LMC_ERR_PROTOCOL);
    msgpack_unpacked_destroy(&up);
    /* {ok: 1}: ok must be a boolean. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\x81\xa2ok\x01", 5, &up, &map, &e), LMC_ERR_PROTOCOL);
    msgpack_unpacked_destroy(&up);
    /* Trailing bytes after the map. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\x81\xa2ok\xc3\x00", 6, &up, &map, &e), LMC_ERR_PROTOCOL);
    msgpack_unpacked_destroy(&up);
    /* Truncated. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\x81\xa2o", 3, &up, &map, &e), LMC_ERR_PROTOCOL);
    msgpack_unpacked_destroy(&up);
    /* Empty frame. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("", 0, &up, &map, &e), LMC_ERR_PROTOCOL);
    msgpack_unpacked_destroy(&up);
}

static void test_structure_check(void **state) {
    (void)state;
    /* Counts the bytes cannot back are rejected before msgpack-c allocates for them. */
    assert_int_equal(lmcc_check_structure("\xdf\xff\xff\xff\xff", 5), -1);
    assert_int_equal(lmcc_check_structure("\xdd\x7f\xff\xff\xff\x01", 6), -1);
    assert_int_equal(lmcc_check_structure("\x91\xdd\x00\x01\x00\x00\x01", 7), -1);
    assert_int_equal(lmcc_check_structure("\xc6\xff\xff\xff\xff", 5), -1);
    assert_int_equal(lmcc_check_structure("\xd9\x03"
                                          "ab",
                                          4),
                     -1);
    assert_int_equal(lmcc_check_structure("\xcf\x00", 2), -1);
    assert_int_equal(lmcc_check_structure("\xc1", 1), -1);
    assert_int_equal(lmcc_check_structure("", 0), -1);
    assert_int_equal(lmcc_check_structure("\xc3\xc3", 2), -1); /* two objects */
    /* Well-formed objects of every family pass. */
    assert_int_equal(lmcc_check_structure("\x80", 1), 0);
    assert_int_equal(lmcc_check_structure("\xdf\x00\x00\x00\x01\xa2ok\xc3", 9), 0);
    assert_int_equal(lmcc_check_structure("\x92\x91\x90\xcb\0\0\0\0\0\0\0\0", 12), 0);
    assert_int_equal(lmcc_check_structure("\xc4\x02xy", 4), 0);
    assert_int_equal(lmcc_check_structure("\xd6\x01\0\0\0\0", 6), 0);
    assert_int_equal(lmcc_check_structure("\xc7\x02\x05"
                                          "ab",
                                          5),
                     0);
    /* Whatever the encoder writes passes. */
    struct lmcc_map m;
    lmcc_map_init(&m);
    uint32_t toks[3] = {1, 70000, 0xffffffffu};
    lmc_chunks ch = {.token_ids = toks, .num_tokens = 3, .start = 0, .end = -1, .cache_salt = "s"};
    assert_int_equal(lmcc_put_chunks(&m, &ch, NULL), LMC_OK);
    lmcc_put_int(&m, "neg", -70000);
    lmcc_put_bool(&m, "b", false);
    assert_int_equal(lmcc_map_finish(&m), 0);
    assert_int_equal(lmcc_check_structure(m.buf.data, m.buf.size), 0);
    assert_int_equal(lmcc_check_structure(m.buf.data, m.buf.size - 1), -1);
    lmcc_map_destroy(&m);
}

static void test_error_mapping(void **state) {
    (void)state;
    static const struct {
        const char *code;
        lmc_status s;
    } rows[] = {
        {"bad_request", LMC_ERR_BAD_REQUEST},
        {"unknown_operation", LMC_ERR_UNKNOWN_OPERATION},
        {"too_large", LMC_ERR_TOO_LARGE},
        {"not_registered", LMC_ERR_NOT_REGISTERED},
        {"invalid_blocks", LMC_ERR_INVALID_BLOCKS},
        {"not_found", LMC_ERR_NOT_FOUND},
        {"out_of_memory", LMC_ERR_OUT_OF_MEMORY},
        {"shm_error", LMC_ERR_SHM_ERROR},
        {"internal", LMC_ERR_INTERNAL},
    };
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        msgpack_sbuffer sb;
        pack_reply(&sb, false, rows[i].code, "why it failed");
        msgpack_unpacked up;
        msgpack_unpacked_init(&up);
        const msgpack_object *map;
        lmc_error e;
        assert_int_equal(lmcc_decode_reply(sb.data, sb.size, &up, &map, &e), LMC_OK);
        assert_int_equal(lmcc_reply_error(map, &e), rows[i].s);
        assert_int_equal(e.status, rows[i].s);
        assert_string_equal(e.code, rows[i].code);
        assert_string_equal(e.message, "why it failed");
        assert_string_equal(lmc_status_name(rows[i].s), rows[i].code);
        assert_int_equal(lmc_status_from_code(rows[i].code, strlen(rows[i].code)), rows[i].s);
        msgpack_unpacked_destroy(&up);
        msgpack_sbuffer_destroy(&sb);
    }
}

static void test_error_unknown_code_and_long_message(void **state) {
    (void)state;
    char longmsg[1000];
    memset(longmsg, 'x', sizeof(longmsg) - 1);
    longmsg[sizeof(longmsg) - 1] = '\0';
    msgpack_sbuffer sb;
    pack_reply(&sb, false, "brand_new_code", longmsg);
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    const msgpack_object *map;
    lmc_error e;
    assert_int_equal(lmcc_decode_reply(sb.data, sb.size, &up, &map, &e), LMC_OK);
    assert_int_equal(lmcc_reply_error(map, &e), LMC_ERR_SERVER_OTHER);
    assert_string_equal(e.code, "brand_new_code");
    assert_int_equal(strlen(e.message), sizeof(e.message) - 1);
    msgpack_unpacked_destroy(&up);
    msgpack_sbuffer_destroy(&sb);
    /* ok=false without code or message still maps to an error. */
    msgpack_unpacked_init(&up);
    assert_int_equal(lmcc_decode_reply("\x81\xa2ok\xc2", 5, &up, &map, &e), LMC_OK);
    assert_int_equal(lmcc_reply_error(map, &e), LMC_ERR_SERVER_OTHER);
    msgpack_unpacked_destroy(&up);
    /* A NULL err is allowed everywhere. */
    assert_int_equal(lmcc_reply_error(map, NULL), LMC_ERR_SERVER_OTHER);
}

static void test_status_names(void **state) {
    (void)state;
    assert_string_equal(lmc_status_name(LMC_OK), "ok");
    assert_string_equal(lmc_status_name(LMC_ERR_TIMEOUT), "timeout");
    assert_string_equal(lmc_status_name(LMC_ERR_SYSTEM), "system");
    assert_string_equal(lmc_status_name((lmc_status)999), "unknown");
    assert_int_equal(lmc_status_from_code("timeout", 7), LMC_ERR_SERVER_OTHER);
    assert_int_equal(lmc_status_from_code("not_found_x", 9), LMC_ERR_NOT_FOUND);
}

static void test_parse_id(void **state) {
    (void)state;
    assert_int_equal(lmcc_parse_id("1", 1), 1);
    assert_int_equal(lmcc_parse_id("18446744073709551615", 20), UINT64_MAX);
    assert_int_equal(lmcc_parse_id("18446744073709551616", 20), 0);
    assert_int_equal(lmcc_parse_id("", 0), 0);
    assert_int_equal(lmcc_parse_id("12a", 3), 0);
    assert_int_equal(lmcc_parse_id("-1", 2), 0);
}

static void test_layout_math(void **state) {
    (void)state;
    lmc_kv_layout l = {.num_layers = 4,
                       .num_blocks = 10,
                       .tokens_per_block = 16,
                       .bytes_per_token = 256,
                       .kv_count = 2};
    uint64_t bb = 16 * 256;
    assert_int_equal(lmc_kv_block_bytes(&l), bb);
    assert_int_equal(lmc_kv_total_bytes(&l), 4 * 2 * 10 * bb);
    /* layer_major: ((l*kv + k)*blocks + b)*bb + t*bpt */
    assert_int_equal(lmc_kv_offset(&l, 1, 1, 3, 2), ((1 * 2 + 1) * 10 + 3) * bb + 2 * 256);
    l.block_order = LMC_BLOCK_MAJOR;
    /* block_major: ((b*layers + l)*kv + k)*bb + t*bpt */
    assert_int_equal(lmc_kv_offset(&l, 1, 1, 3, 2), ((3 * 4 + 1) * 2 + 1) * bb + 2 * 256);
    l.kv_count = 1;
    assert_int_equal(lmc_kv_total_bytes(&l), 4 * 10 * bb);
    l.kv_count = 3;
    assert_int_equal(lmc_kv_total_bytes(&l), 0);
    l.kv_count = 2;
    l.num_blocks = 0;
    assert_int_equal(lmc_kv_total_bytes(&l), 0);
    lmc_kv_layout huge = {.num_layers = UINT32_MAX,
                          .num_blocks = UINT32_MAX,
                          .tokens_per_block = UINT32_MAX,
                          .bytes_per_token = UINT64_MAX / 2};
    assert_int_equal(lmc_kv_block_bytes(&huge), 0);
    huge.bytes_per_token = 1;
    assert_int_equal(lmc_kv_total_bytes(&huge), 0);
}

static void test_connect_arguments(void **state) {
    (void)state;
    lmc_client *c = NULL;
    lmc_error e;
    assert_int_equal(lmc_client_connect(NULL, 5555, NULL, &c, &e), LMC_ERR_INVALID_ARGUMENT);
    assert_int_equal(lmc_client_connect("127.0.0.1", 0, NULL, &c, &e), LMC_ERR_INVALID_ARGUMENT);
    assert_int_equal(lmc_client_connect_endpoint("nonsense://x", NULL, &c, &e), LMC_ERR_TRANSPORT);
    assert_string_equal(e.code, "transport");
    assert_null(c);
    lmc_client_close(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty_map),
        cmocka_unit_test(test_scalar_fields),
        cmocka_unit_test(test_chunks_tokens),
        cmocka_unit_test(test_token_ids_encoding_matches_the_packer),
        cmocka_unit_test(test_chunks_defaults_omitted),
        cmocka_unit_test(test_chunks_hashes),
        cmocka_unit_test(test_chunks_invalid),
        cmocka_unit_test(test_layout_fields),
        cmocka_unit_test(test_decode_ok),
        cmocka_unit_test(test_decode_malformed),
        cmocka_unit_test(test_structure_check),
        cmocka_unit_test(test_error_mapping),
        cmocka_unit_test(test_error_unknown_code_and_long_message),
        cmocka_unit_test(test_status_names),
        cmocka_unit_test(test_parse_id),
        cmocka_unit_test(test_layout_math),
        cmocka_unit_test(test_connect_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
