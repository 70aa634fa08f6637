/* Growable byte buffer. */
#include "base/strbuf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int grow(struct strbuf *sb, size_t need) {
    if (sb->oom) return -1;
    if (sb->len + need + 1 <= sb->cap) return 0;
    size_t cap = sb->cap ? sb->cap : 256;
    while (cap < sb->len + need + 1) {
        if (cap > ((size_t)-1) / 2) {
            sb->oom = 1;
            return -1;
        }
        cap *= 2;
    }
    char *p = realloc(sb->buf, cap);
    if (!p) {
        sb->oom = 1;
        return -1;
    }
    sb->buf = p;
    sb->cap = cap;
    return 0;
}

int sb_append(struct strbuf *sb, const char *data, size_t len) {
    if (grow(sb, len) < 0) return -1;
    if (len) memcpy(sb->buf + sb->len, data, len);
    sb->len += len;
    sb->buf[sb->len] = 0;
    return 0;
}

int sb_puts(struct strbuf *sb, const char *s) { return sb_append(sb, s, strlen(s)); }

int sb_vprintf(struct strbuf *sb, const char *fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n < 0 || grow(sb, (size_t)n) < 0) return -1;
    vsnprintf(sb->buf + sb->len, (size_t)n + 1, fmt, ap);
    sb->len += (size_t)n;
    return 0;
}

int sb_printf(struct strbuf *sb, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = sb_vprintf(sb, fmt, ap);
    va_end(ap);
    return rc;
}

char *sb_detach(struct strbuf *sb, size_t *len) {
    if (sb->oom) {
        sb_free(sb);
        return NULL;
    }
    if (!sb->buf && grow(sb, 0) < 0) return NULL;
    if (!sb->buf) return NULL;
    sb->buf[sb->len] = 0;
    char *p = sb->buf;
    if (len) *len = sb->len;
    sb->buf = NULL;
    sb->len = sb->cap = 0;
    return p;
}

void sb_free(struct strbuf *sb) {
    free(sb->buf);
    sb->buf = NULL;
    sb->len = sb->cap = 0;
    sb->oom = 0;
}
