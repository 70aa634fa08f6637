/* ObjectKey: the identity of one cached KV object (chunk hash, model, rank, object group, salt),
 * the SHA-256 prefix chain that produces chunk hashes, the L2 object-name encoding and an
 * intern table that maps model names and salts to small integer ids.
 *
 * All functions are thread-safe unless noted; none allocates except the intern table. */
#ifndef LMCACHE_SERVER_KEYS_H
#define LMCACHE_SERVER_KEYS_H

#include <stddef.h>
#include <stdint.h>

#define KEYS_HASH_LEN       32  /* SHA-256 digest: what this server produces */
#define KEYS_HASH_MAX       32  /* longest chunk hash accepted from outside */
#define KEYS_MODEL_NAME_MAX 256 /* bytes, without the terminating NUL */
#define KEYS_SALT_MAX       128 /* characters (bytes), without the terminating NUL */
#define KEYS_ERR_MAX        160 /* a buffer this large holds every error message */
/* Longest L2 object name: model@8hex@8hex@64hex@salt + NUL. */
#define KEYS_L2_NAME_MAX                                                                           \
    (KEYS_MODEL_NAME_MAX + 1 + 8 + 1 + 8 + 1 + 2 * KEYS_HASH_MAX + 1 + KEYS_SALT_MAX + 1)

/* The chain seed used unless --hash-seed overrides it: SHA-256 of this ASCII string. */
#define KEYS_DEFAULT_SEED_STRING "lmcache-chunk-hash-v1"

/* ---- chunk hashing ------------------------------------------------------------------------
 * h_0 = SHA-256(seed ‖ tokens_0), h_i = SHA-256(h_{i-1} ‖ tokens_i), every token id written as a
 * big-endian uint32. The seed is 32 bytes; keys_seed_from_string() derives it from any string. */

/* seed = SHA-256(s). */
void keys_seed_from_string(const char *s, uint8_t seed[KEYS_HASH_LEN]);
/* seed = SHA-256(KEYS_DEFAULT_SEED_STRING). */
void keys_default_seed(uint8_t seed[KEYS_HASH_LEN]);

/* out = SHA-256(prev ‖ tokens[0..n)). Returns 0, or -1 if OpenSSL fails. */
int keys_chunk_hash(const uint8_t prev[KEYS_HASH_LEN], const uint32_t *tokens, size_t n,
                    uint8_t out[KEYS_HASH_LEN]);

/* Hashes the full chunks of a prompt: out[i] = h_i for i < min(ntokens / chunk_size, max_out).
 * Trailing tokens that do not fill a chunk are ignored. Returns the number of hashes written, or
 * -1 when chunk_size is 0 or OpenSSL fails. */
long keys_prefix_hashes(const uint8_t seed[KEYS_HASH_LEN], const uint32_t *tokens, size_t ntokens,
                        size_t chunk_size, uint8_t (*out)[KEYS_HASH_LEN], size_t max_out);

/* ---- hex ------------------------------------------------------------------------------------ */

/* Lowercase hex of in[0..n) into out (2n + 1 bytes with the NUL). */
void keys_hex_encode(const uint8_t *in, size_t n, char *out);
/* Decodes a chunk hash: 2..2*KEYS_HASH_MAX hex digits, an even count, either case. Short hashes
 * (e.g. "aa") are accepted because other implementations and tools use them; this server's own
 * hashes are always 32 bytes. Returns 0, or -1 with a message in err. */
int keys_hash_from_hex(const char *hex, size_t len, uint8_t out[KEYS_HASH_MAX], uint8_t *out_len,
                       char *err, size_t errlen);

/* ---- kv_rank -------------------------------------------------------------------------------
 * kv_rank = world_size << 24 | rank << 16 | world_size << 8 | rank (local = global, as the anchor
 * does). TP1 -> 0x01000100, TP4 rank 2 -> 0x04020402. */

/* Returns 0, or -1 with a message when world_size is not 1..255 or rank not 0..world_size-1. */
int keys_kv_rank_pack(long world_size, long rank, uint32_t *out, char *err, size_t errlen);
void keys_kv_rank_unpack(uint32_t kv_rank, unsigned *world_size, unsigned *rank);

/* ---- ObjectKey ------------------------------------------------------------------------------ */

struct keys_object_key {
    uint8_t hash[KEYS_HASH_MAX];
    uint8_t hash_len; /* 1..KEYS_HASH_MAX */
    uint32_t kv_rank;
    uint32_t object_group_id;
    char model_name[KEYS_MODEL_NAME_MAX + 1]; /* no '@', no NUL inside */
    char cache_salt[KEYS_SALT_MAX + 1];       /* "" = no salt; no '@' '/' '\' NUL */
};

/* Field checks on counted strings (a wire string may carry a NUL). Return 0, or -1 with a
 * message naming the field and the rule in err. */
int keys_check_model_name(const char *s, size_t len, char *err, size_t errlen);
int keys_check_cache_salt(const char *s, size_t len, char *err, size_t errlen);
int keys_check_object_group_id(long long group, char *err, size_t errlen);

/* Builds and validates a key from its JSON/wire form (EncodedObjectKey). Strings are counted;
 * cache_salt may be NULL for "". Returns 0, or -1 with a message in err (HTTP 400 material). */
int keys_object_key_init(struct keys_object_key *k, const char *hash_hex, size_t hash_hex_len,
                         const char *model_name, size_t model_len, uint32_t kv_rank,
                         long long object_group_id, const char *cache_salt, size_t salt_len,
                         char *err, size_t errlen);

/* L2 object name: <model_name>@<kv_rank, 8 lowercase hex>@<object_group_id, lowercase hex, no
 * padding>@<hash, lowercase hex>[@<cache_salt> when non-empty]. Writes a NUL-terminated name
 * into out and returns its length, or -1 when outlen is too small (KEYS_L2_NAME_MAX always
 * suffices). */
int keys_l2_name(const struct keys_object_key *k, char *out, size_t outlen);
/* Parses an L2 object name (4 or 5 '@'-separated fields; kv_rank exactly 8 hex digits; group 1..8
 * hex digits; hash as keys_hash_from_hex; a 5th field must be a non-empty valid salt). Returns 0,
 * or -1 with a message. Hex is accepted in either case, so encode(parse(x)) == x for lowercase x.
 */
int keys_l2_name_parse(const char *name, size_t len, struct keys_object_key *out, char *err,
                       size_t errlen);

/* ---- intern table ---------------------------------------------------------------------------
 * Maps strings to small ids below max_ids. A new string takes a never-used id (0, 1, 2, ...) or,
 * once those ran out, the id removed longest ago. Every id has a generation that
 * keys_intern_remove() bumps, so a (id, generation) pair names one string for ever even after
 * the id is reused: a holder that may outlive the string keeps both and compares. Lookups,
 * inserts and removals take the table's mutex (a leaf lock); keys_intern_str(),
 * keys_intern_gen() and keys_intern_count() take no lock. The string of an id stays valid until
 * that id is removed: a caller that reads it must exclude removal itself (L1 removes ids only
 * under its LRU lock). */

struct keys_intern;

struct keys_intern *keys_intern_create(uint32_t max_ids);
void keys_intern_destroy(struct keys_intern *t);
/* Returns 0 with the id and generation (gen may be NULL) of s, inserting it if new; -1 when
 * every id is in use or out of memory. */
int keys_intern(struct keys_intern *t, const char *s, size_t len, uint32_t *id, uint32_t *gen);
/* Returns 0 with the id and generation if s is interned, -1 otherwise. Never inserts. */
int keys_intern_find(struct keys_intern *t, const char *s, size_t len, uint32_t *id, uint32_t *gen);
/* Frees an id for reuse and bumps its generation. Returns 0, or -1 when the id is not in use. */
int keys_intern_remove(struct keys_intern *t, uint32_t id);
/* The current generation of an id (0 for ids never handed out). */
uint32_t keys_intern_gen(const struct keys_intern *t, uint32_t id);
/* The string of an id, or NULL if the id is not in use. */
const char *keys_intern_str(const struct keys_intern *t, uint32_t id);
/* One more than the highest id ever handed out: a bound for loops over ids (some may be free). */
uint32_t keys_intern_count(const struct keys_intern *t);
/* Ids currently in use. */
uint32_t keys_intern_used(struct keys_intern *t);

#endif
