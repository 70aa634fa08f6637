/* `lmcache bench server --mode throughput`: N clients (threads, one DEALER and one
 * shared-memory KV cache each) store and retrieve their prompts through shared memory, then
 * through store_bytes/retrieve_bytes (each also with chunk frames); GB/s and minor page faults
 * per phase, lookup latency percentiles, and a single-thread memcpy reference of the same run.
 * Options, shared helpers and the other modes: bench_server.c. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "bench/bench.h"
#include "bench/bench_server.h"
#include "lmcache/client.h"

/* ---- throughput mode --------------------------------------------------------------------- */

/* PH_STORE_FRAMES: store_bytes with chunk_frames (the chunks sent from the client's buffers
 * as frames); PH_RETRIEVE_FRAMES: retrieve_bytes with chunk_frames (sent from L1 as frames). */
enum {
    PH_STORE,
    PH_LOOKUP,
    PH_RETRIEVE,
    PH_STORE_BYTES,
    PH_STORE_FRAMES,
    PH_RETRIEVE_BYTES,
    PH_RETRIEVE_FRAMES,
    NPHASE
};
static const char *const PHASE_NAMES[NPHASE] = {"store (shm)",    "lookup",       "retrieve (shm)",
                                                "store_bytes",    "store_frames", "retrieve_bytes",
                                                "retrieve_frames"};

struct worker {
    const struct opts *o;
    const struct shape *sh;
    pthread_barrier_t *bar;
    int idx;
    int failed;
    uint64_t bytes[NPHASE];
    double *lat; /* lookup latencies, seconds */
    size_t nlat;
};

static void fail(struct worker *w, const char *what, const lmc_error *e) {
    if (!w->failed) fprintf(stderr, "client %d: %s: %s (%s)\n", w->idx, what, e->message, e->code);
    w->failed = 1;
}

/* One timed retrieve_bytes phase (salt "b", the keys of phase 3): --rounds passes over the
 * prompts, the bytes of every chunk received counted to `phase`. */
static void retrieve_bytes_phase(struct worker *w, lmc_client *c, const uint32_t *toks, size_t ntok,
                                 const lmc_retrieve_bytes_options *ro, int phase,
                                 const char *what) {
    const struct opts *o = w->o;
    lmc_error e;
    pthread_barrier_wait(w->bar);
    for (int r = 0; r < o->rounds; r++)
        for (int p = 0; p < o->prompts && !w->failed; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok,
                             .num_tokens = ntok,
                             .end = -1,
                             .cache_salt = "b"};
            lmc_reply *rep = NULL;
            if (lmc_retrieve_bytes_ex(c, o->model, 1, 0, &ch, NULL, ro, &rep, &e) != LMC_OK) {
                fail(w, what, &e);
                break;
            }
            size_t n = lmc_reply_num_chunks(rep);
            for (size_t i = 0; i < n; i++) {
                const void *d;
                size_t l;
                if (lmc_reply_chunk(rep, i, &d, &l)) w->bytes[phase] += l;
            }
            lmc_reply_free(rep);
        }
    pthread_barrier_wait(w->bar);
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    const struct opts *o = w->o;
    const struct shape *sh = w->sh;
    lmc_client *c = NULL;
    lmc_kv_context *kv = NULL;
    lmc_error e;
    lmc_client_options co = {.timeout_ms = o->timeout_ms};
    int64_t inst = o->instance_base + w->idx;
    uint64_t ntok = sh->nchunks * sh->chunk;
    uint32_t *toks = malloc((size_t)o->prompts * ntok * sizeof(uint32_t));
    int64_t *blocks = malloc(sh->bpp * sizeof(int64_t));
    void **objs = calloc(sh->nchunks, sizeof(void *));
    size_t *lens = calloc(sh->nchunks, sizeof(size_t));
    if (!toks || !blocks || !objs || !lens) {
        fprintf(stderr, "client %d: out of memory\n", w->idx);
        w->failed = 1;
    }
    if (!w->failed && bsrv_connect(o, &co, &c, &e) != LMC_OK) fail(w, "connect", &e);
    if (!w->failed) {
        lmc_register_args ra = {.instance_id = inst, .model_name = o->model, .layout = sh->layout};
        if (lmc_register_kv_cache(c, &ra, &kv, &e) != LMC_OK)
            fail(w, "register_kv_cache", &e);
        else
            bsrv_fill_random(lmc_kv_base(kv), lmc_kv_size(kv),
                             (uint64_t)o->seed + (uint64_t)w->idx);
        /* the server faults the region in after registering it: not in the timed phases */
        if (!w->failed && lmc_kv_wait_warm(c, inst, -1, &e) != LMC_OK) fail(w, "warm-up", &e);
        for (int p = 0; p < o->prompts && !w->failed; p++)
            bsrv_prompt_tokens(toks + (size_t)p * ntok, ntok,
                               (uint64_t)o->seed * 1000003u + (uint64_t)w->idx * 7919u +
                                   (uint64_t)p);
        for (uint64_t i = 0; i < sh->nchunks && !w->failed && o->bytes_path; i++) {
            objs[i] = malloc(sh->chunk_obj);
            lens[i] = sh->chunk_obj;
            if (!objs[i])
                w->failed = 1;
            else
                bsrv_fill_random(objs[i], sh->chunk_obj, i + 1);
        }
    }
    if (o->warmup) {
        /* Untimed: touch the server's mapping of our blocks and L1 pages; main clears L1. */
        for (int p = 0; p < o->prompts && !w->failed; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok,
                             .num_tokens = ntok,
                             .end = -1,
                             .cache_salt = "warmup"};
            for (uint64_t b = 0; b < sh->bpp; b++) blocks[b] = (int64_t)((uint64_t)p * sh->bpp + b);
            if (lmc_store(c, inst, &ch, blocks, sh->bpp, NULL, NULL, &e) != LMC_OK)
                fail(w, "warm-up store", &e);
        }
        /* The bytes path's message buffers, on both sides: a few requests of each kind at the
         * timed size, so that the heaps hold (and have faulted in) the buffers the steady
         * state reuses — with glibc set up as the server's, two per direction, as a message is
         * allocated before the previous one is freed. Without it the first requests of a phase
         * pay a page fault per 4 KiB of each buffer (at 256 MiB messages on a VM, seconds). */
        for (int p = 0; p < o->prompts && p < 3 && !w->failed && o->bytes_path; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok,
                             .num_tokens = ntok,
                             .end = -1,
                             .cache_salt = "warmup-b"};
            lmc_store_options so = {.chunk_frames = true};
            lmc_retrieve_bytes_options ro = {.chunk_frames = true};
            lmc_store_result res;
            lmc_reply *rep = NULL;
            if (lmc_store_bytes(c, o->model, 1, 0, &ch, (const void *const *)objs, lens,
                                sh->nchunks, NULL, NULL, &e) != LMC_OK ||
                lmc_retrieve_bytes_ex(c, o->model, 1, 0, &ch, NULL, NULL, &rep, &e) != LMC_OK) {
                fail(w, "warm-up store_bytes/retrieve_bytes", &e);
                break;
            }
            lmc_reply_free(rep);
            rep = NULL;
            ch.cache_salt = "warmup-f";
            if (lmc_store_bytes_ex(c, o->model, 1, 0, &ch, (const void *const *)objs, lens,
                                   sh->nchunks, &so, &res, &e) != LMC_OK ||
                lmc_retrieve_bytes_ex(c, o->model, 1, 0, &ch, NULL, &ro, &rep, &e) != LMC_OK) {
                fail(w, "warm-up store_bytes/retrieve_bytes chunk_frames", &e);
                break;
            }
            lmc_reply_free(rep);
        }
        /* Plain stores last: the server keeps freed message memory up to three times the
         * largest message (glibc then trims the whole free top), so the buffers of the timed
         * phase's first kind, store_bytes, are the ones left in its heap. */
        for (int p = 0; p < o->prompts && p < 2 && !w->failed && o->bytes_path; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok,
                             .num_tokens = ntok,
                             .end = -1,
                             .cache_salt = "warmup-c"};
            if (lmc_store_bytes(c, o->model, 1, 0, &ch, (const void *const *)objs, lens,
                                sh->nchunks, NULL, NULL, &e) != LMC_OK)
                fail(w, "warm-up store_bytes", &e);
        }
        pthread_barrier_wait(w->bar);
        pthread_barrier_wait(w->bar);
    }
    /* Phase 0: store. */
    pthread_barrier_wait(w->bar);
    for (int p = 0; p < o->prompts && !w->failed; p++) {
        lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok, .num_tokens = ntok, .end = -1};
        for (uint64_t b = 0; b < sh->bpp; b++) blocks[b] = (int64_t)((uint64_t)p * sh->bpp + b);
        uint64_t stored = 0, skipped = 0;
        if (lmc_store(c, inst, &ch, blocks, sh->bpp, &stored, &skipped, &e) != LMC_OK)
            fail(w, "store", &e);
        w->bytes[PH_STORE] += stored * sh->chunk_obj;
    }
    pthread_barrier_wait(w->bar);
    for (int r = 0; r < o->rounds; r++) {
        /* Phase 1: lookups (sessions keep their read locks). */
        pthread_barrier_wait(w->bar);
        for (int p = 0; p < o->prompts && !w->failed; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok, .num_tokens = ntok, .end = -1};
            char rid[64];
            snprintf(rid, sizeof(rid), "tp-%lld-%d-%d", o->seed, w->idx, p);
            uint64_t hits = 0;
            double t0 = clock_mono();
            if (lmc_lookup_wait(c, rid, o->model, 1, &ch, 1, 20, &hits, &e) != LMC_OK)
                fail(w, "lookup", &e);
            w->lat[w->nlat++] = clock_mono() - t0;
            if (!w->failed && hits != sh->nchunks) {
                fprintf(stderr, "client %d: lookup hit %llu of %llu chunks (is L1 large enough?)\n",
                        w->idx, (unsigned long long)hits, (unsigned long long)sh->nchunks);
                w->failed = 1;
            }
        }
        pthread_barrier_wait(w->bar);
        /* Phase 2: retrieve under the sessions' locks. */
        pthread_barrier_wait(w->bar);
        for (int p = 0; p < o->prompts && !w->failed; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok, .num_tokens = ntok, .end = -1};
            char rid[64];
            snprintf(rid, sizeof(rid), "tp-%lld-%d-%d", o->seed, w->idx, p);
            for (uint64_t b = 0; b < sh->bpp; b++) blocks[b] = (int64_t)((uint64_t)p * sh->bpp + b);
            uint64_t got = 0;
            if (lmc_retrieve(c, inst, &ch, blocks, sh->bpp, rid, 0, &got, &e) != LMC_OK)
                fail(w, "retrieve", &e);
            w->bytes[PH_RETRIEVE] += got * sh->chunk_obj;
        }
        pthread_barrier_wait(w->bar);
        for (int p = 0; p < o->prompts && c; p++) {
            char rid[64];
            snprintf(rid, sizeof(rid), "tp-%lld-%d-%d", o->seed, w->idx, p);
            if (lmc_end_session(c, rid, &e) != LMC_OK) fail(w, "end_session", &e);
        }
    }
    if (o->bytes_path) {
        /* Phase 3: store_bytes (salt "b": other keys than the shared-memory ones). */
        pthread_barrier_wait(w->bar);
        for (int p = 0; p < o->prompts && !w->failed; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok,
                             .num_tokens = ntok,
                             .end = -1,
                             .cache_salt = "b"};
            uint64_t stored = 0, skipped = 0;
            if (lmc_store_bytes(c, o->model, 1, 0, &ch, (const void *const *)objs, lens,
                                sh->nchunks, &stored, &skipped, &e) != LMC_OK)
                fail(w, "store_bytes", &e);
            w->bytes[PH_STORE_BYTES] += stored * sh->chunk_obj;
        }
        pthread_barrier_wait(w->bar);
        /* Phase 3b: store_bytes with chunk_frames (salt "f"). */
        pthread_barrier_wait(w->bar);
        lmc_store_options so = {.chunk_frames = true};
        for (int p = 0; p < o->prompts && !w->failed; p++) {
            lmc_chunks ch = {.token_ids = toks + (size_t)p * ntok,
                             .num_tokens = ntok,
                             .end = -1,
                             .cache_salt = "f"};
            lmc_store_result res;
            if (lmc_store_bytes_ex(c, o->model, 1, 0, &ch, (const void *const *)objs, lens,
                                   sh->nchunks, &so, &res, &e) != LMC_OK)
                fail(w, "store_bytes chunk_frames", &e);
            w->bytes[PH_STORE_FRAMES] += res.stored_chunks * sh->chunk_obj;
        }
        pthread_barrier_wait(w->bar);
        /* Phase 4: retrieve_bytes (the chunks in the reply map). */
        retrieve_bytes_phase(w, c, toks, ntok, NULL, PH_RETRIEVE_BYTES, "retrieve_bytes");
        /* Phase 5: retrieve_bytes with chunk_frames. */
        lmc_retrieve_bytes_options ro = {.chunk_frames = true};
        retrieve_bytes_phase(w, c, toks, ntok, &ro, PH_RETRIEVE_FRAMES,
                             "retrieve_bytes chunk_frames");
    }
    if (kv && lmc_unregister_kv_cache(c, kv, &e) != LMC_OK) fail(w, "unregister_kv_cache", &e);
    lmc_client_close(c);
    for (uint64_t i = 0; i < sh->nchunks; i++) free(objs[i]);
    free(objs);
    free(lens);
    free(toks);
    free(blocks);
    return NULL;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(const double *v, size_t n, double p) {
    if (n == 0) return 0;
    size_t i = (size_t)(p / 100.0 * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

/* Lookup latency as an engine sees it before scheduling a request: lmc_lookup_wait (lookup +
 * query_prefetch_status until ready) and end_session, on a prompt whose chunks are all in L1.
 * The objects are 4 KiB, stored with store_bytes under model <model>-lat (no KV cache is
 * registered for it), so the figure is the round trip and the per-chunk work, not copies.
 * Prints p50/p90/p99/max for 4- and 128-chunk prompts. */
static int lookup_latency(const struct opts *o, const lmc_client_options *co, uint64_t chunk) {
    enum { MAXCH = 128, OBJ = 4096 };
    lmc_client *c = NULL;
    lmc_error e;
    char model[300];
    snprintf(model, sizeof(model), "%s-lat", o->model);
    uint32_t *toks = malloc(MAXCH * chunk * sizeof(uint32_t));
    unsigned char *obj = malloc(OBJ);
    const void **bufs = malloc(MAXCH * sizeof(void *));
    size_t *lens = malloc(MAXCH * sizeof(size_t));
    double *lat = malloc((size_t)o->lookup_samples * sizeof(double));
    static uint8_t hashes[MAXCH * 32];
    int rc = 1;
    if (!toks || !obj || !bufs || !lens || !lat) {
        fprintf(stderr, "lmcache bench server: out of memory\n");
        goto out;
    }
    bsrv_prompt_tokens(toks, MAXCH * chunk, (uint64_t)o->seed * 31u + 17u);
    bsrv_fill_random(obj, OBJ, (uint64_t)o->seed);
    bsrv_fill_random(hashes, sizeof(hashes), (uint64_t)o->seed * 7u + 3u);
    for (int i = 0; i < MAXCH; i++) {
        bufs[i] = obj;
        lens[i] = OBJ;
    }
    lmc_chunks all = {.token_ids = toks, .num_tokens = MAXCH * chunk, .end = -1};
    lmc_chunks allh = {
        .chunk_hashes = hashes, .num_chunk_hashes = MAXCH, .hash_len = 32, .end = -1};
    if (bsrv_connect(o, co, &c, &e) != LMC_OK ||
        lmc_store_bytes(c, model, 1, 0, &all, bufs, lens, MAXCH, NULL, NULL, &e) != LMC_OK ||
        lmc_store_bytes(c, model, 1, 0, &allh, bufs, lens, MAXCH, NULL, NULL, &e) != LMC_OK) {
        bsrv_perr("lookup latency: store_bytes", &e);
        goto out;
    }
    /* 4 and 128 chunks named by token_ids (the whole prompt is sent and hashed by the server),
     * and 128 chunks named by chunk_hashes (32 bytes per chunk on the wire). */
    static const int sizes[3] = {4, MAXCH, MAXCH};
    for (int k = 0; k < 3; k++) {
        int by_hash = k == 2;
        lmc_chunks ch = {.token_ids = toks, .num_tokens = (size_t)sizes[k] * chunk, .end = -1};
        if (by_hash) ch = allh;
        for (int i = -8; i < o->lookup_samples; i++) { /* 8 untimed */
            char rid[64];
            uint64_t hits = 0;
            snprintf(rid, sizeof(rid), "lat-%d-%d", k, i);
            double t0 = clock_mono();
            if (lmc_lookup_wait(c, rid, model, 1, &ch, 1, 20, &hits, &e) != LMC_OK) {
                bsrv_perr("lookup latency: lookup", &e);
                goto out;
            }
            double dt = clock_mono() - t0;
            if (lmc_end_session(c, rid, &e) != LMC_OK) {
                bsrv_perr("lookup latency: end_session", &e);
                goto out;
            }
            if (hits != (uint64_t)sizes[k]) {
                fprintf(stderr, "lmcache bench server: lookup latency: %llu of %d chunks hit\n",
                        (unsigned long long)hits, sizes[k]);
                goto out;
            }
            if (i >= 0) lat[i] = dt;
        }
        size_t n = (size_t)o->lookup_samples;
        qsort(lat, n, sizeof(double), cmp_double);
        printf("lookup %3d chunks by %-12s (lookup_wait until ready, %zu samples): p50 %.1f us, "
               "p90 %.1f us, p99 %.1f us, max %.1f us\n",
               sizes[k], by_hash ? "chunk_hashes" : "token_ids", n, pct(lat, n, 50) * 1e6,
               pct(lat, n, 90) * 1e6, pct(lat, n, 99) * 1e6, lat[n - 1] * 1e6);
    }
    rc = 0;
out:
    lmc_client_close(c);
    free(toks);
    free(obj);
    free(bufs);
    free(lens);
    free(lat);
    return rc;
}

int bsrv_run_throughput(const struct opts *o) {
    lmc_client *c;
    lmc_error e;
    lmc_client_options co = {.timeout_ms = o->timeout_ms};
    uint64_t chunk = 0;
    struct shape sh;
    if (o->clients < 1 || o->rounds < 1 || o->rounds > MAX_ROUNDS) {
        fprintf(stderr, "lmcache bench server: --clients must be positive, --rounds 1..%d\n",
                MAX_ROUNDS);
        return 2;
    }
    if (bsrv_connect(o, &co, &c, &e) != LMC_OK || lmc_get_chunk_size(c, &chunk, &e) != LMC_OK) {
        bsrv_perr("get_chunk_size", &e);
        lmc_client_close(c);
        return 1;
    }
    lmc_client_close(c);
    if (bsrv_make_shape(o, chunk, &sh) != 0) return 2;
    double ws = (double)sh.prompt_obj * o->prompts * o->clients;
    printf("throughput: %d clients x %d prompts x %llu chunks of %llu tokens; layout %d layers, "
           "%d KV heads x %d dim x %d bytes, %d tokens/block, %s; chunk object %.2f MiB; "
           "working set %.2f GiB per path (L1 must hold %s)\n",
           o->clients, o->prompts, (unsigned long long)sh.nchunks, (unsigned long long)chunk,
           o->layers, o->kv_heads, o->head_dim, o->dtype_bytes, o->tokens_per_block, o->block_order,
           (double)sh.chunk_obj / MiB, ws / (1 << 30), o->bytes_path ? "twice that" : "it");
    bsrv_print_server_threads(o);
    double ref_before = bench_memcpy_gbps(0, 1.0);

    pthread_barrier_t bar;
    if (pthread_barrier_init(&bar, NULL, (unsigned)o->clients + 1) != 0) return 1;
    struct worker *w = calloc((size_t)o->clients, sizeof(*w));
    pthread_t *th = calloc((size_t)o->clients, sizeof(*th));
    size_t nlat_each = (size_t)o->prompts * (size_t)o->rounds;
    int started = 0, rc = 0;
    if (!w || !th) goto oom;
    for (int i = 0; i < o->clients; i++) {
        w[i] = (struct worker){.o = o, .sh = &sh, .bar = &bar, .idx = i};
        w[i].lat = malloc(nlat_each * sizeof(double));
        if (!w[i].lat) goto oom;
    }
    for (; started < o->clients; started++)
        if (pthread_create(&th[started], NULL, worker_main, &w[started]) != 0) {
            fprintf(stderr, "lmcache bench server: pthread_create failed\n");
            abort(); /* the barrier cannot complete without every worker */
        }
    double secs[NPHASE] = {0};
    /* The phases in the order the workers run them; each is bracketed by two barriers. */
    int phases[1 + 2 * MAX_ROUNDS + 4];
    int np = 0;
    phases[np++] = PH_STORE;
    for (int r = 0; r < o->rounds; r++) {
        phases[np++] = PH_LOOKUP;
        phases[np++] = PH_RETRIEVE;
    }
    if (o->bytes_path) {
        phases[np++] = PH_STORE_BYTES;
        phases[np++] = PH_STORE_FRAMES;
        phases[np++] = PH_RETRIEVE_BYTES;
        phases[np++] = PH_RETRIEVE_FRAMES;
    }
    if (o->warmup) {
        pthread_barrier_wait(&bar);
        uint64_t cleared = 0;
        if (bsrv_connect(o, &co, &c, &e) != LMC_OK || lmc_clear(c, &cleared, &e) != LMC_OK) {
            bsrv_perr("clear after the warm-up", &e);
            rc = 1;
        } else {
            printf("warm-up: stored and cleared %llu objects\n", (unsigned long long)cleared);
        }
        lmc_client_close(c);
        pthread_barrier_wait(&bar);
    }
    long long sflt[NPHASE] = {0}, cflt[NPHASE] = {0};
    for (int i = 0; i < np; i++) {
        pthread_barrier_wait(&bar);
        long long s0 = bsrv_minflt_of(o->server_pid), c0 = bsrv_minflt_self();
        double t0 = clock_mono();
        pthread_barrier_wait(&bar);
        secs[phases[i]] += clock_mono() - t0;
        long long s1 = bsrv_minflt_of(o->server_pid), c1 = bsrv_minflt_self();
        sflt[phases[i]] += s0 >= 0 && s1 >= 0 ? s1 - s0 : 0;
        cflt[phases[i]] += c1 - c0;
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < o->clients; i++) rc |= w[i].failed;
    if (!rc && o->lookup_samples > 0 && lookup_latency(o, &co, chunk) != 0) rc = 1;
    /* The reference is taken before and after the phases; ratios use the higher one. */
    double ref_after = bench_memcpy_gbps(0, 1.0);
    double ref = ref_before > ref_after ? ref_before : ref_after;
    printf("memcpy reference (1 thread, 64 MiB buffers): %.2f GB/s before, %.2f GB/s after\n",
           ref_before, ref_after);
    uint64_t bytes[NPHASE] = {0};
    size_t nl = 0;
    double *lat = malloc((size_t)o->clients * nlat_each * sizeof(double));
    if (!lat) goto oom;
    for (int i = 0; i < o->clients; i++) {
        rc |= w[i].failed;
        for (int p = 0; p < NPHASE; p++) bytes[p] += w[i].bytes[p];
        memcpy(lat + nl, w[i].lat, w[i].nlat * sizeof(double));
        nl += w[i].nlat;
    }
    qsort(lat, nl, sizeof(double), cmp_double);
    for (int p = 0; p < NPHASE; p++) {
        if (p == PH_LOOKUP || secs[p] == 0) continue;
        double g = (double)bytes[p] / secs[p] / 1e9;
        char srv[48] = "";
        if (o->server_pid > 0) snprintf(srv, sizeof(srv), "%lld server / ", sflt[p]);
        printf("%-15s %8.2f GB/s  (%.2f GiB in %.3f s, %.0f%% of memcpy; minor faults: %s%lld "
               "client)\n",
               PHASE_NAMES[p], g, (double)bytes[p] / (1 << 30), secs[p],
               ref > 0 ? 100.0 * g / ref : 0.0, srv, cflt[p]);
    }
    printf("lookup latency (lookup + query_prefetch_status until ready, %zu samples): p50 %.1f us, "
           "p90 %.1f us, p99 %.1f us, max %.1f us\n",
           nl, pct(lat, nl, 50) * 1e6, pct(lat, nl, 90) * 1e6, pct(lat, nl, 99) * 1e6,
           nl ? lat[nl - 1] * 1e6 : 0.0);
    free(lat);
    goto out;
oom:
    fprintf(stderr, "lmcache bench server: out of memory\n");
    rc = 1;
out:
    for (int i = 0; w && i < o->clients; i++) free(w[i].lat);
    free(w);
    free(th);
    pthread_barrier_destroy(&bar);
    if (rc) printf("FAILED: some requests failed (see above)\n");
    return rc ? 1 : 0;
}
