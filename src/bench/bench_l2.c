/* `lmcache bench l2`: the fs L2 adapter's store and load throughput (GB/s) against the raw
 * sequential O_DIRECT throughput of the same filesystem, measured in the same run.
 *
 *   lmcache bench l2 [--dir PATH] [--total-mb N] [--obj-mb N] [--threads] [--buffered]
 *
 * Raw: one file written then read sequentially with O_DIRECT in obj-sized requests, queue depth
 * 1 (what `dd oflag=direct bs=<obj>` does), the reference of the 80 % target; then the same with
 * RAW_QD requests in flight through io_uring, the device's parallel ceiling. Adapter: total/obj
 * objects stored in one task and loaded in one task (o_direct unless --buffered; io_uring unless
 * --threads), each object with its temporary file, rename and CRC32C. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <liburing.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/clock.h"
#include "bench/bench.h"
#include "server/l2/adapter.h"
#include "server/l2/fs.h"

#define MiB (1ull << 20)

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* Raw sequential O_DIRECT write then read of total bytes in obj-sized requests. */
static int raw_gbps(const char *dir, uint64_t total, uint64_t obj, double *w, double *r) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/raw.bin", dir);
    void *buf;
    if (posix_memalign(&buf, 4096, obj) != 0) return -1;
    memset(buf, 0x5a, obj);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (fd < 0) {
        fprintf(stderr, "open %s: %s\n", path, strerror(errno));
        free(buf);
        return -1;
    }
    uint64_t t0 = clock_mono_ns();
    for (uint64_t off = 0; off < total; off += obj)
        if (pwrite(fd, buf, obj, (off_t)off) != (ssize_t)obj) {
            fprintf(stderr, "raw write: %s\n", strerror(errno));
            close(fd);
            free(buf);
            return -1;
        }
    *w = (double)total / (double)(clock_mono_ns() - t0);
    close(fd);
    fd = open(path, O_RDONLY | O_DIRECT);
    t0 = clock_mono_ns();
    for (uint64_t off = 0; fd >= 0 && off < total; off += obj)
        if (pread(fd, buf, obj, (off_t)off) != (ssize_t)obj) break;
    *r = (double)total / (double)(clock_mono_ns() - t0);
    if (fd >= 0) close(fd);
    unlink(path);
    free(buf);
    return 0;
}

#define RAW_QD 8

/* One pass over total bytes of path in obj-sized O_DIRECT requests, RAW_QD in flight. */
static int qd_pass(struct io_uring *ring, int fd, uint8_t **bufs, uint64_t total, uint64_t obj,
                   bool write, double *gbps) {
    uint64_t next = 0, done = 0, t0 = clock_mono_ns();
    unsigned inflight = 0;
    while (done < total) {
        while (inflight < RAW_QD && next < total) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(ring);
            uint8_t *b = bufs[(next / obj) % RAW_QD];
            if (write)
                io_uring_prep_write(sqe, fd, b, (unsigned)obj, next);
            else
                io_uring_prep_read(sqe, fd, b, (unsigned)obj, next);
            next += obj;
            inflight++;
        }
        struct io_uring_cqe *cqe;
        int rc = io_uring_submit_and_wait(ring, 1);
        if (rc < 0 && rc != -EINTR) return -1;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(ring, head, cqe) {
            seen++;
            if (cqe->res != (int)obj) {
                fprintf(stderr, "raw qd %s: %s\n", write ? "write" : "read",
                        cqe->res < 0 ? strerror(-cqe->res) : "short transfer");
                return -1;
            }
            done += obj;
            inflight--;
        }
        io_uring_cq_advance(ring, seen);
    }
    *gbps = (double)total / (double)(clock_mono_ns() - t0);
    return 0;
}

/* Raw sequential O_DIRECT write then read with RAW_QD requests in flight (io_uring). */
static int raw_qd_gbps(const char *dir, uint64_t total, uint64_t obj, double *w, double *r) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/raw-qd.bin", dir);
    uint8_t *bufs[RAW_QD] = {0};
    struct io_uring ring;
    if (io_uring_queue_init(2 * RAW_QD, &ring, 0) != 0) return -1;
    int rc = -1, fd = -1;
    for (int i = 0; i < RAW_QD; i++) {
        if (posix_memalign((void **)&bufs[i], 4096, obj) != 0) goto out;
        memset(bufs[i], 0x5a, obj);
    }
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0644);
    if (fd < 0) goto out;
    if (qd_pass(&ring, fd, bufs, total, obj, true, w) != 0) goto out;
    if (qd_pass(&ring, fd, bufs, total, obj, false, r) != 0) goto out;
    rc = 0;
out:
    if (fd >= 0) close(fd);
    unlink(path);
    for (int i = 0; i < RAW_QD; i++) free(bufs[i]);
    io_uring_queue_exit(&ring);
    return rc;
}

static int adapter_gbps(const char *dir, uint64_t total, uint64_t obj, bool uring, bool direct,
                        double *w, double *r, const char **engine) {
    char js[4200];
    snprintf(js, sizeof(js),
             "{\"type\":\"fs\",\"base_path\":\"%s/fs\",\"o_direct\":%s,\"io_uring\":%s}", dir,
             direct ? "true" : "false", uring ? "true" : "false");
    json_t *cfg = json_loads(js, 0, NULL);
    struct l2_adapter *a = NULL;
    char err[256];
    if (!cfg || l2_adapter_create(cfg, &a, err, sizeof(err)) != L2_OK) {
        fprintf(stderr, "fs adapter: %s\n", err);
        json_decref(cfg);
        return -1;
    }
    json_decref(cfg);
    *engine = fs_adapter_uses_io_uring(a) ? "io_uring" : "threads";
    size_t n = (size_t)(total / obj);
    struct keys_object_key *keys = calloc(n, sizeof(*keys));
    struct l2_buf *bufs = calloc(n, sizeof(*bufs));
    uint8_t *ok = calloc(n, 1);
    uint64_t *sizes = calloc(n, sizeof(*sizes));
    uint8_t *mem = NULL;
    int rc = -1;
    if (!keys || !bufs || !ok || !sizes || posix_memalign((void **)&mem, 4096, n * obj) != 0)
        goto out;
    for (size_t i = 0; i < n; i++) {
        char hex[65];
        snprintf(hex, sizeof(hex), "%064zx", i + 1);
        if (keys_object_key_init(&keys[i], hex, 64, "bench/model", 11, 0x01000100u, 0, "", 0, err,
                                 sizeof(err)) != 0)
            goto out;
        bufs[i] = (struct l2_buf){mem + i * obj, obj};
        memset(bufs[i].data, (int)i, obj);
    }
    struct l2_task st = {.op = L2_OP_STORE, .n = n, .keys = keys, .bufs = bufs, .ok = ok};
    uint64_t t0 = clock_mono_ns();
    if (l2_adapter_run(a, &st) != L2_OK || st.nok != n) {
        fprintf(stderr, "store failed: %s (%u/%zu)\n", l2_strerror(st.status), st.nok, n);
        goto out;
    }
    *w = (double)total / (double)(clock_mono_ns() - t0);
    if (!direct) {
        /* buffered: make the load read the device, not the page cache */
        sync();
        int dc = open("/proc/sys/vm/drop_caches", O_WRONLY);
        if (dc >= 0) {
            if (write(dc, "1", 1) != 1) fprintf(stderr, "drop_caches failed\n");
            close(dc);
        }
    }
    memset(mem, 0, n * obj);
    struct l2_task lk = {.op = L2_OP_LOOKUP, .n = n, .keys = keys, .ok = ok, .sizes = sizes};
    t0 = clock_mono_ns();
    if (l2_adapter_run(a, &lk) != L2_OK || lk.nok != n) goto out;
    struct l2_task ld = {.op = L2_OP_LOAD, .n = n, .keys = keys, .bufs = bufs, .ok = ok};
    if (l2_adapter_run(a, &ld) != L2_OK || ld.nok != n) {
        fprintf(stderr, "load failed: %s (%u/%zu)\n", l2_strerror(ld.status), ld.nok, n);
        goto out;
    }
    *r = (double)total / (double)(clock_mono_ns() - t0);
    l2_adapter_unlock(a, keys, n);
    for (size_t i = 0; i < n; i++)
        if (((uint8_t *)bufs[i].data)[obj - 1] != (uint8_t)i) {
            fprintf(stderr, "load returned wrong bytes\n");
            goto out;
        }
    rc = 0;
out:
    l2_adapter_destroy(a);
    free(keys);
    free(bufs);
    free(ok);
    free(sizes);
    free(mem);
    char p[4200];
    snprintf(p, sizeof(p), "%s/fs", dir);
    nftw(p, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return rc;
}

int bench_l2_main(int argc, char **argv) {
    const char *dir = "/var/tmp/lmcache-bench-l2";
    uint64_t total = 1024 * MiB, obj = 4 * MiB;
    bool uring = true, direct = true;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--total-mb") && i + 1 < argc)
            total = strtoull(argv[++i], NULL, 10) * MiB;
        else if (!strcmp(argv[i], "--obj-mb") && i + 1 < argc)
            obj = strtoull(argv[++i], NULL, 10) * MiB;
        else if (!strcmp(argv[i], "--threads"))
            uring = false;
        else if (!strcmp(argv[i], "--buffered"))
            direct = false;
        else {
            fprintf(stderr, "usage: lmcache bench l2 [--dir PATH] [--total-mb N] [--obj-mb N] "
                            "[--threads] [--buffered]\n");
            return 2;
        }
    }
    if (!obj || total < obj) {
        fprintf(stderr, "--total-mb must be at least --obj-mb\n");
        return 2;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "mkdir %s: %s\n", dir, strerror(errno));
        return 1;
    }
    double rw = 0, rr = 0, qw = 0, qr = 0, aw = 0, ar = 0;
    const char *engine = "?";
    if (raw_gbps(dir, total, obj, &rw, &rr) != 0) return 1;
    bool have_qd = raw_qd_gbps(dir, total, obj, &qw, &qr) == 0;
    if (adapter_gbps(dir, total, obj, uring, direct, &aw, &ar, &engine) != 0) return 1;
    printf("l2 fs bench: dir=%s total=%llu MiB object=%llu MiB engine=%s o_direct=%s\n", dir,
           (unsigned long long)(total / MiB), (unsigned long long)(obj / MiB), engine,
           direct ? "yes" : "no");
    printf("  raw O_DIRECT sequential   write %.2f GB/s   read %.2f GB/s\n", rw, rr);
    if (have_qd)
        printf("  raw O_DIRECT queue depth %d write %.2f GB/s   read %.2f GB/s\n", RAW_QD, qw, qr);
    else
        printf("  raw O_DIRECT queue depth %d unavailable (io_uring)\n", RAW_QD);
    printf("  fs adapter                write %.2f GB/s   read %.2f GB/s\n", aw, ar);
    printf("  adapter / raw             write %.0f %%       read %.0f %%\n", 100 * aw / rw,
           100 * ar / rr);
    return 0;
}
