/* Data-plane message codec. The reply map header is written last: the body is packed after a
 * 5-byte hole (map32), and the hole is filled once the field count is known. */
#include "server/dataplane/wire.h"

#include "base/mpcheck.h"
#include "base/utf8.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

void dp_fail(struct dp_err *err, const char *code, const char *fmt, ...) {
    err->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
}

int dp_msgpack_check(const void *buf, size_t len, uint64_t max_elements) {
    size_t used;
    return mpcheck_document(buf, len, max_elements, &used);
}

/* ---- large integer arrays read in place ---- */

static const char *const RAW_FIELDS[] = {"token_ids", "block_ids"};

/* Bytes of a plain unsigned element by its first byte (positive fixint, uint8, uint16, uint32),
 * 0 for any other form; and how far its 4 bytes after the first are shifted right. */
static uint8_t elem_width[256], elem_shift[256];

static void elem_tables_init(void) {
    for (unsigned b = 0; b <= 0x7f; b++) elem_width[b] = 1;
    elem_width[0xcc] = 2;
    elem_shift[0xcc] = 24;
    elem_width[0xcd] = 3;
    elem_shift[0xcd] = 16;
    elem_width[0xce] = 5;
}

static pthread_once_t elem_once = PTHREAD_ONCE_INIT;

/* Length of a str header at p (fixstr, str8/16/32) and of its body; -1 when not a str. */
static int str_head(const unsigned char *p, size_t avail, size_t *head, size_t *body) {
    if (avail < 1) return -1;
    unsigned b = p[0];
    int n = b >= 0xa0 && b <= 0xbf ? 0 : b == 0xd9 ? 1 : b == 0xda ? 2 : b == 0xdb ? 4 : -1;
    if (n < 0 || avail < 1 + (size_t)n) return -1;
    *head = 1 + (size_t)n;
    *body = n == 0 ? (b & 0x1f) : (size_t)mpcheck_be(p + 1, n);
    return *body <= avail - *head ? 0 : -1;
}

/* A container header: fix (0x80 fixmap or 0x90 fixarray, 16 entries), then the 16- and 32-bit
 * forms b16 and b16 + 1. Its entry count and header length; -1 when p holds another form. */
static int container_head(const unsigned char *p, size_t avail, unsigned fix, unsigned b16,
                          uint64_t *cnt, size_t *head) {
    if (avail < 1) return -1;
    unsigned b = p[0];
    if (b >= fix && b <= fix + 0x0f) {
        *cnt = b & 0x0f;
        *head = 1;
        return 0;
    }
    int w = b == b16 ? 2 : b == b16 + 1 ? 4 : 0;
    if (w == 0 || avail < 1 + (size_t)w) return -1;
    *cnt = mpcheck_be(p + 1, w);
    *head = 1 + (size_t)w;
    return 0;
}

/* The value of a plain unsigned element of width w (elem_width) at p. */
static uint32_t elem_value(const unsigned char *p, unsigned w) {
    uint32_t x = 0;
    for (unsigned k = 1; k < w; k++) x = x << 8 | p[k];
    return w == 1 ? p[0] : x;
}

/* An array of at least DP_RAW_MIN non-negative integers below 2^32, each positive fixint, uint8,
 * uint16 or uint32: its element count, first element and end, and its elements converted into
 * *vals (malloc'd; one pass over the bytes does both); 0 when it is one, else -1 (nothing
 * allocated). */
static int plain_u32_array(const unsigned char *p, size_t avail, uint32_t *n,
                           const unsigned char **first, size_t *used, uint32_t **vals) {
    size_t pos;
    uint64_t cnt;
    if (container_head(p, avail, 0x90, 0xdc, &cnt, &pos) < 0) return -1;
    if (cnt < DP_RAW_MIN || cnt > avail - pos) return -1; /* each element takes a byte at least */
    if (cnt > DP_MAX_ELEMENTS) return -1; /* refused by the whole decode, before any allocation */
    /* The first element decides before anything is allocated: most arrays that are not plain
     * (strings, negative ids) show it there. */
    if (elem_width[p[pos]] == 0) return -1;
    uint32_t *out = malloc((size_t)cnt * sizeof(*out));
    if (!out) return -1;
    *first = p + pos;
    /* While 5 bytes remain no element can run past the end, and the 4 bytes after an element's
     * first can be read and shifted without branching on its form (token ids mix uint16 and
     * uint32 at random); the last few are checked one by one. A zero width (another form) stops
     * the walk. */
    uint64_t i = 0;
    while (i < cnt && avail - pos >= 5) {
        unsigned e = p[pos], w = elem_width[e];
        if (w == 0) goto bad;
        uint32_t x = (uint32_t)p[pos + 1] << 24 | (uint32_t)p[pos + 2] << 16 |
                     (uint32_t)p[pos + 3] << 8 | p[pos + 4];
        out[i++] = w == 1 ? e : x >> elem_shift[e];
        pos += w;
    }
    for (; i < cnt; i++) {
        if (pos >= avail) goto bad;
        unsigned e = p[pos], w = elem_width[e];
        if (w == 0 || w > avail - pos) goto bad;
        out[i] = elem_value(p + pos, w);
        pos += w;
    }
    *n = (uint32_t)cnt;
    *used = pos;
    *vals = out;
    return 0;
bad:
    free(out);
    return -1;
}

/* Splits a payload map into the raw-read fields and the rest (copied into m->rest, a map32 of
 * the other pairs, which msgpack-c then decodes). 1 when split, 0 when the payload is to be
 * decoded whole (no such field, or anything unusual: the whole decode reports it). */
static int split_raw(const unsigned char *p, size_t len, struct dp_map *m) {
    pthread_once(&elem_once, elem_tables_init);
    size_t pos;
    uint64_t pairs;
    if (container_head(p, len, 0x80, 0xde, &pairs, &pos) < 0) return 0;
    if (pairs > 64) return 0; /* no operation has that many fields */
    size_t start[64], end[64];
    int raw_of[64], seen[sizeof(RAW_FIELDS) / sizeof(RAW_FIELDS[0])] = {0};
    uint64_t elements = 1;
    for (uint64_t i = 0; i < pairs; i++) {
        size_t head, body, used;
        start[i] = pos;
        raw_of[i] = -1;
        if (str_head(p + pos, len - pos, &head, &body) < 0) return 0;
        const char *key = (const char *)p + pos + head;
        pos += head + body;
        for (size_t f = 0; f < sizeof(RAW_FIELDS) / sizeof(RAW_FIELDS[0]); f++) {
            if (strlen(RAW_FIELDS[f]) != body || memcmp(key, RAW_FIELDS[f], body)) continue;
            uint32_t n;
            const unsigned char *first;
            if (seen[f]++) return 0; /* twice: decoded whole, as msgpack-c sees it */
            uint32_t *vals;
            if (plain_u32_array(p + pos, len - pos, &n, &first, &used, &vals) < 0) break;
            struct dp_rawarr *r = &m->raw[m->nraw];
            r->vals = vals;
            r->name = RAW_FIELDS[f];
            r->p = first;
            r->end = p + pos + used;
            r->n = n;
            memset(&r->stub, 0, sizeof(r->stub));
            r->stub.type = MSGPACK_OBJECT_ARRAY;
            r->stub.via.array.size = n;
            raw_of[i] = (int)m->nraw++;
            elements += 2 + (uint64_t)n;
            break;
        }
        if (raw_of[i] < 0) {
            if (mpcheck_document(p + pos, len - pos, DP_MAX_ELEMENTS, &used) < 0) return 0;
            elements += 2;
        }
        pos += used;
        end[i] = pos;
    }
    if (pos != len || m->nraw == 0 || elements > DP_MAX_ELEMENTS) return 0;
    size_t rest = 5, raw_bytes = 0;
    for (uint64_t i = 0; i < pairs; i++)
        if (raw_of[i] < 0)
            rest += end[i] - start[i];
        else
            raw_bytes += end[i] - start[i];
    /* The rest is copied: worth it only while it is small beside the arrays it spares msgpack-c
     * (24 bytes of object and a few ns per element). A store_bytes payload carries its chunks:
     * copying them (hundreds of MiB) cost far more than decoding its token ids. */
    if (rest > DP_RAW_REST_MAX && rest > 16 * raw_bytes) return 0;
    unsigned char *q = malloc(rest);
    if (!q) return 0;
    uint32_t kept = (uint32_t)pairs - m->nraw;
    q[0] = 0xdf;
    q[1] = (unsigned char)(kept >> 24);
    q[2] = (unsigned char)(kept >> 16);
    q[3] = (unsigned char)(kept >> 8);
    q[4] = (unsigned char)kept;
    size_t at = 5;
    for (uint64_t i = 0; i < pairs; i++) {
        if (raw_of[i] >= 0) continue;
        memcpy(q + at, p + start[i], end[i] - start[i]);
        at += end[i] - start[i];
    }
    m->rest = q;
    m->rest_len = rest;
    return 1;
}

void dp_raw_u32(const struct dp_rawarr *r, uint32_t *out) {
    if (r->vals) {
        memcpy(out, r->vals, (size_t)r->n * sizeof(*out));
        return;
    }
    /* taken by dp_u32_array: read the bytes again (checked when they were converted) */
    const unsigned char *p = r->p;
    for (uint32_t i = 0; i < r->n; i++) {
        unsigned w = elem_width[*p];
        out[i] = elem_value(p, w);
        p += w;
    }
}

static struct dp_rawarr *raw_find(struct dp_map *m, const char *name) {
    for (unsigned k = 0; k < m->nraw; k++)
        if (!strcmp(m->raw[k].name, name)) return &m->raw[k];
    return NULL;
}

const struct dp_rawarr *dp_raw(const struct dp_map *m, const char *name) {
    return raw_find((struct dp_map *)m, name);
}

/* Forgets the fields read in place (a split given up, or the map freed). */
static void raw_drop(struct dp_map *m) {
    for (unsigned k = 0; k < m->nraw; k++) {
        free(m->raw[k].vals);
        m->raw[k].vals = NULL;
    }
    m->nraw = 0;
}

void dp_map_free(struct dp_map *m) {
    raw_drop(m);
    free(m->rest);
    m->rest = NULL;
    m->rest_len = 0;
    m->obj = NULL;
}

int dp_decode(const void *buf, size_t len, msgpack_unpacked *up, struct dp_map *out,
              struct dp_err *err) {
    memset(out, 0, sizeof(*out));
    if (len == 0) return 0;
    if (split_raw(buf, len, out)) {
        buf = out->rest;
        len = out->rest_len;
    } else {
        raw_drop(out);
    }
    if (dp_msgpack_check(buf, len, DP_MAX_ELEMENTS) < 0) {
        dp_fail(err, DP_BAD_REQUEST, "payload is not valid msgpack (or has over %u elements)",
                DP_MAX_ELEMENTS);
        return -1;
    }
    size_t off = 0;
    msgpack_unpack_return rc = msgpack_unpack_next(up, buf, len, &off);
    if (rc != MSGPACK_UNPACK_SUCCESS) {
        dp_fail(err, DP_BAD_REQUEST, "payload is not valid msgpack");
        return -1;
    }
    if (off != len) {
        dp_fail(err, DP_BAD_REQUEST, "payload has %zu trailing bytes", len - off);
        return -1;
    }
    if (up->data.type == MSGPACK_OBJECT_NIL) return 0;
    if (up->data.type != MSGPACK_OBJECT_MAP) {
        dp_fail(err, DP_BAD_REQUEST, "payload must be a msgpack map");
        return -1;
    }
    out->obj = &up->data;
    return 0;
}

const msgpack_object *dp_get(const struct dp_map *m, const char *name) {
    const struct dp_rawarr *r = dp_raw(m, name);
    if (r) return &r->stub;
    if (!m->obj) return NULL;
    size_t n = strlen(name);
    const msgpack_object_map *map = &m->obj->via.map;
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *k = &map->ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            (n == 0 || memcmp(k->via.str.ptr, name, n) == 0)) { /* "": ptr may be NULL */
            const msgpack_object *v = &map->ptr[i].val;
            return v->type == MSGPACK_OBJECT_NIL ? NULL : v;
        }
    }
    return NULL;
}

static int absent(const char *name, int required, struct dp_err *err) {
    if (!required) return 1;
    dp_fail(err, DP_BAD_REQUEST, "missing required field '%s'", name);
    return -1;
}

static int obj_int(const msgpack_object *v, int64_t *out) {
    if (v->type == MSGPACK_OBJECT_POSITIVE_INTEGER) {
        if (v->via.u64 > (uint64_t)INT64_MAX) return -1;
        *out = (int64_t)v->via.u64;
        return 0;
    }
    if (v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
        *out = v->via.i64;
        return 0;
    }
    return -1;
}

int dp_int(const struct dp_map *m, const char *name, int required, int64_t min, int64_t max,
           int64_t *out, struct dp_err *err) {
    const msgpack_object *v = dp_get(m, name);
    if (!v) return absent(name, required, err);
    int64_t x;
    if (obj_int(v, &x) < 0) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' must be an integer", name);
        return -1;
    }
    if (x < min || x > max) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' is out of range [%lld, %lld]", name,
                (long long)min, (long long)max);
        return -1;
    }
    *out = x;
    return 0;
}

int dp_bool(const struct dp_map *m, const char *name, int required, int *out, struct dp_err *err) {
    const msgpack_object *v = dp_get(m, name);
    if (!v) return absent(name, required, err);
    if (v->type != MSGPACK_OBJECT_BOOLEAN) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' must be a boolean", name);
        return -1;
    }
    *out = v->via.boolean;
    return 0;
}

/* Strict UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF) without
 * C0 controls, DEL or C1 controls. */
size_t dp_text_check(const char *s, size_t len) {
    return utf8_check(s, len, UTF8_NO_CONTROL, NULL);
}

int dp_str(const struct dp_map *m, const char *name, int required, size_t maxlen, const char **s,
           size_t *len, struct dp_err *err) {
    const msgpack_object *v = dp_get(m, name);
    if (!v) return absent(name, required, err);
    if (v->type != MSGPACK_OBJECT_STR) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' must be a string", name);
        return -1;
    }
    if (v->via.str.size > maxlen) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' is longer than %zu bytes", name, maxlen);
        return -1;
    }
    if (memchr(v->via.str.ptr, 0, v->via.str.size)) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' contains a NUL byte", name);
        return -1;
    }
    size_t bad = dp_text_check(v->via.str.ptr, v->via.str.size);
    if (bad != v->via.str.size) {
        dp_fail(err, DP_BAD_REQUEST,
                "field '%s' is not valid UTF-8 text (byte %zu: invalid sequence or control "
                "character)",
                name, bad);
        return -1;
    }
    *s = v->via.str.ptr;
    *len = v->via.str.size;
    return 0;
}

int dp_cstr(const struct dp_map *m, const char *name, int required, char *out, size_t cap,
            struct dp_err *err) {
    const char *s;
    size_t len;
    int rc = dp_str(m, name, required, cap - 1, &s, &len, err);
    if (rc == 0) {
        memcpy(out, s, len);
        out[len] = 0;
    }
    return rc;
}

int dp_array(const struct dp_map *m, const char *name, int required, const msgpack_object **arr,
             uint32_t *n, struct dp_err *err) {
    const msgpack_object *v = dp_get(m, name);
    if (!v) return absent(name, required, err);
    if (v->type != MSGPACK_OBJECT_ARRAY) {
        dp_fail(err, DP_BAD_REQUEST, "field '%s' must be an array", name);
        return -1;
    }
    if (dp_raw(m, name)) { /* no element objects: callers read such fields with dp_raw */
        dp_fail(err, DP_INTERNAL, "field '%s' was read in place", name);
        return -1;
    }
    *arr = v->via.array.ptr;
    *n = v->via.array.size;
    return 0;
}

int dp_u32_array(struct dp_map *m, const char *name, int required, uint32_t **out, uint32_t *n,
                 struct dp_err *err) {
    struct dp_rawarr *r = raw_find(m, name);
    if (r && r->vals) { /* converted while it was checked: handed over */
        *out = r->vals;
        *n = r->n;
        r->vals = NULL;
        return 0;
    }
    if (r) {
        uint32_t *v = malloc((size_t)r->n * sizeof(*v));
        if (!v) {
            dp_fail(err, DP_INTERNAL, "out of memory");
            return -1;
        }
        dp_raw_u32(r, v);
        *out = v;
        *n = r->n;
        return 0;
    }
    const msgpack_object *a;
    uint32_t cnt;
    int rc = dp_array(m, name, required, &a, &cnt, err);
    if (rc != 0) return rc;
    uint32_t *v = malloc((cnt ? cnt : 1) * sizeof(*v));
    if (!v) {
        dp_fail(err, DP_INTERNAL, "out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < cnt; i++) {
        int64_t x;
        if (obj_int(&a[i], &x) < 0 || x < 0 || x > UINT32_MAX) {
            free(v);
            dp_fail(err, DP_BAD_REQUEST, "field '%s'[%u] must be an integer in [0, 4294967295]",
                    name, i);
            return -1;
        }
        v[i] = (uint32_t)x;
    }
    *out = v;
    *n = cnt;
    return 0;
}

/* ---- replies ---- */

#define HEADER_HOLE 5

void dp_reply_init(struct dp_reply *r) {
    msgpack_sbuffer_init(&r->buf);
    msgpack_packer_init(&r->pk, &r->buf, msgpack_sbuffer_write);
    r->nfields = 0;
    static const char hole[HEADER_HOLE] = {0};
    msgpack_sbuffer_write(&r->buf, hole, HEADER_HOLE);
    r->header = HEADER_HOLE;
    r->frames = NULL;
    r->nframes = 0;
}

void dp_frames_release(struct dp_frame *frames, uint32_t n) {
    for (uint32_t i = 0; frames && i < n; i++)
        if (frames[i].release) frames[i].release(frames[i].data, frames[i].hint);
    free(frames);
}

void dp_reply_free(struct dp_reply *r) {
    msgpack_sbuffer_destroy(&r->buf);
    dp_frames_release(r->frames, r->nframes);
    r->frames = NULL;
    r->nframes = 0;
}

int dp_reply_reserve(struct dp_reply *r, size_t extra) {
    if (r->buf.size + extra <= r->buf.alloc) return 0;
    size_t need = r->buf.size + extra + 256; /* room for the fields dp_finish adds */
    char *p = realloc(r->buf.data, need);
    if (!p) return -1;
    r->buf.data = p;
    r->buf.alloc = need;
    return 0;
}

void dp_key(struct dp_reply *r, const char *name) {
    size_t n = strlen(name);
    msgpack_pack_str(&r->pk, n);
    msgpack_pack_str_body(&r->pk, name, n);
    r->nfields++;
}

void dp_put_bool(struct dp_reply *r, const char *name, int v) {
    dp_key(r, name);
    if (v)
        msgpack_pack_true(&r->pk);
    else
        msgpack_pack_false(&r->pk);
}

void dp_put_int(struct dp_reply *r, const char *name, int64_t v) {
    dp_key(r, name);
    msgpack_pack_int64(&r->pk, v);
}

void dp_put_double(struct dp_reply *r, const char *name, double v) {
    dp_key(r, name);
    msgpack_pack_double(&r->pk, v);
}

void dp_put_str(struct dp_reply *r, const char *name, const char *s) {
    dp_key(r, name);
    size_t n = strlen(s);
    msgpack_pack_str(&r->pk, n);
    msgpack_pack_str_body(&r->pk, s, n);
}

const char *dp_finish(struct dp_reply *r, int ok, const struct dp_err *err, size_t *len) {
    dp_put_bool(r, "ok", ok);
    if (!ok) {
        dp_put_str(r, "code", err && err->code ? err->code : DP_INTERNAL);
        dp_put_str(r, "message", err ? err->message : "");
    }
    /* map32 header: 0xdf + big-endian count. */
    unsigned char *h = (unsigned char *)r->buf.data;
    h[0] = 0xdf;
    h[1] = (unsigned char)(r->nfields >> 24);
    h[2] = (unsigned char)(r->nfields >> 16);
    h[3] = (unsigned char)(r->nfields >> 8);
    h[4] = (unsigned char)r->nfields;
    *len = r->buf.size;
    return r->buf.data;
}
