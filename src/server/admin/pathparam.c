/* Percent-decoding of admin request paths that keeps NUL visible, and checks of decoded path
 * parameters (see pathparam.h). */
#include "server/admin/pathparam.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/utf8.h"

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

size_t pathparam_decode(const char *src, size_t len, char *dst) {
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        int hi, lo;
        if (src[i] == '%' && i + 2 < len && (hi = hexval(src[i + 1])) >= 0 &&
            (lo = hexval(src[i + 2])) >= 0) {
            unsigned char b = (unsigned char)(hi << 4 | lo);
            i += 2;
            if (b == 0) {
                /* Three input bytes give two: decoding in place never overtakes the input. */
                dst[o++] = (char)0xC0;
                dst[o++] = (char)0x80;
            } else {
                dst[o++] = (char)b;
            }
            continue;
        }
        dst[o++] = src[i];
    }
    dst[o] = '\0';
    return o;
}

size_t pathparam_unescape(void *cls, struct MHD_Connection *conn, char *s) {
    (void)cls;
    (void)conn;
    return pathparam_decode(s, strlen(s), s);
}

int pathparam_check_text(const char *s, size_t len, char *err, size_t errlen) {
    struct utf8_error e;
    if (utf8_check(s, len, UTF8_NO_CONTROL, &e) == len) return 0;
    const char *what = e.reason == UTF8_ENCODED_NUL || e.reason == UTF8_NUL
                           ? "must not contain a NUL character ("
                       : e.reason == UTF8_CONTROL   ? "must not contain control characters ("
                       : e.reason == UTF8_TRUNCATED ? "not valid UTF-8 (truncated sequence at "
                                                    : "not valid UTF-8 (";
    errbuf_set(err, errlen, "%sbyte %zu)", what, e.at);
    return -1;
}
