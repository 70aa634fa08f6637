/* The fleet listeners' placement-hash table (src/server/fleet/ptable.c): digests that share
 * their first 8 bytes (one chain) stay distinct, growth past the initial buckets keeps every
 * entry findable, removal unlinks only the one entry, ptable_each visits each entry once and
 * ptable_fini frees the owner entries (the sanitizer run checks nothing leaks). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/fleet/ptable.h"

struct owner {
    uint32_t tag;
    struct pt_entry pe; /* not first: PT_OWNER must honour the offset */
};

static void digest(uint8_t h[PT_HASH_LEN], uint32_t n, uint32_t salt) {
    memset(h, 0, PT_HASH_LEN);
    memcpy(h, &n, sizeof(n)); /* the table hash */
    memcpy(h + 28, &salt, sizeof(salt));
}

static struct owner *add(struct ptable *t, uint32_t n, uint32_t salt) {
    struct owner *o = calloc(1, sizeof(*o));
    assert_non_null(o);
    o->tag = n * 2 + salt;
    uint8_t h[PT_HASH_LEN];
    digest(h, n, salt);
    ptable_insert(t, &o->pe, h);
    return o;
}

static struct owner *find(struct ptable *t, uint32_t n, uint32_t salt) {
    uint8_t h[PT_HASH_LEN];
    digest(h, n, salt);
    struct pt_entry *p = ptable_find(t, h);
    return p ? PT_OWNER(p, struct owner, pe) : NULL;
}

static void count_one(struct pt_entry *p, void *arg) {
    uint64_t *sum = arg;
    sum[0]++;
    sum[1] += PT_OWNER(p, struct owner, pe)->tag;
}

static void test_same_table_hash_different_digest(void **state) {
    (void)state;
    struct ptable t;
    assert_int_equal(ptable_init(&t), 0);
    add(&t, 7, 0);
    add(&t, 7, 1);
    assert_int_equal(find(&t, 7, 0)->tag, 14);
    assert_int_equal(find(&t, 7, 1)->tag, 15);
    assert_null(find(&t, 7, 2));
    struct owner *o = find(&t, 7, 0);
    ptable_remove(&t, &o->pe);
    free(o);
    assert_null(find(&t, 7, 0));
    assert_int_equal(find(&t, 7, 1)->tag, 15);
    ptable_fini(&t, offsetof(struct owner, pe));
}

static void test_growth_each_and_fini(void **state) {
    (void)state;
    struct ptable t;
    assert_int_equal(ptable_init(&t), 0);
    const uint32_t n = 5000; /* several doublings past the 1024 initial buckets */
    uint64_t want = 0;
    for (uint32_t i = 0; i < n; i++) {
        add(&t, i, 0);
        want += i * 2;
    }
    for (uint32_t i = 0; i < n; i += 97) assert_int_equal(find(&t, i, 0)->tag, i * 2);
    for (uint32_t i = 0; i < n; i += 2) {
        struct owner *o = find(&t, i, 0);
        ptable_remove(&t, &o->pe);
        free(o);
        want -= i * 2;
    }
    uint64_t sum[2] = {0, 0};
    ptable_each(&t, count_one, sum);
    assert_int_equal(sum[0], n / 2);
    assert_int_equal(sum[1], want);
    assert_null(find(&t, 0, 0));
    assert_non_null(find(&t, 1, 0));
    ptable_fini(&t, offsetof(struct owner, pe));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_table_hash_different_digest),
        cmocka_unit_test(test_growth_each_and_fini),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
