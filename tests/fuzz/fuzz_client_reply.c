/* libFuzzer driver for liblmcache-client's reply decoder: input = a reply body as the server
 * would send it. Decoding must never crash, allocate beyond the input's size class, or accept
 * a reply without a boolean `ok`. */
#include <stddef.h>
#include <stdint.h>

#include "client/client_codec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    msgpack_unpacked up;
    msgpack_unpacked_init(&up);
    const msgpack_object *map = NULL;
    lmc_error err;
    if (lmcc_decode_reply((const char *)data, size, &up, &map, &err) == LMC_OK) {
        const msgpack_object *ok = lmcc_map_get(map, "ok");
        if (!ok || ok->type != MSGPACK_OBJECT_BOOLEAN) __builtin_trap();
        lmc_status s = lmcc_reply_error(map, &err);
        if ((s == LMC_OK) != ok->via.boolean) __builtin_trap();
        (void)lmcc_map_get(map, "chunks");
    } else if (err.status == LMC_OK) {
        __builtin_trap();
    }
    (void)lmcc_parse_id((const char *)data, size < 24 ? size : 24);
    msgpack_unpacked_destroy(&up);
    return 0;
}
