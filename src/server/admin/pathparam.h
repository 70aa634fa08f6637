/* Percent-decoding of the admin API's request paths and checks of decoded path parameters.
 * libmicrohttpd decodes a path into a NUL-terminated string, so a `%00` would silently cut a
 * parameter short (`/quota/a%00b` naming tenant `a`); this decoder never produces a NUL byte. */
#ifndef LMCACHE_ADMIN_PATHPARAM_H
#define LMCACHE_ADMIN_PATHPARAM_H

#include <stddef.h>

struct MHD_Connection;

/* libmicrohttpd unescape callback (MHD_OPTION_UNESCAPE_CALLBACK): decodes %XX in place and
 * returns the decoded length. An encoded NUL becomes the two bytes C0 80 (an overlong form
 * that is not valid UTF-8), so the string stays NUL-free and every UTF-8 check rejects it. */
size_t pathparam_unescape(void *cls, struct MHD_Connection *conn, char *s);

/* Decodes len bytes of src (with %XX escapes) into dst (room for len + 1 bytes), encoding a
 * NUL as C0 80 as above. Returns the decoded length; dst is NUL-terminated. */
size_t pathparam_decode(const char *src, size_t len, char *dst);

/* 0 when s[0..len) is valid UTF-8 (no overlong forms, no surrogates) without control
 * characters (C0, DEL, C1); -1 with a message naming the byte offset otherwise. */
int pathparam_check_text(const char *s, size_t len, char *err, size_t errlen);

#endif
