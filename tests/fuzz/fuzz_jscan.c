/* libFuzzer driver for base/jscan (the routing query's body scanner), checked against jansson:
 * a body jansson reads as an object (nesting within the limit, no raw NUL byte, which jansson
 * may take for the end of the text) must be accepted; a body jscan
 * accepts must be one jansson reads, except for numbers too large for jansson's types and keys
 * holding \u0000 (jansson refuses them, JSON does not); and an
 * array jscan_u32_array reads must hold the integers jansson reads. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "base/jscan.h"

static json_t *g_doc;

static int check_member(void *arg, const struct jscan_member *m) {
    (void)arg;
    uint32_t out[64];
    long n = jscan_u32_array(m->val, m->val_len, out, 64);
    if (n < 0 || !g_doc) return 0;
    json_t *v = json_loadb(m->val, m->val_len, JSON_DECODE_ANY, NULL);
    if (!json_is_array(v) || json_array_size(v) != (size_t)n) __builtin_trap();
    for (long i = 0; i < n; i++) {
        json_t *e = json_array_get(v, (size_t)i);
        if (!json_is_integer(e) || json_integer_value(e) != (json_int_t)out[i]) __builtin_trap();
    }
    json_decref(v);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *txt = (const char *)data;
    json_error_t je;
    json_t *j = json_loadb(txt, size, JSON_ALLOW_NUL, &je);
    g_doc = json_is_object(j) ? j : NULL;
    int rc = jscan_object(txt, size, 32, check_member, NULL);
    if (rc != JSCAN_DEPTH) {
        if (g_doc && rc != 0 && !memchr(txt, 0, size)) __builtin_trap();
        /* jansson also refuses a key holding \u0000, which JSON allows (and jscan accepts). */
        if (!g_doc && rc == 0 && !j && !strstr(je.text, "too big") &&
            !strstr(je.text, "overflow") && !strstr(je.text, "NUL byte in object key"))
            __builtin_trap();
    }
    json_decref(j);
    return 0;
}
