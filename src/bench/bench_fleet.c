/* `lmcache bench fleet`: what reporting to the master costs and what the master sustains, in one
 * run, with every process started here on 127.0.0.1 (docs/benchmarks.md, "Fleet"):
 *
 *   1. data-path store throughput (store_bytes, one client) of two identical servers, one
 *      reporting to a live master and one not, in alternating rounds;
 *   2. master ingest: four servers, each holding entries/4 chunks while their master is down,
 *      send their full reports at once when it comes up; hashes/s as the servers count them;
 *   3. the routing query (`POST /route` on the master's metrics port) for 128-chunk prompts with
 *      those entries indexed: p50/p99 by token ids and by precomputed hashes, one keep-alive
 *      connection. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/fleethash.h"
#include "bench/bench.h"
#include "lmcache/client.h"

#define MODEL       "bench-fleet"
#define SEED_STRING "lmcache-chunk-hash-v1"
#define KV_RANK_TP1 0x01000100u
#define PROMPT      128 /* chunks per prompt (and per store call in the ingest phase) */
#define NSERVERS    4
#define MAX_ROUNDS  9
#define HTTP_MAX    (4u << 20)

struct fopts {
    int rounds;
    double seconds;
    long entries;
    int queries;
    int object_kib;
    int chunk;
};

/* ---- processes ------------------------------------------------------------------------------ */

static int tcp_connect(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET,
                             .sin_port = htons((uint16_t)port),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        return fd;
    }
    if (fd >= 0) close(fd);
    return -1;
}

static bool wait_listen(int port, double seconds) {
    for (double t0 = clock_mono(); clock_mono() - t0 < seconds; usleep(20000)) {
        int fd = tcp_connect(port);
        if (fd >= 0) {
            close(fd);
            return true;
        }
    }
    return false;
}

/* Runs `lmcache <args>` (this binary), its output to /dev/null; ends with the bench. */
static pid_t spawn(char *const args[]) {
    fflush(stdout); /* or the child's copy of the buffer is written too */
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) || getppid() == 1) _exit(127);
        int null = open("/dev/null", O_WRONLY);
        if (null < 0 || dup2(null, 1) < 0 || dup2(null, 2) < 0) _exit(127);
        setenv("LMCACHE_MASTER_METRICS_HOST", "127.0.0.1", 1);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    return pid < 0 ? 0 : pid;
}

static void stop(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
}

struct master {
    pid_t pid;
    int port, http;
    char addr[64];
};

/* port < 0: a free one. */
static bool master_start(struct master *m, int port) {
    m->port = port > 0 ? port : bench_free_port();
    m->http = bench_free_port();
    snprintf(m->addr, sizeof(m->addr), "127.0.0.1:%d", m->port);
    char hp[16];
    snprintf(hp, sizeof(hp), "%d", m->http);
    char *args[] = {"lmcache", "master", m->addr, hp, NULL};
    m->pid = spawn(args);
    return m->pid && wait_listen(m->port, 30) && wait_listen(m->http, 30);
}

struct server {
    pid_t pid;
    int port, http;
    lmc_client *c;
    double cpu_s;    /* the process's CPU time during the timed rounds */
    uint64_t chunks; /* stored during the timed rounds */
};

/* User + system CPU seconds of a process (all its threads). */
static double cpu_of(pid_t pid) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char buf[1024];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces */
    unsigned long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* A server on free ports; master NULL: not reporting. */
static bool server_start(struct server *s, double l1_gb, int chunk, bool prefault,
                         const char *master, const char *node_id) {
    s->port = bench_free_port();
    s->http = bench_free_port();
    char port[16], http[16], l1[32], cs[16];
    snprintf(port, sizeof(port), "%d", s->port);
    snprintf(http, sizeof(http), "%d", s->http);
    snprintf(l1, sizeof(l1), "%g", l1_gb);
    snprintf(cs, sizeof(cs), "%d", chunk);
    char *args[24] = {"lmcache",
                      "server",
                      "--host",
                      "127.0.0.1",
                      "--port",
                      port,
                      "--http-host",
                      "127.0.0.1",
                      "--http-port",
                      http,
                      "--l1-size-gb",
                      l1,
                      "--chunk-size",
                      cs,
                      "--eviction-policy",
                      "LRU",
                      prefault ? "--l1-prefault=true" : "--l1-prefault=false"};
    int n = 17;
    if (master) {
        args[n++] = "--master-address";
        args[n++] = (char *)master;
        args[n++] = "--node-id";
        args[n++] = (char *)node_id;
    }
    args[n] = NULL;
    s->pid = spawn(args);
    if (!s->pid || !wait_listen(s->port, 60)) return false;
    lmc_error e;
    lmc_client_options co = {.timeout_ms = 60000};
    for (double t0 = clock_mono(); clock_mono() - t0 < 60; usleep(50000))
        if (lmc_client_connect("127.0.0.1", s->port, &co, &s->c, &e) == LMC_OK) {
            size_t csz;
            if (lmc_get_chunk_size(s->c, &csz, &e) == LMC_OK) return true;
            lmc_client_close(s->c);
            s->c = NULL;
        }
    return false;
}

static void server_stop(struct server *s) {
    lmc_client_close(s->c);
    s->c = NULL;
    stop(s->pid);
    s->pid = 0;
}

/* ---- HTTP/1.1 (keep-alive, Content-Length bodies only) -------------------------------------- */

struct http {
    int port, fd;
    char *buf;
    size_t cap;
};

static int http_send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* One request; the body of a 2xx answer in h->buf (NUL-terminated). Returns the status or -1. */
static int http_req(struct http *h, const char *method, const char *path, const char *body,
                    size_t blen) {
    for (int attempt = 0; attempt < 2; attempt++) {
        if (h->fd < 0 && (h->fd = tcp_connect(h->port)) < 0) return -1;
        char head[256];
        int hn = snprintf(head, sizeof(head),
                          "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          "Content-Length: %zu\r\n\r\n",
                          method, path, blen);
        if (http_send_all(h->fd, head, (size_t)hn) == 0 &&
            (blen == 0 || http_send_all(h->fd, body, blen) == 0)) {
            size_t got = 0;
            long status = -1, clen = -1;
            char *hdr_end = NULL;
            for (;;) {
                if (got + 1 >= h->cap) break;
                ssize_t r = recv(h->fd, h->buf + got, h->cap - 1 - got, 0);
                if (r <= 0) break;
                got += (size_t)r;
                h->buf[got] = 0;
                if (!hdr_end && (hdr_end = strstr(h->buf, "\r\n\r\n"))) {
                    status = strtol(h->buf + 9, NULL, 10);
                    const char *cl = strcasestr(h->buf, "\r\nContent-Length:");
                    clen = cl && cl < hdr_end ? strtol(cl + 17, NULL, 10) : 0;
                }
                if (hdr_end && (size_t)(hdr_end + 4 - h->buf) + (size_t)clen <= got) {
                    size_t off = (size_t)(hdr_end + 4 - h->buf);
                    memmove(h->buf, h->buf + off, (size_t)clen);
                    h->buf[clen] = 0;
                    return (int)status;
                }
            }
        }
        close(h->fd); /* the server closed a kept-alive connection: once more on a new one */
        h->fd = -1;
    }
    return -1;
}

/* The value of an unlabelled metric in the text of /metrics, or -1. */
static double metric_value(const char *text, const char *name) {
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (strncmp(p, name, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    return -1;
}

static double server_metric(struct http *h, const char *name) {
    return http_req(h, "GET", "/metrics", NULL, 0) == 200 ? metric_value(h->buf, name) : -1;
}

/* ---- helpers -------------------------------------------------------------------------------- */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Token ids of prompt p (PROMPT chunks of chunk tokens): distinct prompts, distinct chains. */
static void prompt_tokens(uint32_t *t, size_t n, uint64_t p) {
    uint64_t s = p * 0x2545f4914f6cdd1dull + 1;
    for (size_t i = 0; i < n; i++) t[i] = (uint32_t)(splitmix(&s) % 151936); /* a vocab size */
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(const double *v, size_t n, double p) {
    size_t i = (size_t)(p * (double)(n - 1) + 0.5);
    return v[i < n ? i : n - 1];
}

static void loadavg(char *out, size_t len) {
    FILE *f = fopen("/proc/loadavg", "r");
    double a = 0, b = 0, c = 0;
    if (!f || fscanf(f, "%lf %lf %lf", &a, &b, &c) != 3) a = b = c = -1;
    if (f) fclose(f);
    snprintf(out, len, "%.2f %.2f %.2f", a, b, c);
}

/* ---- 1. the data path with and without reporting -------------------------------------------- */

/* Stores 16-chunk prompts of object_kib objects for `seconds`; chunks/s, or -1. */
static double store_rate(struct server *s, const struct fopts *o, uint64_t *prompt_seq,
                         double *gbps) {
    enum { CHUNKS = 16 };
    size_t ntok = (size_t)CHUNKS * (size_t)o->chunk, obj = (size_t)o->object_kib << 10;
    uint32_t *toks = malloc(ntok * sizeof(*toks));
    char *data = malloc(obj);
    if (!toks || !data) {
        free(toks);
        free(data);
        return -1;
    }
    memset(data, 0x5a, obj);
    const void *objs[CHUNKS];
    size_t lens[CHUNKS];
    for (int i = 0; i < CHUNKS; i++) objs[i] = data, lens[i] = obj;
    uint64_t chunks = 0;
    double t0 = clock_mono(), t;
    lmc_error e;
    while ((t = clock_mono()) - t0 < o->seconds) {
        prompt_tokens(toks, ntok, (*prompt_seq)++);
        lmc_chunks ch = {.token_ids = toks, .num_tokens = ntok, .end = -1};
        uint64_t stored = 0, skipped = 0;
        if (lmc_store_bytes(s->c, MODEL, 1, 0, &ch, objs, lens, CHUNKS, &stored, &skipped, &e) !=
                LMC_OK ||
            stored + skipped != CHUNKS) {
            fprintf(stderr, "store_bytes: %s\n", e.message);
            chunks = 0;
            break;
        }
        chunks += CHUNKS;
    }
    free(toks);
    free(data);
    double dt = clock_mono() - t0;
    *gbps = (double)chunks * (double)obj / dt / 1e9;
    s->chunks += chunks;
    return chunks ? (double)chunks / dt : -1;
}

static int run_datapath(const struct fopts *o, struct master *m) {
    struct server plain = {0}, rep = {0};
    int rc = 1;
    if (!server_start(&plain, 1.0, o->chunk, true, NULL, NULL) ||
        !server_start(&rep, 1.0, o->chunk, true, m->addr, "bench-reporting")) {
        fprintf(stderr, "lmcache bench fleet: cannot start the servers\n");
        goto out;
    }
    double r_plain[MAX_ROUNDS], r_rep[MAX_ROUNDS], g;
    uint64_t seq = 1;
    /* Untimed: each L1 filled past its size, so that the rounds run in the steady state (every
     * store evicts, the reporting server reports and revokes). */
    struct fopts warm = *o;
    warm.seconds = 0.5;
    for (int i = 0; i < 2; i++) {
        uint64_t before = seq;
        while ((double)(seq - before) * 16 * ((double)o->object_kib / 1024 / 1024) < 1.25)
            if (store_rate(i ? &rep : &plain, &warm, &seq, &g) < 0) goto out;
    }
    plain.chunks = rep.chunks = 0;
    double c0_plain = cpu_of(plain.pid), c0_rep = cpu_of(rep.pid);
    for (int r = 0; r < o->rounds; r++) {
        /* Alternate the order: a shared machine's drift hits both equally. */
        struct server *first = r % 2 ? &rep : &plain, *second = r % 2 ? &plain : &rep;
        double a = store_rate(first, o, &seq, &g), b = store_rate(second, o, &seq, &g);
        if (a < 0 || b < 0) goto out;
        r_plain[r] = r % 2 ? b : a;
        r_rep[r] = r % 2 ? a : b;
        printf("| store_bytes round %d, %d KiB objects | %.0f chunks/s without reporting, %.0f "
               "with (%+.1f%%) |\n",
               r + 1, o->object_kib, r_plain[r], r_rep[r],
               (r_rep[r] - r_plain[r]) / r_plain[r] * 100);
    }
    plain.cpu_s = cpu_of(plain.pid) - c0_plain;
    rep.cpu_s = cpu_of(rep.pid) - c0_rep;
    /* CPU per stored chunk does not depend on what else the machine runs, as throughput does. */
    double cpu_p = plain.cpu_s / (double)plain.chunks * 1e6,
           cpu_r = rep.cpu_s / (double)rep.chunks * 1e6;
    printf("| server CPU per stored chunk (all threads, timed rounds) | %.1f us without reporting, "
           "%.1f us with: %+.1f%% |\n",
           cpu_p, cpu_r, (cpu_r - cpu_p) / cpu_p * 100);
    /* Each round pairs the two servers back to back: the median of the paired differences is
     * the figure; the medians of each side are printed beside it. */
    double diff[MAX_ROUNDS];
    for (int r = 0; r < o->rounds; r++) diff[r] = (r_rep[r] - r_plain[r]) / r_plain[r] * 100;
    qsort(diff, (size_t)o->rounds, sizeof(double), cmp_double);
    qsort(r_plain, (size_t)o->rounds, sizeof(double), cmp_double);
    qsort(r_rep, (size_t)o->rounds, sizeof(double), cmp_double);
    double mp = r_plain[o->rounds / 2], mr = r_rep[o->rounds / 2];
    double obj = (double)((size_t)o->object_kib << 10);
    printf("| store_bytes, %d rounds | median %.0f chunks/s (%.2f GB/s) without reporting, %.0f "
           "(%.2f GB/s) with; median paired difference %+.1f%% (range %+.1f%% .. %+.1f%%) |\n",
           o->rounds, mp, mp * obj / 1e9, mr, mr * obj / 1e9, diff[o->rounds / 2], diff[0],
           diff[o->rounds - 1]);
    struct http h = {rep.http, -1, malloc(HTTP_MAX), HTTP_MAX};
    if (h.buf)
        printf("| reporting server, after the rounds | %.0f hashes reported, %.0f revoked, "
               "connected %.0f |\n",
               server_metric(&h, "lmcache_mp_master_reported_hashes_total"),
               server_metric(&h, "lmcache_mp_master_revoked_hashes_total"),
               server_metric(&h, "lmcache_mp_master_connected"));
    if (h.fd >= 0) close(h.fd);
    free(h.buf);
    rc = 0;
out:
    server_stop(&plain);
    server_stop(&rep);
    return rc;
}

/* ---- 2. ingest, 3. routing ------------------------------------------------------------------ */

static void hexify(const uint8_t *d, char *out) {
    static const char D[] = "0123456789abcdef";
    for (int i = 0; i < FLEETHASH_LEN; i++) {
        out[2 * i] = D[d[i] >> 4];
        out[2 * i + 1] = D[d[i] & 15];
    }
    out[FLEETHASH_HEX_LEN] = 0;
}

/* Stores prompts [first, first + n) on s by chunk hashes (the chain of their token ids), with
 * 1 KiB objects. */
static int fill(struct server *s, const struct fopts *o, uint64_t first, uint64_t n) {
    size_t ntok = (size_t)PROMPT * (size_t)o->chunk;
    uint32_t *toks = malloc(ntok * sizeof(*toks));
    uint8_t(*ch)[FLEETHASH_LEN] = malloc(PROMPT * sizeof(*ch));
    static char data[1024];
    const void *objs[PROMPT];
    size_t lens[PROMPT];
    for (int i = 0; i < PROMPT; i++) objs[i] = data, lens[i] = sizeof(data);
    int rc = toks && ch ? 0 : -1;
    lmc_error e;
    for (uint64_t p = first; rc == 0 && p < first + n; p++) {
        prompt_tokens(toks, ntok, p);
        if (fleethash_chunks(SEED_STRING, toks, ntok, (size_t)o->chunk, ch, PROMPT) != PROMPT) {
            rc = -1;
            break;
        }
        lmc_chunks c = {.chunk_hashes = &ch[0][0],
                        .num_chunk_hashes = PROMPT,
                        .hash_len = FLEETHASH_LEN,
                        .end = -1};
        uint64_t stored = 0, skipped = 0;
        if (lmc_store_bytes(s->c, MODEL, 1, 0, &c, objs, lens, PROMPT, &stored, &skipped, &e) !=
                LMC_OK ||
            stored != PROMPT) {
            fprintf(stderr, "store_bytes: %s (%llu stored)\n", e.message,
                    (unsigned long long)stored);
            rc = -1;
        }
    }
    free(toks);
    free(ch);
    return rc;
}

/* Appends s to the JSON body b at *len (bounded by cap). */
static void put(char *b, size_t cap, size_t *len, const char *s) {
    size_t n = strlen(s);
    if (*len + n < cap) {
        memcpy(b + *len, s, n + 1);
        *len += n;
    }
}

static int run_route(const struct fopts *o, struct master *m, uint64_t prompts_per_server) {
    struct http h = {m->http, -1, malloc(HTTP_MAX), HTTP_MAX};
    size_t cap = HTTP_MAX, ntok = (size_t)PROMPT * (size_t)o->chunk;
    char *body = malloc(cap);
    uint32_t *toks = malloc(ntok * sizeof(*toks));
    uint8_t(*ch)[FLEETHASH_LEN] = malloc(PROMPT * sizeof(*ch));
    double *lat = malloc((size_t)o->queries * sizeof(double));
    int rc = 1;
    if (!h.buf || !body || !toks || !ch || !lat) goto out;
    for (int form = 0; form < 2; form++) {
        uint64_t s = 42;
        int right = 0;
        size_t blen_sum = 0;
        for (int q = -o->queries / 10; q < o->queries; q++) { /* the first tenth warms up */
            uint64_t srv = splitmix(&s) % NSERVERS, p = splitmix(&s) % prompts_per_server;
            uint64_t pid = 1000000 + srv * prompts_per_server + p;
            prompt_tokens(toks, ntok, pid);
            size_t len = 0;
            char num[64];
            if (form == 0) {
                snprintf(num, sizeof(num), "{\"model_name\":\"%s\",\"chunk_size\":%d,", MODEL,
                         o->chunk);
                put(body, cap, &len, num);
                put(body, cap, &len, "\"token_ids\":[");
                for (size_t i = 0; i < ntok; i++) {
                    snprintf(num, sizeof(num), i ? ",%u" : "%u", toks[i]);
                    put(body, cap, &len, num);
                }
                put(body, cap, &len, "]}");
            } else {
                fleethash_chunks(SEED_STRING, toks, ntok, (size_t)o->chunk, ch, PROMPT);
                snprintf(num, sizeof(num), "{\"chunk_size\":%d,\"hashes\":[", o->chunk);
                put(body, cap, &len, num);
                for (int i = 0; i < PROMPT; i++) {
                    uint8_t d[FLEETHASH_LEN];
                    char hex[FLEETHASH_HEX_LEN + 1];
                    fleethash_compute(MODEL, "", KV_RANK_TP1, ch[i], FLEETHASH_LEN, d);
                    hexify(d, hex);
                    put(body, cap, &len, i ? ",\"" : "\"");
                    put(body, cap, &len, hex);
                    put(body, cap, &len, "\"");
                }
                put(body, cap, &len, "]}");
            }
            double t0 = clock_mono();
            int st = http_req(&h, "POST", "/route", body, len);
            double dt = clock_mono() - t0;
            if (st != 200) {
                fprintf(stderr, "POST /route: %d %s\n", st, st > 0 ? h.buf : "");
                goto out;
            }
            char want[64];
            snprintf(want, sizeof(want), "\"node_id\": \"bench-node-%d\"", (int)srv);
            char want2[64];
            snprintf(want2, sizeof(want2), "\"node_id\":\"bench-node-%d\"", (int)srv);
            char *rec = strstr(h.buf, "\"recommended\"");
            if (q < 0) continue;
            lat[q] = dt * 1e3;
            blen_sum += len;
            if (rec && (strstr(rec, want) || strstr(rec, want2))) right++;
        }
        qsort(lat, (size_t)o->queries, sizeof(double), cmp_double);
        printf("| POST /route, %d-chunk prompt by %s (%zu-byte body), %d queries | p50 %.3f ms, "
               "p99 %.3f ms, max %.3f ms; holder recommended %d/%d |\n",
               PROMPT, form ? "hashes" : "token ids", blen_sum / (size_t)o->queries, o->queries,
               pct(lat, (size_t)o->queries, 0.5), pct(lat, (size_t)o->queries, 0.99),
               lat[o->queries - 1], right, o->queries);
    }
    rc = 0;
out:
    if (h.fd >= 0) close(h.fd);
    free(h.buf);
    free(body);
    free(toks);
    free(ch);
    free(lat);
    return rc;
}

static int run_ingest_and_route(const struct fopts *o) {
    struct server s[NSERVERS] = {{0}};
    struct master m = {0};
    int rc = 1;
    uint64_t prompts = (uint64_t)(o->entries / NSERVERS + PROMPT - 1) / PROMPT;
    uint64_t per = prompts * PROMPT, total = per * NSERVERS;
    /* The master's port is chosen now; it starts once the servers hold their chunks. */
    int mport = bench_free_port();
    char maddr[64];
    snprintf(maddr, sizeof(maddr), "127.0.0.1:%d", mport);
    /* 1 KiB objects take one 4 KiB unit each; room below the eviction watermark */
    double l1 = (double)per * 4096.0 * 1.5 / (double)(1ull << 30) + 0.25;
    for (int i = 0; i < NSERVERS; i++) {
        char id[32];
        snprintf(id, sizeof(id), "bench-node-%d", i);
        if (!server_start(&s[i], l1, o->chunk, false, maddr, id)) {
            fprintf(stderr, "lmcache bench fleet: cannot start server %d\n", i);
            goto out;
        }
    }
    double t0 = clock_mono();
    for (int i = 0; i < NSERVERS; i++)
        if (fill(&s[i], o, 1000000 + (uint64_t)i * prompts, prompts) != 0) goto out;
    printf("| setup | %d servers x %llu chunks (%d-chunk prompts, %d-token chunks, 1 KiB "
           "objects) stored in %.1f s while their master is down |\n",
           NSERVERS, (unsigned long long)per, PROMPT, o->chunk, clock_mono() - t0);
    if (!master_start(&m, mport)) {
        fprintf(stderr, "lmcache bench fleet: cannot start the master\n");
        goto out;
    }
    struct http h[NSERVERS];
    for (int i = 0; i < NSERVERS; i++)
        h[i] = (struct http){s[i].http, -1, malloc(1 << 20), 1 << 20};
    /* Each server's window runs from the last sample that saw none of its hashes reported to
     * the first that saw them all; the servers start their reports when their registration
     * retry (every second) finds the master, so the windows overlap but are staggered. */
    double first = 0, last = 0, prev_t = clock_mono(), sum = 0;
    double t_first[NSERVERS] = {0}, t_done[NSERVERS] = {0};
    for (double start = prev_t; clock_mono() - start < 600;) {
        double now = clock_mono();
        sum = 0;
        for (int i = 0; i < NSERVERS; i++) {
            double v =
                h[i].buf ? server_metric(&h[i], "lmcache_mp_master_reported_hashes_total") : -1;
            sum += v > 0 ? v : 0;
            if (v > 0 && t_first[i] == 0) t_first[i] = prev_t;
            if (v >= (double)per && t_done[i] == 0) t_done[i] = now;
        }
        if (sum > 0 && first == 0) first = prev_t;
        prev_t = now;
        if (sum >= (double)total) {
            last = now;
            break;
        }
        usleep(10000);
    }
    for (int i = 0; i < NSERVERS; i++) {
        if (h[i].fd >= 0) close(h[i].fd);
        free(h[i].buf);
    }
    if (!last) {
        fprintf(stderr, "lmcache bench fleet: the full reports did not complete (%.0f of %llu)\n",
                sum, (unsigned long long)total);
        goto out;
    }
    /* While all four were sending: from the last start to the first end. */
    double all_from = 0, all_to = last;
    for (int i = 0; i < NSERVERS; i++) {
        if (t_first[i] > all_from) all_from = t_first[i];
        if (t_done[i] && t_done[i] < all_to) all_to = t_done[i];
    }
    printf("| master ingest, %d servers' full reports (%llu hashes each) | first start to last end "
           "%.2f s: %.0f hashes/s overall; per server %.2f / %.2f / %.2f / %.2f s; all %d "
           "overlapping for %.2f s |\n",
           NSERVERS, (unsigned long long)per, last - first, (double)total / (last - first),
           t_done[0] - t_first[0], t_done[1] - t_first[1], t_done[2] - t_first[2],
           t_done[3] - t_first[3], NSERVERS, all_to > all_from ? all_to - all_from : 0);
    {
        double agg = 0;
        for (int i = 0; i < NSERVERS; i++)
            if (t_done[i] > t_first[i]) agg += (double)per / (t_done[i] - t_first[i]);
        printf("| master ingest, sum of the 4 servers' own rates | %.0f hashes/s |\n", agg);
    }
    rc = run_route(o, &m, prompts);
out:
    for (int i = 0; i < NSERVERS; i++) server_stop(&s[i]);
    stop(m.pid);
    return rc;
}

int bench_fleet_main(int argc, char **argv) {
    struct fopts o = {5, 2.0, 1 << 20, 2000, 256, 256};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--rounds") && v)
            o.rounds = atoi(argv[++i]);
        else if (!strcmp(a, "--seconds") && v)
            o.seconds = atof(argv[++i]);
        else if (!strcmp(a, "--entries") && v)
            o.entries = atol(argv[++i]);
        else if (!strcmp(a, "--queries") && v)
            o.queries = atoi(argv[++i]);
        else if (!strcmp(a, "--object-kib") && v)
            o.object_kib = atoi(argv[++i]);
        else if (!strcmp(a, "--chunk-size") && v)
            o.chunk = atoi(argv[++i]);
        else {
            bool help = !strcmp(a, "-h") || !strcmp(a, "--help");
            fprintf(help ? stdout : stderr,
                    "usage: lmcache bench fleet [--rounds N (5)] [--seconds S per round (2)] "
                    "[--object-kib K (256)] [--entries N (1048576)] [--queries N (2000)] "
                    "[--chunk-size T (256)]\n");
            return help ? 0 : 2;
        }
    }
    if (o.rounds < 1 || o.rounds > MAX_ROUNDS || o.seconds <= 0 || o.entries < PROMPT * NSERVERS ||
        o.entries > (64l << 20) || o.queries < 10 || o.object_kib < 1 || o.object_kib > 65536 ||
        o.chunk < 1 || o.chunk > 1024) {
        fprintf(stderr,
                "lmcache bench fleet: --rounds 1..%d, --seconds > 0, --entries %d..64Mi, "
                "--queries >= 10, --object-kib 1..65536, --chunk-size 1..1024\n",
                MAX_ROUNDS, PROMPT * NSERVERS);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    char la[64];
    loadavg(la, sizeof(la));
    printf("| what | result |\n|---|---|\n| load average at start | %s (%ld CPUs) |\n", la,
           sysconf(_SC_NPROCESSORS_ONLN));
    fflush(stdout);
    struct master m = {0};
    int rc = 1;
    if (!master_start(&m, -1)) {
        fprintf(stderr, "lmcache bench fleet: cannot start the master\n");
        stop(m.pid);
        return 1;
    }
    rc = run_datapath(&o, &m);
    stop(m.pid);
    fflush(stdout);
    if (rc == 0) rc = run_ingest_and_route(&o);
    loadavg(la, sizeof(la));
    printf("| load average at end | %s |\n", la);
    return rc;
}
