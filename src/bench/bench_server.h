/* `lmcache bench server` internals shared by its modes: bench_server.c (options, shared helpers,
 * the correctness and echo modes) and bench_server_tp.c (the throughput mode and the lookup
 * latency). */
#ifndef LMCACHE_BENCH_BENCH_SERVER_H
#define LMCACHE_BENCH_BENCH_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "lmcache/client.h"

#define MiB        (1ull << 20)
#define MAX_ROUNDS 16

struct opts {
    const char *mode;
    const char *host;
    int port;
    const char *http_host;
    int http_port;
    const char *model;
    int clients;
    int layers, kv_heads, head_dim, dtype_bytes, tokens_per_block, kv_count;
    const char *block_order;
    int prompt_tokens;
    int prompts;
    int rounds;
    int instance_base;
    int timeout_ms;
    long long seed;
    int bytes_path; /* throughput: also measure store_bytes/retrieve_bytes */
    int warmup;     /* throughput: untimed store pass, then `clear`, before the timed phases */
    int echo_mib;   /* echo: message size */
    const char *endpoint; /* full ZMQ endpoint of the server (ipc://...); overrides host/port */
    const char *echo_endpoint; /* echo: tcp | ipc */
    const char *echo_shape;    /* echo: echo | send | fetch */
    int server_pid;            /* > 0: page faults of that process are printed per phase */
    int lookup_samples;        /* throughput: lookups per size in the lookup-latency phase */
    int malloc_tuning;         /* the server's malloc set-up in this process too */
    int client_keep;           /* the client keeps its large request buffers (the default) */
};

struct shape {
    lmc_kv_layout layout;
    uint64_t chunk;      /* tokens per chunk (server's chunk_size) */
    uint64_t bpc;        /* blocks per chunk */
    uint64_t nchunks;    /* chunks per prompt */
    uint64_t bpp;        /* blocks per prompt */
    uint64_t chunk_obj;  /* bytes of one cached object: kv_count * layers * chunk * bpt */
    uint64_t prompt_obj; /* bytes of a prompt's chunks */
};

/* Pseudo-random bytes (splitmix64), the same for the same seed. */
void bsrv_fill_random(void *p, size_t n, uint64_t seed);
/* n token ids below 128,256 (a Llama-3 vocabulary), the same for the same seed. */
void bsrv_prompt_tokens(uint32_t *t, uint64_t n, uint64_t seed);
/* The server's data-plane threads from GET /config, printed with the results so a run with the
 * copy pool and one without (--copy-threads 0) are told apart. Nothing without the admin port
 * or when it does not answer. */
void bsrv_print_server_threads(const struct opts *o);
/* The layout and chunk geometry of the options for the server's chunk size; 0, or -1 (printed)
 * when they do not fit. */
int bsrv_make_shape(const struct opts *o, uint64_t chunk, struct shape *sh);
/* Connects to --endpoint when given, else tcp://--host:--port. */
lmc_status bsrv_connect(const struct opts *o, const lmc_client_options *co, lmc_client **c,
                        lmc_error *e);
/* Minor page faults: of this process (getrusage), and of pid from /proc/pid/stat (field 10);
 * -1 when unknown. */
long long bsrv_minflt_self(void);
long long bsrv_minflt_of(int pid);
/* Prints "lmcache bench server: <what>: <message> (<code>)" to stderr. */
void bsrv_perr(const char *what, const lmc_error *e);

/* --mode throughput (bench_server_tp.c). */
int bsrv_run_throughput(const struct opts *o);

#endif
