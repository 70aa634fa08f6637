/* `lmcache bench ...`: load generators and micro-benchmarks. */
#ifndef LMCACHE_BENCH_BENCH_H
#define LMCACHE_BENCH_BENCH_H

/* Dispatches `lmcache bench <name> [options]`. */
int bench_main(int argc, char **argv);
/* `lmcache bench l1`: allocator, key-table lookup and metadata figures of L1. */
int bench_l1_main(int argc, char **argv);
/* `lmcache bench l2`: fs adapter GB/s against raw O_DIRECT throughput of the same filesystem. */
int bench_l2_main(int argc, char **argv);
/* `lmcache bench server`: round trips through a running server's data socket (correctness and
 * throughput modes). */
int bench_server_main(int argc, char **argv);
/* `lmcache bench s3`: PUT/GET throughput of the S3 L2 adapter. */
int bench_s3_main(int argc, char **argv);
/* `lmcache bench master` (also `lmcache master bench`): MatchExternalKv / report / revoke load
 * against a spawned or external master (docs/benchmarks.md). */
int bench_master_main(int argc, char **argv);
/* `lmcache bench fleet`: store throughput with and without reporting to a master, the master's
 * ingest of four servers' full reports, and POST /route latency (docs/benchmarks.md, "Fleet"). */
int bench_fleet_main(int argc, char **argv);
/* `lmcache bench dax`: store and load GB/s of the Device-DAX L2 adapter against memcpy. */
int bench_dax_main(int argc, char **argv);

#include <stdint.h>

/* Single-thread memcpy GB/s over `seconds`: the reference every benchmark prints beside its own
 * figures. object = bytes per copy (0: whole 64 MiB buffers). */
double bench_memcpy_gbps(uint64_t object, double seconds);

/* A TCP port on 127.0.0.1 that was free a moment ago (for the processes a benchmark starts),
 * or -1. */
int bench_free_port(void);

#endif
