/* Helpers shared by the cmocka unit tests. Include after <cmocka.h> (the helpers fail the
 * current test with cmocka's macros, so call them on the test's own thread only). */
#ifndef LMCACHE_TESTS_UNIT_TEST_UTIL_H
#define LMCACHE_TESTS_UNIT_TEST_UTIL_H

#include <ftw.h>
#include <jansson.h>
#include <stdio.h>
#include <sys/stat.h>

#include "server/l2/adapter.h"

static inline int test_rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* Removes a directory tree (a test's scratch directory); errors are ignored. */
static inline void test_rm_rf(const char *dir) { nftw(dir, test_rm_cb, 16, FTW_DEPTH | FTW_PHYS); }

/* Creates an L2 adapter from its JSON configuration; fails the test with the adapter's message
 * when that does not work. */
static inline struct l2_adapter *test_adapter_json(const char *json) {
    json_error_t je;
    json_t *cfg = json_loads(json, 0, &je);
    if (!cfg) fail_msg("bad adapter JSON: %s", je.text);
    struct l2_adapter *a = NULL;
    char err[256] = "";
    int rc = l2_adapter_create(cfg, &a, err, sizeof(err));
    json_decref(cfg);
    if (rc != L2_OK) fail_msg("create: %s", err);
    return a;
}

#endif
