/* `lmcache bench`: one row per benchmark. */
#include "bench/bench.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"

static const struct {
    const char *name;
    int (*main)(int argc, char **argv);
    const char *summary;
} BENCHES[] = {
    {"l2", bench_l2_main, "fs L2 adapter store/load GB/s against raw O_DIRECT of the same disk"},
    {"l1", bench_l1_main, "L1 allocator ops/s, 128-chunk lookups on 1 and 2 threads, metadata"},
    {"server", bench_server_main,
     "round trips through a running server: correctness check or store/retrieve GB/s"},
    {"s3", bench_s3_main,
     "S3 L2 adapter PUT/GET MB/s against an S3 endpoint (scripts/bench-s3.sh)"},
    {"dax", bench_dax_main, "L2 dax adapter store and load GB/s against memcpy"},
    {"master", bench_master_main,
     "UMBP master: MatchExternalKv calls/s and p99, report/revoke, RSS"},
    {"fleet", bench_fleet_main,
     "servers reporting to a master: store cost of reporting, ingest, POST /route p50/p99"},
};
#define NBENCH (sizeof(BENCHES) / sizeof(BENCHES[0]))

static void usage(FILE *f) {
    fprintf(f, "usage: lmcache bench <name> [options]\n\nbenchmarks:\n");
    for (size_t i = 0; i < NBENCH; i++)
        fprintf(f, "  %-8s %s\n", BENCHES[i].name, BENCHES[i].summary);
}

int bench_main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < NBENCH; i++)
        if (strcmp(argv[1], BENCHES[i].name) == 0) return BENCHES[i].main(argc - 1, argv + 1);
    fprintf(stderr, "lmcache bench: unknown benchmark '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

double bench_memcpy_gbps(uint64_t object, double seconds) {
    size_t n = 64u << 20;
    if (n < object) n = (size_t)object;
    if (object == 0) object = n;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, n);
    memset(b, 2, n);
    uint64_t t0 = clock_mono_ns(), bytes = 0, off = 0;
    while (clock_mono_ns() - t0 < (uint64_t)(seconds * 1e9)) {
        if (off + object > n) off = 0;
        memcpy(b + off, a + off, object);
        a[off]++; /* a changing source keeps the copies from being folded away */
        off += object;
        bytes += object;
    }
    double s = (double)(clock_mono_ns() - t0) / 1e9;
    volatile char sink = b[n / 2];
    (void)sink;
    free(a);
    free(b);
    return (double)bytes / s / 1e9;
}

int bench_free_port(void) {
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
