/* `lmcache master` / `umbp_master`: the UMBP-compatible cluster master. */
#ifndef LMCACHE_MASTER_MASTER_H
#define LMCACHE_MASTER_MASTER_H

/* umbp_master [listen_address] [metrics_port]; exit 0 after SIGINT/SIGTERM. */
int master_main(int argc, char **argv);

#endif
