/* libFuzzer driver for the path and key encoders of hostile names: the admin path decoder (no
 * NUL ever comes out), the path-parameter text check, and the S3 key escape (round trip exact,
 * no dot segment left in the escaped key). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/admin/pathparam.h"
#include "server/l2/s3.h"

static int has_dot_segment(const char *s) {
    for (const char *seg = s;;) {
        size_t n = strcspn(seg, "/");
        if ((n == 1 && seg[0] == '.') || (n == 2 && seg[0] == '.' && seg[1] == '.')) return 1;
        if (!seg[n]) return 0;
        seg += n + 1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    char *s = malloc(size + 1), *d = malloc(size + 1);
    if (!s || !d) goto out;
    memcpy(s, data, size);
    s[size] = 0;
    size_t sl = strlen(s); /* paths and names are C strings */
    size_t n = pathparam_decode(s, sl, d);
    if (n > sl || d[n] != 0 || memchr(d, 0, n)) __builtin_trap();
    char err[128];
    (void)pathparam_check_text(d, n, err, sizeof(err));
    char key[S3_KEY_MAX + 1], back[S3_KEY_MAX + 1];
    long kl = s3_key_escape(s, key, sizeof(key));
    if (kl >= 0) {
        if (has_dot_segment(key)) __builtin_trap();
        long bl = s3_key_unescape(key, (size_t)kl, back, sizeof(back));
        if (bl != (long)sl || memcmp(back, s, sl) != 0) __builtin_trap();
    }
    (void)s3_key_unescape(s, sl, back, sizeof(back));
out:
    free(s);
    free(d);
    return 0;
}
