/* Growable byte buffer for building responses. */
#ifndef LMCACHE_BASE_STRBUF_H
#define LMCACHE_BASE_STRBUF_H

#include <stdarg.h>
#include <stddef.h>

struct strbuf {
    char *buf; /* always NUL-terminated when len > 0 or after any append */
    size_t len;
    size_t cap;
    int oom; /* set once an allocation failed; further appends are dropped */
};

#define STRBUF_INIT                                                                                \
    { NULL, 0, 0, 0 }

int sb_append(struct strbuf *sb, const char *data, size_t len);
int sb_puts(struct strbuf *sb, const char *s);
int sb_printf(struct strbuf *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int sb_vprintf(struct strbuf *sb, const char *fmt, va_list ap);
/* Detaches the buffer (caller frees); never NULL unless OOM. */
char *sb_detach(struct strbuf *sb, size_t *len);
void sb_free(struct strbuf *sb);

#endif
