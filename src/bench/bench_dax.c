/* `lmcache bench dax`: store and load GB/s of the Device-DAX L2 adapter against memcpy between
 * two DRAM buffers of the same object size, measured in the same run. The arena is a file in
 * --dir (default /dev/shm, memory-backed like a DAX device) or a real --device. Stores run in
 * two passes: into never-touched arena pages (first touch), then again after deleting every key
 * (warm). Loads read every key back repeatedly. Several tasks are kept in flight so every copy
 * worker is busy. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/size.h"
#include "bench/bench.h"
#include "server/l2/adapter.h"
#include "server/l2/dax.h"

#define BATCH    8 /* keys per task */
#define INFLIGHT 4 /* tasks in flight */

struct opts {
    uint64_t arena, object;
    double seconds;
    int workers;
    const char *dir, *device;
};

static struct keys_object_key key_of(unsigned i) {
    struct keys_object_key k;
    memset(&k, 0, sizeof(k));
    memcpy(k.hash, &i, sizeof(i));
    k.hash_len = 32;
    k.kv_rank = 0x01000100;
    snprintf(k.model_name, sizeof(k.model_name), "bench");
    return k;
}

struct slot {
    struct l2_task t;
    struct keys_object_key keys[BATCH];
    struct l2_buf bufs[BATCH];
    uint8_t ok[BATCH];
    int busy;
};

/* Runs op over keys [0, nkeys) in batches, repeating until `seconds` passed when repeat, else
 * once. Returns GB/s of successfully copied bytes; *failed counts failed keys. */
static double run(struct l2_adapter *a, enum l2_op op, unsigned nkeys, uint64_t object,
                  char *const *buffers, int repeat, double seconds, uint64_t *failed) {
    struct slot s[INFLIGHT];
    memset(s, 0, sizeof(s));
    unsigned next = 0;
    uint64_t bytes = 0, t0 = clock_mono_ns();
    int inflight = 0, done = 0;
    *failed = 0;
    while (!done || inflight) {
        for (int i = 0; i < INFLIGHT && !done; i++) {
            if (s[i].busy) continue;
            if (next >= nkeys) {
                if (!repeat || clock_mono_ns() - t0 >= (uint64_t)(seconds * 1e9)) {
                    done = 1;
                    break;
                }
                next = 0;
            }
            size_t n = 0;
            for (; n < BATCH && next < nkeys; n++, next++) {
                s[i].keys[n] = key_of(next);
                s[i].bufs[n].data = buffers[i * BATCH + (int)n];
                s[i].bufs[n].size = object;
            }
            s[i].t = (struct l2_task){
                .op = op, .n = n, .keys = s[i].keys, .bufs = s[i].bufs, .ok = s[i].ok};
            s[i].t.user = &s[i];
            if (l2_adapter_submit(a, &s[i].t) != L2_OK) {
                *failed += n;
                continue;
            }
            s[i].busy = 1;
            inflight++;
        }
        if (!inflight) continue;
        struct pollfd p = {.fd = l2_adapter_event_fd(a), .events = POLLIN};
        poll(&p, 1, 100);
        for (struct l2_task *t = l2_adapter_drain(a), *nx; t; t = nx) {
            nx = t->next;
            ((struct slot *)t->user)->busy = 0;
            inflight--;
            bytes += t->bytes;
            *failed += t->n - t->nok;
        }
    }
    double sec = (double)(clock_mono_ns() - t0) / 1e9;
    return (double)bytes / sec / 1e9;
}

static void usage(void) {
    fprintf(stderr, "usage: lmcache bench dax [--arena SIZE] [--object SIZE] [--seconds S] "
                    "[--workers N] [--dir DIR | --device PATH]\n"
                    "  defaults: --arena 1GiB --object 4MiB --seconds 3 --workers 2 --dir "
                    "/dev/shm\n");
}

int bench_dax_main(int argc, char **argv) {
    struct opts o = {
        .arena = 1ull << 30, .object = 4ull << 20, .seconds = 3, .workers = 2, .dir = "/dev/shm"};
    char err[256];
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--arena") == 0 && v && size_parse(v, &o.arena, err, 256) == 0)
            i++;
        else if (strcmp(argv[i], "--object") == 0 && v && size_parse(v, &o.object, err, 256) == 0)
            i++;
        else if (strcmp(argv[i], "--seconds") == 0 && v && atof(v) > 0)
            o.seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--workers") == 0 && v && atoi(v) >= 1 && atoi(v) <= 16)
            o.workers = atoi(argv[++i]);
        else if (strcmp(argv[i], "--dir") == 0 && v)
            o.dir = argv[++i];
        else if (strcmp(argv[i], "--device") == 0 && v)
            o.device = argv[++i];
        else {
            usage();
            return strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0 ? 0 : 2;
        }
    }
    char path[4096];
    if (o.device)
        snprintf(path, sizeof(path), "%s", o.device);
    else
        snprintf(path, sizeof(path), "%s/lmcache-bench-dax-%d", o.dir, (int)getpid());
    json_t *cfg = json_pack("{s:s, s:I, s:i, s:[{s:s, s:I}]}", "type", "dax", "slot_size",
                            (json_int_t)o.object, "workers", o.workers, "devices", "device_path",
                            path, "size", (json_int_t)o.arena);
    struct l2_adapter *a = NULL;
    int rc = cfg ? l2_adapter_create(cfg, &a, err, sizeof(err)) : L2_ERR_NOMEM;
    json_decref(cfg);
    if (rc != L2_OK) {
        fprintf(stderr, "lmcache bench dax: %s\n", rc == L2_ERR_NOMEM ? "out of memory" : err);
        if (!o.device) unlink(path);
        return 1;
    }
    uint64_t object = (o.object + 4095) / 4096 * 4096;
    json_t *st = a->ops->reconfigure_status(a);
    json_t *dev = json_array_get(json_object_get(st, "devices"), 0);
    unsigned nkeys = (unsigned)json_integer_value(json_object_get(dev, "slot_count"));
    json_decref(st);
    char *buffers[INFLIGHT * BATCH];
    int okbuf = 1;
    for (int i = 0; i < INFLIGHT * BATCH; i++) {
        buffers[i] = aligned_alloc(4096, object);
        if (!buffers[i])
            okbuf = 0;
        else
            memset(buffers[i], i + 1, object);
    }
    int ret = 0;
    if (!okbuf || nkeys == 0) {
        fprintf(stderr, "lmcache bench dax: out of memory\n");
        ret = 1;
    } else {
        printf("L2 dax: arena %s (%.0f MiB), object %llu KiB, %u slots, %d copy workers, "
               "%d tasks x %d keys in flight\n",
               path, (double)o.arena / (1 << 20), (unsigned long long)(object >> 10), nkeys,
               o.workers, INFLIGHT, BATCH);
        double mc = bench_memcpy_gbps(object, o.seconds);
        uint64_t f1, f2, f3;
        double first = run(a, L2_OP_STORE, nkeys, object, buffers, 0, 0, &f1);
        double load = run(a, L2_OP_LOAD, nkeys, object, buffers, 1, o.seconds, &f2);
        struct keys_object_key *all = malloc(sizeof(*all) * nkeys);
        if (all) {
            for (unsigned i = 0; i < nkeys; i++) all[i] = key_of(i);
            l2_adapter_delete(a, all, nkeys, NULL, NULL);
            free(all);
        }
        double warm = run(a, L2_OP_STORE, nkeys, object, buffers, 0, 0, &f3);
        double mc2 = bench_memcpy_gbps(object, o.seconds);
        printf("%-34s %8s\n", "measure", "GB/s");
        printf("%-34s %8.2f\n", "memcpy DRAM->DRAM (before)", mc);
        printf("%-34s %8.2f\n", "dax store, first touch", first);
        printf("%-34s %8.2f\n", "dax store, warm", warm);
        printf("%-34s %8.2f\n", "dax load", load);
        printf("%-34s %8.2f\n", "memcpy DRAM->DRAM (after)", mc2);
        if (f1 || f2 || f3) {
            printf("failed keys: store %llu, load %llu, warm store %llu\n", (unsigned long long)f1,
                   (unsigned long long)f2, (unsigned long long)f3);
            ret = 1;
        }
    }
    for (int i = 0; i < INFLIGHT * BATCH; i++) free(buffers[i]);
    l2_adapter_destroy(a);
    if (!o.device) unlink(path);
    return ret;
}
