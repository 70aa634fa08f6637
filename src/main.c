/* lmcache: subcommand dispatch only. */
#include <stdio.h>
#include <string.h>

#include "base/version.h"
#include "server/dataplane/curve.h"
#include "server/server.h"
#ifdef LMCACHE_HAVE_MASTER
#include "master/master.h"
#endif
#ifdef LMCACHE_HAVE_BENCH
#include "bench/bench.h"
#endif

static int version_main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    printf("lmcache %s (commit %s)\n", version_lmc(), *version_commit() ? version_commit() : "NA");
    return 0;
}

static const struct subcommand {
    const char *name;
    int (*main)(int argc, char **argv);
    const char *summary;
} SUBCOMMANDS[] = {
    {"server", server_main, "run the KV cache daemon (ZMQ data socket + HTTP admin API)"},
#ifdef LMCACHE_HAVE_MASTER
    {"master", master_main, "run the UMBP-compatible cluster master (gRPC)"},
#endif
#ifdef LMCACHE_HAVE_BENCH
    {"bench", bench_main, "run a benchmark (lmcache bench --help lists them)"},
#endif
    {"curve-keygen", curve_keygen_main, "write a CURVE key pair for the data socket"},
    {"version", version_main, "print the version and the commit id"},
};
#define NSUB (sizeof(SUBCOMMANDS) / sizeof(SUBCOMMANDS[0]))

static void usage(FILE *f) {
    fprintf(f, "usage: lmcache <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < NSUB; i++)
        fprintf(f, "  %-10s %s\n", SUBCOMMANDS[i].name, SUBCOMMANDS[i].summary);
    fprintf(f, "\nRun 'lmcache <command> --help' for the options of a command.\n");
}

int main(int argc, char **argv) {
    const char *self = strrchr(argv[0], '/');
    self = self ? self + 1 : argv[0];
#ifdef LMCACHE_HAVE_MASTER
    /* Installed as a symlink, it behaves exactly like the UMBP master binary. */
    if (strcmp(self, "umbp_master") == 0) return master_main(argc, argv);
#endif
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(argv[1], "--version") == 0) return version_main(argc - 1, argv + 1);
#if defined LMCACHE_HAVE_MASTER && defined LMCACHE_HAVE_BENCH
    /* `lmcache master bench` is `lmcache bench master`: the benchmark lives with the others. */
    if (strcmp(argv[1], "master") == 0 && argc > 2 && strcmp(argv[2], "bench") == 0)
        return bench_master_main(argc - 2, argv + 2);
#endif
    for (size_t i = 0; i < NSUB; i++)
        if (strcmp(argv[1], SUBCOMMANDS[i].name) == 0)
            return SUBCOMMANDS[i].main(argc - 1, argv + 1);
    fprintf(stderr, "lmcache: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
