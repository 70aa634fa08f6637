/* liblmcache-client: the shared-memory KV context of the data plane. The layout arithmetic of
 * a registered KV cache, creating (or opening) its POSIX shared-memory object, registration
 * with its proof of access, and unregistration (docs/protocol.md, docs/client.md). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "client/client_codec.h"
#include "client/client_internal.h"

/* ---- registered KV caches ---------------------------------------------------------------- */

LMC_API uint64_t lmc_kv_block_bytes(const lmc_kv_layout *l) {
    if (!l || l->tokens_per_block == 0 || l->bytes_per_token == 0) return 0;
    if (l->bytes_per_token > UINT64_MAX / l->tokens_per_block) return 0;
    return (uint64_t)l->tokens_per_block * l->bytes_per_token;
}

static uint32_t kv_count(const lmc_kv_layout *l) { return l->kv_count ? l->kv_count : 2; }

LMC_API uint64_t lmc_kv_total_bytes(const lmc_kv_layout *l) {
    uint64_t bb = lmc_kv_block_bytes(l);
    if (bb == 0 || l->num_layers == 0 || l->num_blocks == 0 || kv_count(l) > 2) return 0;
    uint64_t per_block = (uint64_t)l->num_layers * kv_count(l); /* < 2^33 */
    if (l->num_blocks > UINT64_MAX / per_block) return 0;
    uint64_t units = per_block * l->num_blocks;
    if (bb > UINT64_MAX / units) return 0;
    return units * bb;
}

LMC_API uint64_t lmc_kv_offset(const lmc_kv_layout *l, uint32_t layer, uint32_t k, uint32_t block,
                               uint32_t token) {
    uint64_t bb = lmc_kv_block_bytes(l), unit;
    if (l->block_order == LMC_BLOCK_MAJOR)
        unit = ((uint64_t)block * l->num_layers + layer) * kv_count(l) + k;
    else
        unit = ((uint64_t)layer * kv_count(l) + k) * l->num_blocks + block;
    return unit * bb + (uint64_t)token * l->bytes_per_token;
}

struct lmc_kv_context {
    int64_t instance_id;
    lmc_kv_layout layout;
    char dtype[32];
    char shm_name[256];
    void *base;
    uint64_t size;
    bool created; /* this library created the object and unlinks it */
};

static void put_register(struct lmcc_map *m, const lmc_register_args *a, const char *shm_name) {
    lmcc_put_int(m, "instance_id", a->instance_id);
    lmcc_put_str(m, "model_name", a->model_name);
    lmcc_put_int(m, "world_size", a->world_size > 0 ? a->world_size : 1);
    lmcc_put_int(m, "worker_id", a->worker_id > 0 ? a->worker_id : 0);
    lmcc_put_str(m, "shm_name", shm_name);
    lmcc_put_layout(m, &a->layout);
}

/* Writes the nonce of a proof_required reply into the object's proof page: fd when the caller
 * holds the object open, else it is opened by name. */
static lmc_status write_proof(const lmc_reply *r, int fd, const char *shm_name, uint64_t layout,
                              lmc_error *err) {
    const msgpack_object *nonce = lmcc_reply_field(r, "nonce");
    uint64_t off = 0;
    if (!nonce || nonce->type != MSGPACK_OBJECT_BIN || nonce->via.bin.size != 32 ||
        !lmc_reply_get_u64(r, "proof_offset", &off) || off < layout) {
        lmcc_set_error(err, LMC_ERR_PROTOCOL,
                       "proof_required reply without a 32-byte nonce at "
                       "the end of the object");
        return LMC_ERR_PROTOCOL;
    }
    int own = fd < 0;
    if (own) fd = shm_open(shm_name, O_RDWR | O_NOFOLLOW, 0);
    if (fd < 0) {
        lmcc_set_error(err, LMC_ERR_SYSTEM, "shm_open %s: %s", shm_name, strerror(errno));
        return LMC_ERR_SYSTEM;
    }
    ssize_t w = pwrite(fd, nonce->via.bin.ptr, 32, (off_t)off);
    int saved = errno;
    if (own) close(fd);
    if (w != 32) {
        lmcc_set_error(err, LMC_ERR_SYSTEM, "writing the proof of %s: %s", shm_name,
                       w < 0 ? strerror(saved) : "short write");
        return LMC_ERR_SYSTEM;
    }
    return LMC_OK;
}

/* register_kv_cache, and once more after answering a proof-of-access challenge. */
static lmc_status send_register(lmc_client *c, const lmc_register_args *a, const char *shm_name,
                                int fd, lmc_error *err) {
    lmc_status s = LMC_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        struct lmcc_map m;
        lmcc_map_init(&m);
        put_register(&m, a, shm_name);
        lmc_req_id id = 0;
        lmc_reply *r;
        s = lmcc_finish(c, lmcc_send_map(c, "register_kv_cache", &m, &id, err), &id, &r, err);
        if (s == LMC_ERR_PROOF_REQUIRED && attempt == 0) {
            lmc_status w = write_proof(r, fd, shm_name, lmc_kv_total_bytes(&a->layout), err);
            lmc_reply_free(r);
            if (w != LMC_OK) return w;
            continue;
        }
        lmc_reply_free(r);
        break;
    }
    return s;
}

LMC_API lmc_status lmc_register_kv_cache_raw(lmc_client *c, const lmc_register_args *a,
                                             lmc_error *err) {
    lmcc_clear_error(err);
    if (!c || !a || !a->model_name || !a->shm_name)
        return lmcc_bad_arg(err, "model_name and shm_name are required");
    return send_register(c, a, a->shm_name, -1, err);
}

LMC_API lmc_status lmc_register_kv_cache(lmc_client *c, const lmc_register_args *a,
                                         lmc_kv_context **out, lmc_error *err) {
    lmcc_clear_error(err);
    if (!c || !a || !a->model_name || !out)
        return lmcc_bad_arg(err, "model_name and out are required");
    uint64_t size = lmc_kv_total_bytes(&a->layout);
    if (size == 0 || size > (uint64_t)SIZE_MAX - LMC_KV_PROOF_PAGE ||
        (off_t)(size + LMC_KV_PROOF_PAGE) < 0)
        return lmcc_bad_arg(err, "invalid KV layout (zero field, kv_count > 2 or overflow)");
    lmc_kv_context *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        lmcc_set_error(err, LMC_ERR_NO_MEMORY, "out of memory");
        return LMC_ERR_NO_MEMORY;
    }
    ctx->instance_id = a->instance_id;
    ctx->layout = a->layout;
    ctx->layout.kv_count = kv_count(&a->layout);
    if (a->layout.dtype) {
        snprintf(ctx->dtype, sizeof(ctx->dtype), "%s", a->layout.dtype);
        ctx->layout.dtype = ctx->dtype;
    }
    int n = a->shm_name ? snprintf(ctx->shm_name, sizeof(ctx->shm_name), "%s", a->shm_name)
                        : snprintf(ctx->shm_name, sizeof(ctx->shm_name), "/lmcache-kv-%ld-%lld",
                                   (long)getpid(), (long long)a->instance_id);
    if (n < 0 || (size_t)n >= sizeof(ctx->shm_name) || ctx->shm_name[0] != '/') {
        free(ctx);
        return lmcc_bad_arg(err, "shm_name must start with '/' and be shorter than 256 bytes");
    }
    int fd = shm_open(ctx->shm_name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd >= 0) {
        ctx->created = true;
    } else if (errno == EEXIST) {
        fd = shm_open(ctx->shm_name, O_RDWR, 0600);
    }
    struct stat st;
    lmc_status s = LMC_OK;
    if (fd < 0) {
        lmcc_set_error(err, LMC_ERR_SYSTEM, "shm_open %s: %s", ctx->shm_name, strerror(errno));
        s = LMC_ERR_SYSTEM;
    } else if (fstat(fd, &st) != 0) {
        lmcc_set_error(err, LMC_ERR_SYSTEM, "fstat %s: %s", ctx->shm_name, strerror(errno));
        s = LMC_ERR_SYSTEM;
    } else if ((uint64_t)st.st_size < size + LMC_KV_PROOF_PAGE &&
               ftruncate(fd, (off_t)(size + LMC_KV_PROOF_PAGE)) != 0) {
        lmcc_set_error(err, LMC_ERR_SYSTEM, "ftruncate %s to %llu bytes: %s", ctx->shm_name,
                       (unsigned long long)(size + LMC_KV_PROOF_PAGE), strerror(errno));
        s = LMC_ERR_SYSTEM;
    } else if (ctx->created &&
               (errno = posix_fallocate(fd, 0, (off_t)(size + LMC_KV_PROOF_PAGE))) != 0) {
        /* Allocated now: a full /dev/shm fails here, not as a SIGBUS at a first write; and the
         * server faults in only the pages an object holds (docs/protocol.md). */
        lmcc_set_error(err, LMC_ERR_SYSTEM, "posix_fallocate %s, %llu bytes: %s", ctx->shm_name,
                       (unsigned long long)(size + LMC_KV_PROOF_PAGE), strerror(errno));
        s = LMC_ERR_SYSTEM;
    } else {
        void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            lmcc_set_error(err, LMC_ERR_SYSTEM, "mmap %s: %s", ctx->shm_name, strerror(errno));
            s = LMC_ERR_SYSTEM;
        } else {
            ctx->base = p;
            ctx->size = size;
        }
    }
    if (s == LMC_OK) s = send_register(c, a, ctx->shm_name, fd, err);
    if (fd >= 0) close(fd);
    if (s != LMC_OK) {
        if (ctx->base) munmap(ctx->base, (size_t)ctx->size);
        if (ctx->created) shm_unlink(ctx->shm_name);
        free(ctx);
        return s;
    }
    *out = ctx;
    return LMC_OK;
}

LMC_API lmc_status lmc_kv_wait_warm(lmc_client *c, int64_t instance_id, int timeout_ms,
                                    lmc_error *err) {
    lmcc_clear_error(err);
    if (!c || instance_id < 0) return lmcc_bad_arg(err, "a client and an instance_id are required");
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        lmc_req_id id = 0;
        lmc_reply *r;
        lmc_status s = lmcc_finish(c, lmc_send_ping(c, instance_id, &id, err), &id, &r, err);
        bool warming = false, registered = true;
        if (s == LMC_OK) {
            (void)lmc_reply_get_bool(r, "warming", &warming); /* absent: an older server */
            (void)lmc_reply_get_bool(r, "registered", &registered);
        }
        lmc_reply_free(r);
        if (s != LMC_OK) return s;
        if (!registered) {
            lmcc_set_error(err, LMC_ERR_NOT_REGISTERED,
                           "instance_id %lld is not registered on this connection",
                           (long long)instance_id);
            return LMC_ERR_NOT_REGISTERED;
        }
        if (!warming) return LMC_OK;
        clock_gettime(CLOCK_MONOTONIC, &now);
        double ms =
            (double)(now.tv_sec - t0.tv_sec) * 1e3 + (double)(now.tv_nsec - t0.tv_nsec) / 1e6;
        if (timeout_ms >= 0 && ms >= timeout_ms) {
            lmcc_set_error(err, LMC_ERR_TIMEOUT, "the server is still faulting in instance %lld",
                           (long long)instance_id);
            return LMC_ERR_TIMEOUT;
        }
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
}

LMC_API void *lmc_kv_base(const lmc_kv_context *ctx) { return ctx->base; }
LMC_API uint64_t lmc_kv_size(const lmc_kv_context *ctx) { return ctx->size; }
LMC_API const char *lmc_kv_shm_name(const lmc_kv_context *ctx) { return ctx->shm_name; }
LMC_API int64_t lmc_kv_instance_id(const lmc_kv_context *ctx) { return ctx->instance_id; }
LMC_API const lmc_kv_layout *lmc_kv_layout_of(const lmc_kv_context *ctx) { return &ctx->layout; }

LMC_API lmc_status lmc_unregister_instance(lmc_client *c, int64_t instance_id, lmc_error *err) {
    lmcc_clear_error(err);
    struct lmcc_map m;
    lmcc_map_init(&m);
    lmcc_put_int(&m, "instance_id", instance_id);
    lmc_req_id id = 0;
    lmc_reply *r;
    lmc_status s =
        lmcc_finish(c, lmcc_send_map(c, "unregister_kv_cache", &m, &id, err), &id, &r, err);
    lmc_reply_free(r);
    return s;
}

LMC_API lmc_status lmc_unregister_kv_cache(lmc_client *c, lmc_kv_context *ctx, lmc_error *err) {
    lmcc_clear_error(err);
    if (!ctx) return LMC_OK;
    lmc_status s = c ? lmc_unregister_instance(c, ctx->instance_id, err) : LMC_OK;
    if (ctx->base) munmap(ctx->base, (size_t)ctx->size);
    if (ctx->created) shm_unlink(ctx->shm_name);
    free(ctx);
    return s;
}
