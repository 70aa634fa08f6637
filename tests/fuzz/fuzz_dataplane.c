/* libFuzzer driver for the data-plane request decoder and handlers: input = operation name,
 * '\n', msgpack payload, and optionally frames after the payload (store_bytes chunk frames),
 * carved from the end of the input when it ends with a trailer: [frame bytes...][len 1..k, one
 * byte each][k][0xc1] (0xc1 is never valid msgpack, so a plain payload never ends that way).
 * Every input must yield a complete reply map with a boolean "ok" (and "code" and "message"
 * when it is false). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <msgpack.h>

#include "fuzz_util.h"
#include "server/dataplane/dataplane.h"
#include "server/dataplane/wire.h"

static int key_is(const msgpack_object *k, const char *name) {
    size_t n = strlen(name);
    return k->via.str.size == n && memcmp(k->via.str.ptr, name, n) == 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct engine *e = fuzz_engine();
    const uint8_t *nl = memchr(data, '\n', size < 64 ? size : 64);
    size_t oplen = nl ? (size_t)(nl - data) : 0;
    const uint8_t *payload = nl ? nl + 1 : data;
    size_t plen = size - (size_t)(payload - data);
    struct dp_blob frames[16];
    uint32_t nframes = 0;
    if (plen >= 2 && payload[plen - 1] == 0xc1 && payload[plen - 2] <= 16 &&
        plen >= 2u + payload[plen - 2]) {
        uint32_t k = payload[plen - 2];
        const uint8_t *lens = payload + plen - 2 - k;
        size_t total = 0;
        for (uint32_t i = 0; i < k; i++) total += lens[i];
        if (total <= (size_t)(lens - payload)) {
            const uint8_t *f = lens - total;
            for (uint32_t i = 0; i < k; i++) {
                frames[i] = (struct dp_blob){f, lens[i]};
                f += lens[i];
            }
            nframes = k;
            plen = (size_t)(lens - total - payload);
        }
    }
    struct dp_reply r;
    dp_reply_init(&r);
    dataplane_handle_peer(e, NULL, (const char *)data, oplen, payload, plen,
                          nframes ? frames : NULL, nframes, &r);
    /* The reply must decode as one map with exactly one boolean "ok"; a failure also carries
     * string "code" and "message" fields. */
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    if (msgpack_unpack_next(&up, r.buf.data, r.buf.size, &off) != MSGPACK_UNPACK_SUCCESS ||
        up.data.type != MSGPACK_OBJECT_MAP || off != r.buf.size)
        __builtin_trap();
    int nok = 0, ok = 0, code = 0, message = 0;
    for (uint32_t i = 0; i < up.data.via.map.size; i++) {
        const msgpack_object_kv *kv = &up.data.via.map.ptr[i];
        if (kv->key.type != MSGPACK_OBJECT_STR) __builtin_trap();
        if (key_is(&kv->key, "ok")) {
            if (kv->val.type != MSGPACK_OBJECT_BOOLEAN) __builtin_trap();
            nok++;
            ok = kv->val.via.boolean;
        } else if (key_is(&kv->key, "code")) {
            code = kv->val.type == MSGPACK_OBJECT_STR && kv->val.via.str.size > 0;
        } else if (key_is(&kv->key, "message")) {
            message = kv->val.type == MSGPACK_OBJECT_STR;
        }
    }
    if (nok != 1 || (!ok && !(code && message))) __builtin_trap();
    msgpack_unpacked_destroy(&up);
    dp_reply_free(&r);
    return 0;
}
