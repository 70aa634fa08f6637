/* lmcache_client_smoke HOST PORT: drives a running `lmcache server` through every operation of
 * liblmcache-client (linked as the shared library) and checks every byte that comes back.
 * lmcache_client_smoke HOST PORT lookup-wait: lmc_lookup_wait alone, prints the hit chunks.
 * lmcache_client_smoke HOST PORT frames-reset SERVER_PID: a store with chunk frames that times
 * out (the server is stopped with SIGSTOP meanwhile) gives the caller's buffer back and is
 * never delivered later; the client works again once the server resumes.
 * lmcache_client_smoke HOST PORT keep-buffers: large store_bytes requests (48 MiB, glibc's
 * default malloc) reuse the client's kept request buffer: the page faults of each store with the
 * default keep and with none, and every stored byte read back.
 * Prints one line per step; exit 0 when all pass, 1 otherwise. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "lmcache/client.h"

#define LAYERS 3
#define BLOCKS 64
#define TPB    16
#define BPT    64

static int failures;

static void check(const char *what, lmc_status s, const lmc_error *e) {
    if (s == LMC_OK) {
        printf("ok   %s\n", what);
    } else {
        printf("FAIL %s: %s (%s)\n", what, e->message, e->code);
        failures++;
    }
}

static void expect(const char *what, int cond) {
    printf("%s %s\n", cond ? "ok  " : "FAIL", what);
    if (!cond) failures++;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (unsigned char)(seed >> 16);
    }
}

/* A client of host:port with the given timeout, or NULL (FAIL printed). */
static lmc_client *connect_to(const char *host, int port, int timeout_ms) {
    lmc_error e;
    lmc_client *c;
    lmc_client_options o = {.timeout_ms = timeout_ms};
    if (lmc_client_connect(host, port, &o, &c, &e) != LMC_OK) {
        printf("FAIL connect: %s\n", e.message);
        return NULL;
    }
    return c;
}

static int frames_reset(const char *host, int port, pid_t server) {
    lmc_error e;
    lmc_client *c = connect_to(host, port, 1000);
    if (!c) return 1;
    check("noop", lmc_noop(c, &e), &e);
    /* Larger than the socket buffers of both ends: libzmq still holds it at the timeout. */
    size_t big = 64u << 20;
    unsigned char *buf = malloc(big), h[2][32];
    if (!buf) return 1;
    fill(buf, big, 5);
    memset(h, 0, sizeof(h));
    h[0][0] = 1;
    h[1][0] = 2;
    lmc_chunks ch = {.chunk_hashes = h[0], .num_chunk_hashes = 1, .hash_len = 32, .end = -1};
    const void *bufs[1] = {buf};
    size_t lens[1] = {big};
    lmc_store_options fo = {.chunk_frames = true};
    lmc_store_result res;
    kill(server, SIGSTOP);
    lmc_status s = lmc_store_bytes_ex(c, "reset-model", 1, 0, &ch, bufs, lens, 1, &fo, &res, &e);
    expect("a store with chunk frames to a stopped server times out", s == LMC_ERR_TIMEOUT);
    /* The buffer is the caller's again: overwrite and free it. Were it still being sent, the
     * server would get these bytes (or freed memory) once it resumes. */
    memset(buf, 0xaa, big);
    free(buf);
    kill(server, SIGCONT);
    lmc_client_set_timeout(c, 20000);
    check("noop on the new connection", lmc_noop(c, &e), &e);
    uint64_t hits = 99;
    check("lookup of the timed-out chunk",
          lmc_lookup_wait(c, "reset-1", "reset-model", 1, &ch, 1, 0, &hits, &e), &e);
    expect("the timed-out store was never delivered", hits == 0);
    check("end_session", lmc_end_session(c, "reset-1", &e), &e);
    unsigned char small[4096];
    fill(small, sizeof(small), 6);
    bufs[0] = small;
    lens[0] = sizeof(small);
    ch.chunk_hashes = h[1];
    check("store with chunk frames after the reset",
          lmc_store_bytes_ex(c, "reset-model", 1, 0, &ch, bufs, lens, 1, &fo, &res, &e), &e);
    expect("stored", res.stored_chunks == 1);
    lmc_reply *r = NULL;
    const void *b = NULL;
    size_t l = 0;
    check("retrieve_bytes", lmc_retrieve_bytes(c, "reset-model", 1, 0, &ch, NULL, &r, &e), &e);
    expect("the bytes stored",
           r && lmc_reply_chunk(r, 0, &b, &l) && l == sizeof(small) && !memcmp(b, small, l));
    lmc_reply_free(r);
    lmc_client_close(c);
    printf("%s\n", failures ? "FAILED" : "OK");
    return failures ? 1 : 0;
}

static long minor_faults(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_minflt;
}

#define KEEP_STORES 4
#define KEEP_CHUNKS 3
#define KEEP_CHUNK  (16u << 20)

/* The KEEP_CHUNKS 32-byte hashes at h as a chunk range. */
static lmc_chunks keep_chunks(const unsigned char *h) {
    return (lmc_chunks){
        .chunk_hashes = h, .num_chunk_hashes = KEEP_CHUNKS, .hash_len = 32, .end = -1};
}

/* KEEP_STORES stores of KEEP_CHUNKS chunks under `keep` (0: none kept); the minor faults of
 * each store into faults[], then every chunk read back and compared. */
static void keep_round(lmc_client *c, size_t keep, unsigned tag, unsigned char **src,
                       long faults[KEEP_STORES]) {
    lmc_error e;
    lmc_client_set_keep_bytes(c, keep);
    unsigned char h[KEEP_STORES][KEEP_CHUNKS][32];
    memset(h, 0, sizeof(h));
    for (int i = 0; i < KEEP_STORES; i++) {
        for (int k = 0; k < KEEP_CHUNKS; k++) {
            h[i][k][0] = (unsigned char)tag;
            h[i][k][1] = (unsigned char)i;
            h[i][k][2] = (unsigned char)k;
            fill(src[k], KEEP_CHUNK, tag * 100 + (unsigned)(i * KEEP_CHUNKS + k));
        }
        lmc_chunks ch = keep_chunks(h[i][0]);
        const void *bufs[KEEP_CHUNKS];
        size_t lens[KEEP_CHUNKS];
        for (int k = 0; k < KEEP_CHUNKS; k++) {
            bufs[k] = src[k];
            lens[k] = KEEP_CHUNK;
        }
        uint64_t stored = 0, skipped = 0;
        long f0 = minor_faults();
        lmc_status s = lmc_store_bytes(c, "keep-model", 1, 0, &ch, bufs, lens, KEEP_CHUNKS, &stored,
                                       &skipped, &e);
        faults[i] = minor_faults() - f0;
        check("store_bytes of 48 MiB", s, &e);
        expect("all chunks stored", stored == KEEP_CHUNKS);
        printf("keep %zu store %d: %ld minor faults, %zu bytes kept\n", keep, i, faults[i],
               lmc_client_kept_bytes(c));
    }
    int same = 1;
    for (int i = 0; i < KEEP_STORES; i++) {
        lmc_chunks ch = keep_chunks(h[i][0]);
        lmc_reply *r = NULL;
        if (lmc_retrieve_bytes(c, "keep-model", 1, 0, &ch, NULL, &r, &e) != LMC_OK) {
            check("retrieve_bytes", LMC_ERR_TRANSPORT, &e);
            same = 0;
            continue;
        }
        for (int k = 0; k < KEEP_CHUNKS; k++) {
            const void *b = NULL;
            size_t l = 0;
            fill(src[0], KEEP_CHUNK, tag * 100 + (unsigned)(i * KEEP_CHUNKS + k));
            if (!lmc_reply_chunk(r, (size_t)k, &b, &l) || l != KEEP_CHUNK ||
                memcmp(b, src[0], l) != 0)
                same = 0;
        }
        lmc_reply_free(r);
    }
    expect("every stored byte reads back", same);
}

static int keep_buffers(const char *host, int port) {
    lmc_client *c = connect_to(host, port, 60000);
    if (!c) return 1;
    unsigned char *src[KEEP_CHUNKS];
    for (int k = 0; k < KEEP_CHUNKS; k++)
        if (!(src[k] = malloc(KEEP_CHUNK))) return 1;
    long kept[KEEP_STORES], none[KEEP_STORES];
    keep_round(c, (size_t)1 << 30, 1, src, kept);
    expect("the request buffer is kept", lmc_client_kept_bytes(c) >= KEEP_CHUNKS * KEEP_CHUNK);
    keep_round(c, 0, 2, src, none);
    expect("none kept at 0", lmc_client_kept_bytes(c) == 0);
    /* A 48 MiB buffer is 12,288 pages: fresh each time without the keep. */
    long kmax = 0, nmin = none[1];
    for (int i = 1; i < KEEP_STORES; i++) {
        if (kept[i] > kmax) kmax = kept[i];
        if (none[i] < nmin) nmin = none[i];
    }
    printf("later stores: at most %ld faults kept, at least %ld without\n", kmax, nmin);
    expect("a kept buffer is not faulted in again", kmax < 1000);
    expect("without the keep each store faults its buffer in", nmin > 6000);
    for (int k = 0; k < KEEP_CHUNKS; k++) free(src[k]);
    lmc_client_close(c);
    printf("%s\n", failures ? "FAILED" : "OK");
    return failures ? 1 : 0;
}

/* lmc_lookup_wait alone (for a stand-in server): prints the hit chunks. */
static int lookup_wait_only(const char *host, int port) {
    lmc_error e;
    lmc_client *c = connect_to(host, port, 10000);
    if (!c) return 1;
    uint8_t h[3][32];
    memset(h, 7, sizeof(h));
    lmc_chunks ch = {.chunk_hashes = h[0], .num_chunk_hashes = 3, .hash_len = 32, .end = -1};
    uint64_t hits = 99;
    lmc_status s = lmc_lookup_wait(c, "lw-1", "lw-model", 1, &ch, 1, 100, &hits, &e);
    check("lookup_wait", s, &e);
    printf("hits %llu\n", (unsigned long long)hits);
    lmc_client_close(c);
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[3], "lookup-wait"))
        return lookup_wait_only(argv[1], atoi(argv[2]));
    if (argc == 4 && !strcmp(argv[3], "keep-buffers")) return keep_buffers(argv[1], atoi(argv[2]));
    if (argc == 5 && !strcmp(argv[3], "frames-reset"))
        return frames_reset(argv[1], atoi(argv[2]), (pid_t)atoi(argv[4]));
    if (argc != 3) {
        fprintf(stderr,
                "usage: %s HOST PORT [lookup-wait | keep-buffers | frames-reset SERVER_PID]\n",
                argv[0]);
        return 2;
    }
    lmc_error e;
    lmc_client *c;
    /* With LMC_SMOKE_CURVE_{SERVER,PUBLIC,SECRET} set (Z85 keys) the client speaks CURVE. */
    lmc_client_options o = {.timeout_ms = 10000,
                            .curve_server_key = getenv("LMC_SMOKE_CURVE_SERVER"),
                            .curve_public_key = getenv("LMC_SMOKE_CURVE_PUBLIC"),
                            .curve_secret_key = getenv("LMC_SMOKE_CURVE_SECRET")};
    if (lmc_client_connect(argv[1], atoi(argv[2]), &o, &c, &e) != LMC_OK) {
        printf("FAIL connect: %s\n", e.message);
        return 1;
    }
    check("noop", lmc_noop(c, &e), &e);
    uint64_t chunk = 0;
    check("get_chunk_size", lmc_get_chunk_size(c, &chunk, &e), &e);
    if (chunk == 0 || chunk % TPB) {
        printf("FAIL chunk size %llu is not a multiple of %d\n", (unsigned long long)chunk, TPB);
        return 1;
    }
    size_t bpc = chunk / TPB; /* blocks per chunk */
    char shm[64];
    snprintf(shm, sizeof(shm), "/lmcache-smoke-%d", (int)getpid());
    lmc_register_args ra = {.instance_id = 7,
                            .model_name = "smoke-model",
                            .shm_name = shm,
                            .layout = {.num_layers = LAYERS,
                                       .num_blocks = BLOCKS,
                                       .tokens_per_block = TPB,
                                       .bytes_per_token = BPT,
                                       .kv_count = 2,
                                       .block_order = LMC_LAYER_MAJOR,
                                       .dtype = "bfloat16"}};
    lmc_kv_context *kv = NULL;
    lmc_status s = lmc_register_kv_cache(c, &ra, &kv, &e);
    check("register_kv_cache", s, &e);
    if (s != LMC_OK) return 1;
    unsigned char *base = lmc_kv_base(kv);
    size_t size = lmc_kv_size(kv);
    check("kv_wait_warm", lmc_kv_wait_warm(c, 7, 30000, &e), &e);
    s = lmc_kv_wait_warm(c, 12345, 30000, &e);
    expect("kv_wait_warm of an unregistered instance is not_registered",
           s == LMC_ERR_NOT_REGISTERED);
    fill(base, size, (unsigned)getpid());
    unsigned char *orig = malloc(size);
    if (!orig) return 1;
    memcpy(orig, base, size);

    /* Two chunks in blocks [0, 2*bpc). */
    size_t ntok = 2 * chunk;
    uint32_t *toks = malloc(ntok * sizeof(uint32_t));
    int64_t *blocks = malloc(2 * bpc * sizeof(int64_t));
    if (!toks || !blocks) return 1;
    for (size_t i = 0; i < ntok; i++) toks[i] = (uint32_t)(getpid() * 1000 + i);
    for (size_t i = 0; i < 2 * bpc; i++) blocks[i] = (int64_t)i;
    lmc_chunks ch = {.token_ids = toks, .num_tokens = ntok, .end = -1};

    uint64_t hits = 99, stored = 0, skipped = 0, got = 0;
    check("lookup (cold)", lmc_lookup_wait(c, "smoke-1", "smoke-model", 1, &ch, 1, 0, &hits, &e),
          &e);
    expect("cold lookup misses", hits == 0);
    check("end_session", lmc_end_session(c, "smoke-1", &e), &e);
    check("store", lmc_store(c, 7, &ch, blocks, 2 * bpc, &stored, &skipped, &e), &e);
    expect("store stored 2 chunks", stored == 2 && skipped == 0);
    check("store again", lmc_store(c, 7, &ch, blocks, 2 * bpc, &stored, &skipped, &e), &e);
    expect("existing chunks skipped", stored == 0 && skipped == 2);
    /* Every count of the reply; wait_l2 without L2 tiers answers l2_stored_chunks = 0. */
    lmc_store_options so = {.wait_l2 = true};
    lmc_store_result sr;
    memset(&sr, 0xff, sizeof(sr));
    check("store_ex wait_l2", lmc_store_ex(c, 7, &ch, blocks, 2 * bpc, &so, &sr, &e), &e);
    expect("store_ex counts", sr.stored_chunks == 0 && sr.skipped_chunks == 2 &&
                                  sr.pending_chunks == 0 && sr.has_l2_stored &&
                                  sr.l2_stored_chunks == 0);
    check("store_ex", lmc_store_ex(c, 7, &ch, blocks, 2 * bpc, NULL, &sr, &e), &e);
    expect("store_ex without wait_l2 has no l2_stored_chunks", !sr.has_l2_stored);
    /* A failing lookup_wait (the lookup is refused) leaves no reply behind. */
    s = lmc_lookup_wait(c, "smoke-bad", "bad@model", 1, &ch, 1, 0, &hits, &e);
    expect("lookup_wait of a bad model name is bad_request", s == LMC_ERR_BAD_REQUEST);
    expect("nothing left in flight after a failed lookup_wait", lmc_in_flight(c) == 0);

    memset(base, 0, size);
    check("lookup (warm)", lmc_lookup_wait(c, "smoke-2", "smoke-model", 1, &ch, 1, 0, &hits, &e),
          &e);
    expect("warm lookup hits 2 chunks", hits == 2);
    check("retrieve", lmc_retrieve(c, 7, &ch, blocks, 2 * bpc, "smoke-2", 0, &got, &e), &e);
    expect("retrieved 2 chunks", got == 2);
    check("end_session", lmc_end_session(c, "smoke-2", &e), &e);
    int same = 1;
    for (uint32_t l = 0; l < LAYERS; l++)
        for (uint32_t k = 0; k < 2; k++) {
            uint64_t off = lmc_kv_offset(lmc_kv_layout_of(kv), l, k, 0, 0);
            same &= memcmp(base + off, orig + off, 2 * bpc * TPB * BPT) == 0;
        }
    expect("retrieved blocks are byte-identical", same);

    /* The same chunks over the socket. */
    lmc_reply *r = NULL;
    check("retrieve_bytes", lmc_retrieve_bytes(c, "smoke-model", 1, 0, &ch, NULL, &r, &e), &e);
    expect("retrieve_bytes returned 2 chunks", r && lmc_reply_num_chunks(r) == 2);
    const void *b0 = NULL;
    size_t l0 = 0;
    if (r) lmc_reply_chunk(r, 0, &b0, &l0);
    expect("chunk object size is kv_count*layers*chunk*bpt", l0 == 2 * LAYERS * chunk * BPT);
    if (r && l0 == 2 * LAYERS * chunk * BPT) {
        /* [K|V][layer][token][bytes] from layer_major engine blocks. */
        const unsigned char *p = b0;
        int ok = 1;
        for (uint32_t k = 0; k < 2; k++)
            for (uint32_t l = 0; l < LAYERS; l++) {
                uint64_t off = lmc_kv_offset(lmc_kv_layout_of(kv), l, k, 0, 0);
                ok &= memcmp(p + ((size_t)k * LAYERS + l) * chunk * BPT, orig + off, chunk * BPT) ==
                      0;
            }
        expect("retrieve_bytes object layout is [K|V][layer][token][bytes]", ok);
    }
    lmc_reply_free(r);

    uint32_t *toks2 = malloc(chunk * sizeof(uint32_t));
    unsigned char *obj = malloc(2 * LAYERS * chunk * BPT);
    if (!toks2 || !obj) return 1;
    for (size_t i = 0; i < chunk; i++) toks2[i] = (uint32_t)(7u << 28) + (uint32_t)i;
    fill(obj, 2 * LAYERS * chunk * BPT, 42);
    lmc_chunks ch2 = {.token_ids = toks2, .num_tokens = chunk, .end = -1};
    const void *bufs[1] = {obj};
    size_t lens[1] = {2 * LAYERS * chunk * BPT};
    check("store_bytes",
          lmc_store_bytes(c, "smoke-model", 1, 0, &ch2, bufs, lens, 1, &stored, &skipped, &e), &e);
    check("store_bytes_ex wait_l2",
          lmc_store_bytes_ex(c, "smoke-model", 1, 0, &ch2, bufs, lens, 1, &so, &sr, &e), &e);
    expect("store_bytes_ex counts", sr.stored_chunks == 0 && sr.skipped_chunks == 1 &&
                                        sr.pending_chunks == 0 && sr.has_l2_stored);
    r = NULL;
    check("retrieve_bytes", lmc_retrieve_bytes(c, "smoke-model", 1, 0, &ch2, NULL, &r, &e), &e);
    if (r && lmc_reply_chunk(r, 0, &b0, &l0))
        expect("store_bytes/retrieve_bytes byte-identical", l0 == lens[0] && !memcmp(b0, obj, l0));
    else
        expect("store_bytes/retrieve_bytes byte-identical", 0);
    expect("retrieve_bytes without options: the chunks array", r && !lmc_reply_has_chunk_frames(r));
    lmc_reply_free(r);
    /* The same as chunk frames: read through the same accessors, no copy. */
    lmc_retrieve_bytes_options ro = {.chunk_frames = true};
    r = NULL;
    check("retrieve_bytes_ex chunk_frames",
          lmc_retrieve_bytes_ex(c, "smoke-model", 1, 0, &ch2, NULL, &ro, &r, &e), &e);
    l0 = 0;
    expect("retrieve_bytes chunk frames byte-identical",
           r && lmc_reply_has_chunk_frames(r) && lmc_reply_num_chunks(r) == 1 &&
               lmc_reply_chunk(r, 0, &b0, &l0) && l0 == lens[0] && !memcmp(b0, obj, l0) &&
               !lmc_reply_chunk(r, 1, &b0, &l0));
    lmc_reply_free(r);

    /* store_bytes with chunk frames: sent from the caller's buffer, synchronous and pipelined. */
    unsigned char *obj3 = malloc(lens[0]);
    uint32_t *toks3 = malloc(chunk * sizeof(uint32_t));
    if (!obj3 || !toks3) return 1;
    for (size_t i = 0; i < chunk; i++) toks3[i] = (uint32_t)(9u << 28) + (uint32_t)i;
    fill(obj3, lens[0], 43);
    lmc_chunks ch3 = {.token_ids = toks3, .num_tokens = chunk, .end = -1};
    const void *bufs3[1] = {obj3};
    lmc_store_options fo = {.chunk_frames = true};
    check("store_bytes_ex chunk_frames",
          lmc_store_bytes_ex(c, "smoke-model", 1, 0, &ch3, bufs3, lens, 1, &fo, &sr, &e), &e);
    expect("store_bytes_ex chunk_frames stored 1", sr.stored_chunks == 1 && sr.skipped_chunks == 0);
    r = NULL;
    check("retrieve_bytes of a chunk stored as a frame",
          lmc_retrieve_bytes(c, "smoke-model", 1, 0, &ch3, NULL, &r, &e), &e);
    expect("chunk stored as a frame is byte-identical",
           r && lmc_reply_chunk(r, 0, &b0, &l0) && l0 == lens[0] && !memcmp(b0, obj3, l0));
    lmc_reply_free(r);
    lmc_req_id fid = 0;
    check("send_store_bytes_ex chunk_frames",
          lmc_send_store_bytes_ex(c, "smoke-model", 1, 0, &ch3, bufs3, lens, 1, &fo, &fid, &e), &e);
    r = NULL;
    check("wait for it", lmc_wait(c, fid, &r, &e), &e);
    expect("pipelined store with chunk frames skipped the resident chunk",
           r && lmc_reply_store_result(r, &sr, &e) == LMC_OK && sr.skipped_chunks == 1);
    lmc_reply_free(r);
    free(obj3);
    free(toks3);

    /* Pipelined: 64 noops and a get_chunk_size, collected newest first. */
    lmc_req_id ids[65];
    for (int i = 0; i < 64; i++) lmc_send_noop(c, &ids[i], &e);
    lmc_send_get_chunk_size(c, &ids[64], &e);
    int pipe_ok = lmc_in_flight(c) == 65;
    for (int i = 64; i >= 0; i--) {
        lmc_reply *pr;
        if (lmc_wait(c, ids[i], &pr, &e) != LMC_OK) {
            pipe_ok = 0;
            break;
        }
        pipe_ok &= lmc_reply_id(pr) == ids[i];
        pipe_ok &= strcmp(lmc_reply_op(pr), i == 64 ? "get_chunk_size" : "noop") == 0;
        lmc_reply_free(pr);
    }
    expect("65 pipelined requests matched by id", pipe_ok && lmc_in_flight(c) == 0);

    /* Error replies come back as values. */
    s = lmc_retrieve(c, 12345, &ch, blocks, 2 * bpc, NULL, 0, &got, &e);
    expect("retrieve on an unregistered instance is not_registered",
           s == LMC_ERR_NOT_REGISTERED && strcmp(e.code, "not_registered") == 0);
    s = lmc_store(c, 7, &ch, blocks, 1, &stored, &skipped, &e);
    expect("store with too few block ids is invalid_blocks", s == LMC_ERR_INVALID_BLOCKS);

    double t = 0;
    check("ping", lmc_ping(c, 7, &t, &e), &e);
    expect("ping server_time", t > 0);
    uint64_t cleared = 0;
    check("clear", lmc_clear(c, &cleared, &e), &e);
    expect("clear freed the 4 objects", cleared == 4);
    check("unregister_kv_cache", lmc_unregister_kv_cache(c, kv, &e), &e);
    s = lmc_unregister_instance(c, 7, &e);
    expect("second unregister is not_registered", s == LMC_ERR_NOT_REGISTERED);
    lmc_client_close(c);
    free(orig);
    free(toks);
    free(toks2);
    free(obj);
    free(blocks);
    printf("%s\n", failures ? "FAILED" : "OK");
    return failures ? 1 : 0;
}
