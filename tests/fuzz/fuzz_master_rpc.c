/* libFuzzer driver over the master's request decoders and handlers: the first byte picks
 * the method, the rest is the protobuf request, run against one long-lived store. The
 * hand-written MatchExternalKv decoder is also checked against protobuf-c's (the driver aborts
 * when it cannot find that method). Seeds: tests/fuzz/corpus/fuzz_master_rpc (gen_corpus.py). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "master/mrpc.h"
#include "master/mstore.h"
#include "master/mwire.h"
#include "umbp.pb-c.h"

static int64_t fixed_now(void) { return 1000000; }
static uint64_t fixed_rand(void) { return 42; }

static const char MATCH_PATH[] = "/umbp.UMBPMaster/MatchExternalKv";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static struct master m;
    static size_t match_method;
    if (!m.store) {
        /* Without the method the decoder comparison below would silently never run. */
        int idx = mrpc_find(MATCH_PATH, strlen(MATCH_PATH));
        if (idx < 0) {
            fprintf(stderr, "fuzz_master_rpc: no method %s\n", MATCH_PATH);
            abort();
        }
        match_method = (size_t)idx;
        log_set_level(log_get("lmcache"), LOG_CRITICAL);
        mcfg_load(&m.cfg, (const char *(*)(const char *))getenv, NULL, NULL);
        struct mstore_mem_cfg c = {.shards = 4};
        m.store = mstore_mem_create(&c);
        m.lg = log_get("lmcache.master");
        m.now_ms = fixed_now;
        m.rand64 = fixed_rand;
    }
    if (size < 1) return 0;
    if (data[0] % MRPC_NMETHODS == match_method) {
        struct mstore_key *k;
        size_t nk;
        bool hit;
        int rc = mwire_match_request(data + 1, size - 1, &k, &nk, &hit);
        Umbp__MatchExternalKvRequest *q =
            umbp__match_external_kv_request__unpack(NULL, size - 1, data + 1);
        if ((rc == MWIRE_OK) != (q != NULL)) abort();
        if (q) {
            if (nk != q->n_hashes || hit != q->count_as_hit) abort();
            for (size_t i = 0; i < nk; i++) { /* protobuf-c's C string ends at a NUL */
                const char *z = memchr(k[i].p, 0, k[i].n);
                size_t cn = z ? (size_t)(z - k[i].p) : k[i].n;
                if (cn != strlen(q->hashes[i]) || memcmp(k[i].p, q->hashes[i], cn)) abort();
            }
            umbp__match_external_kv_request__free_unpacked(q, NULL);
        }
        free(k);
    }
    struct mrpc_reply r;
    mrpc_dispatch(&m, data[0] % MRPC_NMETHODS, data + 1, size - 1, &r);
    free(r.buf);
    if (data[0] == 0xff) mrpc_reap(&m, 1 << 30);
    return 0;
}
