/* Strict UTF-8 validation (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF)
 * for text that arrives from the network, with optional bans on NUL and control characters.
 * One checker serves every decoder so they agree on what counts as text. */
#ifndef LMCACHE_BASE_UTF8_H
#define LMCACHE_BASE_UTF8_H

#include <stddef.h>

enum {
    UTF8_NO_NUL = 1,    /* U+0000 is an error (UTF8_NUL): C strings would be cut there */
    UTF8_NO_CONTROL = 2 /* C0 controls (U+0000-U+001F), DEL and C1 (U+007F-U+009F) are errors */
};

enum utf8_reason {
    UTF8_OK = 0,
    UTF8_INVALID,     /* bad lead or continuation byte, overlong form, surrogate, > U+10FFFF */
    UTF8_TRUNCATED,   /* a multi-byte sequence runs past the end */
    UTF8_ENCODED_NUL, /* C0 80, the overlong NUL (what some decoders make of %00): invalid */
    UTF8_NUL,         /* a NUL byte, with UTF8_NO_NUL */
    UTF8_CONTROL      /* a control character, with UTF8_NO_CONTROL */
};

struct utf8_error {
    enum utf8_reason reason;
    size_t at; /* offset of the offending byte: the bad continuation byte itself for one, else
                  the start of the sequence */
};

/* Checks s[0..len) and returns the length of its longest valid prefix: len when all of it is
 * valid, else the offset where the first bad sequence starts. e (may be NULL) gets the reason
 * and offset (UTF8_OK and len on success). */
size_t utf8_check(const char *s, size_t len, unsigned flags, struct utf8_error *e);

/* A short English description of reason ("not valid UTF-8", "a control character", ...). */
const char *utf8_reason_str(enum utf8_reason reason);

#endif
