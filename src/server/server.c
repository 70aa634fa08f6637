/* `lmcache server`: parses options, starts the admin API and the engine, waits for a signal. */
#include "server/server.h"

#include <stdio.h>

int server_main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "lmcache server: not built yet\n");
    return 2;
}
