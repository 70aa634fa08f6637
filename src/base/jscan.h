/* A strict one-pass JSON scanner for request bodies whose bulk is one long array of numbers
 * (the master's routing query: 131072 token ids in about 1 MiB). A general DOM parser spends
 * microseconds per element there; this one checks the whole text against RFC 8259 and hands
 * back the members of the top-level object as spans, so that the caller decodes the long array
 * with jscan_u32_array and every small member with its usual parser.
 *
 * What it accepts: exactly one object (whitespace around it), strings of valid UTF-8 without
 * raw control characters, the escapes of RFC 8259 (a \u escape must be four hex digits; a
 * surrogate must be a proper pair), numbers of the JSON grammar, true, false, null, containers
 * nested at most max_depth deep (the top-level object counts as one). */
#ifndef LMCACHE_BASE_JSCAN_H
#define LMCACHE_BASE_JSCAN_H

#include <stddef.h>
#include <stdint.h>

struct jscan_member {
    const char *key; /* the key's raw text between its quotes (escapes not decoded) */
    size_t key_len;
    int key_escaped; /* the raw key holds a backslash: compare it decoded, not raw */
    const char *val; /* the value's text, from its first to its last byte */
    size_t val_len;
};

/* Checks buf[0..len) and calls fn for each member of the top-level object, in order. Returns
 * 0, JSCAN_SYNTAX for text that is not such an object (nothing is called after the first
 * error is found, but members before it may have been), JSCAN_DEPTH for nesting deeper than
 * max_depth, or fn's nonzero return. */
enum { JSCAN_SYNTAX = -1, JSCAN_DEPTH = -2 };
int jscan_object(const char *buf, size_t len, int max_depth,
                 int (*fn)(void *arg, const struct jscan_member *m), void *arg);

/* Reads a value that jscan_object accepted as an array of integers in [0, 2^32) (no fraction,
 * no exponent, no minus sign) into out[0..max). Returns the element count, -1 when the value
 * is not such an array, -2 when it has more than max elements. */
long jscan_u32_array(const char *val, size_t len, uint32_t *out, size_t max);

#endif
