/* Unit tests of the one redaction helper every display of the configuration goes through. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/config.h"

static void test_secret_names(void **state) {
    (void)state;
    const char *yes[] = {"secret_access_key", "session_token", "password", "private_key",
                         "api_key",           "admin-token",   "SECRET",   "tls_key_password"};
    const char *no[] = {"access_key_id", "bucket", "max_tokens", "credentials",
                        "secretive",     "prefix", "",           "tokenizer"};
    for (size_t i = 0; i < sizeof(yes) / sizeof(*yes); i++)
        assert_true(config_is_secret_name(yes[i]));
    for (size_t i = 0; i < sizeof(no) / sizeof(*no); i++)
        assert_false(config_is_secret_name(no[i]));
}

static void test_redact_nested(void **state) {
    (void)state;
    json_t *v = json_pack("{s:[{s:s, s:s, s:s, s:n, s:{s:s}}]}", "l2_adapters", "type", "s3",
                          "secret_access_key", "S", "access_key_id", "A", "session_token", "nested",
                          "password", "P");
    config_redact(v);
    json_t *a = json_array_get(json_object_get(v, "l2_adapters"), 0);
    assert_string_equal(json_string_value(json_object_get(a, "secret_access_key")),
                        CONFIG_REDACTED);
    assert_string_equal(json_string_value(json_object_get(a, "access_key_id")), "A");
    assert_true(json_is_null(json_object_get(a, "session_token")));
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(a, "nested"), "password")),
        CONFIG_REDACTED);
    char *s = json_dumps(v, 0);
    assert_null(strstr(s, "\"S\""));
    assert_null(strstr(s, "\"P\""));
    free(s);
    json_decref(v);
}

/* Parses a command line with the given --l2-adapter value; config_parse's result. */
static int parse_with_adapter(struct server_config *cfg, const char *adapter, char *err,
                              size_t errlen) {
    memset(cfg, 0, sizeof(*cfg));
    char *argv[] = {"server",       "--l1-size-gb", "1", "--eviction-policy", "LRU",
                    "--l2-adapter", (char *)adapter};
    return config_parse(cfg, 7, argv, err, errlen);
}

static void test_config_to_json_redacts(void **state) {
    (void)state;
    struct server_config cfg;
    char err[256];
    assert_int_equal(parse_with_adapter(&cfg,
                                        "{\"type\":\"s3\",\"bucket\":\"b\","
                                        "\"secret_access_key\":\"TOPSECRET\"}",
                                        err, sizeof(err)),
                     0);
    json_t *j = config_to_json(&cfg);
    char *s = json_dumps(j, 0);
    assert_null(strstr(s, "TOPSECRET"));
    assert_non_null(strstr(s, CONFIG_REDACTED));
    free(s);
    json_decref(j);
    /* The parsed value itself is untouched (the adapter needs it). */
    json_t *a = json_array_get(cfg.l2_adapter, 0);
    assert_string_equal(json_string_value(json_object_get(a, "secret_access_key")), "TOPSECRET");
    config_scrub(cfg.l2_adapter);
    assert_int_equal(json_string_value(json_object_get(a, "secret_access_key"))[0], 0);
    config_free(&cfg);
}

static void test_bad_json_not_echoed(void **state) {
    (void)state;
    struct server_config cfg;
    char err[256];
    assert_int_equal(parse_with_adapter(&cfg,
                                        "{\"type\":\"s3\",\"secret_access_key\":\"SHORTSECRET", err,
                                        sizeof(err)),
                     -1);
    assert_null(strstr(err, "SHORTSECRET"));
    assert_non_null(strstr(err, "column"));
    config_free(&cfg);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_secret_names),
        cmocka_unit_test(test_redact_nested),
        cmocka_unit_test(test_config_to_json_redacts),
        cmocka_unit_test(test_bad_json_not_echoed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
