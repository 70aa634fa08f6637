/* Data-plane message codec. The reply map header is written last: the body is packed after a
 * 5-byte hole (map32), and the hole is filled once the field count is known. */
#include "server/dataplane/wire.h"

#include "base/mpcheck.h"
#include "base/utf8.h"

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

int dp_decode(const void *buf, size_t len, msgpack_unpacked *up, struct dp_map *out,
              struct dp_err *err) {
    out->obj = NULL;
    if (len == 0) return 0;
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
    if (!m->obj) return NULL;
    size_t n = strlen(name);
    const msgpack_object_map *map = &m->obj->via.map;
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *k = &map->ptr[i].key;
        if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == n &&
            memcmp(k->via.str.ptr, name, n) == 0) {
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
    *arr = v->via.array.ptr;
    *n = v->via.array.size;
    return 0;
}

int dp_u32_array(const struct dp_map *m, const char *name, int required, uint32_t **out,
                 uint32_t *n, struct dp_err *err) {
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
