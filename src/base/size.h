/* Size strings: "100GiB", "512m", "4096" (base 1024). */
#ifndef LMCACHE_BASE_SIZE_H
#define LMCACHE_BASE_SIZE_H

#include <stddef.h>
#include <stdint.h>

/* Parses an integer byte count or a number with a unit suffix (b, k/kib, m/mib,
 * g/gib, t/tib; case-insensitive; base 1024; a fractional number is allowed with
 * a unit, e.g. "1.5GiB"). Returns 0 and *out, or -1 with err filled (also
 * for zero, negative, or overflowing values). */
int size_parse(const char *s, uint64_t *out, char *err, size_t errlen);

#endif
