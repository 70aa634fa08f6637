/* `lmcache bench l1`: L1 micro-benchmark. Allocator alloc/free ops per second on one thread,
 * the key-table lookup of a 128-chunk prompt (take read locks on the leading hits, then release
 * them) on 1 and 2 threads, chunk hashing of the same prompt, metadata bytes per object, and a
 * memcpy reference measured in the same run. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "bench/bench.h"
#include "server/keys.h"
#include "server/l1/arena.h"
#include "server/l1/l1.h"

#define CHUNKS 128
#define MiB    (1ull << 20)

struct opts {
    int prompts;  /* distinct 128-chunk prompts cached */
    int seconds;  /* per measurement, roughly */
    uint64_t obj; /* object size */
};

/* Alloc/free pairs with ~4096 live objects of 1..64 units in a 4 GiB (virtual) arena. */
static double alloc_ops(double seconds) {
    struct arena_config cfg = {.size_bytes = 4096 * MiB};
    struct arena *a;
    char err[160];
    if (arena_create(&cfg, &a, err, sizeof(err)) != 0) {
        fprintf(stderr, "arena: %s\n", err);
        return 0;
    }
    enum { LIVE = 4096 };
    uint64_t off[LIVE], sz[LIVE];
    unsigned seed = 1;
    for (int i = 0; i < LIVE; i++) {
        sz[i] = 4096ull * (1 + (unsigned)rand_r(&seed) % 64);
        if (arena_alloc(a, sz[i], &off[i]) != 0) return 0;
    }
    uint64_t ops = 0, t0 = clock_mono_ns();
    while (clock_mono_ns() - t0 < (uint64_t)(seconds * 1e9)) {
        for (int j = 0; j < 10000; j++) {
            int i = rand_r(&seed) % LIVE;
            arena_free(a, off[i], sz[i]);
            sz[i] = 4096ull * (1 + (unsigned)rand_r(&seed) % 64);
            if (arena_alloc(a, sz[i], &off[i]) != 0) {
                fprintf(stderr, "arena: unexpected allocation failure\n");
                arena_destroy(a);
                return 0;
            }
        }
        ops += 20000;
    }
    double s = (double)(clock_mono_ns() - t0) / 1e9;
    arena_destroy(a);
    return (double)ops / s;
}

struct lookup_arg {
    struct l1 *l1;
    struct l1_key *keys; /* prompts * CHUNKS */
    int prompts, first, stride;
    double seconds;
    uint64_t lookups;
    uint64_t ns, lookup_ns;
};

static void *lookup_thread(void *p) {
    struct lookup_arg *a = p;
    uint64_t n = 0, t0 = clock_mono_ns();
    int i = a->first;
    while (clock_mono_ns() - t0 < (uint64_t)(a->seconds * 1e9)) {
        for (int j = 0; j < 100; j++) {
            const struct l1_key *k = &a->keys[(size_t)i * CHUNKS];
            uint64_t now = clock_mono_ns();
            size_t hits = l1_reserve_read_prefix(a->l1, k, CHUNKS, 1, now);
            a->lookup_ns += clock_mono_ns() - now;
            for (size_t c = 0; c < hits; c++) l1_finish_read(a->l1, &k[c], 1, now);
            if (hits != CHUNKS) fprintf(stderr, "lookup: only %zu hits\n", hits);
            i += a->stride;
            if (i >= a->prompts) i = a->first;
            n++;
        }
    }
    a->ns = clock_mono_ns() - t0;
    a->lookups = n;
    return NULL;
}

/* Average microseconds per 128-chunk lookup+release with nthreads threads; *lookup_only the
 * part spent taking the locks. */
static double lookup_us(struct l1 *l1, struct l1_key *keys, int prompts, int nthreads,
                        double seconds, double *total_per_s, double *lookup_only) {
    pthread_t th[2];
    struct lookup_arg args[2];
    for (int t = 0; t < nthreads; t++) {
        args[t] = (struct lookup_arg){l1, keys, prompts, t, nthreads, seconds, 0, 0, 0};
        pthread_create(&th[t], NULL, lookup_thread, &args[t]);
    }
    double us = 0, rate = 0, lus = 0;
    for (int t = 0; t < nthreads; t++) {
        pthread_join(th[t], NULL);
        us += (double)args[t].ns / 1e3 / (double)args[t].lookups;
        lus += (double)args[t].lookup_ns / 1e3 / (double)args[t].lookups;
        rate += (double)args[t].lookups / ((double)args[t].ns / 1e9);
    }
    *total_per_s = rate;
    *lookup_only = lus / nthreads;
    return us / nthreads;
}

int bench_l1_main(int argc, char **argv) {
    struct opts o = {.prompts = 500, .seconds = 2, .obj = 4096};
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--prompts") == 0 && i + 1 < argc)
            o.prompts = atoi(argv[++i]);
        else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            o.seconds = atoi(argv[++i]);
        else {
            printf("usage: lmcache bench l1 [--prompts N (500)] [--seconds S (2)]\n");
            return strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0 ? 0 : 2;
        }
    }
    if (o.prompts < 2 || o.seconds < 1) {
        fprintf(stderr, "lmcache bench l1: --prompts >= 2 and --seconds >= 1\n");
        return 2;
    }
    printf("memcpy reference (64 MiB buffers): %.2f GB/s\n", bench_memcpy_gbps(0, o.seconds));
    printf("allocator, 1 thread, 4096 live objects of 1-64 units: %.2f M ops/s\n",
           alloc_ops(o.seconds) / 1e6);

    /* Chunk hashing of one 128 x 256-token prompt. */
    uint32_t *tokens = malloc(sizeof(uint32_t) * CHUNKS * 256);
    uint8_t(*hashes)[KEYS_HASH_LEN] = malloc((size_t)KEYS_HASH_LEN * CHUNKS);
    uint8_t seed[KEYS_HASH_LEN];
    keys_default_seed(seed);
    if (!tokens || !hashes) return 1;
    for (int i = 0; i < CHUNKS * 256; i++) tokens[i] = (uint32_t)i * 2654435761u;
    uint64_t t0 = clock_mono_ns();
    int reps = 0;
    while (clock_mono_ns() - t0 < 1000000000ull) {
        tokens[0] = (uint32_t)reps++;
        keys_prefix_hashes(seed, tokens, CHUNKS * 256, 256, hashes, CHUNKS);
    }
    printf("chunk hashing, 128 chunks x 256 tokens (SHA-256 chain): %.1f us per prompt\n",
           (double)(clock_mono_ns() - t0) / 1e3 / reps);

    /* Fill an L1 with prompts x 128 objects, then look prompts up. */
    uint64_t nobj = (uint64_t)o.prompts * CHUNKS;
    struct l1_config cfg = {.size_bytes = nobj * o.obj + 64 * MiB,
                            .policy = L1_POLICY_LRU,
                            .touch_interval_ns = 100000000ull};
    struct l1 *l1;
    char err[160];
    if (l1_create(&cfg, &l1, err, sizeof(err)) != 0) {
        fprintf(stderr, "l1: %s\n", err);
        return 1;
    }
    struct l1_key *keys = malloc(sizeof(*keys) * nobj);
    if (!keys) return 1;
    for (int p = 0; p < o.prompts; p++) {
        tokens[0] = 1000000u + (uint32_t)p;
        keys_prefix_hashes(seed, tokens, CHUNKS * 256, 256, hashes, CHUNKS);
        for (int c = 0; c < CHUNKS; c++) {
            struct keys_object_key ok = {.hash_len = KEYS_HASH_LEN, .kv_rank = 0x01000100};
            memcpy(ok.hash, hashes[c], KEYS_HASH_LEN);
            strcpy(ok.model_name, "meta-llama/Llama-3.1-8B-Instruct");
            struct l1_key *k = &keys[(size_t)p * CHUNKS + c];
            struct l1_ref r;
            if (l1_key_make(l1, &ok, k) != L1_OK ||
                l1_reserve_write(l1, k, o.obj, false, clock_mono_ns(), &r) != L1_OK ||
                l1_finish_write(l1, k, r.token, 0, clock_mono_ns()) != L1_OK) {
                fprintf(stderr, "l1: fill failed\n");
                return 1;
            }
        }
    }
    for (int t = 1; t <= 2; t++) {
        double rate, lus;
        double us = lookup_us(l1, keys, o.prompts, t, o.seconds, &rate, &lus);
        printf("128-chunk prompt, %d thread%s, %llu objects: lookup %.2f us, lookup + release "
               "%.2f us per prompt (%.0f prompts/s in total)\n",
               t, t > 1 ? "s" : "", (unsigned long long)nobj, lus, us, rate);
    }
    printf("metadata per object: %zu bytes (entry + malloc header + bucket) + 12 bytes per "
           "4 KiB unit of allocator tags\n",
           l1_entry_overhead_bytes());
    l1_destroy(l1);
    free(keys);
    free(tokens);
    free(hashes);
    return 0;
}
