/* FNV-1a string and byte hashes (32- and 64-bit) for in-memory tables. The 64-bit offset basis
 * is the specified 14695981039346656037 (older copies in the tree dropped its last digit). Not
 * for hostile input that could choose collisions at scale: chains stay correct, only slower. */
#ifndef LMCACHE_BASE_HASH_H
#define LMCACHE_BASE_HASH_H

#include <stddef.h>
#include <stdint.h>

#define FNV1A32_INIT 2166136261u
#define FNV1A64_INIT 14695981039346656037ull

/* Folds n bytes into a running hash h (start from FNV1A32_INIT / FNV1A64_INIT), so a key made of
 * several fields hashes without being copied into one buffer. */
static inline uint32_t fnv1a32_add(uint32_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 16777619u;
    return h;
}

static inline uint64_t fnv1a64_add(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

static inline uint32_t fnv1a32(const void *p, size_t n) { return fnv1a32_add(FNV1A32_INIT, p, n); }
static inline uint64_t fnv1a64(const void *p, size_t n) { return fnv1a64_add(FNV1A64_INIT, p, n); }

/* The same over a NUL-terminated string (the NUL is not hashed). */
static inline uint32_t fnv1a32_str(const char *s) {
    uint32_t h = FNV1A32_INIT;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

static inline uint64_t fnv1a64_str(const char *s) {
    uint64_t h = FNV1A64_INIT;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

#endif
