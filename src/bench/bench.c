/* `lmcache bench`: one row per benchmark. */
#include "bench/bench.h"

#include <stdio.h>
#include <string.h>

#include "master/master.h"

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
    {"master", master_bench_main,
     "UMBP master: MatchExternalKv calls/s and p99, report/revoke, RSS"},
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
