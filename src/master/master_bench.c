/* `lmcache bench master`: load generator for the master (filled in below). */
#include <stdio.h>

#include "master/master.h"

int master_bench_main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "bench master: not built yet\n");
    return 2;
}
