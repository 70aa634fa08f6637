/* Reading the protobuf wire format, bounds-checked against the end of the buffer: varints,
 * field tags and length prefixes read exactly as protobuf-c reads them (tags and lengths of at
 * most 5 bytes, a tag with no field-number bits refused). Header-only, so that the master and
 * its C client library share one copy without a link dependency. Wire types: 0 varint,
 * 1 fixed64, 2 length-delimited, 5 fixed32; groups (3, 4) are refused as protobuf-c refuses
 * them. */
#ifndef LMCACHE_BASE_PBWIRE_H
#define LMCACHE_BASE_PBWIRE_H

#include <stddef.h>
#include <stdint.h>

/* A varint at *p (< end). 0 ok, -1 truncated or longer than 10 bytes. */
static inline int pbw_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    for (unsigned i = 0; i < 10; i++) {
        if (*p >= end) return -1;
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << (7 * i);
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

/* A field's tag: at most 5 bytes, bits past 32 dropped. */
static inline int pbw_tag(const uint8_t **p, const uint8_t *end, uint32_t *field, unsigned *wt) {
    const uint8_t *d = *p;
    size_t max = (size_t)(end - d) < 5 ? (size_t)(end - d) : 5;
    if (!max || !(d[0] & 0xf8)) return -1;
    *wt = d[0] & 7;
    uint32_t tag = (uint32_t)(d[0] & 0x7f) >> 3;
    if (!(d[0] & 0x80)) {
        *field = tag;
        *p = d + 1;
        return 0;
    }
    unsigned shift = 4;
    for (size_t i = 1; i < max; i++, shift += 7) {
        tag |= (uint32_t)(d[i] & 0x7f) << shift;
        if (!(d[i] & 0x80)) {
            *field = tag;
            *p = d + i + 1;
            return 0;
        }
    }
    return -1;
}

/* A length prefix: at most 5 bytes, and the data it announces inside the buffer. */
static inline int pbw_len(const uint8_t **p, const uint8_t *end, uint64_t *len) {
    const uint8_t *d = *p;
    size_t max = (size_t)(end - d) < 5 ? (size_t)(end - d) : 5;
    uint64_t v = 0;
    for (size_t i = 0; i < max; i++) {
        v |= (uint64_t)(d[i] & 0x7f) << (7 * i);
        if (!(d[i] & 0x80)) {
            if (v > (uint64_t)(end - d) - (i + 1)) return -1;
            *len = v;
            *p = d + i + 1;
            return 0;
        }
    }
    return -1;
}

/* Skips the value of one field of wire type wt. */
static inline int pbw_skip(const uint8_t **p, const uint8_t *end, unsigned wt) {
    uint64_t v;
    switch (wt) {
    case 0:
        return pbw_varint(p, end, &v);
    case 1:
    case 5: {
        size_t w = wt == 1 ? 8 : 4;
        if ((size_t)(end - *p) < w) return -1;
        *p += w;
        return 0;
    }
    case 2:
        if (pbw_len(p, end, &v)) return -1;
        *p += v;
        return 0;
    default:
        return -1;
    }
}

/* One field of a message. */
struct pbw_field {
    uint32_t num;
    unsigned wt;
    uint64_t v;         /* the varint (wire type 0) or the length (2) */
    const uint8_t *ptr; /* wire type 2: the bytes */
};

/* 1: the next field in *f; 0: end of the message; -1: malformed. */
static inline int pbw_next(const uint8_t **p, const uint8_t *end, struct pbw_field *f) {
    if (*p >= end) return 0;
    if (pbw_tag(p, end, &f->num, &f->wt)) return -1;
    switch (f->wt) {
    case 0:
        return pbw_varint(p, end, &f->v) ? -1 : 1;
    case 2:
        if (pbw_len(p, end, &f->v)) return -1;
        f->ptr = *p;
        *p += f->v;
        return 1;
    default:
        return pbw_skip(p, end, f->wt) ? -1 : 1;
    }
}

#endif
