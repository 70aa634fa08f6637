/* Unit tests for the server option table and the admin route matcher. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>

#include "server/admin/http.h"
#include "server/config.h"

static int parse(struct server_config *c, char *err, size_t len, ...) {
    char *argv[32] = {"server"};
    int argc = 1;
    va_list ap;
    va_start(ap, len);
    for (char *a; (a = va_arg(ap, char *));) argv[argc++] = a;
    va_end(ap);
    return config_parse(c, argc, argv, err, len);
}

static void test_defaults_and_values(void **state) {
    (void)state;
    struct server_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof(err), "--l1-size-gb", "2", "--eviction-policy",
                           "IsolatedLRU", "--port=6000", "--l2-adapter", "{\"type\":\"s3\"}",
                           "--l2-adapter", "{\"type\":\"fs\"}", "--run-script-api-enabled", NULL),
                     0);
    assert_string_equal(c.host, "localhost");
    assert_int_equal(c.port, 6000);
    assert_string_equal(c.http_host, "0.0.0.0");
    assert_int_equal(c.http_port, 8080);
    assert_int_equal(c.chunk_size, 256);
    assert_true(c.l1_size_gb == 2.0);
    assert_true(c.eviction_trigger_watermark == 0.8);
    assert_true(c.l1_read_ttl_seconds == 300 && c.l1_write_ttl_seconds == 600);
    assert_string_equal(c.eviction_policy, "IsolatedLRU");
    assert_int_equal(c.run_script_api_enabled, 1);
    assert_int_equal(c.env_api_unredacted, 0);
    assert_int_equal(json_array_size(c.l2_adapter), 2);
    json_t *j = config_to_json(&c);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "mp"), "port")), 6000);
    assert_int_equal(
        json_array_size(json_object_get(json_object_get(j, "storage_manager"), "l2_adapters")), 2);
    json_decref(j);
    config_free(&c);
}

static void test_errors_name_the_option(void **state) {
    (void)state;
    struct server_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof(err), "--l1-size-gb", "1", NULL), -1);
    assert_non_null(strstr(err, "--eviction-policy"));
    config_free(&c);
    assert_int_equal(parse(&c, err, sizeof(err), "--l1-size-gb", "1", "--eviction-policy", "LRU",
                           "--max-workers", "x", NULL),
                     -1);
    assert_non_null(strstr(err, "--max-workers"));
    config_free(&c);
    assert_int_equal(
        parse(&c, err, sizeof(err), "--l1-size-gb", "1e400", "--eviction-policy", "LRU", NULL), -1);
    assert_non_null(strstr(err, "--l1-size-gb"));
    config_free(&c);
    assert_int_equal(parse(&c, err, sizeof(err), "positional", NULL), -1);
    assert_non_null(strstr(err, "positional"));
    config_free(&c);
}

static void test_route_matching(void **state) {
    (void)state;
    char params[HTTP_MAX_PARAMS][256], allow[64];
    size_t np;
    int pm;
    const struct http_route *r =
        http_match("GET", "/periodic-threads/foo", params, &np, &pm, allow, sizeof(allow));
    assert_non_null(r);
    assert_string_equal(r->pattern, "/periodic-threads/{thread_name}");
    assert_int_equal(np, 1);
    assert_string_equal(params[0], "foo");
    assert_null(http_match("GET", "/periodic-threads/", params, &np, &pm, allow, sizeof(allow)));
    assert_null(http_match("GET", "/periodic-threads/a/b", params, &np, &pm, allow, sizeof(allow)));
    r = http_match("DELETE", "/status", params, &np, &pm, allow, sizeof(allow));
    assert_null(r);
    assert_int_equal(pm, 1);
    assert_string_equal(allow, "GET");
    assert_non_null(http_match("HEAD", "/", params, &np, &pm, allow, sizeof(allow)));
}

static void body_case(const char *body, int allow_empty, int want_ok, int want_status) {
    struct http_req req = {0};
    req.body = body;
    req.body_len = strlen(body);
    struct http_resp resp = {0};
    json_t *o = http_body_object(&req, &resp, 422, allow_empty);
    if (want_ok) {
        assert_non_null(o);
        assert_true(json_is_object(o));
        assert_null(resp.body);
    } else {
        assert_null(o);
        assert_int_equal(resp.status, want_status);
        assert_non_null(strstr(resp.body, "\"detail\""));
    }
    json_decref(o);
    free(resp.body);
}

static void test_json_body_helper(void **state) {
    (void)state;
    body_case("{\"a\": 1}", 0, 1, 0);
    body_case("  \n", 1, 1, 0);                   /* empty body allowed: {} */
    body_case("", 0, 0, 422);                     /* empty body required */
    body_case("{bad", 0, 0, 422);                 /* malformed */
    body_case("[1, 2]", 0, 0, 422);               /* not an object */
    body_case("{\"a\": 1, \"a\": 2}", 0, 0, 422); /* duplicate keys */
    body_case("\"str\"", 1, 0, 422);
}

/* Every row of the table, given on a command line (with the required options) with its default
 * value (a flag without one), parses: the parser's per-row bookkeeping covers the whole table
 * however many options it grows to (it once had room for 64). */
static void test_every_option_parses_alone(void **state) {
    (void)state;
    size_t tried = 0, last = 0;
    for (size_t i = 0; i < SERVER_NOPTIONS; i++) {
        const struct option_def *d = &SERVER_OPTION_DEFS[i];
        char arg[512], err[256] = "";
        if (d->type == OPT_BOOL)
            snprintf(arg, sizeof(arg), "--%s", d->flag);
        else if (d->def && d->def[0] && d->type != OPT_STRLIST && d->type != OPT_JSONLIST)
            snprintf(arg, sizeof(arg), "--%s=%s", d->flag, d->def);
        else
            continue;
        struct server_config c;
        int rc =
            parse(&c, err, sizeof(err), "--l1-size-gb", "1", "--eviction-policy", "LRU", arg, NULL);
        if (rc != 0) fail_msg("%s: %d %s", arg, rc, err);
        config_free(&c);
        tried++;
        last = i;
    }
    /* rows all over the table, up to one of its last */
    assert_true(SERVER_NOPTIONS > 64 && tried > SERVER_NOPTIONS / 2 && last > 64);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_and_values),
        cmocka_unit_test(test_every_option_parses_alone),
        cmocka_unit_test(test_errors_name_the_option),
        cmocka_unit_test(test_route_matching),
        cmocka_unit_test(test_json_body_helper),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
