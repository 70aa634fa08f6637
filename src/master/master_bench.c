/* `lmcache bench master` (also `lmcache master bench`): starts a master on a free loopback
 * port (or uses --master), indexes N (hash, node, tier) entries over 16 nodes through the C
 * client, then measures MatchExternalKv of 256-hash queries at concurrency 1 and 32,
 * report and revoke throughput, and the master's resident memory per million entries. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "lmcache/umbp_client.h"
#include "master/master.h"

#define NODES    16
#define REPLICAS 4
#define BATCH    1024

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof(sa);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) ||
        getsockname(fd, (struct sockaddr *)&sa, &len)) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(sa.sin_port);
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

static void run_match(struct umbp_client *c, char **universe, size_t nh, unsigned depth,
                      size_t calls) {
    const char ***q = calloc(calls, sizeof(*q));
    size_t *ql = calloc(calls, sizeof(*ql));
    uint64_t *lat = calloc(calls, sizeof(*lat));
    uint64_t seed = 88172645463325252ull;
    for (size_t i = 0; q && ql && lat && i < calls; i++) {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        q[i] = (const char **)&universe[seed % (nh - 256)]; /* a 256-hash prefix window */
        ql[i] = 256;
    }
    char err[256] = "";
    uint64_t matched = 0;
    double t0 = now_s();
    int rc = q && ql && lat
                 ? umbp_match_external_kv_pipelined(c, (const char *const *const *)q, ql, calls,
                                                    false, depth, lat, &matched, err, sizeof(err))
                 : -1;
    double dt = now_s() - t0;
    if (rc) {
        fprintf(stderr, "match: %s\n", err);
    } else {
        qsort(lat, calls, sizeof(*lat), cmp_u64);
        printf("| MatchExternalKv, 256 hashes, concurrency %u | %.0f calls/s | p50 %.3f ms | "
               "p99 %.3f ms | %.1f node matches/call |\n",
               depth, (double)calls / dt, (double)lat[calls / 2] / 1e6,
               (double)lat[calls * 99 / 100] / 1e6, (double)matched / (double)calls);
    }
    free(q);
    free(ql);
    free(lat);
}

int master_bench_main(int argc, char **argv) {
    size_t entries = 1000000, calls = 20000;
    const char *ext = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--entries") == 0 && i + 1 < argc)
            entries = strtoull(argv[++i], 0, 10);
        else if (strcmp(argv[i], "--calls") == 0 && i + 1 < argc)
            calls = strtoull(argv[++i], 0, 10);
        else if (strcmp(argv[i], "--master") == 0 && i + 1 < argc)
            ext = argv[++i];
        else {
            fprintf(stderr, "usage: lmcache bench master [--entries N] [--calls N] "
                            "[--master host:port]\n");
            return 2;
        }
    }
    char addr[64];
    pid_t pid = 0;
    if (ext) {
        snprintf(addr, sizeof(addr), "%s", ext);
    } else {
        int port = free_port();
        if (port < 0) return 1;
        snprintf(addr, sizeof(addr), "127.0.0.1:%d", port);
        pid = fork();
        if (pid == 0) {
            char *args[] = {"lmcache", "master", addr, "0", NULL};
            execv("/proc/self/exe", args);
            _exit(127);
        }
        if (pid < 0) return 1;
        /* Wait until it listens, so the clients' first connection attempt succeeds. */
        for (int tries = 0; tries < 400; tries++) {
            int fd = socket(AF_INET, SOCK_STREAM, 0);
            struct sockaddr_in sa = {.sin_family = AF_INET,
                                     .sin_port = htons((uint16_t)port),
                                     .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
            int ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
            if (fd >= 0) close(fd);
            if (ok) break;
            usleep(25000);
        }
    }
    struct umbp_client *nodes[NODES];
    char err[256] = "";
    int rc = 1;
    size_t nh = entries / REPLICAS;
    char **hs = calloc(nh, sizeof(char *));
    memset(nodes, 0, sizeof(nodes));
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
    for (size_t i = 0; hs && i < nh; i++) {
        hs[i] = malloc(65);
        if (!hs[i]) goto out;
        uint64_t x = i * 0x9e3779b97f4a7c15ull;
        snprintf(hs[i], 65, "%016llx%016llx%016llx%016llx", (unsigned long long)x,
                 (unsigned long long)(x ^ 0xdeadbeef), (unsigned long long)~x,
                 (unsigned long long)(i));
    }
    long rss0 = pid ? rss_kb(pid) : -1;
    printf("| setup | %zu entries = %zu hashes x %d replicas over %d nodes, 64-char hashes |\n",
           nh * REPLICAS, nh, REPLICAS, NODES);
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
    if (pid) {
        long rss1 = rss_kb(pid);
        printf("| master RSS | %.1f MB before, %.1f MB after: %.1f MB per million entries |\n",
               rss0 / 1024.0, rss1 / 1024.0,
               (double)(rss1 - rss0) / 1024.0 / ((double)(nh * REPLICAS) / 1e6));
    }
    run_match(nodes[0], hs, nh, 1, calls / 10);
    run_match(nodes[0], hs, nh, 32, calls);
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
    for (size_t i = 0; hs && i < nh; i++) free(hs[i]);
    free(hs);
    if (pid > 0) {
        kill(pid, SIGTERM);
        int st;
        while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
        }
    }
    return rc;
}
