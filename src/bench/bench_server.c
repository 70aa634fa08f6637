/* `lmcache bench server`: placeholder until the round-trip benchmark lands. */
#include <stdio.h>

#include "bench/bench.h"

int bench_server_main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "lmcache bench server: not built yet\n");
    return 2;
}
