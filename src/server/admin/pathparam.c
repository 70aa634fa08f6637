/* Percent-decoding of admin request paths that keeps NUL visible, and checks of decoded path
 * parameters (see pathparam.h). */
#include "server/admin/pathparam.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        unsigned c = p[i];
        size_t n;
        uint32_t cp, min;
        if (c < 0x80) {
            n = 1, cp = c, min = 0;
        } else if ((c & 0xE0) == 0xC0) {
            n = 2, cp = c & 0x1F, min = 0x80;
        } else if ((c & 0xF0) == 0xE0) {
            n = 3, cp = c & 0x0F, min = 0x800;
        } else if ((c & 0xF8) == 0xF0) {
            n = 4, cp = c & 0x07, min = 0x10000;
        } else {
            snprintf(err, errlen, "not valid UTF-8 (byte %zu)", i);
            return -1;
        }
        if (n > len - i) {
            snprintf(err, errlen, "not valid UTF-8 (truncated sequence at byte %zu)", i);
            return -1;
        }
        for (size_t k = 1; k < n; k++) {
            if ((p[i + k] & 0xC0) != 0x80) {
                snprintf(err, errlen, "not valid UTF-8 (byte %zu)", i + k);
                return -1;
            }
            cp = cp << 6 | (p[i + k] & 0x3F);
        }
        if (n == 2 && cp == 0) {
            snprintf(err, errlen, "must not contain a NUL character (byte %zu)", i);
            return -1;
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            snprintf(err, errlen, "not valid UTF-8 (byte %zu)", i);
            return -1;
        }
        if (cp < 0x20 || (cp >= 0x7F && cp < 0xA0)) {
            snprintf(err, errlen, "must not contain control characters (byte %zu)", i);
            return -1;
        }
        i += n;
    }
    return 0;
}
