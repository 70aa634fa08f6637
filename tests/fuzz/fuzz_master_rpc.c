/* libFuzzer driver over the master's request decoders and handlers: the first byte picks
 * the method, the rest is the protobuf request, run against one long-lived store. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "master/mrpc.h"
#include "master/mstore.h"

static int64_t fixed_now(void) { return 1000000; }
static uint64_t fixed_rand(void) { return 42; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct master m;
    if (!m.store) {
        log_set_level(log_get("lmcache"), LOG_CRITICAL);
        mcfg_load(&m.cfg, (const char *(*)(const char *))getenv, NULL, NULL);
        struct mstore_mem_cfg c = {.shards = 4};
        m.store = mstore_mem_create(&c);
        m.lg = log_get("lmcache.master");
        m.now_ms = fixed_now;
        m.rand64 = fixed_rand;
    }
    if (size < 1) return 0;
    struct mrpc_reply r;
    mrpc_dispatch(&m, data[0] % MRPC_NMETHODS, data + 1, size - 1, &r);
    free(r.buf);
    if (data[0] == 0xff) mrpc_reap(&m, 1 << 30);
    return 0;
}
