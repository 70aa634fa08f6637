/* libFuzzer driver for the data-plane payload decoder (dp_decode), checked against msgpack-c
 * decoding the whole payload: input = the payload. Both must accept or refuse the same payloads;
 * when they accept, every field msgpack-c finds (the first of a repeated key) must be found
 * with the same type, and an integer array read in place (token_ids, block_ids) must hold the
 * same values as msgpack-c's elements. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "base/mpcheck.h"
#include "server/dataplane/wire.h"

/* msgpack-c alone, as dp_decode did before arrays were read in place. */
static int whole_decode(const uint8_t *p, size_t len, msgpack_unpacked *up) {
    size_t used, off = 0;
    if (len == 0) return 1;
    if (mpcheck_document(p, len, DP_MAX_ELEMENTS, &used) < 0) return -1;
    if (msgpack_unpack_next(up, (const char *)p, len, &off) != MSGPACK_UNPACK_SUCCESS) return -1;
    if (off != len) return -1;
    if (up->data.type == MSGPACK_OBJECT_NIL) return 1;
    return up->data.type == MSGPACK_OBJECT_MAP ? 0 : -1;
}

static int first_of(const msgpack_object_map *map, uint32_t i) {
    const msgpack_object *k = &map->ptr[i].key;
    for (uint32_t j = 0; j < i; j++) {
        const msgpack_object *o = &map->ptr[j].key;
        if (o->type == MSGPACK_OBJECT_STR && o->via.str.size == k->via.str.size &&
            (k->via.str.size == 0 || !memcmp(o->via.str.ptr, k->via.str.ptr, k->via.str.size)))
            return 0; /* (an empty string's ptr may be NULL) */
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    msgpack_unpacked ref, up;
    msgpack_unpacked_init(&ref);
    msgpack_unpacked_init(&up);
    struct dp_map m;
    struct dp_err err = {NULL, ""};
    int want = whole_decode(data, size, &ref);
    int got = dp_decode(data, size, &up, &m, &err);
    if ((want < 0) != (got < 0)) __builtin_trap();
    if (want == 0) {
        if (!m.obj && !m.nraw) __builtin_trap();
        const msgpack_object_map *map = &ref.data.via.map;
        for (uint32_t i = 0; i < map->size; i++) {
            const msgpack_object *k = &map->ptr[i].key, *v = &map->ptr[i].val;
            if (k->type != MSGPACK_OBJECT_STR || k->via.str.size > 63 || !first_of(map, i))
                continue;
            char name[64];
            if (k->via.str.size) memcpy(name, k->via.str.ptr, k->via.str.size);
            name[k->via.str.size] = 0;
            if (memchr(name, 0, k->via.str.size)) continue;
            const msgpack_object *g = dp_get(&m, name);
            if (v->type == MSGPACK_OBJECT_NIL) {
                if (g) __builtin_trap();
                continue;
            }
            if (!g || g->type != v->type) __builtin_trap();
            const struct dp_rawarr *r = dp_raw(&m, name);
            if (!r) continue;
            if (v->via.array.size != r->n) __builtin_trap();
            uint32_t *vals = malloc((size_t)r->n * sizeof(*vals));
            if (!vals) continue;
            dp_raw_u32(r, vals);
            for (uint32_t j = 0; j < r->n; j++) {
                const msgpack_object *e = &v->via.array.ptr[j];
                if (e->type != MSGPACK_OBJECT_POSITIVE_INTEGER || e->via.u64 != vals[j])
                    __builtin_trap();
            }
            free(vals);
        }
    }
    dp_map_free(&m);
    msgpack_unpacked_destroy(&up);
    msgpack_unpacked_destroy(&ref);
    return 0;
}
