/* Unit tests for the periodic-thread registry: snapshots, filters, health of a stalled job. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <semaphore.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/periodic.h"

struct ctl {
    sem_t ticked;
    sem_t release; /* a stalled job waits here */
    int stall_after;
    int runs;
    int fail;
};

static int tick(void *arg, json_t **summary) {
    struct ctl *c = arg;
    c->runs++;
    *summary = json_pack("{s:i}", "runs", c->runs);
    sem_post(&c->ticked);
    if (c->stall_after && c->runs >= c->stall_after) sem_wait(&c->release);
    return c->fail ? -1 : 0;
}

static void test_registry_snapshot_and_filters(void **state) {
    (void)state;
    char err[128];
    struct periodic_registry *r = periodic_registry_new();
    struct ctl a = {0}, b = {0};
    sem_init(&a.ticked, 0, 0);
    sem_init(&b.ticked, 0, 0);
    b.fail = 1;
    assert_int_equal(
        periodic_start(r, "job-a", PERIODIC_CRITICAL, 0.01, tick, &a, err, sizeof(err)), 0);
    assert_int_equal(periodic_start(r, "job-b", PERIODIC_LOW, 0.01, tick, &b, err, sizeof(err)), 0);
    assert_int_equal(periodic_start(r, "job-a", PERIODIC_LOW, 1, tick, &a, err, sizeof(err)), -1);
    assert_int_equal(periodic_start(r, "bad", PERIODIC_LOW, 0, tick, &a, err, sizeof(err)), -1);
    for (int i = 0; i < 3; i++) {
        sem_wait(&a.ticked);
        sem_wait(&b.ticked);
    }
    double now = clock_mono();
    json_t *snap = periodic_snapshot(r, -1, 0, 0, now);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(snap, "summary"), "total_count")), 2);
    json_decref(snap);
    snap = periodic_snapshot(r, PERIODIC_LOW, 0, 0, now);
    json_t *threads = json_object_get(snap, "threads");
    assert_int_equal(json_array_size(threads), 1);
    json_t *t = json_array_get(threads, 0);
    assert_string_equal(json_string_value(json_object_get(t, "name")), "job-b");
    assert_true(json_integer_value(json_object_get(t, "failed_runs")) >= 2);
    assert_true(json_real_value(json_object_get(t, "success_rate")) == 0.0);
    json_decref(snap);
    json_t *one = periodic_status(r, "job-a", now);
    assert_non_null(one);
    assert_true(json_is_true(json_object_get(one, "is_active")));
    assert_true(json_integer_value(json_object_get(json_object_get(one, "last_summary"), "runs")) >=
                2);
    json_decref(one);
    assert_null(periodic_status(r, "nope", now));
    assert_int_equal(periodic_level_parse("high"), PERIODIC_HIGH);
    assert_int_equal(periodic_level_parse("urgent"), -1);
    periodic_registry_free(r);
}

static void test_stalled_critical_job_is_unhealthy(void **state) {
    (void)state;
    char err[128];
    struct periodic_registry *r = periodic_registry_new();
    struct ctl c = {0};
    sem_init(&c.ticked, 0, 0);
    sem_init(&c.release, 0, 0);
    c.stall_after = 2;
    assert_int_equal(periodic_start(r, "flusher", PERIODIC_HIGH, 0.5, tick, &c, err, sizeof(err)),
                     0);
    sem_wait(&c.ticked);
    sem_wait(&c.ticked); /* now stalled inside its second tick */
    json_t *h = periodic_health(r, clock_mono());
    assert_true(json_is_true(json_object_get(h, "healthy")));
    json_decref(h);
    /* Evaluate at a time well past 2 * interval + 1 s without sleeping. */
    h = periodic_health(r, clock_mono() + 10);
    assert_true(json_is_false(json_object_get(h, "healthy")));
    assert_int_equal(json_integer_value(json_object_get(h, "unhealthy_count")), 1);
    json_t *bad = json_array_get(json_object_get(h, "unhealthy_threads"), 0);
    assert_string_equal(json_string_value(json_object_get(bad, "name")), "flusher");
    assert_string_equal(json_string_value(json_object_get(bad, "level")), "high");
    json_decref(h);
    json_t *snap = periodic_snapshot(r, -1, 0, 1, clock_mono() + 10);
    assert_int_equal(json_array_size(json_object_get(snap, "threads")), 0);
    json_decref(snap);
    sem_post(&c.release);
    periodic_registry_free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry_snapshot_and_filters),
        cmocka_unit_test(test_stalled_critical_job_is_unhealthy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
