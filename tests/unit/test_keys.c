/* Unit tests for server/keys: chunk-hash chain vectors, ObjectKey validation, kv_rank packing,
 * L2 object names and the intern table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "server/keys.h"

static void hex_of(const uint8_t *h, char *out) { keys_hex_encode(h, KEYS_HASH_LEN, out); }

/* Vectors computed independently with Python hashlib (see docs/architecture.md, L1 keys). */
static void test_chain_vectors(void **state) {
    (void)state;
    uint8_t seed[32], h[2][32];
    char hex[65];
    keys_default_seed(seed);
    hex_of(seed, hex);
    assert_string_equal(hex, "75523f49815e6fed62b3dd1b2a0c42256c63e9453f36780d87587233ada6211b");
    uint32_t toks[8] = {0, 1, 2, 3, 4, 5, 6, 0xdeadbeef};
    assert_int_equal(keys_prefix_hashes(seed, toks, 8, 4, h, 2), 2);
    hex_of(h[0], hex);
    assert_string_equal(hex, "123979a5f9c859984d66f467512a41c8e2c1e8bf462a08fe8e9bdab3f7b37077");
    hex_of(h[1], hex);
    assert_string_equal(hex, "d245920a7a4ffd27fe1467d407885c8712adcfa7f93ece778dd7868286dcae31");
    /* keys_chunk_hash is one step of the same chain. */
    uint8_t one[32];
    assert_int_equal(keys_chunk_hash(h[0], toks + 4, 4, one), 0);
    assert_memory_equal(one, h[1], 32);
}

static void test_chain_partial_chunks_ignored(void **state) {
    (void)state;
    uint8_t seed[32], h[4][32];
    char hex[65];
    keys_default_seed(seed);
    uint32_t toks[600];
    for (int i = 0; i < 600; i++) toks[i] = 1000 + (uint32_t)i;
    assert_int_equal(keys_prefix_hashes(seed, toks, 600, 256, h, 4), 2);
    hex_of(h[0], hex);
    assert_string_equal(hex, "58094779ed0264171db2972c10930e9bfabbbadeb15f5e200f6ddc313a5cb9ec");
    hex_of(h[1], hex);
    assert_string_equal(hex, "68f769af90ce028f50e74565e0715268e094b03773017158c90246990d85f473");
    assert_int_equal(keys_prefix_hashes(seed, toks, 255, 256, h, 4), 0);
    assert_int_equal(keys_prefix_hashes(seed, toks, 600, 256, h, 1), 1);
    assert_int_equal(keys_prefix_hashes(seed, toks, 600, 0, h, 4), -1);
    /* A different seed gives a different chain. */
    uint8_t seed2[32], g[1][32];
    keys_seed_from_string("other", seed2);
    assert_int_equal(keys_prefix_hashes(seed2, toks, 256, 256, g, 1), 1);
    assert_memory_not_equal(g[0], h[0], 32);
}

static void test_hex(void **state) {
    (void)state;
    uint8_t out[KEYS_HASH_MAX], n = 0;
    char err[KEYS_ERR_MAX];
    assert_int_equal(keys_hash_from_hex("aA", 2, out, &n, err, sizeof(err)), 0);
    assert_int_equal(n, 1);
    assert_int_equal(out[0], 0xaa);
    assert_int_equal(keys_hash_from_hex("", 0, out, &n, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "empty"));
    assert_int_equal(keys_hash_from_hex("abc", 3, out, &n, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "even"));
    assert_int_equal(keys_hash_from_hex("zz", 2, out, &n, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "non-hex"));
    char big[67];
    memset(big, 'a', 66);
    big[66] = 0;
    assert_int_equal(keys_hash_from_hex(big, 66, out, &n, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "at most 64"));
    assert_int_equal(keys_hash_from_hex(big, 64, out, &n, err, sizeof(err)), 0);
    assert_int_equal(n, 32);
    char enc[5];
    uint8_t raw[2] = {0x0f, 0xa0};
    keys_hex_encode(raw, 2, enc);
    assert_string_equal(enc, "0fa0");
}

static void test_kv_rank(void **state) {
    (void)state;
    uint32_t r;
    char err[KEYS_ERR_MAX];
    assert_int_equal(keys_kv_rank_pack(1, 0, &r, err, sizeof(err)), 0);
    assert_int_equal(r, 0x01000100);
    assert_int_equal(keys_kv_rank_pack(4, 2, &r, err, sizeof(err)), 0);
    assert_int_equal(r, 0x04020402);
    unsigned w, k;
    keys_kv_rank_unpack(r, &w, &k);
    assert_int_equal(w, 4);
    assert_int_equal(k, 2);
    assert_int_equal(keys_kv_rank_pack(0, 0, &r, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "world_size"));
    assert_int_equal(keys_kv_rank_pack(256, 0, &r, err, sizeof(err)), -1);
    assert_int_equal(keys_kv_rank_pack(4, 4, &r, err, sizeof(err)), -1);
    assert_non_null(strstr(err, "rank"));
    assert_int_equal(keys_kv_rank_pack(4, -1, &r, err, sizeof(err)), -1);
}

static int init(struct keys_object_key *k, const char *hash, const char *model, long long group,
                const char *salt, size_t salt_len, char *err) {
    return keys_object_key_init(k, hash, strlen(hash), model, strlen(model), 0x01000100, group,
                                salt, salt_len, err, KEYS_ERR_MAX);
}

static void test_object_key_validation(void **state) {
    (void)state;
    struct keys_object_key k;
    char err[KEYS_ERR_MAX];
    assert_int_equal(init(&k, "aa", "m", 0, "user-a", 6, err), 0);
    assert_string_equal(k.model_name, "m");
    assert_string_equal(k.cache_salt, "user-a");
    assert_int_equal(init(&k, "aa", "m", 0, NULL, 0, err), 0);
    assert_string_equal(k.cache_salt, "");

    assert_int_equal(init(&k, "aa", "org@model", 0, NULL, 0, err), -1);
    assert_non_null(strstr(err, "model_name must not contain '@'"));
    assert_int_equal(init(&k, "aa", "m", -1, NULL, 0, err), -1);
    assert_non_null(strstr(err, "object_group_id must be >= 0"));
    assert_int_equal(init(&k, "aa", "m", 1LL << 33, NULL, 0, err), -1);
    assert_non_null(strstr(err, "object_group_id"));
    assert_int_equal(init(&k, "xyz1", "m", 0, NULL, 0, err), -1);
    assert_non_null(strstr(err, "hex"));

    const char *bad[] = {"a@b", "a/b", "a\\b"};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(init(&k, "aa", "m", 0, bad[i], 3, err), -1);
        assert_non_null(strstr(err, "cache_salt must not contain"));
    }
    assert_int_equal(init(&k, "aa", "m", 0, "a\0b", 3, err), -1);
    assert_non_null(strstr(err, "NUL"));
    char salt[130];
    memset(salt, 's', 129);
    salt[129] = 0;
    assert_int_equal(init(&k, "aa", "m", 0, salt, 128, err), 0);
    assert_int_equal(init(&k, "aa", "m", 0, salt, 129, err), -1);
    assert_non_null(strstr(err, "at most 128"));
    /* Model names keep their '/'. */
    assert_int_equal(init(&k, "aa", "Qwen/Qwen3-8B", 0, NULL, 0, err), 0);
}

static void test_l2_names(void **state) {
    (void)state;
    struct keys_object_key k, p;
    char err[KEYS_ERR_MAX], name[KEYS_L2_NAME_MAX], again[KEYS_L2_NAME_MAX];
    assert_int_equal(init(&k, "3f9ae2", "Qwen/Qwen3-8B", 0, NULL, 0, err), 0);
    int len = keys_l2_name(&k, name, sizeof(name));
    assert_int_equal(len, (int)strlen(name));
    assert_string_equal(name, "Qwen/Qwen3-8B@01000100@0@3f9ae2");
    assert_int_equal(init(&k, "AB01", "m", 26, "user-a", 6, err), 0);
    keys_l2_name(&k, name, sizeof(name));
    assert_string_equal(name, "m@01000100@1a@ab01@user-a");
    /* Round trip, field by field. */
    assert_int_equal(keys_l2_name_parse(name, strlen(name), &p, err, sizeof(err)), 0);
    assert_memory_equal(&p, &k, sizeof(k));
    keys_l2_name(&p, again, sizeof(again));
    assert_string_equal(again, name);
    /* Full-length 32-byte hash and longest salt. */
    uint8_t seed[32];
    char hex[65];
    keys_default_seed(seed);
    keys_hex_encode(seed, 32, hex);
    char salt[129];
    memset(salt, 'z', 128);
    salt[128] = 0;
    assert_int_equal(init(&k, hex, "meta-llama/Llama-3.1-8B-Instruct", 7, salt, 128, err), 0);
    assert_true(keys_l2_name(&k, name, sizeof(name)) > 0);
    assert_int_equal(keys_l2_name_parse(name, strlen(name), &p, err, sizeof(err)), 0);
    assert_memory_equal(&p, &k, sizeof(k));
    /* Too small a buffer. */
    assert_int_equal(keys_l2_name(&k, name, 10), -1);

    const char *bad[] = {
        "m@01000100@0",            /* 3 fields */
        "m@01000100@0@aa@s@t",     /* 6 fields */
        "m@0100010@0@aa",          /* 7-digit rank */
        "m@0100010g@0@aa",         /* non-hex rank */
        "m@01000100@@aa",          /* empty group */
        "m@01000100@123456789@aa", /* 9-digit group */
        "m@01000100@0@a",          /* odd hash */
        "m@01000100@0@",           /* empty hash */
        "m@01000100@0@aa@",        /* empty salt field */
        "m@01000100@0@aa@a/b",     /* bad salt */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = 0;
        assert_int_equal(keys_l2_name_parse(bad[i], strlen(bad[i]), &p, err, sizeof(err)), -1);
        assert_true(strlen(err) > 0);
    }
}

static void test_intern(void **state) {
    (void)state;
    struct keys_intern *t = keys_intern_create(3);
    assert_non_null(t);
    uint32_t a, b, c, d;
    assert_int_equal(keys_intern(t, "", 0, &a, NULL), 0);
    assert_int_equal(keys_intern(t, "alice", 5, &b, NULL), 0);
    assert_int_equal(keys_intern(t, "alice", 5, &c, NULL), 0);
    assert_int_equal(a, 0);
    assert_int_equal(b, 1);
    assert_int_equal(c, 1);
    assert_int_equal(keys_intern_find(t, "bob", 3, &d, NULL), -1);
    assert_int_equal(keys_intern(t, "bob", 3, &d, NULL), 0);
    assert_int_equal(d, 2);
    assert_int_equal(keys_intern(t, "carol", 5, &d, NULL), -1); /* full */
    assert_int_equal(keys_intern_find(t, "alice", 5, &d, NULL), 0);
    assert_int_equal(d, 1);
    assert_string_equal(keys_intern_str(t, 0), "");
    assert_string_equal(keys_intern_str(t, 2), "bob");
    assert_null(keys_intern_str(t, 3));
    assert_int_equal(keys_intern_count(t), 3);
    keys_intern_destroy(t);
    assert_null(keys_intern_create(0));
}

static int next_rand(unsigned *seed) {
    *seed = *seed * 1103515245u + 12345u;
    return (int)((*seed >> 16) & 0x7fff);
}

/* Removal frees an id for reuse under a new generation, oldest removed first, and keeps every
 * other string findable (backward-shift deletion checked against a model). */
static void test_intern_remove_reuse(void **state) {
    (void)state;
    struct keys_intern *t = keys_intern_create(3);
    uint32_t id, gen;
    assert_int_equal(keys_intern(t, "a", 1, &id, &gen), 0);
    assert_int_equal(keys_intern(t, "b", 1, &id, &gen), 0);
    assert_int_equal(keys_intern(t, "c", 1, &id, &gen), 0);
    assert_int_equal(keys_intern(t, "d", 1, &id, &gen), -1); /* full */
    assert_int_equal(keys_intern_remove(t, 1), 0);
    assert_int_equal(keys_intern_remove(t, 1), -1);
    assert_int_equal(keys_intern_remove(t, 7), -1);
    assert_int_equal(keys_intern_remove(t, 0), 0);
    assert_null(keys_intern_str(t, 1));
    assert_int_equal(keys_intern_find(t, "b", 1, &id, &gen), -1);
    assert_int_equal(keys_intern_used(t), 1);
    assert_int_equal(keys_intern(t, "d", 1, &id, &gen), 0);
    assert_int_equal(id, 1); /* removed first, reused first */
    assert_int_equal(gen, 1);
    assert_int_equal(keys_intern(t, "b", 1, &id, &gen), 0);
    assert_int_equal(id, 0);
    assert_int_equal(gen, 1);
    assert_string_equal(keys_intern_str(t, 1), "d");
    assert_int_equal(keys_intern_count(t), 3);
    keys_intern_destroy(t);

    enum { N = 48, CAP = 32, OPS = 20000 };
    t = keys_intern_create(CAP);
    int model[N]; /* id + 1 of string i, 0 when absent */
    memset(model, 0, sizeof(model));
    unsigned seed = 1;
    uint32_t used = 0;
    for (int op = 0; op < OPS; op++) {
        int i = next_rand(&seed) % N;
        char s[8];
        int len = snprintf(s, sizeof(s), "s%d", i);
        if (next_rand(&seed) % 2) {
            int rc = keys_intern(t, s, (size_t)len, &id, NULL);
            if (model[i]) {
                assert_int_equal(rc, 0);
                assert_int_equal(id + 1, model[i]);
            } else if (used < CAP) {
                assert_int_equal(rc, 0);
                model[i] = (int)id + 1;
                used++;
            } else {
                assert_int_equal(rc, -1);
            }
        } else if (model[i]) {
            assert_int_equal(keys_intern_remove(t, (uint32_t)model[i] - 1), 0);
            model[i] = 0;
            used--;
        }
        int j = next_rand(&seed) % N;
        len = snprintf(s, sizeof(s), "s%d", j);
        int rc = keys_intern_find(t, s, (size_t)len, &id, NULL);
        assert_int_equal(rc, model[j] ? 0 : -1);
        if (model[j]) assert_int_equal(id + 1, model[j]);
    }
    assert_int_equal(keys_intern_used(t), used);
    keys_intern_destroy(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chain_vectors),
        cmocka_unit_test(test_chain_partial_chunks_ignored),
        cmocka_unit_test(test_hex),
        cmocka_unit_test(test_kv_rank),
        cmocka_unit_test(test_object_key_validation),
        cmocka_unit_test(test_l2_names),
        cmocka_unit_test(test_intern),
        cmocka_unit_test(test_intern_remove_reuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
