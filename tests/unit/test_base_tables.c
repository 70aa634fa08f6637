/* Unit tests for the table pieces of src/base: the intrusive hash table (htab), FNV-1a (hash.h)
 * and the JSON config-field readers (jfield). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/htab.h"
#include "base/jfield.h"

struct item {
    int v;
    struct htab_node hn;
};

#define ITEM(n) HTAB_ENTRY(n, struct item, hn)

/* No stored hash: recomputed from the value, as a table saving the bytes would do. */
static uint64_t item_hash_of(int v) { return fnv1a64(&v, sizeof(v)); }
static uint64_t item_hash(const struct htab_node *n, void *arg) {
    (*(int *)arg)++;
    return item_hash_of(ITEM(n)->v);
}

static struct item *find(struct htab *t, int v) {
    for (struct htab_node *n = *htab_bucket(t, item_hash_of(v)); n; n = n->next)
        if (ITEM(n)->v == v) return ITEM(n);
    return NULL;
}

static void test_htab_grows_and_keeps_every_entry(void **state) {
    (void)state;
    int calls = 0;
    struct htab t;
    assert_int_equal(htab_init(&t, 3, item_hash, &calls), 0);
    assert_int_equal(t.nb, 4); /* rounded up to a power of two */
    enum { N = 1000 };
    struct item *it = calloc(N, sizeof(*it));
    assert_non_null(it);
    for (int i = 0; i < N; i++) {
        it[i].v = i;
        htab_insert(&t, &it[i].hn, item_hash_of(i));
    }
    assert_int_equal(t.count, N);
    assert_true(t.nb >= N); /* load factor <= 1 after growth */
    assert_true(calls > 0);
    for (int i = 0; i < N; i++) assert_ptr_equal(find(&t, i), &it[i]);
    assert_null(find(&t, N));
    /* every node sits in the chain of its own hash */
    size_t seen = 0;
    for (size_t b = 0; b < t.nb; b++)
        for (struct htab_node *n = t.b[b]; n; n = n->next) {
            assert_int_equal(item_hash_of(ITEM(n)->v) & (t.nb - 1), b);
            seen++;
        }
    assert_int_equal(seen, N);
    for (int i = 0; i < N; i += 2) htab_remove(&t, &it[i].hn, item_hash_of(i));
    assert_int_equal(t.count, N / 2);
    for (int i = 0; i < N; i++) assert_true((find(&t, i) != NULL) == (i % 2 == 1));
    htab_fini(&t);
    assert_null(t.b);
    htab_fini(&t); /* harmless twice */
    free(it);
}

static void test_fnv1a_known_values(void **state) {
    (void)state;
    /* reference values of the FNV-1a specification */
    assert_int_equal(fnv1a32_str(""), 0x811c9dc5u);
    assert_int_equal(fnv1a32_str("a"), 0xe40c292cu);
    assert_int_equal(fnv1a32_str("foobar"), 0xbf9cf968u);
    assert_true(fnv1a64_str("") == 0xcbf29ce484222325ull);
    assert_true(fnv1a64_str("a") == 0xaf63dc4c8601ec8cull);
    assert_true(fnv1a64_str("foobar") == 0x85944171f73967e8ull);
    assert_int_equal(fnv1a32("foobar", 6), fnv1a32_str("foobar"));
    assert_true(fnv1a64_add(fnv1a64("foo", 3), "bar", 3) == fnv1a64_str("foobar"));
    assert_int_equal(fnv1a32_add(fnv1a32("fo", 2), "obar", 4), fnv1a32_str("foobar"));
}

static void test_jfield_readers(void **state) {
    (void)state;
    json_t *o = json_pack("{s:b, s:i, s:s, s:n, s:s, s:i}", "flag", 1, "n", 7, "s", "text", "nul",
                          "size", "2KiB", "zero", 0);
    char err[256];
    bool b = false;
    assert_int_equal(jfield_bool(o, "flag", &b, "t", err, sizeof(err)), 0);
    assert_true(b);
    bool d = true;
    assert_int_equal(jfield_bool(o, "absent", &d, "t", err, sizeof(err)), 0);
    assert_true(d); /* default kept */
    assert_int_equal(jfield_bool(o, "nul", &d, "t", err, sizeof(err)), 0);
    assert_true(d);
    assert_int_equal(jfield_bool(o, "n", &d, "who", err, sizeof(err)), -1);
    assert_string_equal(err, "who: \"n\" must be a boolean");
    long n = 3;
    assert_int_equal(jfield_int(o, "n", 1, 10, &n, "t", err, sizeof(err)), 0);
    assert_int_equal(n, 7);
    assert_int_equal(jfield_int(o, "n", 8, 10, &n, "who", err, sizeof(err)), -1);
    assert_string_equal(err, "who: \"n\" must be an integer in [8, 10]");
    assert_int_equal(jfield_int(o, "s", 0, 10, &n, "who", err, sizeof(err)), -1);
    char *s = NULL;
    assert_int_equal(jfield_str(o, "s", &s, "t", err, sizeof(err)), 0);
    assert_string_equal(s, "text");
    assert_int_equal(jfield_str(o, "n", &s, "who", err, sizeof(err)), -1);
    assert_string_equal(err, "who: \"n\" must be a string");
    assert_string_equal(s, "text");
    free(s);
    uint64_t sz = 0;
    assert_int_equal(jfield_size(json_object_get(o, "size"), "size", &sz, err, sizeof(err)), 0);
    assert_int_equal(sz, 2048);
    assert_int_equal(jfield_size(json_object_get(o, "n"), "size", &sz, err, sizeof(err)), 0);
    assert_int_equal(sz, 7);
    assert_int_equal(jfield_size(json_object_get(o, "zero"), "size", &sz, err, sizeof(err)), -2);
    assert_int_equal(jfield_size(json_object_get(o, "s"), "size", &sz, err, sizeof(err)), -2);
    assert_int_equal(jfield_size(json_object_get(o, "flag"), "size", &sz, err, sizeof(err)), -1);
    assert_int_equal(jfield_size(NULL, "size", &sz, err, sizeof(err)), -1);
    static const char *const all[] = {"flag", "n", "s", "nul", "size", "zero", NULL};
    static const char *const some[] = {"flag", "n", "s", "nul", "size", NULL};
    assert_null(jfield_unknown(o, all));
    assert_string_equal(jfield_unknown(o, some), "zero");
    json_decref(o);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_htab_grows_and_keeps_every_entry),
        cmocka_unit_test(test_fnv1a_known_values),
        cmocka_unit_test(test_jfield_readers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
