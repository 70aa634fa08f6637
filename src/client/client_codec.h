/* liblmcache-client internals (client_codec.c) shared by client.c and its unit tests: the msgpack
 * request encoder and reply decoder. Not installed; the symbols are hidden in the shared library.
 */
#ifndef LMCACHE_CLIENT_CLIENT_CODEC_H
#define LMCACHE_CLIENT_CLIENT_CODEC_H

#include <msgpack.h>

#include "lmcache/client.h"

/* A request payload under construction: one msgpack map whose header is patched at the end
 * (a map32 header is reserved up front so fields can be added without counting them first). */
struct lmcc_map {
    msgpack_sbuffer buf;
    msgpack_packer pk;
    uint32_t n;
    int failed; /* an allocation failed; the payload must not be sent */
};

void lmcc_map_init(struct lmcc_map *m);
/* Patches the header; returns 0, or -1 when a write failed. */
int lmcc_map_finish(struct lmcc_map *m);
void lmcc_map_destroy(struct lmcc_map *m);
/* Makes room for `extra` more bytes at once (a large payload then costs one allocation and no
 * regrowth copies). 0, or -1 when out of memory. */
int lmcc_map_reserve(struct lmcc_map *m, size_t extra);
/* Moves the bytes written so far into `buf` (malloc'ed, `cap` bytes, at least the size written)
 * and makes it the map's buffer; the old one is freed. */
void lmcc_map_adopt(struct lmcc_map *m, char *buf, size_t cap);

/* A key of the map; the caller packs its value next (counted as one field). */
void lmcc_put_key(struct lmcc_map *m, const char *key);
void lmcc_put_str(struct lmcc_map *m, const char *key, const char *val);
void lmcc_put_int(struct lmcc_map *m, const char *key, int64_t val);
void lmcc_put_bool(struct lmcc_map *m, const char *key, bool val);
void lmcc_put_i64_array(struct lmcc_map *m, const char *key, const int64_t *v, size_t n);
/* The same for unsigned 32-bit values (token ids), encoded without a packer call each. */
void lmcc_put_u32_array(struct lmcc_map *m, const char *key, const uint32_t *v, size_t n);
/* The chunk fields of docs/protocol.md (token_ids or chunk_hashes, start, end, cache_salt).
 * Returns LMC_OK or LMC_ERR_INVALID_ARGUMENT (err filled). */
lmc_status lmcc_put_chunks(struct lmcc_map *m, const lmc_chunks *ch, lmc_error *err);
void lmcc_put_layout(struct lmcc_map *m, const lmc_kv_layout *l);

/* 0 when `data` is exactly one msgpack object whose every length and element count fits in the
 * bytes that follow it (so decoding it allocates O(len)); -1 otherwise. Linear, no recursion. */
int lmcc_check_structure(const char *data, size_t len);
/* Decodes a reply body: it must be a msgpack map with a boolean `ok`. On success *map points into
 * `up` (which the caller destroys). */
lmc_status lmcc_decode_reply(const char *body, size_t len, msgpack_unpacked *up,
                             const msgpack_object **map, lmc_error *err);
/* Looks a key up in a decoded map; NULL when absent. */
const msgpack_object *lmcc_map_get(const msgpack_object *map, const char *key);
/* LMC_OK for ok=true; otherwise the status of `code`, with err filled from code/message. */
lmc_status lmcc_reply_error(const msgpack_object *map, lmc_error *err);
/* Parses a request id frame written by this library (decimal ASCII); 0 when it is not one. */
uint64_t lmcc_parse_id(const char *s, size_t len);

void lmcc_set_error(lmc_error *err, lmc_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Resets err (may be NULL) to LMC_OK with empty code and message. */
void lmcc_clear_error(lmc_error *err);

#endif
