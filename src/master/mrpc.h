/* The master's RPC handlers: one table row per UMBPMaster method (decode the request with
 * protobuf-c, run it against the store, encode the reply). Transport-free, so the gRPC
 * server, unit tests and the fuzz driver all call mrpc_dispatch. */
#ifndef LMCACHE_MASTER_MRPC_H
#define LMCACHE_MASTER_MRPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "master/mconfig.h"

struct mstore;
struct metrics;
struct mrelay;
struct logger;
struct mmet; /* native metric handles (mrpc.c) */

struct master {
    struct mcfg cfg;
    struct mstore *store;
    struct metrics *metrics; /* NULL when the metrics endpoint is disabled */
    struct mrelay *relay;    /* NULL when the metrics endpoint is disabled */
    struct mmet *met;
    struct logger *lg;
    int64_t (*now_ms)(void); /* wall clock; tests substitute their own */
    uint64_t (*rand64)(void);
};

/* gRPC status codes used here (numerically the grpc_status_code values). */
enum {
    MRPC_OK = 0,
    MRPC_INVALID_ARGUMENT = 3,
    MRPC_ALREADY_EXISTS = 6,
    MRPC_RESOURCE_EXHAUSTED = 8,
    MRPC_INTERNAL = 13,
    MRPC_UNAVAILABLE = 14,
};

struct mrpc_reply {
    int status;
    char msg[256];
    uint8_t *buf; /* malloc'd packed response (OK only) */
    size_t len;
};

struct mrpc_method {
    const char *name; /* "MatchExternalKv" */
    const char *path; /* "/umbp.UMBPMaster/MatchExternalKv" */
};

extern const struct mrpc_method MRPC_METHODS[];
extern const size_t MRPC_NMETHODS;

/* Index of a method path, or -1. */
int mrpc_find(const char *path, size_t len);

/* Decodes data as the method's request and runs it. Always fills r (free r->buf). */
void mrpc_dispatch(struct master *m, size_t method, const uint8_t *data, size_t len,
                   struct mrpc_reply *r);

/* Sets up m->met (native metric families) when m->metrics is set. 0 or -1. */
int mrpc_metrics_init(struct master *m);
void mrpc_metrics_free(struct master *m);

/* Background ticks, called by the periodic threads (and by tests with their own now). */
size_t mrpc_reap(struct master *m, int64_t now_ms);
size_t mrpc_hit_gc(struct master *m, int64_t now_ms);

#endif
