/* Unit tests for server/fleethash: the placement-hash recipe against the test vectors shared
 * with the Python module (python/lmcache_fleet/vectors.json). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "base/fleethash.h"
#include "server/keys.h"

/* The vectors file, found from this source file's path. */
static json_t *load_vectors(void) {
    char path[4096];
    snprintf(path, sizeof(path), "%s", __FILE__);
    char *cut = strstr(path, "tests/unit/test_fleethash.c");
    assert_non_null(cut);
    snprintf(cut, sizeof(path) - (size_t)(cut - path), "python/lmcache_fleet/vectors.json");
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j) fail_msg("%s: %s", path, je.text);
    return j;
}

static void test_shared_vectors(void **state) {
    (void)state;
    json_t *j = load_vectors();
    json_t *vs = json_object_get(j, "vectors");
    assert_true(json_array_size(vs) >= 3);
    uint8_t seed[KEYS_HASH_LEN];
    keys_default_seed(seed);
    size_t i;
    json_t *v;
    json_array_foreach(vs, i, v) {
        json_t *toks = json_object_get(v, "token_ids");
        uint32_t t[256];
        size_t nt = json_array_size(toks);
        assert_true(nt <= 256);
        for (size_t k = 0; k < nt; k++)
            t[k] = (uint32_t)json_integer_value(json_array_get(toks, k));
        uint8_t h[16][KEYS_HASH_LEN];
        long n = keys_prefix_hashes(
            seed, t, nt, (size_t)json_integer_value(json_object_get(v, "chunk_size")), h, 16);
        json_t *want = json_object_get(v, "placements");
        assert_int_equal(n, json_array_size(want));
        /* the master's copy of the chain agrees with the server's */
        uint8_t h2[16][FLEETHASH_LEN];
        assert_int_equal(
            fleethash_chunks(KEYS_DEFAULT_SEED_STRING, t, nt,
                             (size_t)json_integer_value(json_object_get(v, "chunk_size")), h2, 16),
            n);
        assert_memory_equal(h, h2, (size_t)n * FLEETHASH_LEN);
        uint32_t rank;
        assert_int_equal(keys_kv_rank_pack(json_integer_value(json_object_get(v, "world_size")),
                                           json_integer_value(json_object_get(v, "rank")), &rank,
                                           NULL, 0),
                         0);
        for (long c = 0; c < n; c++) {
            uint8_t p[FLEETHASH_LEN];
            char hex[FLEETHASH_HEX_LEN + 1];
            assert_int_equal(fleethash_compute(json_string_value(json_object_get(v, "model_name")),
                                               json_string_value(json_object_get(v, "cache_salt")),
                                               rank, h[c], KEYS_HASH_LEN, p),
                             0);
            keys_hex_encode(p, FLEETHASH_LEN, hex);
            assert_string_equal(hex, json_string_value(json_array_get(want, (size_t)c)));
        }
    }
    json_decref(j);
}

static void test_one_vector_inline(void **state) {
    (void)state;
    uint8_t chunk[32], p[FLEETHASH_LEN];
    char hex[FLEETHASH_HEX_LEN + 1];
    for (int i = 0; i < 32; i++) chunk[i] = (uint8_t)i;
    assert_int_equal(fleethash_compute("m", "", 0x01000100, chunk, 32, p), 0);
    keys_hex_encode(p, FLEETHASH_LEN, hex);
    assert_string_equal(hex, "47c444583894c818c55e82694cdecad9e4f2e4c084a03b4c85b1f6373b3be27f");
    /* another salt, another placement */
    uint8_t q[FLEETHASH_LEN];
    assert_int_equal(fleethash_compute("m", "a", 0x01000100, chunk, 32, q), 0);
    assert_memory_not_equal(p, q, FLEETHASH_LEN);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shared_vectors),
        cmocka_unit_test(test_one_vector_inline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
