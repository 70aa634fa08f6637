/* The strict JSON scanner (see jscan.h). */
#include "base/jscan.h"

#include <stdbool.h>

#include "base/utf8.h"

struct scan {
    const char *p, *end;
    int depth, max_depth;
    int err; /* JSCAN_SYNTAX or JSCAN_DEPTH once something failed */
};

static bool fail(struct scan *s, int err) {
    if (!s->err) s->err = err;
    return false;
}

static void skip_ws(struct scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static int hex_val(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Four hex digits after "\u" into *cp. */
static bool read_u4(struct scan *s, unsigned *cp) {
    if (s->end - s->p < 4) return false;
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hex_val(s->p[i]);
        if (h < 0) return false;
        v = v << 4 | (unsigned)h;
    }
    s->p += 4;
    *cp = v;
    return true;
}

/* A string, s->p at its opening quote; *escaped tells whether it held a backslash. The whole
 * text was checked as UTF-8 before, so bytes >= 0x80 are taken as they are. */
static bool scan_string(struct scan *s, bool *escaped) {
    s->p++;
    *escaped = false;
    while (s->p < s->end) {
        unsigned char c = (unsigned char)*s->p++;
        if (c == '"') return true;
        if (c < 0x20) return fail(s, JSCAN_SYNTAX);
        if (c != '\\') continue;
        *escaped = true;
        if (s->p >= s->end) break;
        char e = *s->p++;
        if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' ||
            e == 't')
            continue;
        unsigned cp, lo;
        if (e != 'u' || !read_u4(s, &cp)) return fail(s, JSCAN_SYNTAX);
        if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(s, JSCAN_SYNTAX); /* a lone low half */
        if (cp >= 0xD800 && cp <= 0xDBFF) {                             /* needs its low half */
            if (s->end - s->p < 2 || s->p[0] != '\\' || s->p[1] != 'u')
                return fail(s, JSCAN_SYNTAX);
            s->p += 2;
            if (!read_u4(s, &lo) || lo < 0xDC00 || lo > 0xDFFF) return fail(s, JSCAN_SYNTAX);
        }
    }
    return fail(s, JSCAN_SYNTAX);
}

/* -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)? */
static bool scan_number(struct scan *s) {
    if (s->p < s->end && *s->p == '-') s->p++;
    if (s->p >= s->end || !is_digit(*s->p)) return fail(s, JSCAN_SYNTAX);
    if (*s->p++ != '0')
        while (s->p < s->end && is_digit(*s->p)) s->p++;
    if (s->p < s->end && *s->p == '.') {
        s->p++;
        if (s->p >= s->end || !is_digit(*s->p)) return fail(s, JSCAN_SYNTAX);
        while (s->p < s->end && is_digit(*s->p)) s->p++;
    }
    if (s->p < s->end && (*s->p == 'e' || *s->p == 'E')) {
        s->p++;
        if (s->p < s->end && (*s->p == '+' || *s->p == '-')) s->p++;
        if (s->p >= s->end || !is_digit(*s->p)) return fail(s, JSCAN_SYNTAX);
        while (s->p < s->end && is_digit(*s->p)) s->p++;
    }
    return true;
}

static bool scan_literal(struct scan *s, const char *lit, size_t n) {
    if ((size_t)(s->end - s->p) < n) return fail(s, JSCAN_SYNTAX);
    for (size_t i = 0; i < n; i++)
        if (s->p[i] != lit[i]) return fail(s, JSCAN_SYNTAX);
    s->p += n;
    return true;
}

static bool scan_value(struct scan *s);

/* A container, s->p at its opening bracket; fn (top level only) gets each member. */
static bool scan_container(struct scan *s, int (*fn)(void *, const struct jscan_member *),
                           void *arg) {
    bool object = *s->p == '{';
    char close = object ? '}' : ']';
    if (++s->depth > s->max_depth) return fail(s, JSCAN_DEPTH);
    s->p++;
    skip_ws(s);
    if (s->p < s->end && *s->p == close) {
        s->p++;
        s->depth--;
        return true;
    }
    for (;;) {
        struct jscan_member m = {0};
        if (object) {
            bool esc;
            if (s->p >= s->end || *s->p != '"') return fail(s, JSCAN_SYNTAX);
            m.key = s->p + 1;
            if (!scan_string(s, &esc)) return false;
            m.key_len = (size_t)(s->p - 1 - m.key);
            m.key_escaped = esc;
            skip_ws(s);
            if (s->p >= s->end || *s->p != ':') return fail(s, JSCAN_SYNTAX);
            s->p++;
            skip_ws(s);
        }
        m.val = s->p;
        if (!scan_value(s)) return false;
        m.val_len = (size_t)(s->p - m.val);
        if (fn) {
            int rc = fn(arg, &m);
            if (rc) {
                s->err = rc;
                return false;
            }
        }
        skip_ws(s);
        if (s->p >= s->end) return fail(s, JSCAN_SYNTAX);
        if (*s->p == close) {
            s->p++;
            s->depth--;
            return true;
        }
        if (*s->p != ',') return fail(s, JSCAN_SYNTAX);
        s->p++;
        skip_ws(s);
    }
}

static bool scan_value(struct scan *s) {
    if (s->p >= s->end) return fail(s, JSCAN_SYNTAX);
    bool esc;
    switch (*s->p) {
    case '{':
    case '[':
        return scan_container(s, NULL, NULL);
    case '"':
        return scan_string(s, &esc);
    case 't':
        return scan_literal(s, "true", 4);
    case 'f':
        return scan_literal(s, "false", 5);
    case 'n':
        return scan_literal(s, "null", 4);
    default:
        return scan_number(s);
    }
}

int jscan_object(const char *buf, size_t len, int max_depth,
                 int (*fn)(void *arg, const struct jscan_member *m), void *arg) {
    if (utf8_check(buf, len, 0, NULL) != len) return JSCAN_SYNTAX;
    struct scan s = {buf, buf + len, 0, max_depth < 1 ? 1 : max_depth, 0};
    skip_ws(&s);
    if (s.p >= s.end || *s.p != '{') return JSCAN_SYNTAX;
    if (!scan_container(&s, fn, arg)) return s.err ? s.err : JSCAN_SYNTAX;
    skip_ws(&s);
    return s.p == s.end ? 0 : JSCAN_SYNTAX;
}

long jscan_u32_array(const char *val, size_t len, uint32_t *out, size_t max) {
    const char *p = val, *end = val + len;
    struct scan s = {p, end, 0, 0, 0};
    if (s.p >= end || *s.p != '[') return -1;
    s.p++;
    skip_ws(&s);
    if (s.p < end && *s.p == ']') return s.p + 1 == end ? 0 : -1;
    size_t n = 0;
    for (;;) {
        if (s.p >= end || !is_digit(*s.p)) return -1;
        if (*s.p == '0' && s.p + 1 < end && is_digit(s.p[1])) return -1;
        uint64_t v = 0;
        while (s.p < end && is_digit(*s.p)) {
            v = v * 10 + (uint64_t)(*s.p++ - '0');
            if (v > UINT32_MAX) return -1;
        }
        if (n == max) return -2;
        out[n++] = (uint32_t)v;
        skip_ws(&s);
        if (s.p >= end) return -1;
        if (*s.p == ']') return s.p + 1 == end ? (long)n : -1;
        if (*s.p++ != ',') return -1;
        skip_ws(&s);
    }
}
