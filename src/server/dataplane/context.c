/* Registered KV contexts and the block <-> object copies. A copy is one memcpy per
 * (layer, K/V, block): a block's tokens are contiguous on both sides. */
#include "server/dataplane/context.h"

#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

void kvreg_init(struct kv_registry *r) {
    pthread_mutex_init(&r->lock, NULL);
    r->head = NULL;
    r->count = 0;
}

static void ctx_free(struct kv_context *c) {
    if (c->base) munmap(c->base, c->map_size);
    free(c);
}

void kvreg_put(struct kv_context *c) {
    if (c && atomic_fetch_sub(&c->refs, 1) == 1) ctx_free(c);
}

void kvreg_destroy(struct kv_registry *r) {
    pthread_mutex_lock(&r->lock);
    struct kv_context *c = r->head;
    r->head = NULL;
    r->count = 0;
    pthread_mutex_unlock(&r->lock);
    while (c) {
        struct kv_context *n = c->next;
        kvreg_put(c);
        c = n;
    }
    pthread_mutex_destroy(&r->lock);
}

uint64_t kv_layout_bytes(const struct kv_layout *l) {
    return (uint64_t)l->num_layers * l->kv_count * l->num_blocks * l->tokens_per_block *
           l->bytes_per_token;
}

uint64_t kv_object_bytes(const struct kv_layout *l, uint32_t chunk_size) {
    return (uint64_t)l->kv_count * l->num_layers * chunk_size * l->bytes_per_token;
}

int kv_layout_check(const struct kv_layout *l, uint32_t chunk_size, char *err, size_t errlen) {
    if (l->kv_count != 1 && l->kv_count != 2) {
        snprintf(err, errlen, "kv_count must be 1 or 2");
        return -1;
    }
    if (!l->num_layers || !l->num_blocks || !l->tokens_per_block || !l->bytes_per_token) {
        snprintf(err, errlen, "layout sizes must be positive");
        return -1;
    }
    if (chunk_size % l->tokens_per_block) {
        snprintf(err, errlen, "chunk_size %u is not a multiple of tokens_per_block %u", chunk_size,
                 l->tokens_per_block);
        return -1;
    }
    /* Every product below must fit 64 bits with room to spare (< 2^60 bytes). */
    double total = (double)l->num_layers * l->kv_count * l->num_blocks * l->tokens_per_block *
                   (double)l->bytes_per_token;
    double obj = (double)l->kv_count * l->num_layers * chunk_size * (double)l->bytes_per_token;
    if (total > 1e18 || obj > 1e15) {
        snprintf(err, errlen, "layout is too large");
        return -1;
    }
    return 0;
}

static int same_layout(const struct kv_layout *a, const struct kv_layout *b) {
    return a->num_layers == b->num_layers && a->num_blocks == b->num_blocks &&
           a->tokens_per_block == b->tokens_per_block && a->bytes_per_token == b->bytes_per_token &&
           a->kv_count == b->kv_count && a->order == b->order;
}

int kvreg_register(struct kv_registry *r, const struct kv_context *tmpl, uint64_t now_ns, char *err,
                   size_t errlen) {
    /* Idempotent re-registration: the same shared-memory object (not only the same name: an
     * engine that restarted may have recreated it) and layout only refreshes liveness. */
    uint64_t dev = 0, ino = 0;
    int probe = shm_open(tmpl->shm_name, O_RDONLY, 0);
    if (probe >= 0) {
        struct stat pst;
        if (fstat(probe, &pst) == 0) {
            dev = (uint64_t)pst.st_dev;
            ino = (uint64_t)pst.st_ino;
        }
        close(probe);
    }
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        if (c->instance_id == tmpl->instance_id && !strcmp(c->shm_name, tmpl->shm_name) &&
            c->shm_dev == dev && c->shm_ino == ino && ino != 0 &&
            !strcmp(c->model_name, tmpl->model_name) && c->worker_id == tmpl->worker_id &&
            c->world_size == tmpl->world_size && same_layout(&c->layout, &tmpl->layout)) {
            atomic_store(&c->last_seen_ns, now_ns);
            pthread_mutex_unlock(&r->lock);
            return 0;
        }
    }
    pthread_mutex_unlock(&r->lock);

    struct kv_context *c = calloc(1, sizeof(*c));
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    *c = *tmpl;
    c->base = NULL;
    c->next = NULL;
    c->map_size = kv_layout_bytes(&c->layout);
    int fd = shm_open(c->shm_name, O_RDWR, 0);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open shared memory '%s': %s", c->shm_name, strerror(errno));
        free(c);
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || (uint64_t)st.st_size < c->map_size) {
        snprintf(err, errlen, "shared memory '%s' holds %lld bytes, the layout needs %llu",
                 c->shm_name, (long long)st.st_size, (unsigned long long)c->map_size);
        close(fd);
        free(c);
        return -1;
    }
    /* Populated now, so the first store does not pay the page faults of the mapping. */
    c->shm_dev = (uint64_t)st.st_dev;
    c->shm_ino = (uint64_t)st.st_ino;
    void *p = mmap(NULL, c->map_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        snprintf(err, errlen, "cannot map shared memory '%s': %s", c->shm_name, strerror(errno));
        free(c);
        return -1;
    }
    c->base = p;
    atomic_store(&c->refs, 1);
    atomic_store(&c->last_seen_ns, now_ns);

    struct kv_context *old = NULL;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context **pp = &r->head; *pp; pp = &(*pp)->next) {
        if ((*pp)->instance_id == c->instance_id) {
            old = *pp;
            *pp = old->next;
            r->count--;
            break;
        }
    }
    c->next = r->head;
    r->head = c;
    r->count++;
    pthread_mutex_unlock(&r->lock);
    kvreg_put(old);
    return 0;
}

int kvreg_unregister(struct kv_registry *r, int64_t instance_id) {
    struct kv_context *found = NULL;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context **pp = &r->head; *pp; pp = &(*pp)->next) {
        if ((*pp)->instance_id == instance_id) {
            found = *pp;
            *pp = found->next;
            r->count--;
            break;
        }
    }
    pthread_mutex_unlock(&r->lock);
    kvreg_put(found);
    return found ? 0 : -1;
}

struct kv_context *kvreg_get(struct kv_registry *r, int64_t instance_id, uint64_t now_ns) {
    struct kv_context *found = NULL;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        if (c->instance_id == instance_id) {
            atomic_fetch_add(&c->refs, 1);
            atomic_store(&c->last_seen_ns, now_ns);
            found = c;
            break;
        }
    }
    pthread_mutex_unlock(&r->lock);
    return found;
}

int kvreg_ping(struct kv_registry *r, int64_t instance_id, uint64_t now_ns) {
    int rc = -1;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        if (c->instance_id == instance_id) {
            atomic_store(&c->last_seen_ns, now_ns);
            c->pinged = 1;
            rc = 0;
        }
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

size_t kvreg_reap(struct kv_registry *r, uint64_t now_ns, uint64_t timeout_ns, uint64_t grace_ns) {
    struct kv_context *dead = NULL;
    size_t n = 0;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context **pp = &r->head; *pp;) {
        struct kv_context *c = *pp;
        uint64_t seen = atomic_load(&c->last_seen_ns);
        uint64_t limit = c->pinged ? timeout_ns : grace_ns;
        if (now_ns > seen && now_ns - seen > limit) {
            *pp = c->next;
            c->next = dead;
            dead = c;
            r->count--;
            n++;
        } else {
            pp = &c->next;
        }
    }
    pthread_mutex_unlock(&r->lock);
    while (dead) {
        struct kv_context *next = dead->next;
        kvreg_put(dead);
        dead = next;
    }
    return n;
}

json_t *kvreg_ids(struct kv_registry *r) {
    json_t *a = json_array();
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next)
        json_array_append_new(a, json_integer(c->instance_id));
    pthread_mutex_unlock(&r->lock);
    return a;
}

json_t *kvreg_meta(struct kv_registry *r) {
    json_t *o = json_object();
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        const struct kv_layout *l = &c->layout;
        char id[32];
        snprintf(id, sizeof(id), "%lld", (long long)c->instance_id);
        json_t *layout =
            json_pack("{s:i, s:i, s:I, s:i, s:I, s:i, s:s, s:s, s:b}", "num_layers",
                      (int)l->num_layers, "num_blocks", (int)l->num_blocks, "cache_size_per_token",
                      (json_int_t)(l->bytes_per_token * l->kv_count * l->num_layers),
                      "tokens_per_block", (int)l->tokens_per_block, "bytes_per_token",
                      (json_int_t)l->bytes_per_token, "kv_count", (int)l->kv_count, "block_order",
                      l->order == KV_LAYER_MAJOR ? "layer_major" : "block_major", "dtype", l->dtype,
                      "is_mla", l->kv_count == 1);
        json_object_set_new(o, id,
                            json_pack("{s:s, s:i, s:i, s:s, s:o}", "model_name", c->model_name,
                                      "world_size", (int)c->world_size, "worker_id",
                                      (int)c->worker_id, "shm_name", c->shm_name, "kv_cache_layout",
                                      layout));
    }
    pthread_mutex_unlock(&r->lock);
    return o;
}

int kvreg_find_layout(struct kv_registry *r, const char *model, uint32_t world_size,
                      struct kv_layout *out) {
    int rc = -1;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        if (c->world_size == world_size && !strcmp(c->model_name, model)) {
            *out = c->layout;
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&r->lock);
    return rc;
}

unsigned char *kv_block_ptr(const struct kv_context *c, uint32_t layer, uint32_t kv,
                            uint32_t block) {
    const struct kv_layout *l = &c->layout;
    uint64_t block_bytes = (uint64_t)l->tokens_per_block * l->bytes_per_token;
    uint64_t idx = l->order == KV_LAYER_MAJOR
                       ? ((uint64_t)layer * l->kv_count + kv) * l->num_blocks + block
                       : ((uint64_t)block * l->num_layers + layer) * l->kv_count + kv;
    return c->base + idx * block_bytes;
}

void kv_gather(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
               unsigned char *obj) {
    const struct kv_layout *l = &c->layout;
    uint32_t nb = chunk_size / l->tokens_per_block;
    uint64_t block_bytes = (uint64_t)l->tokens_per_block * l->bytes_per_token;
    for (uint32_t k = 0; k < l->kv_count; k++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            unsigned char *dst =
                obj + ((uint64_t)k * l->num_layers + layer) * chunk_size * l->bytes_per_token;
            for (uint32_t b = 0; b < nb; b++)
                memcpy(dst + b * block_bytes, kv_block_ptr(c, layer, k, block_ids[b]), block_bytes);
        }
}

void kv_scatter(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                const unsigned char *obj, uint32_t skip_tokens) {
    const struct kv_layout *l = &c->layout;
    uint32_t tpb = l->tokens_per_block, nb = chunk_size / tpb;
    uint64_t bpt = l->bytes_per_token;
    for (uint32_t k = 0; k < l->kv_count; k++)
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            const unsigned char *src =
                obj + ((uint64_t)k * l->num_layers + layer) * chunk_size * bpt;
            for (uint32_t b = 0; b < nb; b++) {
                uint32_t first = b * tpb;
                if (first + tpb <= skip_tokens) continue;
                uint32_t from = skip_tokens > first ? skip_tokens - first : 0;
                memcpy(kv_block_ptr(c, layer, k, block_ids[b]) + from * bpt,
                       src + ((uint64_t)first + from) * bpt, (uint64_t)(tpb - from) * bpt);
            }
        }
}

/* ---- SIGBUS guard ---- */

static __thread sigjmp_buf *t_bus_jmp;

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    (void)si;
    (void)uc;
    if (t_bus_jmp) siglongjmp(*t_bus_jmp, 1);
    signal(sig, SIG_DFL); /* not a guarded copy: die as without the handler */
    raise(sig);
}

int kv_guard_init(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGBUS, &sa, NULL);
}

int kv_guarded(void (*fn)(void *arg), void *arg) {
    sigjmp_buf jb;
    if (sigsetjmp(jb, 1)) {
        t_bus_jmp = NULL;
        return -1;
    }
    t_bus_jmp = &jb;
    fn(arg);
    t_bus_jmp = NULL;
    return 0;
}

struct copy_args {
    const struct kv_context *c;
    uint32_t chunk_size;
    const uint32_t *ids;
    unsigned char *obj;
    const unsigned char *cobj;
    uint32_t skip;
};

static void do_gather(void *arg) {
    struct copy_args *a = arg;
    kv_gather(a->c, a->chunk_size, a->ids, a->obj);
}

static void do_scatter(void *arg) {
    struct copy_args *a = arg;
    kv_scatter(a->c, a->chunk_size, a->ids, a->cobj, a->skip);
}

int kv_gather_guarded(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                      unsigned char *obj) {
    struct copy_args a = {c, chunk_size, block_ids, obj, NULL, 0};
    return kv_guarded(do_gather, &a);
}

int kv_scatter_guarded(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                       const unsigned char *obj, uint32_t skip_tokens) {
    struct copy_args a = {c, chunk_size, block_ids, NULL, obj, skip_tokens};
    return kv_guarded(do_scatter, &a);
}
