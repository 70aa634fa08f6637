/* Error messages into caller-provided buffers (the errbuf/errlen convention of every library). */
#ifndef LMCACHE_BASE_ERRBUF_H
#define LMCACHE_BASE_ERRBUF_H

#include <stddef.h>

/* Formats into err (nothing when err is NULL or errlen is 0). */
void errbuf_set(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
