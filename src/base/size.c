/* Size strings with base-1024 unit suffixes. */
#include "base/size.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/errbuf.h"

static const struct {
    const char *suffix;
    int shift;
} UNITS[] = {
    {"", 0},     {"b", 0},  {"k", 10},   {"kib", 10}, {"m", 20},
    {"mib", 20}, {"g", 30}, {"gib", 30}, {"t", 40},   {"tib", 40},
};

int size_parse(const char *s, uint64_t *out, char *err, size_t errlen) {
    if (!s) {
        errbuf_set(err, errlen, "size is missing");
        return -1;
    }
    while (isspace((unsigned char)*s)) s++;
    const char *p = s;
    while (isdigit((unsigned char)*p) || *p == '.') p++;
    if (p == s) {
        errbuf_set(err, errlen, "invalid size '%s'", s);
        return -1;
    }
    char num[64];
    size_t nlen = (size_t)(p - s);
    if (nlen >= sizeof(num)) {
        errbuf_set(err, errlen, "invalid size '%s'", s);
        return -1;
    }
    memcpy(num, s, nlen);
    num[nlen] = 0;
    char unit[8];
    size_t ulen = 0;
    while (isspace((unsigned char)*p)) p++;
    while (*p && !isspace((unsigned char)*p)) {
        if (ulen + 1 >= sizeof(unit)) {
            errbuf_set(err, errlen, "invalid size unit in '%s'", s);
            return -1;
        }
        unit[ulen++] = *p++;
    }
    unit[ulen] = 0;
    while (isspace((unsigned char)*p)) p++;
    if (*p) {
        errbuf_set(err, errlen, "invalid size '%s'", s);
        return -1;
    }
    int shift = -1;
    for (size_t i = 0; i < sizeof(UNITS) / sizeof(UNITS[0]); i++)
        if (strcasecmp(unit, UNITS[i].suffix) == 0) shift = UNITS[i].shift;
    if (shift < 0) {
        errbuf_set(err, errlen, "unknown size unit '%s' (use b, kib, mib, gib, tib)", unit);
        return -1;
    }
    uint64_t v;
    if (strchr(num, '.')) {
        char *end;
        errno = 0;
        double d = strtod(num, &end);
        double scaled = ldexp(d, shift);
        if (*end || errno || !isfinite(scaled) || scaled >= 18446744073709551615.0) {
            errbuf_set(err, errlen, "invalid size '%s'", s);
            return -1;
        }
        v = (uint64_t)scaled;
    } else {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(num, &end, 10);
        if (*end || errno || (shift && n > (UINT64_MAX >> shift))) {
            errbuf_set(err, errlen, "size '%s' is out of range", s);
            return -1;
        }
        v = (uint64_t)n << shift;
    }
    if (v == 0) {
        errbuf_set(err, errlen, "size must be positive");
        return -1;
    }
    *out = v;
    return 0;
}
