/* Unit tests for src/base: size strings, loggers, metrics registry and exposition, strbuf, stack
 * dumps, prefaulting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/jfield.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/prefault.h"
#include "base/size.h"
#include "base/stackdump.h"
#include "base/strbuf.h"

static void test_size_parse(void **state) {
    (void)state;
    char err[128];
    uint64_t v = 0;
    assert_int_equal(size_parse("4096", &v, err, sizeof(err)), 0);
    assert_int_equal(v, 4096);
    assert_int_equal(size_parse("100GiB", &v, err, sizeof(err)), 0);
    assert_true(v == 100ULL << 30);
    assert_int_equal(size_parse("2k", &v, err, sizeof(err)), 0);
    assert_int_equal(v, 2048);
    assert_int_equal(size_parse("1.5MiB", &v, err, sizeof(err)), 0);
    assert_int_equal(v, 1572864);
    assert_int_equal(size_parse("3 tib", &v, err, sizeof(err)), 0);
    assert_true(v == 3ULL << 40);
    assert_int_equal(size_parse("7b", &v, err, sizeof(err)), 0);
    assert_int_equal(v, 7);
    const char *bad[] = {
        "", "0", "-1", "GiB", "1XB", "1 GiB x", "99999999999999999999", "20000000t", "1..5g", NULL};
    for (int i = 0; bad[i]; i++) assert_int_equal(size_parse(bad[i], &v, err, sizeof(err)), -1);
    assert_int_equal(size_parse(NULL, &v, err, sizeof(err)), -1);
}

/* Error messages go through errbuf_set: a caller without a buffer (NULL, any length) gets the
 * status alone, and a short buffer gets a terminated prefix. */
static void test_errors_without_a_buffer(void **state) {
    (void)state;
    uint64_t v = 0;
    assert_int_equal(size_parse("1XB", &v, NULL, 64), -1);
    assert_int_equal(size_parse(NULL, &v, NULL, 64), -1);
    json_t *o = json_pack("{s:s, s:i}", "n", "x", "s", 7);
    long n = 0;
    char *str = NULL;
    assert_int_equal(jfield_int(o, "n", 0, 10, &n, "t", NULL, 64), -1);
    assert_int_equal(jfield_str(o, "s", &str, "t", NULL, 64), -1);
    char small[8];
    assert_int_equal(size_parse("1XB", &v, small, sizeof(small)), -1);
    assert_int_equal(strlen(small), sizeof(small) - 1);
    json_decref(o);
}

static void test_log_levels_and_inheritance(void **state) {
    (void)state;
    assert_int_equal(log_level_parse("debug"), LOG_DEBUG);
    assert_int_equal(log_level_parse("Warning"), LOG_WARNING);
    assert_int_equal(log_level_parse("LOUD"), -1);
    assert_string_equal(log_level_name(LOG_ERROR), "ERROR");
    struct logger *root = log_get("t");
    struct logger *child = log_get("t.child");
    assert_non_null(root);
    assert_ptr_equal(log_get("t"), root);
    log_set_level(root, LOG_ERROR);
    assert_int_equal(log_effective_level(child), LOG_ERROR);
    assert_int_equal(log_effective_level_of("t.child.grandchild"), LOG_ERROR);
    assert_false(log_enabled(child, LOG_INFO));
    log_set_level(child, LOG_DEBUG);
    assert_int_equal(log_effective_level(child), LOG_DEBUG);
    assert_int_equal(log_effective_level(root), LOG_ERROR);
    assert_true(log_enabled(child, LOG_DEBUG));
    log_set_level(child, LOG_NOTSET);
    assert_int_equal(log_effective_level(child), LOG_ERROR);
    char longname[LOG_NAME_MAX + 10];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[sizeof(longname) - 1] = 0;
    assert_null(log_get(longname));
    assert_null(log_get(""));
}

static void test_metrics_exposition(void **state) {
    (void)state;
    struct metrics *m = metrics_new();
    const char *const labels[] = {"cache_salt", NULL};
    struct metric_family *c = metrics_counter(m, "x_read_chunks_total", "Chunks read.", labels);
    assert_non_null(c);
    /* Same name, same type: the same family; another type: refused. */
    assert_ptr_equal(metrics_counter(m, "x_read_chunks_total", "", labels), c);
    assert_null(metrics_gauge(m, "x_read_chunks_total", "", NULL));
    const char *a[] = {"alice"}, *q[] = {"we\"ird\\salt\n"};
    metrics_add(c, a, 2);
    metrics_add(c, a, 3);
    metrics_add(c, q, 1);
    assert_true(metric_value(metric_labels(c, a)) == 5.0);
    struct metric_family *g = metrics_gauge(m, "x_usage_ratio", "Usage.", NULL);
    metric_set(metric_series(g), 0.25);
    const double b[] = {0.1, 1};
    struct metric_family *h = metrics_histogram(m, "x_latency_seconds", "Latency.", NULL, b, 2);
    struct metric *hs = metric_series(h);
    metric_observe(hs, 0.05);
    metric_observe(hs, 0.5);
    metric_observe(hs, 7);
    assert_int_equal(metric_hist_count(hs), 3);

    struct strbuf sb = STRBUF_INIT;
    assert_int_equal(metrics_render(m, &sb), 0);
    assert_non_null(strstr(sb.buf, "# TYPE x_read_chunks_total counter\n"));
    assert_non_null(strstr(sb.buf, "x_read_chunks_total{cache_salt=\"alice\"} 5.0\n"));
    assert_non_null(
        strstr(sb.buf, "x_read_chunks_total{cache_salt=\"we\\\"ird\\\\salt\\n\"} 1.0\n"));
    assert_non_null(strstr(sb.buf, "x_usage_ratio 0.25\n"));
    assert_non_null(strstr(sb.buf, "x_latency_seconds_bucket{le=\"0.1\"} 1\n"));
    assert_non_null(strstr(sb.buf, "x_latency_seconds_bucket{le=\"1\"} 2\n"));
    assert_non_null(strstr(sb.buf, "x_latency_seconds_bucket{le=\"+Inf\"} 3\n"));
    assert_non_null(strstr(sb.buf, "x_latency_seconds_sum 7.55\n"));
    assert_non_null(strstr(sb.buf, "x_latency_seconds_count 3\n"));
    /* Families come sorted by name. */
    assert_true(strstr(sb.buf, "x_latency") < strstr(sb.buf, "x_read") &&
                strstr(sb.buf, "x_read") < strstr(sb.buf, "x_usage"));
    sb_free(&sb);

    metrics_reset(m);
    assert_true(metric_value(metric_labels(c, a)) == 0.0);
    assert_int_equal(metric_hist_count(hs), 0);

    /* Removal by label: the departed one's series go, the others stay in order. */
    const char *const nt[] = {"node", "tier", NULL};
    struct metric_family *cap = metrics_gauge(m, "x_cap_bytes", "Capacity.", nt);
    const char *n1[] = {"n1", "DRAM"}, *n2[] = {"n2", "DRAM"}, *n1s[] = {"n1", "SSD"};
    metrics_set(cap, n1, 1);
    metrics_set(cap, n2, 2);
    metrics_set(cap, n1s, 3);
    assert_int_equal(metrics_remove_label(cap, 0, "n1"), 2);
    assert_int_equal(metrics_remove_label(cap, 0, "n1"), 0);
    assert_int_equal(metrics_remove_label(cap, 5, "n2"), 0); /* no such label */
    sb = (struct strbuf)STRBUF_INIT;
    assert_int_equal(metrics_render(m, &sb), 0);
    assert_null(strstr(sb.buf, "node=\"n1\""));
    assert_non_null(strstr(sb.buf, "x_cap_bytes{node=\"n2\",tier=\"DRAM\"} 2"));
    sb_free(&sb);
    metrics_set(cap, n1, 4); /* back: a new series */
    metrics_add(cap, n2, 1);
    sb = (struct strbuf)STRBUF_INIT;
    assert_int_equal(metrics_render(m, &sb), 0);
    assert_non_null(strstr(sb.buf, "x_cap_bytes{node=\"n1\",tier=\"DRAM\"} 4"));
    assert_non_null(strstr(sb.buf, "x_cap_bytes{node=\"n2\",tier=\"DRAM\"} 3"));
    sb_free(&sb);
    assert_int_equal(metrics_remove_label(cap, 0, "n2"), 1);
    assert_int_equal(metrics_remove_label(cap, 0, "n1"), 1);
    metrics_set(cap, n2, 5); /* the family emptied, then used again */
    assert_true(metric_value(metric_labels(cap, n2)) == 5.0);
    metrics_free(m);
}

static double seven(void *arg) {
    (void)arg;
    return 7;
}

static void test_metrics_computed_gauge_survives_reset(void **state) {
    (void)state;
    struct metrics *m = metrics_new();
    metrics_gauge_fn(m, "x_live_bytes", "Live.", seven, NULL);
    metrics_reset(m);
    struct strbuf sb = STRBUF_INIT;
    metrics_render(m, &sb);
    assert_non_null(strstr(sb.buf, "x_live_bytes 7.0\n"));
    sb_free(&sb);
    metrics_free(m);
}

static void test_strbuf(void **state) {
    (void)state;
    struct strbuf sb = STRBUF_INIT;
    for (int i = 0; i < 1000; i++) sb_printf(&sb, "%d,", i);
    assert_int_equal(strncmp(sb.buf, "0,1,2,", 6), 0);
    size_t len;
    char *p = sb_detach(&sb, &len);
    assert_int_equal(len, strlen(p));
    assert_null(sb.buf);
    free(p);
}

/* ---- stack dumps ---------------------------------------------------------------------------- */

#define SAMPLE_SIGNAL (SIGRTMIN + 3) /* stackdump.c's sampling signal */

struct blocker {
    _Atomic pid_t tid;
    _Atomic int stop;
    sem_t wake;
};

static uint64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void block_sample_signal(int how) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SAMPLE_SIGNAL);
    pthread_sigmask(how, &set, NULL);
}

/* Blocks the sampling signal for a moment while it runs, as a thread does inside pthread_create
 * or at the end of the previous sample's handler, then idles with it unblocked. */
static void *transient_blocker(void *arg) {
    struct blocker *b = arg;
    block_sample_signal(SIG_BLOCK);
    atomic_store(&b->tid, (pid_t)syscall(SYS_gettid));
    uint64_t until = mono_ms() + 50;
    while (mono_ms() < until) {
    }
    block_sample_signal(SIG_UNBLOCK);
    while (!atomic_load(&b->stop)) {
        struct timespec ms = {0, 1000000L};
        nanosleep(&ms, NULL);
    }
    return NULL;
}

/* Blocks the sampling signal for good and sleeps, like a library's I/O thread. */
static void *sleeping_blocker(void *arg) {
    struct blocker *b = arg;
    block_sample_signal(SIG_BLOCK);
    atomic_store(&b->tid, (pid_t)syscall(SYS_gettid));
    while (sem_wait(&b->wake) != 0) {
    }
    return NULL;
}

static void report_one(struct blocker *b, void *(*fn)(void *), struct strbuf *out) {
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, fn, b), 0);
    while (atomic_load(&b->tid) == 0) sched_yield();
    assert_int_equal(stackdump_report(out, NULL, atomic_load(&b->tid)), 1);
    atomic_store(&b->stop, 1);
    sem_post(&b->wake);
    pthread_join(th, NULL);
}

/* A thread caught in a moment when it blocks the sampling signal is waited for, not reported
 * as unavailable (the main thread of the daemon was, right after answering a sample). */
static void test_stackdump_waits_out_a_transient_block(void **state) {
    (void)state;
    assert_int_equal(stackdump_init(), 0);
    struct blocker b = {0};
    sem_init(&b.wake, 0, 0);
    struct strbuf out = STRBUF_INIT;
    report_one(&b, transient_blocker, &out);
    assert_non_null(strstr(out.buf, "#0 "));
    assert_null(strstr(out.buf, "stack unavailable"));
    sb_free(&out);
    sem_destroy(&b.wake);
}

static void test_stackdump_reports_a_thread_that_blocks_for_good(void **state) {
    (void)state;
    assert_int_equal(stackdump_init(), 0);
    struct blocker b = {0};
    sem_init(&b.wake, 0, 0);
    struct strbuf out = STRBUF_INIT;
    report_one(&b, sleeping_blocker, &out);
    assert_non_null(strstr(out.buf, "(stack unavailable: the thread blocks the sampling signal)"));
    assert_null(strstr(out.buf, "#0 "));
    sb_free(&out);
    sem_destroy(&b.wake);
}

/* Mapped pages of a range (mincore), out of the pages it spans. */
static size_t resident_pages(void *p, size_t len) {
    unsigned char vec[64];
    assert_true(len / 4096 <= sizeof(vec));
    assert_int_equal(mincore(p, len, vec), 0);
    size_t n = 0;
    for (size_t i = 0; i < len / 4096; i++) n += vec[i] & 1;
    return n;
}

static void test_prefault_keeps_contents_and_faults_in_every_page(void **state) {
    (void)state;
    enum { PAGES = 16 };
    unsigned char *m =
        mmap(NULL, PAGES * 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(m != MAP_FAILED);
    for (int i = 0; i < 4096; i++) m[4096 + i] = (unsigned char)(i * 7 + 1); /* page 1 only */
    assert_int_equal(resident_pages(m, PAGES * 4096), 1);
    /* unaligned start and length: every page they touch is faulted in */
    assert_int_equal(prefault_range(m + 100, PAGES * 4096 - 200, 1), 0);
    assert_int_equal(resident_pages(m, PAGES * 4096), PAGES);
    for (int i = 0; i < 4096; i++) assert_int_equal(m[4096 + i], (unsigned char)(i * 7 + 1));
    assert_int_equal(m[0], 0);
    assert_int_equal(prefault_range(m, 0, 1), 0);
    munmap(m, PAGES * 4096);

    /* a shared object shrunk below its mapping: an error, not a SIGBUS */
    int fd = memfd_create("prefault-test", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, 8 * 4096), 0);
    unsigned char *s = mmap(NULL, 8 * 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    assert_true(s != MAP_FAILED);
    assert_int_equal(prefault_range(s, 8 * 4096, 1), 0);
    assert_int_equal(ftruncate(fd, 4096), 0);
    assert_int_equal(prefault_range(s, 8 * 4096, 1), -1);
    munmap(s, 8 * 4096);
    close(fd);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_size_parse),
        cmocka_unit_test(test_errors_without_a_buffer),
        cmocka_unit_test(test_log_levels_and_inheritance),
        cmocka_unit_test(test_metrics_exposition),
        cmocka_unit_test(test_metrics_computed_gauge_survives_reset),
        cmocka_unit_test(test_strbuf),
        cmocka_unit_test(test_stackdump_waits_out_a_transient_block),
        cmocka_unit_test(test_stackdump_reports_a_thread_that_blocks_for_good),
        cmocka_unit_test(test_prefault_keeps_contents_and_faults_in_every_page),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
