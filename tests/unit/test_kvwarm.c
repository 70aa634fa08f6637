/* Unit tests for the `kv-warm` thread (src/server/kvwarm.c): only pages the shared-memory object
 * holds are faulted in (a registration allocates nothing on the client's behalf), an object that
 * shrinks before or during the warm-up fails it without a SIGBUS, and registrations are warmed
 * after kvreg_register returned, in the background. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "server/kvctx.h"

#define PG 4096u

/* Pages of [p, p + len) in memory, as the kernel reports them through another mapping. */
static size_t resident_pages(const void *p, size_t len) {
    size_t n = len / PG, count = 0;
    unsigned char *vec = malloc(n);
    assert_non_null(vec);
    assert_int_equal(mincore((void *)p, len, vec), 0);
    for (size_t i = 0; i < n; i++) count += vec[i] & 1;
    free(vec);
    return count;
}

static struct kv_context ctx_over(unsigned char *base, size_t size) {
    struct kv_context c;
    memset(&c, 0, sizeof(c));
    c.base = base;
    c.map_size = size;
    return c;
}

static void test_only_the_pages_the_object_holds(void **state) {
    (void)state;
    assert_int_equal(kv_guard_init(), 0);
    const size_t npages = 256, size = npages * PG;
    int fd = memfd_create("kvwarm", 0);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    unsigned char *owner = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(owner != MAP_FAILED);
    /* The owner wrote pages 0-3, 100 and 255 (the rest of the object is a hole). */
    for (size_t i = 0; i < 4; i++) owner[i * PG] = (unsigned char)(i + 1);
    owner[100 * PG + 7] = 42;
    owner[255 * PG + PG - 1] = 43;
    unsigned char *daemon = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(daemon != MAP_FAILED);
    struct kv_context c = ctx_over(daemon, size);
    uint64_t warmed = 0;
    assert_int_equal(kv_warm_range(&c, 0, size, 0, &warmed), 0);
    assert_int_equal(warmed, 6 * PG);
    /* Nothing was allocated: the object still holds six pages, with their contents. */
    assert_int_equal(resident_pages(owner, size), 6);
    assert_int_equal(daemon[100 * PG + 7], 42);
    assert_int_equal(daemon[255 * PG + PG - 1], 43);
    assert_int_equal(daemon[3 * PG], 4);
    /* A range past the mapping, and a range cut at its end. */
    warmed = 0;
    assert_int_equal(kv_warm_range(&c, size, PG, 0, &warmed), 0);
    assert_int_equal(warmed, 0);
    assert_int_equal(kv_warm_range(&c, 250 * PG, 64 * PG, 0, &warmed), 0);
    assert_int_equal(warmed, PG);
    munmap(daemon, size);
    munmap(owner, size);
    close(fd);
}

/* tmpfs reports pages allocated by fallocate but never written as absent: an object the owner
 * allocated whole is faulted in whole (the caller checked its allocated size), allocating
 * nothing more. */
static void test_a_fully_allocated_object_is_faulted_in_whole(void **state) {
    (void)state;
    assert_int_equal(kv_guard_init(), 0);
    const size_t size = 256 * PG;
    int fd = memfd_create("kvwarm", 0);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    assert_int_equal(posix_fallocate(fd, 0, (off_t)size), 0);
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    const blkcnt_t blocks = st.st_blocks;
    assert_true((uint64_t)blocks * 512 >= size);
    unsigned char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    assert_int_equal(resident_pages(m, size), 0); /* allocated, and reported absent */
    struct kv_context c = ctx_over(m, size);
    uint64_t warmed = 0;
    assert_int_equal(kv_warm_range(&c, 0, size, 0, &warmed), 0);
    assert_int_equal(warmed, 0);
    assert_int_equal(kv_warm_range(&c, 0, size, 1, &warmed), 0);
    assert_int_equal(warmed, size);
    assert_int_equal(resident_pages(m, size), 256);
    assert_int_equal(fstat(fd, &st), 0);
    assert_int_equal(st.st_blocks, blocks);
    munmap(m, size);
    close(fd);
}

static void test_an_object_shrunk_before_the_warm_up(void **state) {
    (void)state;
    assert_int_equal(kv_guard_init(), 0);
    const size_t size = 64 * PG;
    int fd = memfd_create("kvwarm", 0);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    unsigned char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    memset(m, 1, size);
    assert_int_equal(ftruncate(fd, (off_t)(size / 4)), 0);
    struct kv_context c = ctx_over(m, size);
    uint64_t warmed = 0;
    /* The pages past the new end are gone: nothing to fault in there, and no SIGBUS. */
    assert_int_equal(kv_warm_range(&c, 0, size, 0, &warmed), 0);
    assert_int_equal(warmed, size / 4);
    munmap(m, size);
    close(fd);
}

struct shrinker {
    int fd;
    size_t size;
    atomic_int stop;
    unsigned long rounds;
};

/* Shrinks the object to one page and grows it back (written again) until told to stop. */
static void *shrinker_main(void *arg) {
    struct shrinker *s = arg;
    unsigned char *m = mmap(NULL, s->size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
    assert_true(m != MAP_FAILED);
    while (!atomic_load(&s->stop)) {
        if (ftruncate(s->fd, PG) != 0) break;
        struct timespec ts = {0, 200000};
        nanosleep(&ts, NULL);
        if (ftruncate(s->fd, (off_t)s->size) != 0) break;
        memset(m, 2, s->size);
        s->rounds++;
    }
    munmap(m, s->size);
    return NULL;
}

/* The object shrinks and grows while it is faulted in, over and over: every call returns
 * (0, or -1 when a fault was caught), none kills the process. */
static void test_an_object_shrinking_during_the_warm_up(void **state) {
    (void)state;
    assert_int_equal(kv_guard_init(), 0);
    struct shrinker s = {.size = 4u << 20};
    s.fd = memfd_create("kvwarm", 0);
    assert_true(s.fd >= 0);
    assert_int_equal(ftruncate(s.fd, (off_t)s.size), 0);
    unsigned char *m = mmap(NULL, s.size, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd, 0);
    assert_true(m != MAP_FAILED);
    memset(m, 1, s.size);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, shrinker_main, &s), 0);
    struct kv_context c = ctx_over(m, s.size);
    int calls = 0, failed = 0;
    for (; calls < 400; calls++) {
        uint64_t warmed = 0;
        int rc = kv_warm_range(&c, 0, s.size, calls & 1, &warmed);
        assert_true(rc == 0 || rc == -1);
        failed += rc != 0;
        assert_true(warmed <= s.size);
    }
    atomic_store(&s.stop, 1);
    pthread_join(t, NULL);
    assert_int_equal(calls, 400);
    assert_true(s.rounds > 0);
    print_message("%d of %d warm-ups failed (a fault caught), %lu shrinks\n", failed, calls,
                  s.rounds);
    munmap(m, s.size);
    close(s.fd);
}

/* ---- the thread, through kvreg_register ---- */

static void make_object(char *name, size_t cap, size_t size, size_t written) {
    snprintf(name, cap, "/lmc-unit-warm-%d-%d", (int)getpid(), rand());
    char path[300];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    int fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)size), 0);
    unsigned char *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(m != MAP_FAILED);
    memset(m, 7, written);
    munmap(m, size);
    close(fd);
}

static void remove_object(const char *name) {
    char path[300];
    snprintf(path, sizeof(path), "/dev/shm%s", name);
    unlink(path);
}

static struct kv_context tmpl(const char *name, int64_t id, uint32_t blocks) {
    struct kv_context c;
    memset(&c, 0, sizeof(c));
    c.instance_id = id;
    snprintf(c.model_name, sizeof(c.model_name), "m");
    c.world_size = 1;
    snprintf(c.shm_name, sizeof(c.shm_name), "%s", name);
    /* one block = 16 tokens x 256 bytes, K and V: 8 KiB per block and layer */
    c.layout = (struct kv_layout){.num_layers = 2,
                                  .num_blocks = blocks,
                                  .tokens_per_block = 16,
                                  .bytes_per_token = 256,
                                  .kv_count = 2,
                                  .order = KV_LAYER_MAJOR};
    return c;
}

static int wait_state(struct kv_registry *r, int64_t id, int want) {
    int st = -1;
    for (int i = 0; i < 5000; i++) {
        assert_int_equal(kvreg_ping(r, id, NULL, 1, &st), 0);
        if (st == want) return st;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return st;
}

static void test_registrations_are_warmed_in_the_background(void **state) {
    (void)state;
    assert_int_equal(kv_guard_init(), 0);
    struct kv_registry r;
    kvreg_init(&r);
    struct kv_auth a;
    memset(&a, 0, sizeof(a));
    char name[64], err[256];
    unsigned char nonce[KV_PROOF_NONCE];
    uint64_t off;

    /* Without the thread: registered, not warmed. */
    struct kv_context c = tmpl("/x", 1, 512); /* 8 MiB */
    size_t layout = (size_t)kv_layout_bytes(&c.layout);
    make_object(name, sizeof(name), layout, layout / 2);
    snprintf(c.shm_name, sizeof(c.shm_name), "%s", name);
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), 0);
    int st = -1;
    assert_int_equal(kvreg_ping(&r, 1, NULL, 1, &st), 0);
    assert_int_equal(st, KV_WARM_OFF);

    /* With it: the half the owner wrote is faulted in, the hole is left alone. */
    assert_int_equal(kvwarm_start(&r), 0);
    c.instance_id = 2;
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), 0);
    assert_int_equal(wait_state(&r, 2, KV_WARM_DONE), KV_WARM_DONE);
    json_t *meta = kvreg_meta(&r);
    json_t *m2 = json_object_get(meta, "2");
    assert_string_equal(json_string_value(json_object_get(m2, "warm_state")), "warm");
    assert_int_equal(json_integer_value(json_object_get(m2, "warmed_bytes")), layout / 2);
    assert_int_equal(json_integer_value(json_object_get(m2, "mapped_bytes")), layout);
    json_decref(meta);

    /* An object allocated whole (posix_fallocate, never written) is faulted in whole. */
    char name3[64];
    make_object(name3, sizeof(name3), layout, 0);
    char path3[300];
    snprintf(path3, sizeof(path3), "/dev/shm%s", name3);
    int fd3 = open(path3, O_RDWR);
    assert_true(fd3 >= 0);
    assert_int_equal(posix_fallocate(fd3, 0, (off_t)layout), 0);
    close(fd3);
    struct kv_context c3 = tmpl(name3, 6, 512);
    assert_int_equal(kvreg_register(&r, &c3, &a, 1, nonce, &off, err, sizeof(err)), 0);
    assert_int_equal(wait_state(&r, 6, KV_WARM_DONE), KV_WARM_DONE);
    meta = kvreg_meta(&r);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(meta, "6"), "warmed_bytes")), layout);
    json_decref(meta);
    remove_object(name3);

    /* Unregistered while queued or running: the thread lets go of it. */
    char name2[64];
    struct kv_context big = tmpl("/y", 3, 16384); /* 256 MiB */
    make_object(name2, sizeof(name2), (size_t)kv_layout_bytes(&big.layout),
                (size_t)kv_layout_bytes(&big.layout));
    snprintf(big.shm_name, sizeof(big.shm_name), "%s", name2);
    assert_int_equal(kvreg_register(&r, &big, &a, 1, nonce, &off, err, sizeof(err)), 0);
    assert_int_equal(kvreg_unregister(&r, 3, NULL), 0);
    assert_int_equal(kvreg_ping(&r, 3, NULL, 1, NULL), -1);

    /* Stopped with work queued: the queue is dropped, later registrations are not warmed. */
    c.instance_id = 4;
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), 0);
    kvwarm_stop(&r);
    assert_int_equal(kvreg_ping(&r, 4, NULL, 1, &st), 0);
    assert_true(st == KV_WARM_DONE || st == KV_WARM_DROPPED);
    c.instance_id = 5;
    assert_int_equal(kvreg_register(&r, &c, &a, 1, nonce, &off, err, sizeof(err)), 0);
    assert_int_equal(kvreg_ping(&r, 5, NULL, 1, &st), 0);
    assert_int_equal(st, KV_WARM_OFF);
    kvreg_destroy(&r);
    remove_object(name);
    remove_object(name2);
}

static void test_state_names(void **state) {
    (void)state;
    assert_string_equal(kv_warm_state_name(KV_WARM_OFF), "off");
    assert_string_equal(kv_warm_state_name(KV_WARM_QUEUED), "warming");
    assert_string_equal(kv_warm_state_name(KV_WARM_DONE), "warm");
    assert_string_equal(kv_warm_state_name(KV_WARM_FAILED), "failed");
    assert_string_equal(kv_warm_state_name(KV_WARM_DROPPED), "dropped");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_only_the_pages_the_object_holds),
        cmocka_unit_test(test_a_fully_allocated_object_is_faulted_in_whole),
        cmocka_unit_test(test_an_object_shrunk_before_the_warm_up),
        cmocka_unit_test(test_an_object_shrinking_during_the_warm_up),
        cmocka_unit_test(test_registrations_are_warmed_in_the_background),
        cmocka_unit_test(test_state_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
