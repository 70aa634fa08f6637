/* `lmcache bench master` (also `lmcache master bench`): starts a master on a free loopback
 * port (or uses --master), indexes N (hash, node, tier) entries over 16 nodes through the C
 * client, then measures MatchExternalKv of 256-hash queries at concurrency 1 and 32 with
 * every hash indexed and with half of them indexed, report and revoke throughput, the
 * master's resident memory per million entries, and as the ceiling a bare gRPC server
 * answering the same request and reply sizes. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "lmcache/umbp_client.h"
#include "base/grpcu.h"
#include "bench/bench.h"

#define NODES       16
#define REPLICAS    4
#define BATCH       1024
#define MAX_THREADS 8

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static long rss_kb(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f && fgets(line, sizeof(line), f))
        if (strncmp(line, "VmRSS:", 6) == 0) kb = strtol(line + 6, NULL, 10);
    if (f) fclose(f);
    return kb;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* ---- the transport ceiling: a bare gRPC C-core server answering every call with a fixed
 * blob, driven by the same kind of pipelined client, in the same run ---- */

#define ECHO_PATH  "/bench.Echo/Echo"
#define ECHO_SLOTS 64

struct echo_call {
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload, *resp;
    int cancelled, sent;
};

struct echo_srv {
    grpc_server *server;
    grpc_completion_queue *cq;
    void *rm;
    const char *blob;
    size_t blob_len;
};

static int echo_arm(struct echo_srv *e) {
    struct echo_call *c = calloc(1, sizeof(*c));
    if (!c) return -1;
    grpc_metadata_array_init(&c->md);
    if (grpc_server_request_registered_call(e->server, e->rm, &c->call, &c->deadline, &c->md,
                                            &c->payload, e->cq, e->cq, c) != GRPC_CALL_OK) {
        grpc_metadata_array_destroy(&c->md);
        free(c);
        return -1;
    }
    return 0;
}

static void echo_free(struct echo_call *c) {
    if (c->call) grpc_call_unref(c->call);
    if (c->payload) grpc_byte_buffer_destroy(c->payload);
    if (c->resp) grpc_byte_buffer_destroy(c->resp);
    grpc_metadata_array_destroy(&c->md);
    free(c);
}

static void *echo_worker(void *arg) {
    struct echo_srv *e = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(e->cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        struct echo_call *c = ev.tag;
        if (c->sent || !ev.success) {
            echo_free(c);
            continue;
        }
        if (echo_arm(e)) fprintf(stderr, "echo: cannot re-arm\n");
        /* Read the request the way a real handler must (one contiguous slice). */
        grpc_byte_buffer_reader rd;
        if (c->payload && grpc_byte_buffer_reader_init(&rd, c->payload)) {
            grpc_slice in = grpc_byte_buffer_reader_readall(&rd);
            grpc_byte_buffer_reader_destroy(&rd);
            grpc_slice_unref(in);
        }
        uint8_t *buf = malloc(e->blob_len ? e->blob_len : 1);
        if (!buf) {
            echo_free(c);
            continue;
        }
        memcpy(buf, e->blob, e->blob_len); /* a real reply is built per call */
        grpc_slice s = grpc_slice_new(buf, e->blob_len, free);
        c->resp = grpc_raw_byte_buffer_create(&s, 1);
        grpc_slice_unref(s);
        grpc_op ops[4];
        memset(ops, 0, sizeof(ops));
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[1].op = GRPC_OP_SEND_MESSAGE;
        ops[1].data.send_message.send_message = c->resp;
        ops[2].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[2].data.send_status_from_server.status = GRPC_STATUS_OK;
        ops[3].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        ops[3].data.recv_close_on_server.cancelled = &c->cancelled;
        c->sent = 1;
        if (grpc_call_start_batch(c->call, ops, 4, c, NULL) != GRPC_CALL_OK) echo_free(c);
    }
    return NULL;
}

/* `lmcache master bench --serve-echo ADDR REPLY_BYTES`: runs until SIGTERM. */
static int echo_serve(const char *addr, size_t reply_bytes) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    grpc_init();
    struct echo_srv e = {0};
    char *blob = malloc(reply_bytes ? reply_bytes : 1);
    if (!blob) return 1;
    memset(blob, 'x', reply_bytes);
    e.blob = blob;
    e.blob_len = reply_bytes;
    grpc_arg args[2];
    args[0].type = args[1].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[0].value.integer = args[1].value.integer = 64 << 20;
    grpc_channel_args ca = {2, args};
    e.server = grpc_server_create(&ca, NULL);
    e.cq = grpc_completion_queue_create_for_next(NULL);
    e.rm = grpc_server_register_method(e.server, ECHO_PATH, NULL,
                                       GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    grpc_server_register_completion_queue(e.server, e.cq, NULL);
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    int port = grpc_server_add_http2_port(e.server, addr, creds);
    grpc_server_credentials_release(creds);
    if (port <= 0) {
        fprintf(stderr, "echo: cannot listen on %s\n", addr);
        return 1;
    }
    grpc_server_start(e.server);
    for (int i = 0; i < ECHO_SLOTS; i++)
        if (echo_arm(&e)) return 1;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nt = ncpu < 2 ? 2 : (int)ncpu;
    pthread_t th[64];
    int started = 0;
    for (int i = 0; i < nt && i < 64; i++)
        if (pthread_create(&th[i], NULL, echo_worker, &e) == 0) started++;
    int sig;
    sigwait(&set, &sig);
    _exit(started ? 0 : 1); /* a load helper: the process ends with the run */
}

/* Pipelined raw calls of req to path on a channel of its own; lat_ns[i] per call. */
static int raw_pipelined(const char *addr, const char *path, const uint8_t *req, size_t req_len,
                         size_t calls, unsigned depth, uint64_t *lat_ns, uint64_t *reply_bytes) {
    grpc_init();
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    grpc_arg args[2];
    args[0].type = args[1].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = 64 << 20;
    args[1].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL; /* a connection per thread */
    args[1].value.integer = 1;
    grpc_channel_args ca = {2, args};
    grpc_channel *ch = creds ? grpc_channel_create(addr, creds, &ca) : NULL;
    if (creds) grpc_channel_credentials_release(creds);
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    struct rcall {
        struct grpcu_call g;
        uint64_t t0;
        size_t qi;
    } *rc = calloc(depth, sizeof(*rc));
    if (!ch || !cq || !rc) {
        free(rc);
        if (cq) grpc_completion_queue_destroy(cq);
        if (ch) grpc_channel_destroy(ch);
        grpc_shutdown();
        return -1;
    }
    grpc_slice method = grpc_slice_from_static_string(path);
    size_t next = 0, inflight = 0;
    int bad = 0;
    uint64_t bytes = 0;
    for (;;) {
        while (!bad && inflight < depth && next < calls) {
            struct rcall *u = NULL;
            for (unsigned k = 0; k < depth && !u; k++)
                if (!rc[k].g.call) u = &rc[k];
            grpc_slice s = grpc_slice_from_static_buffer(req, req_len);
            u->g.req = grpc_raw_byte_buffer_create(&s, 1);
            u->t0 = bench_now_ns();
            u->qi = next++;
            if (grpcu_start(&u->g, ch, cq, method, gpr_inf_future(GPR_CLOCK_REALTIME), u)) {
                grpcu_cleanup(&u->g);
                bad = 1;
                break;
            }
            inflight++;
        }
        if (!inflight) break;
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE) break;
        struct rcall *u = ev.tag;
        inflight--;
        if (lat_ns) lat_ns[u->qi] = bench_now_ns() - u->t0;
        if (!ev.success || u->g.status != GRPC_STATUS_OK || !u->g.resp) bad = 1;
        if (u->g.resp) {
            grpc_byte_buffer_reader rd;
            if (grpc_byte_buffer_reader_init(&rd, u->g.resp)) {
                grpc_slice in = grpc_byte_buffer_reader_readall(&rd);
                bytes += GRPC_SLICE_LENGTH(in);
                grpc_byte_buffer_reader_destroy(&rd);
                grpc_slice_unref(in);
            }
        }
        grpcu_cleanup(&u->g);
    }
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
    grpc_channel_destroy(ch);
    free(rc);
    grpc_shutdown();
    if (reply_bytes) *reply_bytes = bytes;
    return bad ? -1 : 0;
}

/* CPU seconds (user + system) used so far by a child, or by this process when pid is 0. */
static double cpu_s(pid_t pid) {
    if (!pid) {
        struct rusage ru;
        if (getrusage(RUSAGE_SELF, &ru)) return 0;
        return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
               (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    }
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    size_t n = f ? fread(buf, 1, sizeof(buf) - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    const char *p = strrchr(buf, ')'); /* fields after the command name */
    unsigned long long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
        return 0;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The server whose CPU time the next measurement reports (the master or the echo server). */
static pid_t g_server;

/* The redis-server processes the bench started (their CPU is reported beside the master's). */
static pid_t g_redis[4];

struct cpu_mark {
    double server, client, redis;
};

static struct cpu_mark cpu_mark(void) {
    double rd = 0;
    for (int i = 0; i < 4; i++)
        if (g_redis[i]) rd += cpu_s(g_redis[i]);
    return (struct cpu_mark){cpu_s(g_server), cpu_s(0), rd};
}

static void print_lat(const char *what, unsigned depth, size_t calls, double dt, uint64_t *lat,
                      struct cpu_mark c0, const char *extra) {
    struct cpu_mark c1 = cpu_mark();
    qsort(lat, calls, sizeof(*lat), cmp_u64);
    char srv[32] = "?", rds[96] = "";
    double sv = (c1.server - c0.server) / calls * 1e6, cl = (c1.client - c0.client) / calls * 1e6;
    if (g_server) snprintf(srv, sizeof(srv), "%.0f", sv);
    if (g_redis[0]) {
        /* With everything on this machine, the CPU per call bounds the rate whatever else
         * runs here: ncpu / (master + client + redis). */
        double rd = (c1.redis - c0.redis) / calls * 1e6;
        snprintf(rds, sizeof(rds), ", redis %.0f us (CPU-bound at %.0f calls/s on %ld cores)", rd,
                 (double)sysconf(_SC_NPROCESSORS_ONLN) * 1e6 / (sv + cl + rd),
                 sysconf(_SC_NPROCESSORS_ONLN));
    }
    printf("| %s, concurrency %u | %.0f calls/s | p50 %.3f ms | p99 %.3f ms | CPU/call: server "
           "%s us, client %.0f us%s |%s\n",
           what, depth, (double)calls / dt, (double)lat[calls / 2] / 1e6,
           (double)lat[calls * 99 / 100] / 1e6, srv, cl, rds, extra);
}

/* One load thread: either MatchExternalKv through a client, or raw calls to addr. */
struct load {
    struct umbp_client *c;
    const char ***q;
    size_t *ql;
    const char *addr;
    const uint8_t *req;
    size_t req_len;
    size_t n;
    unsigned depth;
    uint64_t *lat;
    uint64_t matched, bytes;
    int rc;
    char err[256];
};

static void *match_thread(void *arg) {
    struct load *l = arg;
    l->rc = umbp_match_external_kv_pipelined(l->c, (const char *const *const *)l->q, l->ql, l->n,
                                             false, l->depth, l->lat, &l->matched, &l->bytes,
                                             l->err, sizeof(l->err));
    return NULL;
}

static void *echo_thread(void *arg) {
    struct load *l = arg;
    l->rc = raw_pipelined(l->addr, "/bench.Echo/Echo", l->req, l->req_len, l->n, l->depth, l->lat,
                          &l->bytes);
    return NULL;
}

/* Runs nt load threads (the first on the calling thread); sums their reply bytes. */
static int run_threads(struct load *lt, unsigned nt, void *(*fn)(void *), uint64_t *bytes) {
    pthread_t th[MAX_THREADS];
    unsigned started = 0;
    for (unsigned t = 1; t < nt; t++, started++)
        if (pthread_create(&th[t], NULL, fn, &lt[t])) break;
    fn(&lt[0]);
    int rc = lt[0].rc;
    *bytes = lt[0].bytes;
    for (unsigned t = 1; t <= started; t++) {
        pthread_join(th[t], NULL);
        if (lt[t].rc && !rc) {
            rc = lt[t].rc;
            fprintf(stderr, "%s\n", lt[t].err);
        }
        *bytes += lt[t].bytes;
    }
    if (started + 1 < nt) rc = -1;
    if (lt[0].rc) fprintf(stderr, "%s\n", lt[0].err);
    return rc;
}

/* Windows of 256 consecutive universe entries at pseudo-random offsets, spread over
 * min(depth, nthreads) threads with a client (connection) each. Returns the average
 * reply size in bytes, 0 on failure. */
static size_t run_match(struct umbp_client **cs, unsigned nthreads, char **universe, size_t nh,
                        unsigned depth, size_t calls, const char *what) {
    unsigned nt = depth < nthreads ? depth : nthreads;
    calls = calls / nt * nt;
    const char ***q = calloc(calls, sizeof(*q));
    size_t *ql = calloc(calls, sizeof(*ql));
    uint64_t *lat = calloc(calls, sizeof(*lat));
    uint64_t seed = 88172645463325252ull;
    for (size_t i = 0; q && ql && lat && i < calls; i++) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        q[i] = (const char **)&universe[seed % (nh - 256)];
        ql[i] = 256;
    }
    size_t avg = 0;
    if (q && ql && lat) {
        struct load lt[MAX_THREADS];
        size_t per = calls / nt;
        for (unsigned t = 0; t < nt; t++)
            lt[t] = (struct load){.c = cs[t],
                                  .q = q + t * per,
                                  .ql = ql + t * per,
                                  .n = per,
                                  .depth = depth / nt,
                                  .lat = lat + t * per};
        uint64_t bytes = 0, matched = 0;
        struct cpu_mark c0 = cpu_mark();
        double t0 = now_s();
        int rc = run_threads(lt, nt, match_thread, &bytes);
        double dt = now_s() - t0;
        for (unsigned t = 0; t < nt; t++) matched += lt[t].matched;
        if (!rc) {
            char extra[96];
            avg = (size_t)(bytes / calls);
            snprintf(extra, sizeof(extra), " %.1f node matches/call, %zu-byte replies |",
                     (double)matched / (double)calls, avg);
            print_lat(what, depth, calls, dt, lat, c0, extra);
        }
    }
    free(q);
    free(ql);
    free(lat);
    return avg;
}

static void wait_listen(int port) {
    for (int tries = 0; tries < 400; tries++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in sa = {.sin_family = AF_INET,
                                 .sin_port = htons((uint16_t)port),
                                 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        int ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
        if (fd >= 0) close(fd);
        if (ok) return;
        usleep(25000);
    }
}

/* Starts `lmcache <args>` on a free loopback port written into addr; 0 on failure. */
static pid_t spawn_self(char *const args[], char *addr, size_t addrlen, int *port) {
    *port = bench_free_port();
    if (*port < 0) return 0;
    snprintf(addr, addrlen, "127.0.0.1:%d", *port);
    pid_t pid = fork();
    if (pid == 0) {
        /* Ends with the bench even if the bench is killed. */
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) || getppid() == 1) _exit(127);
        /* The bench's nodes never heartbeat: keep them alive for the whole run. */
        setenv("UMBP_HEARTBEAT_TTL_SEC", "86400", 1);
        execv("/proc/self/exe", args);
        _exit(127);
    }
    if (pid < 0) return 0;
    wait_listen(*port);
    return pid;
}

static void stop_child(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGTERM);
    int st;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
    }
}

/* The reference: the same request bytes, a reply of reply_bytes, a bare server. */
static void run_echo(const char *const *hashes, size_t reply_bytes, size_t calls,
                     const unsigned *depths, size_t ndepths, unsigned nthreads, const char *what) {
    char addr[64], bytes_arg[32];
    int port;
    snprintf(bytes_arg, sizeof(bytes_arg), "%zu", reply_bytes);
    char *args[] = {"lmcache", "master", "bench", "--serve-echo", addr, bytes_arg, NULL};
    /* addr is filled by spawn_self before the exec reads it. */
    pid_t pid = spawn_self(args, addr, sizeof(addr), &port);
    pid_t master = g_server;
    g_server = pid;
    uint8_t *req = malloc(256 * 80);
    uint64_t *lat = calloc(calls, sizeof(*lat));
    size_t len = 0;
    for (size_t i = 0; req && i < 256; i++) { /* MatchExternalKvRequest.hashes, as encoded */
        size_t hl = strlen(hashes[i]);
        req[len++] = 0x0a;
        req[len++] = (uint8_t)hl;
        memcpy(req + len, hashes[i], hl);
        len += hl;
    }
    for (size_t d = 0; pid && req && lat && d < ndepths; d++) {
        size_t n = depths[d] == 1 ? calls / 10 : calls;
        unsigned nt = depths[d] < nthreads ? depths[d] : nthreads;
        struct load lt[MAX_THREADS];
        for (unsigned t = 0; t < nt; t++)
            lt[t] = (struct load){.addr = addr,
                                  .req = req,
                                  .req_len = len,
                                  .n = n / nt,
                                  .depth = depths[d] / nt,
                                  .lat = lat + t * (n / nt)};
        n = n / nt * nt;
        struct cpu_mark c0 = cpu_mark();
        double t0 = now_s();
        uint64_t got = 0;
        if (run_threads(lt, nt, echo_thread, &got)) {
            fprintf(stderr, "echo: call failed\n");
            break;
        }
        char extra[96];
        snprintf(extra, sizeof(extra), " %zu-byte requests, %zu-byte replies |", len,
                 (size_t)(got / n));
        print_lat(what, depths[d], n, now_s() - t0, lat, c0, extra);
    }
    free(req);
    free(lat);
    stop_child(pid);
    g_server = master;
}

/* ---- --backend redis: a redis-server of our own (unless --redis-uri) and its memory ---- */

/* A redis-server on port with its files in dir (made here); cluster: --cluster-enabled. */
static pid_t spawn_redis(int port, char *dir, bool cluster) {
    if (!mkdtemp(dir)) return 0;
    char portarg[16];
    snprintf(portarg, sizeof(portarg), "%d", port);
    pid_t pid = fork();
    if (pid == 0) {
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) || getppid() == 1) _exit(127);
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) dup2(fd, 1);
        char *args[] = {"redis-server",
                        "--port",
                        portarg,
                        "--bind",
                        "127.0.0.1",
                        "--dir",
                        dir,
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        cluster ? "--cluster-enabled" : NULL,
                        "yes",
                        NULL};
        execvp("redis-server", args);
        _exit(127);
    }
    if (pid < 0) return 0;
    wait_listen(port);
    return pid;
}

#define CLUSTER_NODES 3

/* --backend redis-cluster: three masters made one cluster with redis-cli, all slots served.
 * 0, or -1 (what is started is left for the caller to stop). */
static int make_cluster(const int *ports, pid_t *pids, char (*dirs)[40]) {
    for (int i = 0; i < CLUSTER_NODES; i++)
        if (!(pids[i] = spawn_redis(ports[i], dirs[i], true))) return -1;
    char a[CLUSTER_NODES][32];
    char *args[8 + CLUSTER_NODES] = {"redis-cli", "--cluster", "create"};
    int k = 3;
    for (int i = 0; i < CLUSTER_NODES; i++) {
        snprintf(a[i], sizeof(a[i]), "127.0.0.1:%d", ports[i]);
        args[k++] = a[i];
    }
    args[k++] = "--cluster-replicas";
    args[k++] = "0";
    args[k++] = "--cluster-yes";
    args[k] = NULL;
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) dup2(fd, 1);
        execvp("redis-cli", args);
        _exit(127);
    }
    int st = 0;
    if (pid < 0 || waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st)) return -1;
    /* Every node agrees the cluster is up (gossip takes a moment). */
    for (int tries = 0; tries < 400; tries++) {
        int ok = 0;
        for (int i = 0; i < CLUSTER_NODES; i++) {
            struct timeval tv = {2, 0};
            redisContext *c = redisConnectWithTimeout("127.0.0.1", ports[i], tv);
            redisReply *r = c && !c->err ? redisCommand(c, "CLUSTER INFO") : NULL;
            ok += r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
            if (r) freeReplyObject(r);
            redisFree(c);
        }
        if (ok == CLUSTER_NODES) return 0;
        usleep(50000);
    }
    return -1;
}

/* used_memory of the Redis at host:port in bytes, or -1. */
static long long redis_used_memory1(const char *host, int port) {
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout(host, port, tv);
    long long v = -1;
    if (c && !c->err) {
        const char *pw = getenv("UMBP_REDIS_PASSWORD");
        if (pw && *pw) freeReplyObject(redisCommand(c, "AUTH %s", pw));
        redisReply *r = redisCommand(c, "INFO memory");
        const char *p = r && r->type == REDIS_REPLY_STRING ? r->str : NULL;
        if (p && (p = strstr(p, "used_memory:"))) v = strtoll(p + 12, NULL, 10);
        if (r) freeReplyObject(r);
    }
    redisFree(c);
    return v;
}

static int g_cports[CLUSTER_NODES];
static bool g_cluster;

/* The bench's Redis: one instance, or the sum over the cluster's masters. */
static long long redis_used_memory(const char *host, int port) {
    if (!g_cluster) return redis_used_memory1(host, port);
    long long sum = 0;
    for (int i = 0; i < CLUSTER_NODES; i++) {
        long long v = redis_used_memory1("127.0.0.1", g_cports[i]);
        if (v < 0) return -1;
        sum += v;
    }
    return sum;
}

int bench_master_main(int argc, char **argv) {
    size_t entries = 1000000, calls = 20000;
    unsigned nthreads = 2; /* client threads, a connection each */
    const char *ext = NULL, *backend = "inmemory", *ruri = NULL;
    if (argc == 4 && strcmp(argv[1], "--serve-echo") == 0)
        return echo_serve(argv[2], strtoull(argv[3], 0, 10));
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--entries") == 0 && i + 1 < argc)
            entries = strtoull(argv[++i], 0, 10);
        else if (strcmp(argv[i], "--calls") == 0 && i + 1 < argc)
            calls = strtoull(argv[++i], 0, 10);
        else if (strcmp(argv[i], "--master") == 0 && i + 1 < argc)
            ext = argv[++i];
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            nthreads = (unsigned)strtoul(argv[++i], 0, 10);
        else if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
            backend = argv[++i];
        else if (strcmp(argv[i], "--redis-uri") == 0 && i + 1 < argc)
            ruri = argv[++i];
        else {
            fprintf(stderr,
                    "usage: lmcache bench master [--entries N] [--calls N] "
                    "[--threads N] [--master host:port] [--backend inmemory|redis|redis-cluster] "
                    "[--redis-uri tcp://host:port]\n");
            return 2;
        }
    }
    if (entries < 4096 || calls < 100 || nthreads < 1 || nthreads > MAX_THREADS) {
        fprintf(stderr,
                "lmcache bench master: --entries >= 4096, --calls >= 100, "
                "--threads 1..%d\n",
                MAX_THREADS);
        return 2;
    }
    g_cluster = strcmp(backend, "redis-cluster") == 0;
    bool redis = g_cluster || strcmp(backend, "redis") == 0;
    if (!redis && strcmp(backend, "inmemory") != 0) {
        fprintf(stderr, "lmcache bench master: --backend inmemory, redis or redis-cluster\n");
        return 2;
    }
    char rhost[128] = "127.0.0.1", rdir[] = "/tmp/lmcache-bench-redis-XXXXXX", ruri_buf[160];
    char cdirs[CLUSTER_NODES][40];
    pid_t cpids[CLUSTER_NODES] = {0};
    int rport = 0;
    pid_t rpid = 0;
    if (g_cluster && !ext) {
        /* Three masters of our own (the cluster bus listens on port + 10000). */
        for (int i = 0; i < CLUSTER_NODES; i++) {
            snprintf(cdirs[i], sizeof(cdirs[i]), "/tmp/lmcache-bench-rc-XXXXXX");
            do g_cports[i] = bench_free_port();
            while (g_cports[i] > 55535 || (i && g_cports[i] == g_cports[i - 1]));
        }
        if (make_cluster(g_cports, cpids, cdirs)) {
            fprintf(stderr, "lmcache bench master: cannot start a redis cluster\n");
            for (int i = 0; i < CLUSTER_NODES; i++) stop_child(cpids[i]);
            return 1;
        }
        rport = g_cports[0];
        for (int i = 0; i < CLUSTER_NODES; i++) g_redis[i] = cpids[i];
        snprintf(ruri_buf, sizeof(ruri_buf),
                 "tcp://127.0.0.1:%d,tcp://127.0.0.1:%d,tcp://127.0.0.1:%d", g_cports[0],
                 g_cports[1], g_cports[2]);
        char ns[64];
        snprintf(ns, sizeof(ns), "bench-%d", (int)getpid());
        setenv("UMBP_METADATA_BACKEND", "redis", 1);
        setenv("UMBP_REDIS_CLUSTER", "1", 1);
        setenv("UMBP_REDIS_URI", ruri_buf, 1);
        setenv("UMBP_REDIS_NAMESPACE", ns, 1);
    } else if (redis && !ext) {
        if (ruri) {
            const char *h = strncmp(ruri, "tcp://", 6) == 0 ? ruri + 6 : ruri;
            const char *colon = strrchr(h, ':');
            snprintf(rhost, sizeof(rhost), "%.*s", (int)(colon ? colon - h : (long)strlen(h)), h);
            rport = colon ? atoi(colon + 1) : 6379;
        } else {
            rport = bench_free_port();
            if (rport < 0 || !(rpid = spawn_redis(rport, rdir, false))) {
                fprintf(stderr, "lmcache bench master: cannot start redis-server\n");
                return 1;
            }
            g_redis[0] = rpid;
        }
        snprintf(ruri_buf, sizeof(ruri_buf), "tcp://%s:%d", rhost, rport);
        char ns[64];
        snprintf(ns, sizeof(ns), "bench-%d", (int)getpid());
        setenv("UMBP_METADATA_BACKEND", "redis", 1);
        setenv("UMBP_REDIS_URI", ruri_buf, 1);
        setenv("UMBP_REDIS_NAMESPACE", ns, 1);
    }
    char addr[64];
    pid_t pid = 0;
    if (ext) {
        snprintf(addr, sizeof(addr), "%s", ext);
    } else {
        int port;
        char *args[] = {"lmcache", "master", addr, "0", NULL};
        pid = spawn_self(args, addr, sizeof(addr), &port);
        if (!pid) return 1;
        g_server = pid;
    }
    struct umbp_client *nodes[NODES], *qc[MAX_THREADS] = {0};
    char err[256] = "";
    int rc = 1;
    size_t nh = entries / REPLICAS;
    char **hs = calloc(nh, sizeof(char *));
    char **mixed = calloc(2 * nh, sizeof(char *)); /* indexed, missing, indexed, ... */
    char *miss = malloc(nh * 65);
    memset(nodes, 0, sizeof(nodes));
    if (!hs || !mixed || !miss) goto out;
    for (int i = 0; i < NODES; i++) {
        char id[32];
        snprintf(id, sizeof(id), "bench-node-%02d", i);
        nodes[i] = umbp_client_new(addr, id, id);
        struct umbp_tier_capacity cap = {UMBP_TIER_DRAM, 1ull << 40, 1ull << 40};
        for (int tries = 0; nodes[i]; tries++) {
            if (umbp_client_register(nodes[i], &cap, 1, err, sizeof(err)) == 0) break;
            if (tries > 200) {
                fprintf(stderr, "register: %s\n", err);
                goto out;
            }
            usleep(20000);
        }
    }
    for (unsigned t = 0; t < nthreads; t++)
        if (!(qc[t] = umbp_client_new(addr, "", ""))) goto out;
    for (size_t i = 0; i < nh; i++) {
        hs[i] = malloc(65);
        if (!hs[i]) goto out;
        uint64_t x = i * 0x9e3779b97f4a7c15ull;
        snprintf(hs[i], 65, "%016llx%016llx%016llx%016llx", (unsigned long long)x,
                 (unsigned long long)(x ^ 0xdeadbeef), (unsigned long long)~x,
                 (unsigned long long)(i));
        snprintf(miss + i * 65, 65, "%016llx%016llx%016llx%016llx", (unsigned long long)~x,
                 (unsigned long long)(x ^ 0xfeedface), (unsigned long long)x,
                 (unsigned long long)(i));
        mixed[2 * i] = hs[i];
        mixed[2 * i + 1] = miss + i * 65;
    }
    long rss0 = pid ? rss_kb(pid) : -1;
    long long rmem0 = rport ? redis_used_memory(rhost, rport) : -1;
    printf("| setup | %zu entries = %zu hashes x %d replicas over %d nodes, 64-char hashes; "
           "%u client thread(s), a connection each |\n",
           nh * REPLICAS, nh, REPLICAS, NODES, nthreads);
    /* Report: replica r of hash i lives on node (i + r*4) % 16, tier HBM for r even. */
    double t0 = now_s();
    for (int r = 0; r < REPLICAS; r++)
        for (size_t b = 0; b < nh; b += BATCH)
            for (int n = 0; n < NODES; n++) {
                const char *batch[BATCH];
                size_t k = 0;
                for (size_t i = b; i < b + BATCH && i < nh; i++)
                    if ((int)((i + (size_t)r * 4) % NODES) == n) batch[k++] = hs[i];
                if (!k) continue;
                char id[32];
                snprintf(id, sizeof(id), "bench-node-%02d", n);
                if (umbp_report_external_kv_blocks(nodes[0], id, batch, k,
                                                   r % 2 ? UMBP_TIER_DRAM : UMBP_TIER_HBM, err,
                                                   sizeof(err))) {
                    fprintf(stderr, "report: %s\n", err);
                    goto out;
                }
            }
    double dt = now_s() - t0;
    printf("| ReportExternalKvBlocks (batches of <= %d per node) | %.0f hashes/s |\n",
           BATCH / NODES, (double)(nh * REPLICAS) / dt);
    if (rport) {
        long long rmem1 = redis_used_memory(rhost, rport);
        printf("| Redis used_memory | %.1f MB before, %.1f MB after: %.1f MB per million entries "
               "|\n",
               (double)rmem0 / 1048576.0, (double)rmem1 / 1048576.0,
               (double)(rmem1 - rmem0) / 1048576.0 / ((double)(nh * REPLICAS) / 1e6));
    }
    if (pid) {
        long rss1 = rss_kb(pid);
        printf("| master RSS | %.1f MB before, %.1f MB after: %.1f MB per million entries |\n",
               rss0 / 1024.0, rss1 / 1024.0,
               (double)(rss1 - rss0) / 1024.0 / ((double)(nh * REPLICAS) / 1e6));
    }
    const char *all = "MatchExternalKv, 256 hashes, all indexed";
    const char *half = "MatchExternalKv, 256 hashes, half indexed";
    run_match(qc, nthreads, hs, nh, 1, calls / 10, all);
    size_t all_bytes = run_match(qc, nthreads, hs, nh, 32, calls, all);
    run_match(qc, nthreads, mixed, 2 * nh, 1, calls / 10, half);
    size_t half_bytes = run_match(qc, nthreads, mixed, 2 * nh, 32, calls, half);
    if (all_bytes && half_bytes && !redis) {
        const unsigned d2[] = {1, 32}, d1[] = {32};
        run_echo((const char *const *)hs, all_bytes, calls, d2, 2, nthreads,
                 "bare gRPC, same sizes as all indexed");
        run_echo((const char *const *)hs, half_bytes, calls, d1, 1, nthreads,
                 "bare gRPC, same sizes as half indexed");
    }
    /* Revoke one replica's worth by explicit hashes, batches of 1024. */
    t0 = now_s();
    size_t revoked = 0;
    for (size_t b = 0; b < nh; b += BATCH) {
        size_t k = b + BATCH <= nh ? BATCH : nh - b;
        for (int n = 0; n < NODES; n += 4) {
            char id[32];
            snprintf(id, sizeof(id), "bench-node-%02d", n);
            if (umbp_revoke_external_kv_blocks(nodes[0], id, (const char *const *)&hs[b], k,
                                               UMBP_TIER_HBM, err, sizeof(err))) {
                fprintf(stderr, "revoke: %s\n", err);
                goto out;
            }
            revoked += k;
        }
    }
    dt = now_s() - t0;
    printf("| RevokeExternalKvBlocks (batches of %d) | %.0f hashes/s processed |\n", BATCH,
           (double)revoked / dt);
    t0 = now_s();
    for (int n = 0; n < NODES; n++) {
        char id[32];
        snprintf(id, sizeof(id), "bench-node-%02d", n);
        if (umbp_revoke_all_external_kv_blocks_at_tier(nodes[0], id, UMBP_TIER_DRAM, err,
                                                       sizeof(err))) {
            fprintf(stderr, "revoke-all: %s\n", err);
            goto out;
        }
    }
    dt = now_s() - t0;
    printf("| RevokeAllExternalKvBlocksAtTier (16 nodes, %zu entries) | %.0f hashes/s |\n",
           nh * REPLICAS / 2, (double)(nh * REPLICAS / 2) / dt);
    rc = 0;
out:
    for (int i = 0; i < NODES; i++) umbp_client_free(nodes[i]);
    for (unsigned t = 0; t < MAX_THREADS; t++) umbp_client_free(qc[t]);
    for (size_t i = 0; hs && i < nh; i++) free(hs[i]);
    free(hs);
    free(mixed);
    free(miss);
    stop_child(pid);
    if (rpid) {
        stop_child(rpid);
        rmdir(rdir); /* --save "": nothing was written into it */
    }
    for (int i = 0; i < CLUSTER_NODES; i++)
        if (cpids[i]) {
            stop_child(cpids[i]);
            char f[160];
            snprintf(f, sizeof(f), "%s/nodes.conf", cdirs[i]);
            unlink(f);
            rmdir(cdirs[i]);
        }
    return rc;
}
