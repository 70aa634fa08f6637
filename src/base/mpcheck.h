/* Structure check of a msgpack document without allocating, shared by the server's request
 * decoder and the client's reply decoder (header-only so the client library stays
 * self-contained). msgpack-c allocates a container's elements before reading them, so an
 * unchecked 5-byte map32 header could make it allocate gigabytes: decoders call this first. */
#ifndef LMCACHE_BASE_MPCHECK_H
#define LMCACHE_BASE_MPCHECK_H

#include <stddef.h>
#include <stdint.h>

/* Reads a big-endian length of n bytes at p. */
static inline uint64_t mpcheck_be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = v << 8 | p[i];
    return v;
}

/* Walks the first msgpack document of buf: every declared length must fit the buffer, a
 * container may not declare more elements than bytes remain (each needs at least one), and the
 * document may hold at most max_elements elements. Returns 0 and the document's length in *used,
 * or -1. */
static inline int mpcheck_document(const void *buf, size_t len, uint64_t max_elements,
                                   size_t *used) {
    const unsigned char *p = buf;
    size_t pos = 0;
    uint64_t pending = 1, seen = 0;
    while (pending > 0) {
        if (pos >= len || ++seen > max_elements) return -1;
        unsigned b = p[pos++];
        pending--;
        uint64_t skip = 0, add = 0;
        int lenbytes = 0;
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            skip = 0;
        } else if (b >= 0x80 && b <= 0x8f) {
            add = 2ULL * (b & 0x0f);
        } else if (b >= 0x90 && b <= 0x9f) {
            add = b & 0x0f;
        } else if (b >= 0xa0 && b <= 0xbf) {
            skip = b & 0x1f;
        } else {
            switch (b) {
            case 0xc4:
            case 0xd9:
                lenbytes = 1;
                break;
            case 0xc5:
            case 0xda:
                lenbytes = 2;
                break;
            case 0xc6:
            case 0xdb:
                lenbytes = 4;
                break;
            case 0xc7:
                lenbytes = 1;
                skip = 1;
                break; /* ext: length, then a type byte */
            case 0xc8:
                lenbytes = 2;
                skip = 1;
                break;
            case 0xc9:
                lenbytes = 4;
                skip = 1;
                break;
            case 0xca:
                skip = 4;
                break;
            case 0xcb:
                skip = 8;
                break;
            case 0xcc:
            case 0xd0:
                skip = 1;
                break;
            case 0xcd:
            case 0xd1:
                skip = 2;
                break;
            case 0xce:
            case 0xd2:
                skip = 4;
                break;
            case 0xcf:
            case 0xd3:
                skip = 8;
                break;
            case 0xd4:
                skip = 2;
                break;
            case 0xd5:
                skip = 3;
                break;
            case 0xd6:
                skip = 5;
                break;
            case 0xd7:
                skip = 9;
                break;
            case 0xd8:
                skip = 17;
                break;
            case 0xdc:
            case 0xde:
            case 0xdd:
            case 0xdf: {
                int n = (b == 0xdc || b == 0xde) ? 2 : 4;
                if (len - pos < (size_t)n) return -1;
                add = mpcheck_be(p + pos, n) * ((b == 0xde || b == 0xdf) ? 2 : 1);
                pos += (size_t)n;
                break;
            }
            default:
                return -1; /* 0xc1 is never used */
            }
        }
        if (lenbytes) {
            if (len - pos < (size_t)lenbytes) return -1;
            skip += mpcheck_be(p + pos, lenbytes);
            pos += (size_t)lenbytes;
        }
        if (skip > len - pos) return -1;
        pos += (size_t)skip;
        pending += add;
        if (pending > len - pos) return -1;
    }
    *used = pos;
    return 0;
}

#endif
