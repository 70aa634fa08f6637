/* Strict UTF-8 validation with optional NUL / control-character bans (see utf8.h). */
#include "base/utf8.h"

#include <stdint.h>

static size_t fail(struct utf8_error *e, enum utf8_reason r, size_t start, size_t at) {
    if (e) *e = (struct utf8_error){r, at};
    return start;
}

size_t utf8_check(const char *s, size_t len, unsigned flags, struct utf8_error *e) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < len;) {
        unsigned c = p[i];
        if (c < 0x80) { /* ASCII: the common case */
            if (c == 0 && (flags & UTF8_NO_NUL)) return fail(e, UTF8_NUL, i, i);
            if ((c < 0x20 || c == 0x7f) && (flags & UTF8_NO_CONTROL))
                return fail(e, UTF8_CONTROL, i, i);
            i++;
            continue;
        }
        /* The length comes from the lead byte's pattern; which values are allowed is checked
         * on the decoded code point, so C0 80 can be told apart from other overlong forms. */
        size_t n;
        uint32_t cp, min;
        if ((c & 0xe0) == 0xc0) {
            n = 2, cp = c & 0x1f, min = 0x80;
        } else if ((c & 0xf0) == 0xe0) {
            n = 3, cp = c & 0x0f, min = 0x800;
        } else if ((c & 0xf8) == 0xf0) {
            n = 4, cp = c & 0x07, min = 0x10000;
        } else {
            return fail(e, UTF8_INVALID, i, i); /* a continuation byte or 0xf8.. */
        }
        if (n > len - i) return fail(e, UTF8_TRUNCATED, i, i);
        for (size_t k = 1; k < n; k++) {
            if ((p[i + k] & 0xc0) != 0x80) return fail(e, UTF8_INVALID, i, i + k);
            cp = cp << 6 | (p[i + k] & 0x3f);
        }
        if (n == 2 && cp == 0) return fail(e, UTF8_ENCODED_NUL, i, i);
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return fail(e, UTF8_INVALID, i, i);
        if (cp <= 0x9f && (flags & UTF8_NO_CONTROL)) return fail(e, UTF8_CONTROL, i, i);
        i += n;
    }
    if (e) *e = (struct utf8_error){UTF8_OK, len};
    return len;
}

const char *utf8_reason_str(enum utf8_reason reason) {
    switch (reason) {
    case UTF8_OK:
        return "valid";
    case UTF8_INVALID:
        return "not valid UTF-8";
    case UTF8_TRUNCATED:
        return "not valid UTF-8 (truncated sequence)";
    case UTF8_ENCODED_NUL:
        return "an encoded NUL character";
    case UTF8_NUL:
        return "a NUL byte";
    case UTF8_CONTROL:
        return "a control character";
    }
    return "not valid UTF-8";
}
