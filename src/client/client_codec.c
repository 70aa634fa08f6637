/* liblmcache-client's codec: status names, the msgpack request encoder and the reply decoder
 * (client_codec.h), apart from the socket and request bookkeeping in client.c. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/mpcheck.h"
#include "client/client_codec.h"

#define MAP32_HEADER_BYTES 5

/* ---- errors ------------------------------------------------------------------------------ */

/* One row per status: its stable name (the protocol's code for server errors). */
static const char *const STATUS_NAMES[] = {
    [LMC_OK] = "ok",
    [LMC_ERR_BAD_REQUEST] = "bad_request",
    [LMC_ERR_UNKNOWN_OPERATION] = "unknown_operation",
    [LMC_ERR_TOO_LARGE] = "too_large",
    [LMC_ERR_NOT_REGISTERED] = "not_registered",
    [LMC_ERR_INVALID_BLOCKS] = "invalid_blocks",
    [LMC_ERR_NOT_FOUND] = "not_found",
    [LMC_ERR_OUT_OF_MEMORY] = "out_of_memory",
    [LMC_ERR_SHM_ERROR] = "shm_error",
    [LMC_ERR_INTERNAL] = "internal",
    [LMC_ERR_SERVER_OTHER] = "server_error",
    [LMC_ERR_TIMEOUT] = "timeout",
    [LMC_ERR_TRANSPORT] = "transport",
    [LMC_ERR_PROTOCOL] = "protocol",
    [LMC_ERR_INVALID_ARGUMENT] = "invalid_argument",
    [LMC_ERR_NO_MEMORY] = "no_memory",
    [LMC_ERR_SYSTEM] = "system",
    [LMC_ERR_PROOF_REQUIRED] = "proof_required",
};
#define NSTATUS (sizeof(STATUS_NAMES) / sizeof(STATUS_NAMES[0]))

LMC_API const char *lmc_status_name(lmc_status s) {
    return (unsigned)s < NSTATUS && STATUS_NAMES[s] ? STATUS_NAMES[s] : "unknown";
}

LMC_API lmc_status lmc_status_from_code(const char *code, size_t len) {
    for (unsigned s = LMC_ERR_BAD_REQUEST; s < LMC_ERR_SERVER_OTHER; s++)
        if (strlen(STATUS_NAMES[s]) == len && memcmp(STATUS_NAMES[s], code, len) == 0)
            return (lmc_status)s;
    if (len == 14 && memcmp(code, "proof_required", 14) == 0) return LMC_ERR_PROOF_REQUIRED;
    return LMC_ERR_SERVER_OTHER;
}

void lmcc_set_error(lmc_error *err, lmc_status s, const char *fmt, ...) {
    if (!err) return;
    err->status = s;
    snprintf(err->code, sizeof(err->code), "%s", lmc_status_name(s));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
}

void lmcc_clear_error(lmc_error *err) {
    if (!err) return;
    err->status = LMC_OK;
    err->code[0] = '\0';
    err->message[0] = '\0';
}

/* ---- request encoder --------------------------------------------------------------------- */

void lmcc_map_init(struct lmcc_map *m) {
    msgpack_sbuffer_init(&m->buf);
    msgpack_packer_init(&m->pk, &m->buf, msgpack_sbuffer_write);
    m->n = 0;
    m->failed = 0;
    static const char hdr[MAP32_HEADER_BYTES] = {(char)0xdf, 0, 0, 0, 0};
    if (msgpack_sbuffer_write(&m->buf, hdr, sizeof(hdr)) != 0) m->failed = 1;
}

int lmcc_map_finish(struct lmcc_map *m) {
    if (m->failed || m->buf.size < MAP32_HEADER_BYTES) return -1;
    unsigned char *h = (unsigned char *)m->buf.data;
    h[1] = (unsigned char)(m->n >> 24);
    h[2] = (unsigned char)(m->n >> 16);
    h[3] = (unsigned char)(m->n >> 8);
    h[4] = (unsigned char)m->n;
    return 0;
}

void lmcc_map_destroy(struct lmcc_map *m) { msgpack_sbuffer_destroy(&m->buf); }

int lmcc_map_reserve(struct lmcc_map *m, size_t extra) {
    if (m->buf.size + extra <= m->buf.alloc) return 0;
    char *p = realloc(m->buf.data, m->buf.size + extra);
    if (!p) return -1;
    m->buf.data = p;
    m->buf.alloc = m->buf.size + extra;
    return 0;
}

void lmcc_map_adopt(struct lmcc_map *m, char *buf, size_t cap) {
    if (m->buf.size) memcpy(buf, m->buf.data, m->buf.size);
    free(m->buf.data);
    m->buf.data = buf;
    m->buf.alloc = cap;
}

void lmcc_put_key(struct lmcc_map *m, const char *key) {
    size_t n = strlen(key);
    if (msgpack_pack_str(&m->pk, n) != 0 || msgpack_pack_str_body(&m->pk, key, n) != 0)
        m->failed = 1;
    m->n++;
}

void lmcc_put_str(struct lmcc_map *m, const char *key, const char *val) {
    lmcc_put_key(m, key);
    size_t n = strlen(val);
    if (msgpack_pack_str(&m->pk, n) != 0 || msgpack_pack_str_body(&m->pk, val, n) != 0)
        m->failed = 1;
}

void lmcc_put_int(struct lmcc_map *m, const char *key, int64_t val) {
    lmcc_put_key(m, key);
    if (msgpack_pack_int64(&m->pk, val) != 0) m->failed = 1;
}

void lmcc_put_bool(struct lmcc_map *m, const char *key, bool val) {
    lmcc_put_key(m, key);
    if ((val ? msgpack_pack_true(&m->pk) : msgpack_pack_false(&m->pk)) != 0) m->failed = 1;
}

void lmcc_put_u32_array(struct lmcc_map *m, const char *key, const uint32_t *v, size_t n) {
    lmcc_put_key(m, key);
    if (m->failed || msgpack_pack_array(&m->pk, n) != 0 || lmcc_map_reserve(m, 5 * n) != 0) {
        m->failed = 1;
        return;
    }
    /* Written straight into the buffer (a 32k-token prompt is 32k calls of the packer
     * otherwise), in the forms msgpack_pack_uint32 picks: the smallest that holds the value. */
    unsigned char *p = (unsigned char *)m->buf.data + m->buf.size, *p0 = p;
    for (size_t i = 0; i < n; i++) {
        uint32_t x = v[i];
        if (x < 0x80) {
            *p++ = (unsigned char)x;
        } else if (x < 0x100) {
            *p++ = 0xcc;
            *p++ = (unsigned char)x;
        } else if (x < 0x10000) {
            *p++ = 0xcd;
            *p++ = (unsigned char)(x >> 8);
            *p++ = (unsigned char)x;
        } else {
            *p++ = 0xce;
            *p++ = (unsigned char)(x >> 24);
            *p++ = (unsigned char)(x >> 16);
            *p++ = (unsigned char)(x >> 8);
            *p++ = (unsigned char)x;
        }
    }
    m->buf.size += (size_t)(p - p0);
}

void lmcc_put_i64_array(struct lmcc_map *m, const char *key, const int64_t *v, size_t n) {
    lmcc_put_key(m, key);
    if (msgpack_pack_array(&m->pk, n) != 0) m->failed = 1;
    for (size_t i = 0; i < n && !m->failed; i++)
        if (msgpack_pack_int64(&m->pk, v[i]) != 0) m->failed = 1;
}

lmc_status lmcc_put_chunks(struct lmcc_map *m, const lmc_chunks *ch, lmc_error *err) {
    if (!ch) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "no chunks given");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    bool toks = ch->token_ids != NULL, hashes = ch->chunk_hashes != NULL;
    if (toks == hashes) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT,
                       "exactly one of token_ids or chunk_hashes must be given");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    if (hashes && (ch->hash_len < 1 || ch->hash_len > 32)) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "hash_len must be 1..32, not %zu",
                       ch->hash_len);
        return LMC_ERR_INVALID_ARGUMENT;
    }
    if (ch->num_tokens > UINT32_MAX || ch->num_chunk_hashes > UINT32_MAX) {
        lmcc_set_error(err, LMC_ERR_INVALID_ARGUMENT, "too many tokens or chunk hashes");
        return LMC_ERR_INVALID_ARGUMENT;
    }
    if (toks) {
        lmcc_put_u32_array(m, "token_ids", ch->token_ids, ch->num_tokens);
    } else {
        lmcc_put_key(m, "chunk_hashes");
        if (msgpack_pack_array(&m->pk, ch->num_chunk_hashes) != 0) m->failed = 1;
        for (size_t i = 0; i < ch->num_chunk_hashes && !m->failed; i++)
            if (msgpack_pack_bin(&m->pk, ch->hash_len) != 0 ||
                msgpack_pack_bin_body(&m->pk, ch->chunk_hashes + i * ch->hash_len, ch->hash_len) !=
                    0)
                m->failed = 1;
    }
    if (ch->start != 0) lmcc_put_int(m, "start", ch->start);
    if (ch->end >= 0) lmcc_put_int(m, "end", ch->end);
    if (ch->cache_salt && ch->cache_salt[0]) lmcc_put_str(m, "cache_salt", ch->cache_salt);
    return LMC_OK;
}

void lmcc_put_layout(struct lmcc_map *m, const lmc_kv_layout *l) {
    lmcc_put_int(m, "num_layers", l->num_layers);
    lmcc_put_int(m, "num_blocks", l->num_blocks);
    lmcc_put_int(m, "tokens_per_block", l->tokens_per_block);
    lmcc_put_int(m, "bytes_per_token", (int64_t)l->bytes_per_token);
    lmcc_put_int(m, "kv_count", l->kv_count ? l->kv_count : 2);
    lmcc_put_str(m, "block_order",
                 l->block_order == LMC_BLOCK_MAJOR ? "block_major" : "layer_major");
    if (l->dtype) lmcc_put_str(m, "dtype", l->dtype);
}

/* ---- reply decoder ----------------------------------------------------------------------- */

const msgpack_object *lmcc_map_get(const msgpack_object *map, const char *key) {
    if (!map || map->type != MSGPACK_OBJECT_MAP) return NULL;
    size_t n = strlen(key);
    for (uint32_t i = 0; i < map->via.map.size; i++) {
        const msgpack_object *k = &map->via.map.ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            memcmp(k->via.str.ptr, key, n) == 0)
            return &map->via.map.ptr[i].val;
    }
    return NULL;
}

int lmcc_check_structure(const char *data, size_t len) {
    size_t used;
    return mpcheck_document(data, len, UINT64_MAX, &used) == 0 && used == len ? 0 : -1;
}

lmc_status lmcc_decode_reply(const char *body, size_t len, msgpack_unpacked *up,
                             const msgpack_object **map, lmc_error *err) {
    size_t off = 0;
    /* msgpack-c allocates a container's storage from its header before reading its elements:
     * a few bytes could ask for gigabytes. Reject counts the bytes cannot back first. */
    if (lmcc_check_structure(body, len) != 0) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "reply is not one well-formed msgpack object");
        return LMC_ERR_PROTOCOL;
    }
    msgpack_unpack_return r = msgpack_unpack_next(up, body, len, &off);
    if (r == MSGPACK_UNPACK_NOMEM_ERROR) {
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory decoding a reply");
        return LMC_ERR_NO_MEMORY;
    }
    if (r != MSGPACK_UNPACK_SUCCESS || off != len) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "reply is not one msgpack object");
        return LMC_ERR_PROTOCOL;
    }
    if (up->data.type != MSGPACK_OBJECT_MAP) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "reply is not a msgpack map");
        return LMC_ERR_PROTOCOL;
    }
    const msgpack_object *ok = lmcc_map_get(&up->data, "ok");
    if (!ok || ok->type != MSGPACK_OBJECT_BOOLEAN) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL, "reply has no boolean 'ok'");
        return LMC_ERR_PROTOCOL;
    }
    *map = &up->data;
    return LMC_OK;
}

lmc_status lmcc_reply_error(const msgpack_object *map, lmc_error *err) {
    const msgpack_object *ok = lmcc_map_get(map, "ok");
    if (ok && ok->type == MSGPACK_OBJECT_BOOLEAN && ok->via.boolean) {
        lmcc_clear_error(err);
        return LMC_OK;
    }
    const msgpack_object *code = lmcc_map_get(map, "code");
    const msgpack_object *msg = lmcc_map_get(map, "message");
    lmc_status s = LMC_ERR_SERVER_OTHER;
    const char *cs = "";
    int cl = 0;
    if (code && code->type == MSGPACK_OBJECT_STR) {
        cs = code->via.str.ptr;
        cl = code->via.str.size > INT_MAX ? INT_MAX : (int)code->via.str.size;
        s = lmc_status_from_code(cs, (size_t)cl);
    }
    if (err) {
        err->status = s;
        snprintf(err->code, sizeof(err->code), "%.*s", cl, cs);
        if (msg && msg->type == MSGPACK_OBJECT_STR)
            snprintf(err->message, sizeof(err->message), "%.*s",
                     msg->via.str.size > INT_MAX ? INT_MAX : (int)msg->via.str.size,
                     msg->via.str.ptr);
        else
            snprintf(err->message, sizeof(err->message), "server error without a message");
    }
    return s;
}

uint64_t lmcc_parse_id(const char *s, size_t len) {
    if (len == 0 || len > 20) return 0;
    uint64_t v = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] < '0' || s[i] > '9') return 0;
        uint64_t d = (uint64_t)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10) return 0;
        v = v * 10 + d;
    }
    return v;
}
