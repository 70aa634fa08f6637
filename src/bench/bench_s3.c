/* `lmcache bench s3`: PUT and GET throughput of the S3 L2 adapter against a running S3 endpoint
 * (all objects of one pass in one task, up to --in-flight requests at a time), every object read
 * back and compared. Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY.
 * scripts/bench-s3.sh runs it against s3rver next to awscli. */
#include "bench/bench.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "server/l2/adapter.h"

static void usage(FILE *f) {
    fprintf(f, "usage: lmcache bench s3 --endpoint URL --bucket NAME [--objects N] [--size-mib M]\n"
               "                        [--in-flight K] [--unsigned-payload] [--region R]\n");
}

int bench_s3_main(int argc, char **argv) {
    static const struct option opts[] = {{"endpoint", required_argument, NULL, 'e'},
                                         {"bucket", required_argument, NULL, 'b'},
                                         {"objects", required_argument, NULL, 'n'},
                                         {"size-mib", required_argument, NULL, 's'},
                                         {"in-flight", required_argument, NULL, 'k'},
                                         {"unsigned-payload", no_argument, NULL, 'u'},
                                         {"region", required_argument, NULL, 'r'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    const char *endpoint = NULL, *bucket = NULL, *region = "us-east-1";
    long n = 64, size_mib = 4, inflight = 16;
    int unsigned_payload = 0, c;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'e':
            endpoint = optarg;
            break;
        case 'b':
            bucket = optarg;
            break;
        case 'n':
            n = strtol(optarg, NULL, 10);
            break;
        case 's':
            size_mib = strtol(optarg, NULL, 10);
            break;
        case 'k':
            inflight = strtol(optarg, NULL, 10);
            break;
        case 'u':
            unsigned_payload = 1;
            break;
        case 'r':
            region = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (!endpoint || !bucket || n < 1 || n > 100000 || size_mib < 1 || size_mib > 1024 ||
        inflight < 1) {
        usage(stderr);
        return 2;
    }
    json_t *cfg =
        json_pack("{s:s, s:s, s:s, s:s, s:s, s:i, s:b}", "type", "s3", "endpoint", endpoint,
                  "bucket", bucket, "region", region, "prefix", "bench/", "max_in_flight",
                  (json_int_t)inflight, "sign_payload", !unsigned_payload);
    if (!cfg) return 1;
    struct l2_adapter *a = NULL;
    char err[512];
    int rc = l2_adapter_create(cfg, &a, err, sizeof(err));
    json_decref(cfg);
    if (rc != L2_OK) {
        fprintf(stderr, "lmcache bench s3: %s\n", err);
        return 1;
    }
    size_t size = (size_t)size_mib << 20;
    struct keys_object_key *keys = calloc((size_t)n, sizeof(*keys));
    struct l2_buf *in = calloc((size_t)n, sizeof(*in)), *out = calloc((size_t)n, sizeof(*out));
    uint8_t *ok = calloc((size_t)n, 1);
    int ret = 1;
    if (!keys || !in || !out || !ok) goto done;
    for (long i = 0; i < n; i++) {
        char hex[65];
        snprintf(hex, sizeof(hex), "%064lx", (unsigned long)i + 1);
        if (keys_object_key_init(&keys[i], hex, 64, "bench-model", 11, 0x01000100u, 0, NULL, 0, err,
                                 sizeof(err)) != 0)
            goto done;
        in[i].data = malloc(size);
        out[i].data = malloc(size);
        if (!in[i].data || !out[i].data) goto done;
        in[i].size = out[i].size = size;
        for (size_t b = 0; b < size; b += 4096) ((uint8_t *)in[i].data)[b] = (uint8_t)(i + b);
    }
    double mb = (double)n * (double)size / 1e6;
    struct l2_task t = {.op = L2_OP_STORE, .n = (size_t)n, .keys = keys, .bufs = in, .ok = ok};
    double t0 = clock_mono();
    rc = l2_adapter_run(a, &t);
    double t1 = clock_mono();
    if (rc != L2_OK || t.nok != (uint32_t)n) {
        fprintf(stderr, "lmcache bench s3: store failed: %s (%u/%ld)\n", l2_strerror(rc), t.nok, n);
        goto done;
    }
    printf("s3 PUT: %ld objects x %ld MiB, %ld in flight, %s payload: %.3f s, %.1f MB/s, %.1f "
           "obj/s\n",
           n, size_mib, inflight, unsigned_payload ? "unsigned" : "signed", t1 - t0, mb / (t1 - t0),
           (double)n / (t1 - t0));
    t = (struct l2_task){.op = L2_OP_LOAD, .n = (size_t)n, .keys = keys, .bufs = out, .ok = ok};
    t0 = clock_mono();
    rc = l2_adapter_run(a, &t);
    t1 = clock_mono();
    if (rc != L2_OK || t.nok != (uint32_t)n) {
        fprintf(stderr, "lmcache bench s3: load failed: %s (%u/%ld)\n", l2_strerror(rc), t.nok, n);
        goto done;
    }
    for (long i = 0; i < n; i++)
        if (memcmp(in[i].data, out[i].data, size) != 0) {
            fprintf(stderr, "lmcache bench s3: object %ld differs\n", i);
            goto done;
        }
    printf("s3 GET: %ld objects x %ld MiB, %ld in flight: %.3f s, %.1f MB/s, %.1f obj/s (bytes "
           "verified)\n",
           n, size_mib, inflight, t1 - t0, mb / (t1 - t0), (double)n / (t1 - t0));
    size_t skipped;
    l2_adapter_delete(a, keys, (size_t)n, NULL, &skipped);
    ret = 0;
done:
    l2_adapter_destroy(a);
    for (long i = 0; in && out && i < n; i++) {
        free(in[i].data);
        free(out[i].data);
    }
    free(keys);
    free(in);
    free(out);
    free(ok);
    return ret;
}
