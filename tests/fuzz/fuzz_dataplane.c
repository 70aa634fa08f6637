/* libFuzzer driver for the data-plane request decoder and handlers: input = operation name,
 * '\n', msgpack payload. Every input must yield a complete reply map. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <msgpack.h>

#include "fuzz_util.h"
#include "server/dataplane/dataplane.h"
#include "server/dataplane/wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    struct engine *e = fuzz_engine();
    const uint8_t *nl = memchr(data, '\n', size < 64 ? size : 64);
    size_t oplen = nl ? (size_t)(nl - data) : 0;
    const uint8_t *payload = nl ? nl + 1 : data;
    size_t plen = size - (size_t)(payload - data);
    struct dp_reply r;
    dp_reply_init(&r);
    dataplane_handle(e, (const char *)data, oplen, payload, plen, &r);
    /* The reply must decode as one map with "ok". */
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    size_t off = 0;
    if (msgpack_unpack_next(&up, r.buf.data, r.buf.size, &off) != MSGPACK_UNPACK_SUCCESS ||
        up.data.type != MSGPACK_OBJECT_MAP || off != r.buf.size)
        __builtin_trap();
    msgpack_unpacked_destroy(&up);
    dp_reply_free(&r);
    return 0;
}
