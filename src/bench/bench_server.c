/* `lmcache bench server`: round trips through a running server's data socket with
 * liblmcache-client, the way an engine worker drives it.
 *
 * correctness: for each prompt a cold pass (lookup must miss, store) and a warm pass (lookup must
 * hit every chunk, retrieve into zeroed blocks, compare MD5s of the engine blocks with the ones
 * taken before the store, locally and through `POST /cache/checksums`); exit 1 on any mismatch.
 * throughput: N clients (threads, one DEALER and one shared-memory KV cache each) store and
 * retrieve their prompts through shared memory and then through store_bytes/retrieve_bytes
 * (retrieve_bytes twice: the chunks in the reply map, then as chunk frames sent from L1);
 * prints GB/s, minor page faults per phase (this process, and the server's with --server-pid),
 * lookup latency percentiles (of the throughput prompts, and of 4- and 128-chunk prompts of small
 * objects) and a single-thread memcpy reference of the same run (bench_server_tp.c).
 * echo: the floor under every data-plane number: a bare ZMQ DEALER/ROUTER exchange over loopback
 * tcp or ipc of --echo-mib messages, the transport alone without msgpack, L1 or shared memory. The
 * server thread, in a ZMQ context of its own, either sends back the very message it received
 * (--echo-shape echo: the payload crosses twice per round trip), or answers an 8-byte reply to
 * a full-size message (send: the shape of a store), or a full-size message to an 8-byte request
 * (fetch: the shape of a retrieve). Full-size messages are sent without a copy
 * (zmq_msg_init_data), the most the transport can do with a buffer the sender already holds. */
#include <arpa/inet.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <netdb.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <malloc.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "bench/bench.h"
#include "bench/bench_server.h"
#include "lmcache/client.h"

enum opt_kind { OPT_STR, OPT_INT, OPT_LL, OPT_FLAG_OFF, OPT_FLAG_ON };

/* The option table: the parser and --help come from it. */
static const struct option_row {
    const char *flag;
    enum opt_kind kind;
    size_t off;
    const char *help;
} OPTIONS[] = {
#define O(flag, kind, field, help)                                                                 \
    { flag, kind, offsetof(struct opts, field), help }
    O("--mode", OPT_STR, mode, "correctness | throughput | echo"),
    O("--host", OPT_STR, host, "server data-socket host"),
    O("--port", OPT_INT, port, "server data-socket port"),
    O("--http-host", OPT_STR, http_host, "admin API host for /cache/checksums"),
    O("--http-port", OPT_INT, http_port, "admin API port; 0 skips the server-side checksums"),
    O("--model", OPT_STR, model, "model_name of the registered KV caches"),
    O("--clients", OPT_INT, clients, "throughput: concurrent clients (threads)"),
    O("--layers", OPT_INT, layers, "model layout: attention layers"),
    O("--kv-heads", OPT_INT, kv_heads, "model layout: KV heads"),
    O("--head-dim", OPT_INT, head_dim, "model layout: head dimension"),
    O("--dtype-bytes", OPT_INT, dtype_bytes, "model layout: bytes per element (2 = bf16)"),
    O("--tokens-per-block", OPT_INT, tokens_per_block, "engine tokens per block"),
    O("--kv-count", OPT_INT, kv_count, "2 = K and V, 1 = MLA latent"),
    O("--block-order", OPT_STR, block_order, "layer_major | block_major"),
    O("--prompt-tokens", OPT_INT, prompt_tokens, "tokens per prompt (rounded down to chunks)"),
    O("--prompts", OPT_INT, prompts, "prompts (per client in throughput mode)"),
    O("--rounds", OPT_INT, rounds, "throughput: lookup + retrieve rounds over the prompts"),
    O("--instance-base", OPT_INT, instance_base, "first instance_id registered"),
    O("--timeout-ms", OPT_INT, timeout_ms, "per-request timeout"),
    O("--seed", OPT_LL, seed, "token-id and data seed (default: from the clock, printed)"),
    O("--no-bytes", OPT_FLAG_OFF, bytes_path, "throughput: skip store_bytes/retrieve_bytes"),
    O("--warmup", OPT_FLAG_ON, warmup,
      "throughput: untimed store pass (and three store_bytes/retrieve_bytes of each kind) then "
      "`clear` (empties L1!), so the timed phases find the server's mappings, L1 pages and both "
      "sides' message buffers already touched"),
    O("--echo-mib", OPT_INT, echo_mib,
      "echo: message size in MiB (--rounds x 8 round trips, at least 512 MiB)"),
    O("--endpoint", OPT_STR, endpoint,
      "full ZMQ endpoint of the server, e.g. ipc:///run/lmcache.sock (instead of --host/--port)"),
    O("--echo-endpoint", OPT_STR, echo_endpoint, "echo: tcp (loopback) | ipc (Unix socket)"),
    O("--echo-shape", OPT_STR, echo_shape,
      "echo: echo (the message back) | send (full size up, 8 bytes back) | fetch (8 bytes up, "
      "full size back)"),
    O("--server-pid", OPT_INT, server_pid,
      "throughput: pid of the server; its minor page faults are printed per phase (from "
      "/proc/PID/stat)"),
    O("--malloc-default", OPT_FLAG_OFF, malloc_tuning,
      "keep glibc's default malloc in this process (by default it is set up as the server's: one "
      "arena, no mmap per large message)"),
    O("--no-client-keep", OPT_FLAG_OFF, client_keep,
      "the client keeps none of its large request buffers (lmc_client_set_keep_bytes 0)"),
    O("--lookup-samples", OPT_INT, lookup_samples,
      "throughput: lookups of a 4- and a 128-chunk prompt (small objects, model <model>-lat) "
      "timed after the other phases; 0 skips them"),
#undef O
};
#define NOPTIONS (sizeof(OPTIONS) / sizeof(OPTIONS[0]))

static void usage(FILE *f, const struct opts *d) {
    fprintf(f, "usage: lmcache bench server [options]\n\n");
    for (size_t i = 0; i < NOPTIONS; i++) {
        const struct option_row *r = &OPTIONS[i];
        const char *base = (const char *)d + r->off;
        switch (r->kind) {
        case OPT_STR: {
            const char *v = *(const char *const *)(const void *)base;
            fprintf(f, "  %-20s %s (%s)\n", r->flag, r->help, v ? v : "");
            break;
        }
        case OPT_INT:
            fprintf(f, "  %-20s %s (%d)\n", r->flag, r->help, *(const int *)(const void *)base);
            break;
        case OPT_LL:
        case OPT_FLAG_OFF:
        case OPT_FLAG_ON:
            fprintf(f, "  %-20s %s\n", r->flag, r->help);
            break;
        }
    }
}

static int parse(int argc, char **argv, struct opts *o) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) return 1;
        const struct option_row *r = NULL;
        for (size_t j = 0; j < NOPTIONS && !r; j++)
            if (!strcmp(a, OPTIONS[j].flag)) r = &OPTIONS[j];
        if (!r) {
            fprintf(stderr, "lmcache bench server: unknown option %s\n", a);
            return -1;
        }
        void *field = (char *)o + r->off;
        if (r->kind == OPT_FLAG_OFF || r->kind == OPT_FLAG_ON) {
            *(int *)field = r->kind == OPT_FLAG_ON;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "lmcache bench server: %s needs a value\n", a);
            return -1;
        }
        const char *v = argv[++i];
        if (r->kind == OPT_STR) {
            *(const char **)field = v;
            continue;
        }
        char *end;
        errno = 0;
        long long n = strtoll(v, &end, 10);
        if (errno || *end || end == v || (r->kind == OPT_INT && (n < INT32_MIN || n > INT32_MAX))) {
            fprintf(stderr, "lmcache bench server: %s: not an integer: %s\n", a, v);
            return -1;
        }
        if (r->kind == OPT_INT)
            *(int *)field = (int)n;
        else
            *(long long *)field = n;
    }
    return 0;
}

/* ---- shared helpers ---------------------------------------------------------------------- */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void bsrv_fill_random(void *p, size_t n, uint64_t seed) {
    uint64_t s = seed, *q = p;
    size_t words = n / 8;
    for (size_t i = 0; i < words; i++) q[i] = splitmix(&s);
    for (size_t i = words * 8; i < n; i++) ((unsigned char *)p)[i] = (unsigned char)splitmix(&s);
}

void bsrv_prompt_tokens(uint32_t *t, uint64_t n, uint64_t seed) {
    uint64_t s = seed;
    for (uint64_t i = 0; i < n; i++) t[i] = (uint32_t)(splitmix(&s) % 128256u);
}

/* The blocks of one prompt (all layers, K and V): visit each contiguous run. */
typedef void (*run_fn)(void *arg, unsigned char *p, uint64_t len);
static void for_each_run(const struct shape *sh, unsigned char *base, uint64_t first_block,
                         uint64_t nblocks, run_fn fn, void *arg) {
    const lmc_kv_layout *l = &sh->layout;
    uint64_t bb = lmc_kv_block_bytes(l);
    uint32_t kc = l->kv_count ? l->kv_count : 2;
    for (uint32_t layer = 0; layer < l->num_layers; layer++)
        for (uint32_t k = 0; k < kc; k++) {
            if (l->block_order == LMC_LAYER_MAJOR) {
                fn(arg, base + lmc_kv_offset(l, layer, k, (uint32_t)first_block, 0), bb * nblocks);
            } else {
                for (uint64_t b = 0; b < nblocks; b++)
                    fn(arg, base + lmc_kv_offset(l, layer, k, (uint32_t)(first_block + b), 0), bb);
            }
        }
}

static void zero_run(void *arg, unsigned char *p, uint64_t len) {
    (void)arg;
    memset(p, 0, len);
}

/* Hex MD5 of a chunk's blocks in the order of POST /cache/checksums (docs/http-api.md): for each
 * layer, K then V, each block in order. */
static int chunk_md5(const struct shape *sh, unsigned char *base, uint64_t first_block,
                     char hex[33]) {
    const lmc_kv_layout *l = &sh->layout;
    uint64_t bb = lmc_kv_block_bytes(l);
    uint32_t kc = l->kv_count ? l->kv_count : 2;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestInit_ex(ctx, EVP_md5(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return -1;
    }
    int rc = 0;
    for (uint32_t layer = 0; layer < l->num_layers && !rc; layer++)
        for (uint32_t k = 0; k < kc && !rc; k++)
            for (uint64_t b = 0; b < sh->bpc && !rc; b++)
                if (EVP_DigestUpdate(
                        ctx, base + lmc_kv_offset(l, layer, k, (uint32_t)(first_block + b), 0),
                        bb) != 1)
                    rc = -1;
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int mdlen = 0;
    if (!rc && EVP_DigestFinal_ex(ctx, md, &mdlen) != 1) rc = -1;
    EVP_MD_CTX_free(ctx);
    for (unsigned i = 0; !rc && i < mdlen && i < 16; i++) snprintf(hex + 2 * i, 3, "%02x", md[i]);
    return rc;
}

/* A tiny HTTP/1.1 request over a plain socket (Connection: close, body read to EOF; json NULL:
 * a GET). Returns the status code and the malloc'ed body in *body, or -1 with a message in
 * err. */
static int http_post(const char *host, int port, const char *path, const char *json, char **body,
                     char *err, size_t errlen) {
    const char *method = json ? "POST" : "GET";
    if (!json) json = "";
    *body = NULL;
    char portstr[16];
    snprintf(portstr, sizeof(portstr), "%d", port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    int g = getaddrinfo(host, portstr, &hints, &ai);
    if (g != 0) {
        errbuf_set(err, errlen, "%s: %s", host, gai_strerror(g));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *p = ai; p && fd < 0; p = p->ai_next) {
        fd = socket(p->ai_family, p->ai_socktype, p->ai_protocol);
        if (fd >= 0 && connect(fd, p->ai_addr, p->ai_addrlen) != 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0) {
        errbuf_set(err, errlen, "connect %s:%d: %s", host, port, strerror(errno));
        return -1;
    }
    struct timeval tv = {.tv_sec = 30};
    (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    size_t jl = strlen(json);
    char hdr[512];
    int hl = snprintf(hdr, sizeof(hdr),
                      "%s %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                      method, path, host, port, jl);
    int rc = -1;
    size_t cap = 65536, len = 0;
    char *buf = NULL;
    if (hl < 0 || (size_t)hl >= sizeof(hdr)) {
        errbuf_set(err, errlen, "request header too long");
        goto out;
    }
    const char *parts[2] = {hdr, json};
    size_t lens[2] = {(size_t)hl, jl};
    for (int i = 0; i < 2; i++)
        for (size_t off = 0; off < lens[i];) {
            ssize_t n = send(fd, parts[i] + off, lens[i] - off, MSG_NOSIGNAL);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                errbuf_set(err, errlen, "send: %s", strerror(errno));
                goto out;
            }
            off += (size_t)n;
        }
    buf = malloc(cap);
    if (!buf) goto nomem;
    for (;;) {
        if (len + 1 >= cap) {
            char *nb = cap > 64 * MiB ? NULL : realloc(buf, cap * 2);
            if (!nb) goto nomem;
            buf = nb;
            cap *= 2;
        }
        ssize_t n = recv(fd, buf + len, cap - len - 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
            errbuf_set(err, errlen, "recv: %s", strerror(errno));
            goto out;
        }
        if (n == 0) break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    int status = 0;
    char *sep = strstr(buf, "\r\n\r\n");
    if (sscanf(buf, "HTTP/1.%*d %d", &status) != 1 || !sep) {
        errbuf_set(err, errlen, "malformed HTTP response");
        goto out;
    }
    if (strstr(buf, "Transfer-Encoding: chunked") &&
        strstr(buf, "Transfer-Encoding: chunked") < sep) {
        errbuf_set(err, errlen, "chunked HTTP responses are not supported");
        goto out;
    }
    *body = strdup(sep + 4);
    if (!*body) goto nomem;
    rc = status;
    goto out;
nomem:
    errbuf_set(err, errlen, "out of memory");
out:
    free(buf);
    close(fd);
    return rc;
}

/* The server's data-plane threads from GET /config, printed with the results so a run with
 * the copy pool and one without (--copy-threads 0) are told apart. Nothing without the admin
 * port or when it does not answer. */
void bsrv_print_server_threads(const struct opts *o) {
    char *body = NULL, err[128];
    if (o->http_port <= 0) return;
    int status = http_post(o->http_host, o->http_port, "/config", NULL, &body, err, sizeof(err));
    json_t *cfg = status == 200 && body ? json_loads(body, 0, NULL) : NULL;
    json_t *mp = cfg ? json_object_get(cfg, "mp") : NULL;
    json_t *w = json_object_get(mp, "max_workers"), *ct = json_object_get(mp, "copy_threads");
    json_t *always = json_object_get(mp, "copy_threads_always");
    if (json_is_integer(w) && json_is_integer(ct))
        printf("server: --max-workers %lld, --copy-threads %lld%s%s\n",
               (long long)json_integer_value(w), (long long)json_integer_value(ct),
               json_integer_value(ct) < 0 ? " (one per CPU beyond the first, at most 8)" : "",
               json_is_true(always) ? ", --copy-threads-always" : "");
    json_decref(cfg);
    free(body);
}

/* POST /cache/checksums for one prompt's blocks; fills nchunks hex digests. */
static int server_checksums(const struct opts *o, const struct shape *sh, int64_t instance,
                            uint64_t first_block, char (*hex)[33], char *err, size_t errlen) {
    json_t *ids = json_array(), *req = NULL;
    char *payload = NULL, *body = NULL;
    int rc = -1;
    if (!ids) goto out;
    for (uint64_t b = 0; b < sh->bpp; b++)
        if (json_array_append_new(ids, json_integer((json_int_t)(first_block + b))) != 0) goto out;
    req = json_pack("{s:O, s:I, s:I}", "block_ids", ids, "chunk_size", (json_int_t)sh->bpc,
                    "instance_id", (json_int_t)instance);
    if (!req || !(payload = json_dumps(req, JSON_COMPACT))) goto out;
    int status =
        http_post(o->http_host, o->http_port, "/cache/checksums", payload, &body, err, errlen);
    if (status < 0) goto out;
    if (status != 200) {
        errbuf_set(err, errlen, "HTTP %d: %.200s", status, body ? body : "");
        goto out;
    }
    json_error_t je;
    json_t *r = json_loads(body, 0, &je);
    json_t *sums = r ? json_object_get(r, "chunk_checksums") : NULL;
    if (!json_is_array(sums) || json_array_size(sums) != sh->nchunks) {
        errbuf_set(err, errlen, "unexpected /cache/checksums reply: %.200s", body);
        json_decref(r);
        goto out;
    }
    for (uint64_t i = 0; i < sh->nchunks; i++) {
        const char *s = json_string_value(json_array_get(sums, i));
        snprintf(hex[i], 33, "%s", s ? s : "");
    }
    json_decref(r);
    rc = 0;
out:
    if (rc && err[0] == '\0') errbuf_set(err, errlen, "out of memory");
    json_decref(ids);
    json_decref(req);
    free(payload);
    free(body);
    return rc;
}

int bsrv_make_shape(const struct opts *o, uint64_t chunk, struct shape *sh) {
    memset(sh, 0, sizeof(*sh));
    if (o->layers < 1 || o->kv_heads < 1 || o->head_dim < 1 || o->dtype_bytes < 1 ||
        o->tokens_per_block < 1 || (o->kv_count != 1 && o->kv_count != 2) || o->prompts < 1) {
        fprintf(stderr, "lmcache bench server: layout fields and --prompts must be positive, "
                        "--kv-count 1 or 2\n");
        return -1;
    }
    if (chunk % (uint64_t)o->tokens_per_block) {
        fprintf(stderr,
                "lmcache bench server: chunk size %llu is not a multiple of "
                "--tokens-per-block %d\n",
                (unsigned long long)chunk, o->tokens_per_block);
        return -1;
    }
    sh->chunk = chunk;
    sh->bpc = chunk / (uint64_t)o->tokens_per_block;
    sh->nchunks = (uint64_t)(o->prompt_tokens > 0 ? o->prompt_tokens : 0) / chunk;
    if (sh->nchunks == 0) {
        fprintf(stderr, "lmcache bench server: --prompt-tokens %d is less than one chunk (%llu)\n",
                o->prompt_tokens, (unsigned long long)chunk);
        return -1;
    }
    sh->bpp = sh->nchunks * sh->bpc;
    lmc_kv_layout *l = &sh->layout;
    l->num_layers = (uint32_t)o->layers;
    l->num_blocks = (uint32_t)(sh->bpp * (uint64_t)o->prompts);
    l->tokens_per_block = (uint32_t)o->tokens_per_block;
    l->bytes_per_token = (uint64_t)o->kv_heads * (uint64_t)o->head_dim * (uint64_t)o->dtype_bytes;
    l->kv_count = (uint32_t)o->kv_count;
    if (!strcmp(o->block_order, "block_major"))
        l->block_order = LMC_BLOCK_MAJOR;
    else if (!strcmp(o->block_order, "layer_major"))
        l->block_order = LMC_LAYER_MAJOR;
    else {
        fprintf(stderr, "lmcache bench server: --block-order must be layer_major or block_major\n");
        return -1;
    }
    l->dtype = o->dtype_bytes == 2 ? "bfloat16" : o->dtype_bytes == 4 ? "float32" : "bytes";
    sh->chunk_obj = (uint64_t)l->kv_count * l->num_layers * chunk * l->bytes_per_token;
    sh->prompt_obj = sh->chunk_obj * sh->nchunks;
    return 0;
}

lmc_status bsrv_connect(const struct opts *o, const lmc_client_options *co, lmc_client **c,
                        lmc_error *e) {
    lmc_status s = o->endpoint && *o->endpoint ? lmc_client_connect_endpoint(o->endpoint, co, c, e)
                                               : lmc_client_connect(o->host, o->port, co, c, e);
    if (s == LMC_OK && !o->client_keep) lmc_client_set_keep_bytes(*c, 0);
    return s;
}

/* Minor page faults: of this process (getrusage), and of pid from /proc/pid/stat (field 10);
 * -1 when unknown. */
long long bsrv_minflt_self(void) {
    struct rusage ru;
    return getrusage(RUSAGE_SELF, &ru) == 0 ? (long long)ru.ru_minflt : -1;
}

long long bsrv_minflt_of(int pid) {
    if (pid <= 0) return -1;
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    /* The command name may hold spaces and parentheses: fields count from the last ')'. */
    char *p = strrchr(buf, ')');
    long long v = -1;
    if (p && sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %lld", &v) != 1) v = -1;
    return v;
}

void bsrv_perr(const char *what, const lmc_error *e) {
    fprintf(stderr, "lmcache bench server: %s: %s (%s)\n", what, e->message, e->code);
}

/* ---- correctness mode -------------------------------------------------------------------- */

static int run_correctness(const struct opts *o) {
    lmc_client *c;
    lmc_error e;
    lmc_client_options co = {.timeout_ms = o->timeout_ms};
    if (bsrv_connect(o, &co, &c, &e) != LMC_OK) {
        bsrv_perr("connect", &e);
        return 1;
    }
    uint64_t chunk = 0;
    struct shape sh;
    if (lmc_get_chunk_size(c, &chunk, &e) != LMC_OK) {
        bsrv_perr("get_chunk_size", &e);
        lmc_client_close(c);
        return 1;
    }
    if (bsrv_make_shape(o, chunk, &sh) != 0) {
        lmc_client_close(c);
        return 2;
    }
    int64_t inst = o->instance_base;
    lmc_register_args ra = {.instance_id = inst, .model_name = o->model, .layout = sh.layout};
    lmc_kv_context *kv;
    if (lmc_register_kv_cache(c, &ra, &kv, &e) != LMC_OK) {
        bsrv_perr("register_kv_cache", &e);
        lmc_client_close(c);
        return 1;
    }
    unsigned char *base = lmc_kv_base(kv);
    printf("correctness: %d prompts of %llu chunks (%llu tokens, %llu blocks), chunk %llu tokens "
           "= %.2f MiB, seed %lld, server checksums %s\n",
           o->prompts, (unsigned long long)sh.nchunks, (unsigned long long)(sh.nchunks * chunk),
           (unsigned long long)sh.bpp, (unsigned long long)chunk, (double)sh.chunk_obj / MiB,
           o->seed, o->http_port > 0 ? "on" : "off");
    uint32_t *toks = malloc(sh.nchunks * chunk * sizeof(uint32_t));
    int64_t *blocks = malloc(sh.bpp * sizeof(int64_t));
    char(*before)[33] = malloc(sh.nchunks * sizeof(*before));
    char(*after)[33] = malloc(sh.nchunks * sizeof(*after));
    char(*remote)[33] = malloc(sh.nchunks * sizeof(*remote));
    int mismatches = 0, errors = 0;
    double t_lookup = 0, t_store = 0, t_retrieve = 0;
    if (!toks || !blocks || !before || !after || !remote) {
        fprintf(stderr, "lmcache bench server: out of memory\n");
        errors++;
        goto out;
    }
    for (int p = 0; p < o->prompts && !errors; p++) {
        uint64_t first = (uint64_t)p * sh.bpp;
        for (uint64_t b = 0; b < sh.bpp; b++) blocks[b] = (int64_t)(first + b);
        bsrv_prompt_tokens(toks, sh.nchunks * chunk, (uint64_t)o->seed * 1000003u + (uint64_t)p);
        lmc_chunks ch = {.token_ids = toks, .num_tokens = sh.nchunks * chunk, .end = -1};
        char rid[64];
        uint64_t hits = 0, n = 0, skipped = 0;
        /* Cold pass. */
        for (uint32_t l = 0; l < sh.layout.num_layers; l++)
            for (uint32_t k = 0; k < sh.layout.kv_count; k++)
                for (uint64_t b = 0; b < sh.bpp; b++)
                    bsrv_fill_random(base +
                                         lmc_kv_offset(&sh.layout, l, k, (uint32_t)(first + b), 0),
                                     lmc_kv_block_bytes(&sh.layout),
                                     (uint64_t)o->seed ^ ((first + b) << 20) ^ (l << 4) ^ k);
        snprintf(rid, sizeof(rid), "bench-%lld-%d-cold", o->seed, p);
        double t0 = clock_mono();
        if (lmc_lookup_wait(c, rid, o->model, 1, &ch, 1, 50, &hits, &e) != LMC_OK ||
            lmc_end_session(c, rid, &e) != LMC_OK) {
            bsrv_perr("cold lookup", &e);
            errors++;
            break;
        }
        double t1 = clock_mono();
        lmc_status s = lmc_store(c, inst, &ch, blocks, sh.bpp, &n, &skipped, &e);
        double t2 = clock_mono();
        t_lookup += t1 - t0;
        t_store += t2 - t1;
        if (s != LMC_OK) {
            bsrv_perr("store", &e);
            errors++;
            break;
        }
        int cold_ok = hits == 0 && n == sh.nchunks;
        for (uint64_t i = 0; i < sh.nchunks; i++)
            if (chunk_md5(&sh, base, first + i * sh.bpc, before[i]) != 0) errors++;
        for_each_run(&sh, base, first, sh.bpp, zero_run, NULL);
        /* Warm pass. */
        snprintf(rid, sizeof(rid), "bench-%lld-%d-warm", o->seed, p);
        uint64_t whits = 0, got = 0;
        t0 = clock_mono();
        s = lmc_lookup_wait(c, rid, o->model, 1, &ch, 1, 50, &whits, &e);
        t1 = clock_mono();
        if (s == LMC_OK) s = lmc_retrieve(c, inst, &ch, blocks, sh.bpp, rid, 0, &got, &e);
        t2 = clock_mono();
        lmc_error e2;
        if (lmc_end_session(c, rid, &e2) != LMC_OK && s == LMC_OK) {
            s = e2.status;
            e = e2;
        }
        t_lookup += t1 - t0;
        t_retrieve += t2 - t1;
        if (s != LMC_OK) {
            bsrv_perr("warm lookup/retrieve", &e);
            errors++;
            break;
        }
        int local_ok = 1, server_ok = 1;
        for (uint64_t i = 0; i < sh.nchunks; i++) {
            if (chunk_md5(&sh, base, first + i * sh.bpc, after[i]) != 0) errors++;
            if (strcmp(before[i], after[i]) != 0) local_ok = 0;
        }
        char herr[256] = "";
        if (o->http_port > 0) {
            if (server_checksums(o, &sh, inst, first, remote, herr, sizeof(herr)) != 0) {
                fprintf(stderr, "lmcache bench server: POST /cache/checksums: %s\n", herr);
                errors++;
                server_ok = 0;
            } else {
                for (uint64_t i = 0; i < sh.nchunks; i++)
                    if (strcmp(before[i], remote[i]) != 0) server_ok = 0;
            }
        }
        int warm_ok = whits == sh.nchunks && got == sh.nchunks;
        if (!cold_ok || !warm_ok || !local_ok || !server_ok) mismatches++;
        printf("prompt %d: cold lookup %llu/%llu hits (want 0), stored %llu; warm lookup "
               "%llu/%llu hits, retrieved %llu; checksums local %s, server %s -> %s\n",
               p, (unsigned long long)hits, (unsigned long long)sh.nchunks, (unsigned long long)n,
               (unsigned long long)whits, (unsigned long long)sh.nchunks, (unsigned long long)got,
               local_ok ? "match" : "MISMATCH",
               o->http_port <= 0 ? "skipped"
               : server_ok       ? "match"
                                 : "MISMATCH",
               cold_ok && warm_ok && local_ok && server_ok ? "ok" : "FAIL");
    }
    if (!errors)
        printf("mean latency: lookup (until ready) %.3f ms, store %.3f ms, retrieve %.3f ms per "
               "prompt\n",
               t_lookup * 1e3 / (2.0 * o->prompts), t_store * 1e3 / o->prompts,
               t_retrieve * 1e3 / o->prompts);
out:
    if (lmc_unregister_kv_cache(c, kv, &e) != LMC_OK) bsrv_perr("unregister_kv_cache", &e);
    lmc_client_close(c);
    free(toks);
    free(blocks);
    free(before);
    free(after);
    free(remote);
    int bad = mismatches || errors;
    printf("%s: %d prompts, %d mismatches, %d errors\n", bad ? "FAILED" : "PASSED", o->prompts,
           mismatches, errors);
    return bad ? 1 : 0;
}

enum echo_shape { ECHO_BACK, ECHO_SEND, ECHO_FETCH };

struct echo_side {
    void *sock;
    enum echo_shape shape;
    unsigned char *buf; /* fetch: what every reply carries */
    size_t n;
};

static void no_free(void *data, void *hint) {
    (void)data;
    (void)hint;
}

/* A message of n bytes of buf, sent from buf itself (it outlives every send). */
static int send_whole(void *sock, unsigned char *buf, size_t n, int flags) {
    zmq_msg_t m;
    if (zmq_msg_init_data(&m, buf, n, no_free, NULL) != 0) return -1;
    if (zmq_msg_send(&m, sock, flags) < 0) {
        zmq_msg_close(&m);
        return -1;
    }
    return 0;
}

/* echo: the ROUTER side, in a thread of its own: answers every message in the run's shape; an
 * empty message is answered in kind and ends the thread. */
static void *echo_router(void *arg) {
    struct echo_side *es = arg;
    void *sock = es->sock;
    for (;;) {
        zmq_msg_t id, body;
        zmq_msg_init(&id);
        zmq_msg_init(&body);
        if (zmq_msg_recv(&id, sock, 0) < 0 || zmq_msg_recv(&body, sock, 0) < 0) {
            zmq_msg_close(&id);
            zmq_msg_close(&body);
            return NULL; /* the context was shut down */
        }
        int stop = zmq_msg_size(&body) == 0, sent;
        if (zmq_msg_send(&id, sock, ZMQ_SNDMORE) < 0) {
            zmq_msg_close(&id);
            zmq_msg_close(&body);
            return NULL;
        }
        if (stop || es->shape == ECHO_BACK) {
            sent = zmq_msg_send(&body, sock, 0) >= 0;
            if (!sent) zmq_msg_close(&body);
        } else {
            zmq_msg_close(&body);
            sent = es->shape == ECHO_SEND ? zmq_send(sock, "stored!!", 8, 0) >= 0
                                          : send_whole(sock, es->buf, es->n, 0) == 0;
        }
        if (!sent || stop) return NULL;
    }
}

/* GB/s of one DEALER exchanging messages of o->echo_mib MiB with the ROUTER thread in the shape
 * of --echo-shape, round trip after round trip (bytes counted once per round trip, as a store or
 * retrieve counts them). */
static int run_echo(const struct opts *o) {
    size_t n = (size_t)o->echo_mib * MiB;
    int rounds = o->rounds * 8, rc = 1;
    if (o->echo_mib > 0 && rounds < 512 / o->echo_mib) rounds = 512 / o->echo_mib; /* >= 512 MiB */
    if (o->echo_mib < 1 || o->echo_mib > 1024) {
        fprintf(stderr, "lmcache bench server: --echo-mib must be 1..1024\n");
        return 2;
    }
    const char *shape = o->echo_shape ? o->echo_shape : "echo";
    struct echo_side es = {.n = n};
    if (!strcmp(shape, "echo"))
        es.shape = ECHO_BACK;
    else if (!strcmp(shape, "send"))
        es.shape = ECHO_SEND;
    else if (!strcmp(shape, "fetch"))
        es.shape = ECHO_FETCH;
    else {
        fprintf(stderr, "lmcache bench server: --echo-shape must be echo, send or fetch\n");
        return 2;
    }
    /* Two contexts, as two processes would have: each side gets its own I/O thread. */
    void *ctx = zmq_ctx_new(), *sctx = zmq_ctx_new();
    void *router = ctx && sctx ? zmq_socket(sctx, ZMQ_ROUTER) : NULL;
    void *dealer = router ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    char ep[300], ipc_dir[64] = "";
    size_t eplen = sizeof(ep), want = es.shape == ECHO_SEND ? 8 : n;
    unsigned char *buf = malloc(n);
    pthread_t th;
    int th_started = 0, zero = 0, ipc = o->echo_endpoint && !strcmp(o->echo_endpoint, "ipc");
    if (o->echo_endpoint && !ipc && strcmp(o->echo_endpoint, "tcp")) {
        fprintf(stderr, "lmcache bench server: --echo-endpoint must be tcp or ipc\n");
        rc = 2;
        goto out;
    }
    if (!buf || !router || !dealer) goto out;
    bsrv_fill_random(buf, n, (uint64_t)o->seed);
    es.sock = router;
    es.buf = buf;
    zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof(zero));
    zmq_setsockopt(dealer, ZMQ_LINGER, &zero, sizeof(zero));
    if (ipc) {
        snprintf(ipc_dir, sizeof(ipc_dir), "/tmp/lmcache-echo-XXXXXX");
        if (!mkdtemp(ipc_dir)) {
            ipc_dir[0] = 0;
            goto out;
        }
        snprintf(ep, sizeof(ep), "ipc://%s/echo.sock", ipc_dir);
        if (zmq_bind(router, ep) != 0 || zmq_connect(dealer, ep) != 0) goto out;
    } else if (zmq_bind(router, "tcp://127.0.0.1:*") != 0 ||
               zmq_getsockopt(router, ZMQ_LAST_ENDPOINT, ep, &eplen) != 0 ||
               zmq_connect(dealer, ep) != 0)
        goto out;
    if (pthread_create(&th, NULL, echo_router, &es) != 0) goto out;
    th_started = 1;
    double ref_before = bench_memcpy_gbps(0, 1.0), t0 = 0;
    for (int i = -2; i < rounds; i++) { /* two untimed round trips set the connection up */
        if (i == 0) t0 = clock_mono();
        zmq_msg_t m;
        int sent = es.shape == ECHO_FETCH ? zmq_send(dealer, "retrieve", 8, 0) >= 0
                                          : send_whole(dealer, buf, n, 0) == 0;
        if (!sent) goto out;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, dealer, 0) != (int)want) {
            zmq_msg_close(&m);
            goto out;
        }
        zmq_msg_close(&m);
    }
    double secs = clock_mono() - t0;
    double ref_after = bench_memcpy_gbps(0, 1.0);
    double ref = ref_before > ref_after ? ref_before : ref_after;
    double g = (double)n * rounds / secs / 1e9;
    printf("memcpy reference (1 thread, 64 MiB buffers): %.2f GB/s before, %.2f GB/s after\n",
           ref_before, ref_after);
    printf("%-15s %8.2f GB/s  (%d round trips of %d MiB over %s in %.3f s, %.0f%% of memcpy)\n",
           es.shape == ECHO_BACK   ? "zmq echo"
           : es.shape == ECHO_SEND ? "zmq send"
                                   : "zmq fetch",
           g, rounds, o->echo_mib, ipc ? "ipc" : "tcp", secs, ref > 0 ? 100.0 * g / ref : 0.0);
    rc = 0;
out:
    if (rc == 1)
        fprintf(stderr, "lmcache bench server: echo failed: %s\n", zmq_strerror(zmq_errno()));
    if (th_started) {
        zmq_send(dealer, "", 0, 0); /* an empty message stops the echo thread */
        pthread_join(th, NULL);
    }
    if (router) zmq_close(router);
    if (dealer) zmq_close(dealer);
    if (ctx) zmq_ctx_term(ctx);
    if (sctx) zmq_ctx_term(sctx);
    if (ipc_dir[0]) {
        char sock[128];
        snprintf(sock, sizeof(sock), "%s/echo.sock", ipc_dir);
        unlink(sock);
        rmdir(ipc_dir);
    }
    free(buf);
    return rc;
}

int bench_server_main(int argc, char **argv) {
    struct opts o = {.mode = "correctness",
                     .host = "127.0.0.1",
                     .port = 5555,
                     .http_host = NULL,
                     .http_port = 8080,
                     .model = "bench-model",
                     .clients = 1,
                     .layers = 32,
                     .kv_heads = 8,
                     .head_dim = 128,
                     .dtype_bytes = 2,
                     .tokens_per_block = 16,
                     .kv_count = 2,
                     .block_order = "layer_major",
                     .prompt_tokens = 1024,
                     .prompts = 4,
                     .rounds = 3,
                     .instance_base = 1000,
                     .timeout_ms = 60000,
                     .seed = -1,
                     .bytes_path = 1,
                     .warmup = 0,
                     .echo_mib = 32,
                     .endpoint = NULL,
                     .echo_endpoint = "tcp",
                     .echo_shape = "echo",
                     .server_pid = 0,
                     .lookup_samples = 200,
                     .malloc_tuning = 1,
                     .client_keep = 1};
    struct opts defaults = o;
    defaults.http_host = "--host";
    int r = parse(argc, argv, &o);
    if (r != 0) {
        usage(r > 0 ? stdout : stderr, &defaults);
        return r > 0 ? 0 : 2;
    }
    if (!o.http_host) o.http_host = o.host;
#ifdef __GLIBC__
    if (o.malloc_tuning) {
        /* What an engine process can do for its receive buffers (docs/client.md), as the server
         * does for its own (dataplane_tune_malloc): one arena, no fresh mmap per large message. */
        (void)mallopt(M_ARENA_MAX, 1);
        (void)mallopt(M_MMAP_MAX, 0);
        (void)mallopt(M_TRIM_THRESHOLD, 1 << 30);
    }
#endif
    if (o.seed < 0) o.seed = (long long)(time(NULL) ^ ((long long)getpid() << 16)) & 0xffffffffll;
    if (!strcmp(o.mode, "correctness")) return run_correctness(&o);
    if (!strcmp(o.mode, "throughput")) return bsrv_run_throughput(&o);
    if (!strcmp(o.mode, "echo")) return run_echo(&o);
    fprintf(stderr, "lmcache bench server: --mode must be correctness, throughput or echo\n");
    return 2;
}
