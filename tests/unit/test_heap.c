/* base/heap: what malloc holds, the memory limit from cgroups, and the data plane's heap limit
 * derived from them (--max-heap-mb, config_max_heap_bytes). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/heap.h"
#include "server/config.h"

#define MIB (1ull << 20)

static void test_heap_follows_malloc_and_free(void **state) {
    (void)state;
    uint64_t before = heap_in_use();
    char *p = malloc(64 * MIB);
    assert_non_null(p);
    memset(p, 1, 64 * MIB);
    uint64_t during = heap_in_use();
    assert_true(during >= before + 64 * MIB - MIB);
    /* a crowd of small blocks, the shape of libzmq's frames, counts as well */
    enum { N = 100000 };
    void **small = malloc(N * sizeof(*small));
    assert_non_null(small);
    for (int i = 0; i < N; i++) assert_non_null(small[i] = malloc(48));
    assert_true(heap_in_use() >= during + N * 48ull);
    for (int i = 0; i < N; i++) free(small[i]);
    free(small);
    free(p);
    assert_true(heap_in_use() < during - 60 * MIB);
}

static char root[64];

static void put(const char *rel, const char *content) {
    char path[256];
    snprintf(path, sizeof(path), "%s%s", root, rel);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(content, f);
    fclose(f);
}

static void sub(const char *rel) {
    char path[256];
    snprintf(path, sizeof(path), "%s%s", root, rel);
    assert_int_equal(mkdir(path, 0700), 0);
}

static void test_cgroup_limit_is_the_lowest_on_the_path(void **state) {
    (void)state;
    snprintf(root, sizeof(root), "/tmp/lmc-heap-XXXXXX");
    assert_non_null(mkdtemp(root));
    sub("/a");
    sub("/a/b");
    sub("/a/b/c");
    put("/memory.max", "max\n");
    put("/a/memory.max", "1073741824\n");
    put("/a/b/memory.max", "max\n");
    /* a/b/c has no file: its ancestors count */
    assert_int_equal(heap_cgroup_limit(root, "/a/b/c", "memory.max"), 1073741824ull);
    assert_int_equal(heap_cgroup_limit(root, "/a/b/c/", "memory.max"), 1073741824ull);
    put("/a/b/c/memory.max", "536870912\n");
    assert_int_equal(heap_cgroup_limit(root, "/a/b/c", "memory.max"), 536870912ull);
    /* none set: the root only, "max", a missing file, a file that is not a number */
    assert_int_equal(heap_cgroup_limit(root, "/", "memory.max"), UINT64_MAX);
    assert_int_equal(heap_cgroup_limit(root, "/nope", "memory.max"), UINT64_MAX);
    put("/a/b/memory.max", "12x\n");
    put("/a/memory.max", "");
    put("/a/b/c/memory.max", "-5\n");
    assert_int_equal(heap_cgroup_limit(root, "/a/b/c", "memory.max"), UINT64_MAX);
    /* cgroup v1's "no limit" is a huge number, which the physical memory then caps */
    put("/a/memory.limit_in_bytes", "9223372036854771712\n");
    assert_int_equal(heap_cgroup_limit(root, "/a", "memory.limit_in_bytes"),
                     9223372036854771712ull);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", root);
    assert_int_equal(system(cmd), 0);
}

static void test_memory_limit_is_at_most_physical(void **state) {
    (void)state;
    uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t m = heap_memory_limit();
    assert_true(m > 0);
    assert_true(m <= phys);
}

static void test_config_max_heap_bytes(void **state) {
    (void)state;
    struct server_config cfg;
    char err[256];
    char *argv[] = {"server", "--l1-size-gb",  "1",  "--eviction-policy",
                    "LRU",    "--max-heap-mb", "300"};
    int rc = config_parse(&cfg, 7, argv, err, sizeof(err));
    if (rc) fprintf(stderr, "%s\n", err);
    assert_int_equal(rc, 0);
    assert_int_equal(config_max_heap_bytes(&cfg), 300 * MIB);
    cfg.max_heap_mb = 0; /* no limit */
    assert_int_equal(config_max_heap_bytes(&cfg), 0);
    /* -1 (the default): half of what L1 leaves, never below two worker queues and 256 MiB */
    cfg.max_heap_mb = -1;
    uint64_t mem = heap_memory_limit(), l1 = 1ull << 30;
    uint64_t floor = 2 * 256 * MIB + 256 * MIB;
    uint64_t want = mem > l1 && (mem - l1) / 2 > floor ? (mem - l1) / 2 : floor;
    assert_int_equal(config_max_heap_bytes(&cfg), want);
    cfg.l1_size_gb = (double)(mem >> 30) + 8; /* L1 larger than the memory: the floor */
    cfg.max_workers = 3;
    assert_int_equal(config_max_heap_bytes(&cfg), 3 * 2 * 256 * MIB + 256 * MIB);
    config_free(&cfg);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_heap_follows_malloc_and_free),
        cmocka_unit_test(test_cgroup_limit_is_the_lowest_on_the_path),
        cmocka_unit_test(test_memory_limit_is_at_most_physical),
        cmocka_unit_test(test_config_max_heap_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
