/* ObjectKey validation, the SHA-256 chunk-hash chain, L2 object names and the intern table. */
#include "server/keys.h"

#include "base/errbuf.h"
#include "base/hash.h"

#include <openssl/evp.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- chunk hashing -------------------------------------------------------------------------- */

void keys_seed_from_string(const char *s, uint8_t seed[KEYS_HASH_LEN]) {
    SHA256((const unsigned char *)s, strlen(s), seed);
}

void keys_default_seed(uint8_t seed[KEYS_HASH_LEN]) {
    keys_seed_from_string(KEYS_DEFAULT_SEED_STRING, seed);
}

/* Feeds tokens as big-endian uint32 in stack-sized batches. */
static int digest_tokens(EVP_MD_CTX *ctx, const uint32_t *tokens, size_t n) {
    uint8_t buf[1024];
    while (n > 0) {
        size_t b = n < sizeof(buf) / 4 ? n : sizeof(buf) / 4;
        for (size_t i = 0; i < b; i++) {
            uint32_t t = tokens[i];
            buf[4 * i] = (uint8_t)(t >> 24);
            buf[4 * i + 1] = (uint8_t)(t >> 16);
            buf[4 * i + 2] = (uint8_t)(t >> 8);
            buf[4 * i + 3] = (uint8_t)t;
        }
        if (EVP_DigestUpdate(ctx, buf, 4 * b) != 1) return -1;
        tokens += b;
        n -= b;
    }
    return 0;
}

static int chain_step(EVP_MD_CTX *ctx, const uint8_t prev[KEYS_HASH_LEN], const uint32_t *tokens,
                      size_t n, uint8_t out[KEYS_HASH_LEN]) {
    unsigned int olen = 0;
    if (EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) != 1) return -1;
    if (EVP_DigestUpdate(ctx, prev, KEYS_HASH_LEN) != 1) return -1;
    if (digest_tokens(ctx, tokens, n) != 0) return -1;
    if (EVP_DigestFinal_ex(ctx, out, &olen) != 1 || olen != KEYS_HASH_LEN) return -1;
    return 0;
}

int keys_chunk_hash(const uint8_t prev[KEYS_HASH_LEN], const uint32_t *tokens, size_t n,
                    uint8_t out[KEYS_HASH_LEN]) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return -1;
    int rc = chain_step(ctx, prev, tokens, n, out);
    EVP_MD_CTX_free(ctx);
    return rc;
}

long keys_prefix_hashes(const uint8_t seed[KEYS_HASH_LEN], const uint32_t *tokens, size_t ntokens,
                        size_t chunk_size, uint8_t (*out)[KEYS_HASH_LEN], size_t max_out) {
    if (chunk_size == 0) return -1;
    size_t nchunks = ntokens / chunk_size;
    if (nchunks > max_out) nchunks = max_out;
    if (nchunks == 0) return 0;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx) return -1;
    const uint8_t *prev = seed;
    for (size_t i = 0; i < nchunks; i++) {
        if (chain_step(ctx, prev, tokens + i * chunk_size, chunk_size, out[i]) != 0) {
            EVP_MD_CTX_free(ctx);
            return -1;
        }
        prev = out[i];
    }
    EVP_MD_CTX_free(ctx);
    return (long)nchunks;
}

/* ---- hex ------------------------------------------------------------------------------------ */

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

void keys_hex_encode(const uint8_t *in, size_t n, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[in[i] >> 4];
        out[2 * i + 1] = digits[in[i] & 15];
    }
    out[2 * n] = '\0';
}

int keys_hash_from_hex(const char *hex, size_t len, uint8_t out[KEYS_HASH_MAX], uint8_t *out_len,
                       char *err, size_t errlen) {
    if (len == 0) {
        errbuf_set(err, errlen, "chunk hash hex must not be empty");
        return -1;
    }
    if (len % 2 != 0) {
        errbuf_set(err, errlen, "chunk hash hex must have an even number of digits (got %zu)", len);
        return -1;
    }
    if (len > 2 * KEYS_HASH_MAX) {
        errbuf_set(err, errlen, "chunk hash hex must be at most %d digits (got %zu)",
                   2 * KEYS_HASH_MAX, len);
        return -1;
    }
    for (size_t i = 0; i < len; i += 2) {
        int hi = hexval(hex[i]), lo = hexval(hex[i + 1]);
        if (hi < 0 || lo < 0) {
            errbuf_set(err, errlen, "chunk hash hex has a non-hex character at position %zu",
                       hi < 0 ? i : i + 1);
            return -1;
        }
        out[i / 2] = (uint8_t)(hi << 4 | lo);
    }
    *out_len = (uint8_t)(len / 2);
    return 0;
}

/* ---- kv_rank -------------------------------------------------------------------------------- */

int keys_kv_rank_pack(long world_size, long rank, uint32_t *out, char *err, size_t errlen) {
    if (world_size < 1 || world_size > 255) {
        errbuf_set(err, errlen, "world_size must be 1..255 (got %ld)", world_size);
        return -1;
    }
    if (rank < 0 || rank >= world_size) {
        errbuf_set(err, errlen, "rank must be 0..%ld (got %ld)", world_size - 1, rank);
        return -1;
    }
    uint32_t w = (uint32_t)world_size, r = (uint32_t)rank;
    *out = w << 24 | r << 16 | w << 8 | r;
    return 0;
}

void keys_kv_rank_unpack(uint32_t kv_rank, unsigned *world_size, unsigned *rank) {
    if (world_size) *world_size = kv_rank >> 24;
    if (rank) *rank = (kv_rank >> 16) & 0xff;
}

/* ---- ObjectKey ------------------------------------------------------------------------------ */

int keys_check_model_name(const char *s, size_t len, char *err, size_t errlen) {
    if (len > KEYS_MODEL_NAME_MAX) {
        errbuf_set(err, errlen, "model_name must be at most %d bytes (got %zu)",
                   KEYS_MODEL_NAME_MAX, len);
        return -1;
    }
    for (size_t i = 0; i < len; i++) {
        if (s[i] == '@') {
            errbuf_set(err, errlen, "model_name must not contain '@' (position %zu)", i);
            return -1;
        }
        if (s[i] == '\0') {
            errbuf_set(err, errlen, "model_name must not contain a NUL character (position %zu)",
                       i);
            return -1;
        }
    }
    return 0;
}

int keys_check_cache_salt(const char *s, size_t len, char *err, size_t errlen) {
    if (len > KEYS_SALT_MAX) {
        errbuf_set(err, errlen, "cache_salt must be at most %d characters (got %zu)", KEYS_SALT_MAX,
                   len);
        return -1;
    }
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (c == '@' || c == '/' || c == '\\') {
            errbuf_set(err, errlen, "cache_salt must not contain '%c' (position %zu)", c, i);
            return -1;
        }
        if (c == '\0') {
            errbuf_set(err, errlen, "cache_salt must not contain a NUL character (position %zu)",
                       i);
            return -1;
        }
    }
    return 0;
}

int keys_check_object_group_id(long long group, char *err, size_t errlen) {
    if (group < 0) {
        errbuf_set(err, errlen, "object_group_id must be >= 0 (got %lld)", group);
        return -1;
    }
    if (group > (long long)UINT32_MAX) {
        errbuf_set(err, errlen, "object_group_id must be at most %u (got %lld)", UINT32_MAX, group);
        return -1;
    }
    return 0;
}

int keys_object_key_init(struct keys_object_key *k, const char *hash_hex, size_t hash_hex_len,
                         const char *model_name, size_t model_len, uint32_t kv_rank,
                         long long object_group_id, const char *cache_salt, size_t salt_len,
                         char *err, size_t errlen) {
    memset(k, 0, sizeof(*k));
    if (!cache_salt) salt_len = 0;
    if (!hash_hex || !model_name) {
        errbuf_set(err, errlen, "%s is required", hash_hex ? "model_name" : "chunk_hash_hex");
        return -1;
    }
    if (keys_hash_from_hex(hash_hex, hash_hex_len, k->hash, &k->hash_len, err, errlen) != 0)
        return -1;
    if (keys_check_model_name(model_name, model_len, err, errlen) != 0) return -1;
    if (keys_check_object_group_id(object_group_id, err, errlen) != 0) return -1;
    if (keys_check_cache_salt(cache_salt, salt_len, err, errlen) != 0) return -1;
    memcpy(k->model_name, model_name, model_len);
    k->model_name[model_len] = '\0';
    if (salt_len) memcpy(k->cache_salt, cache_salt, salt_len);
    k->cache_salt[salt_len] = '\0';
    k->kv_rank = kv_rank;
    k->object_group_id = (uint32_t)object_group_id;
    return 0;
}

int keys_l2_name(const struct keys_object_key *k, char *out, size_t outlen) {
    char hex[2 * KEYS_HASH_MAX + 1];
    keys_hex_encode(k->hash, k->hash_len, hex);
    int n;
    if (k->cache_salt[0])
        n = snprintf(out, outlen, "%s@%08x@%x@%s@%s", k->model_name, k->kv_rank, k->object_group_id,
                     hex, k->cache_salt);
    else
        n = snprintf(out, outlen, "%s@%08x@%x@%s", k->model_name, k->kv_rank, k->object_group_id,
                     hex);
    if (n < 0 || (size_t)n >= outlen) return -1;
    return n;
}

/* Parses 1..maxdigits hex digits into *v. */
static int parse_hex_u32(const char *s, size_t len, size_t mindigits, size_t maxdigits,
                         uint32_t *v) {
    if (len < mindigits || len > maxdigits) return -1;
    uint32_t x = 0;
    for (size_t i = 0; i < len; i++) {
        int d = hexval(s[i]);
        if (d < 0) return -1;
        x = x << 4 | (uint32_t)d;
    }
    *v = x;
    return 0;
}

int keys_l2_name_parse(const char *name, size_t len, struct keys_object_key *out, char *err,
                       size_t errlen) {
    const char *f[6];
    size_t fl[6];
    size_t nf = 0, start = 0;
    memset(out, 0, sizeof(*out));
    for (size_t i = 0; i <= len; i++) {
        if (i == len || name[i] == '@') {
            if (nf == 6) break;
            f[nf] = name + start;
            fl[nf] = i - start;
            nf++;
            start = i + 1;
        }
    }
    if (nf != 4 && nf != 5) {
        errbuf_set(err, errlen, "L2 object name must have 4 or 5 '@'-separated fields (got %s%zu)",
                   nf == 6 ? "more than " : "", nf == 6 ? (size_t)5 : nf);
        return -1;
    }
    uint32_t rank, group;
    if (parse_hex_u32(f[1], fl[1], 8, 8, &rank) != 0) {
        errbuf_set(err, errlen, "L2 object name: kv_rank must be exactly 8 hex digits");
        return -1;
    }
    if (parse_hex_u32(f[2], fl[2], 1, 8, &group) != 0) {
        errbuf_set(err, errlen, "L2 object name: object_group_id must be 1 to 8 hex digits");
        return -1;
    }
    if (nf == 5 && fl[4] == 0) {
        errbuf_set(err, errlen, "L2 object name: the cache_salt field must not be empty");
        return -1;
    }
    char e2[KEYS_ERR_MAX];
    if (keys_object_key_init(out, f[3], fl[3], f[0], fl[0], rank, group, nf == 5 ? f[4] : NULL,
                             nf == 5 ? fl[4] : 0, e2, sizeof(e2)) != 0) {
        errbuf_set(err, errlen, "L2 object name: %s", e2);
        return -1;
    }
    return 0;
}

/* ---- intern table --------------------------------------------------------------------------- */

struct keys_intern {
    pthread_mutex_t mu;
    uint32_t max_ids;
    _Atomic uint32_t count; /* ids handed out so far (high-water mark) */
    uint32_t used;          /* ids currently naming a string */
    char *_Atomic *strs;    /* [max_ids], published with release stores; NULL = free id */
    _Atomic uint32_t *gens; /* [max_ids], bumped when an id is removed */
    uint32_t *slots;        /* open addressing: id + 1, 0 = empty */
    uint32_t *slot_hashes;  /* cached hash per slot */
    uint32_t nslots;        /* power of two, >= 2 * max_ids */
    uint32_t *free_ring;    /* removed ids, reused oldest first */
    uint32_t free_head, free_n;
};

static uint32_t str_hash(const char *s, size_t len) { return fnv1a32(s, len); }

struct keys_intern *keys_intern_create(uint32_t max_ids) {
    if (max_ids == 0 || max_ids > (1u << 24)) return NULL;
    struct keys_intern *t = calloc(1, sizeof(*t));
    if (!t) return NULL;
    t->max_ids = max_ids;
    t->nslots = 16;
    while (t->nslots < 2 * max_ids) t->nslots <<= 1;
    t->strs = calloc(max_ids, sizeof(*t->strs));
    t->gens = calloc(max_ids, sizeof(*t->gens));
    t->free_ring = calloc(max_ids, sizeof(*t->free_ring));
    t->slots = calloc(t->nslots, sizeof(*t->slots));
    t->slot_hashes = calloc(t->nslots, sizeof(*t->slot_hashes));
    if (!t->strs || !t->gens || !t->free_ring || !t->slots || !t->slot_hashes ||
        pthread_mutex_init(&t->mu, NULL) != 0) {
        free(t->strs);
        free(t->gens);
        free(t->free_ring);
        free(t->slots);
        free(t->slot_hashes);
        free(t);
        return NULL;
    }
    return t;
}

void keys_intern_destroy(struct keys_intern *t) {
    if (!t) return;
    uint32_t n = atomic_load(&t->count);
    for (uint32_t i = 0; i < n; i++) free(atomic_load(&t->strs[i]));
    free(t->strs);
    free(t->gens);
    free(t->free_ring);
    free(t->slots);
    free(t->slot_hashes);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* Caller holds t->mu. Returns the slot holding s or the empty slot where it belongs. */
static uint32_t do_intern_probe(struct keys_intern *t, const char *s, size_t len, uint32_t h) {
    uint32_t mask = t->nslots - 1;
    for (uint32_t i = h & mask;; i = (i + 1) & mask) {
        uint32_t v = t->slots[i];
        if (v == 0) return i;
        if (t->slot_hashes[i] == h) {
            const char *x = atomic_load_explicit(&t->strs[v - 1], memory_order_relaxed);
            if (strlen(x) == len && memcmp(x, s, len) == 0) return i;
        }
    }
}

static int intern_common(struct keys_intern *t, const char *s, size_t len, uint32_t *id,
                         uint32_t *gen, bool insert) {
    uint32_t h = str_hash(s, len);
    int rc = -1;
    pthread_mutex_lock(&t->mu);
    uint32_t slot = do_intern_probe(t, s, len, h);
    if (t->slots[slot] != 0) {
        *id = t->slots[slot] - 1;
        rc = 0;
    } else if (insert && t->used < t->max_ids) {
        char *copy = malloc(len + 1);
        if (copy) {
            uint32_t n;
            if (t->free_n) { /* the oldest removed id: its generation moved on when removed */
                n = t->free_ring[t->free_head];
                t->free_head = (t->free_head + 1) % t->max_ids;
                t->free_n--;
            } else {
                n = atomic_load_explicit(&t->count, memory_order_relaxed);
            }
            memcpy(copy, s, len);
            copy[len] = '\0';
            atomic_store_explicit(&t->strs[n], copy, memory_order_release);
            if (n == atomic_load_explicit(&t->count, memory_order_relaxed))
                atomic_store_explicit(&t->count, n + 1, memory_order_release);
            t->slots[slot] = n + 1;
            t->slot_hashes[slot] = h;
            t->used++;
            *id = n;
            rc = 0;
        }
    }
    if (rc == 0 && gen) *gen = atomic_load_explicit(&t->gens[*id], memory_order_relaxed);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int keys_intern(struct keys_intern *t, const char *s, size_t len, uint32_t *id, uint32_t *gen) {
    return intern_common(t, s, len, id, gen, true);
}

int keys_intern_find(struct keys_intern *t, const char *s, size_t len, uint32_t *id,
                     uint32_t *gen) {
    return intern_common(t, s, len, id, gen, false);
}

int keys_intern_remove(struct keys_intern *t, uint32_t id) {
    int rc = -1;
    pthread_mutex_lock(&t->mu);
    char *str = id < atomic_load_explicit(&t->count, memory_order_relaxed)
                    ? atomic_load_explicit(&t->strs[id], memory_order_relaxed)
                    : NULL;
    if (str) {
        uint32_t mask = t->nslots - 1;
        uint32_t i = do_intern_probe(t, str, strlen(str), str_hash(str, strlen(str)));
        /* Backward-shift deletion keeps every probe chain unbroken without tombstones: an entry
         * after the hole moves into it unless its home slot lies cyclically in (hole, entry]. */
        t->slots[i] = 0;
        for (uint32_t j = (i + 1) & mask; t->slots[j] != 0; j = (j + 1) & mask) {
            uint32_t home = t->slot_hashes[j] & mask;
            bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
            if (stays) continue;
            t->slots[i] = t->slots[j];
            t->slot_hashes[i] = t->slot_hashes[j];
            t->slots[j] = 0;
            i = j;
        }
        atomic_store_explicit(&t->strs[id], NULL, memory_order_release);
        atomic_fetch_add_explicit(&t->gens[id], 1, memory_order_relaxed);
        t->free_ring[(t->free_head + t->free_n) % t->max_ids] = id;
        t->free_n++;
        t->used--;
        free(str);
        rc = 0;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

uint32_t keys_intern_gen(const struct keys_intern *t, uint32_t id) {
    if (id >= atomic_load_explicit(&t->count, memory_order_acquire)) return 0;
    return atomic_load_explicit(&((struct keys_intern *)t)->gens[id], memory_order_relaxed);
}

const char *keys_intern_str(const struct keys_intern *t, uint32_t id) {
    if (id >= atomic_load_explicit(&t->count, memory_order_acquire)) return NULL;
    return atomic_load_explicit(&t->strs[id], memory_order_acquire);
}

uint32_t keys_intern_count(const struct keys_intern *t) {
    return atomic_load_explicit(&t->count, memory_order_acquire);
}

uint32_t keys_intern_used(struct keys_intern *t) {
    pthread_mutex_lock(&t->mu);
    uint32_t n = t->used;
    pthread_mutex_unlock(&t->mu);
    return n;
}
