/* Registered KV contexts and the block <-> object copies. A copy is one memcpy per
 * (layer, K/V, block): a block's tokens are contiguous on both sides. */
#include "server/kvctx.h"

#include <errno.h>
#include <fcntl.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/errbuf.h"
#include "server/copypool.h"

void kvreg_init(struct kv_registry *r) {
    pthread_mutex_init(&r->lock, NULL);
    r->head = NULL;
    r->count = 0;
    memset(&r->warm, 0, sizeof(r->warm));
    pthread_mutex_init(&r->warm.mu, NULL);
    pthread_cond_init(&r->warm.cv, NULL);
}

/* Out of the registry (the caller unlinked it under the lock): the warmer stops at its next
 * step, and the registry's reference goes. */
static void ctx_retire(struct kv_context *c) {
    if (!c) return;
    atomic_store(&c->retired, 1);
    kvreg_put(c);
}

static void ctx_free(struct kv_context *c) {
    if (c->warm_fd >= 0) close(c->warm_fd);
    if (c->base) munmap(c->base, c->map_size);
    free(c);
}

void kvreg_put(struct kv_context *c) {
    if (c && atomic_fetch_sub(&c->refs, 1) == 1) ctx_free(c);
}

void kvreg_destroy(struct kv_registry *r) {
    kvwarm_stop(r);
    pthread_mutex_lock(&r->lock);
    struct kv_context *c = r->head;
    r->head = NULL;
    r->count = 0;
    pthread_mutex_unlock(&r->lock);
    while (c) {
        struct kv_context *n = c->next;
        ctx_retire(c);
        c = n;
    }
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->warm.cv);
    pthread_mutex_destroy(&r->warm.mu);
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
        errbuf_set(err, errlen, "kv_count must be 1 or 2");
        return -1;
    }
    if (!l->num_layers || !l->num_blocks || !l->tokens_per_block || !l->bytes_per_token) {
        errbuf_set(err, errlen, "layout sizes must be positive");
        return -1;
    }
    if (chunk_size % l->tokens_per_block) {
        errbuf_set(err, errlen, "chunk_size %u is not a multiple of tokens_per_block %u",
                   chunk_size, l->tokens_per_block);
        return -1;
    }
    /* Every product below must fit 64 bits with room to spare (< 2^60 bytes). */
    double total = (double)l->num_layers * l->kv_count * l->num_blocks * l->tokens_per_block *
                   (double)l->bytes_per_token;
    double obj = (double)l->kv_count * l->num_layers * chunk_size * (double)l->bytes_per_token;
    if (total > 1e18 || obj > 1e15) {
        errbuf_set(err, errlen, "layout is too large");
        return -1;
    }
    return 0;
}

static int same_layout(const struct kv_layout *a, const struct kv_layout *b) {
    return a->num_layers == b->num_layers && a->num_blocks == b->num_blocks &&
           a->tokens_per_block == b->tokens_per_block && a->bytes_per_token == b->bytes_per_token &&
           a->kv_count == b->kv_count && a->order == b->order;
}

int kv_shm_name_check(const char *name, char *err, size_t errlen) {
    size_t n = strlen(name);
    if (n < 2 || n > KV_SHM_NAME_MAX + 1 || name[0] != '/') {
        errbuf_set(err, errlen, "shm_name must be '/' followed by 1 to %d characters",
                   KV_SHM_NAME_MAX);
        return -1;
    }
    for (size_t i = 1; i < n; i++) {
        char ch = name[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-')) {
            errbuf_set(err, errlen,
                       "shm_name may only hold A-Z a-z 0-9 . _ - after its leading '/'");
            return -1;
        }
    }
    if (!strcmp(name, "/.") || !strcmp(name, "/..")) {
        errbuf_set(err, errlen, "shm_name must not be \".\" or \"..\"");
        return -1;
    }
    return 0;
}

/* ---- proof of access ---- */

static unsigned char g_secret[32];
static pthread_once_t g_secret_once = PTHREAD_ONCE_INIT;
static int g_secret_ok;

static void secret_init(void) { g_secret_ok = RAND_bytes(g_secret, sizeof(g_secret)) == 1; }

#define PROOF_EPOCH_NS (60ull * 1000000000ull)

/* The nonce of (peer, object) in one epoch: HMAC-SHA256 under a per-process secret, so the server
 * keeps no state per challenge. */
static int proof_nonce(const struct kv_auth *a, uint64_t dev, uint64_t ino, uint64_t epoch,
                       unsigned char out[KV_PROOF_NONCE]) {
    pthread_once(&g_secret_once, secret_init);
    if (!g_secret_ok) return -1;
    unsigned char msg[16 + 24 + KV_PEER_KEY];
    memcpy(msg, "lmcache-proof-v1", 16);
    memcpy(msg + 16, &epoch, 8);
    memcpy(msg + 24, &dev, 8);
    memcpy(msg + 32, &ino, 8);
    memcpy(msg + 40, a->peer, KV_PEER_KEY);
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), g_secret, sizeof(g_secret), msg, sizeof(msg), out, &len) ||
        len != KV_PROOF_NONCE)
        return -1;
    return 0;
}

static int owner_allowed(const struct kv_auth *a, uid_t owner) {
    if (a->has_cred) return a->peer_uid == (uint32_t)owner || a->peer_uid == 0;
    if (a->n_allowed_uids == 0) return owner == geteuid();
    for (size_t i = 0; i < a->n_allowed_uids; i++)
        if (a->allowed_uids[i] == (uint32_t)owner) return 1;
    return 0;
}

/* Opens /dev/shm/<name> for the mapping, refusing (without blocking, and before reading or
 * writing a byte) what is not a regular file or is owned by someone the peer may not use.
 * Returns the descriptor with *st filled, or -1 with a message. */
static int open_checked(const char *name, const struct kv_auth *a, struct stat *st, char *err,
                        size_t errlen) {
    int dfd = open(KV_SHM_DIR, O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) {
        errbuf_set(err, errlen, "cannot open %s: %s", KV_SHM_DIR, strerror(errno));
        return -1;
    }
    const char *rel = name + 1;
    struct stat pre;
    if (fstatat(dfd, rel, &pre, AT_SYMLINK_NOFOLLOW) < 0) {
        errbuf_set(err, errlen, "cannot open shared memory '%s': %s", name, strerror(errno));
        close(dfd);
        return -1;
    }
    if (!S_ISREG(pre.st_mode)) {
        errbuf_set(err, errlen, "shared memory '%s' is not a regular file", name);
        close(dfd);
        return -1;
    }
    if (!owner_allowed(a, pre.st_uid)) {
        errbuf_set(err, errlen,
                   "shared memory '%s' is owned by uid %u, which this client may not use", name,
                   (unsigned)pre.st_uid);
        close(dfd);
        return -1;
    }
    int fd = openat(dfd, rel, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    int saved = errno;
    close(dfd);
    if (fd < 0) {
        errbuf_set(err, errlen, "cannot open shared memory '%s': %s", name, strerror(saved));
        return -1;
    }
    /* The checks again on what was opened: the name may have been replaced in between. */
    if (fstat(fd, st) < 0 || !S_ISREG(st->st_mode) || st->st_dev != pre.st_dev ||
        st->st_ino != pre.st_ino || !owner_allowed(a, st->st_uid)) {
        errbuf_set(err, errlen, "shared memory '%s' changed while it was opened", name);
        close(fd);
        return -1;
    }
    return fd;
}

/* 1 when the proof page holds this peer's nonce of the current or the previous epoch; else 0
 * with nonce set to the current one. */
static int proof_ok(int fd, const struct kv_auth *a, const struct stat *st, uint64_t off,
                    uint64_t now_ns, unsigned char nonce[KV_PROOF_NONCE]) {
    uint64_t epoch = now_ns / PROOF_EPOCH_NS;
    unsigned char prev[KV_PROOF_NONCE], got[KV_PROOF_NONCE];
    if (proof_nonce(a, (uint64_t)st->st_dev, (uint64_t)st->st_ino, epoch, nonce) < 0) return -1;
    if (proof_nonce(a, (uint64_t)st->st_dev, (uint64_t)st->st_ino, epoch - 1, prev) < 0) return -1;
    ssize_t n = pread(fd, got, sizeof(got), (off_t)off);
    if (n != (ssize_t)sizeof(got)) return 0;
    return CRYPTO_memcmp(got, nonce, sizeof(got)) == 0 ||
           CRYPTO_memcmp(got, prev, sizeof(got)) == 0;
}

static int is_owner(const struct kv_context *c, const unsigned char *peer) {
    for (unsigned i = 0; i < c->nowners; i++)
        if (!memcmp(c->owners[i], peer, KV_PEER_KEY)) return 1;
    return 0;
}

/* Caller holds the registry lock (or owns c alone). The oldest owner makes room. */
static void add_owner(struct kv_context *c, const unsigned char *peer) {
    const unsigned cap = sizeof(c->owners) / sizeof(c->owners[0]);
    if (is_owner(c, peer)) return;
    if (c->nowners == cap) {
        memmove(c->owners[0], c->owners[1], (cap - 1) * sizeof(c->owners[0]));
        c->nowners--;
    }
    memcpy(c->owners[c->nowners++], peer, KV_PEER_KEY);
}

/* 1 when a registered context maps the object st names beyond off. */
static int tail_mapped(struct kv_registry *r, const struct stat *st, uint64_t off) {
    int hit = 0;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *o = r->head; o && !hit; o = o->next)
        hit = o->shm_dev == (uint64_t)st->st_dev && o->shm_ino == (uint64_t)st->st_ino &&
              o->map_size > off;
    pthread_mutex_unlock(&r->lock);
    return hit;
}

int kvreg_register(struct kv_registry *r, const struct kv_context *tmpl, const struct kv_auth *auth,
                   uint64_t now_ns, unsigned char nonce[KV_PROOF_NONCE], uint64_t *proof_offset,
                   char *err, size_t errlen) {
    struct kv_context *c = NULL;
    int rc = -1;
    if (kv_shm_name_check(tmpl->shm_name, err, errlen) < 0) return KV_REG_BAD_NAME;
    if (auth->n_prefixes) {
        size_t i = 0;
        while (i < auth->n_prefixes &&
               strncmp(tmpl->shm_name, auth->prefixes[i], strlen(auth->prefixes[i])))
            i++;
        if (i == auth->n_prefixes) {
            errbuf_set(err, errlen, "shm_name '%s' does not start with an allowed prefix",
                       tmpl->shm_name);
            return -1;
        }
    }
    uint64_t need = kv_layout_bytes(&tmpl->layout);
    struct stat st;
    int fd = open_checked(tmpl->shm_name, auth, &st, err, errlen);
    if (fd < 0) return -1;
    /* The proof page is the object's last KV_PROOF_PAGE bytes, and no layout may reach into
     * it: the daemon copies only within layouts, so it never writes where a proof is read (a
     * proof page placed after a layout the client chooses could be made to cover bytes the
     * daemon itself wrote, e.g. a retrieve of chunks another client stored). */
    uint64_t tail = auth->reserve_proof_page || auth->need_proof ? KV_PROOF_PAGE : 0;
    if ((uint64_t)st.st_size < need + tail) {
        errbuf_set(err, errlen, "shared memory '%s' holds %lld bytes, the layout needs %llu%s",
                   tmpl->shm_name, (long long)st.st_size, (unsigned long long)(need + tail),
                   tail ? " (with the 4096-byte proof page at its end)" : "");
        goto out;
    }
    if (auth->need_proof) {
        uint64_t off = (uint64_t)st.st_size - KV_PROOF_PAGE;
        if (tail_mapped(r, &st, off)) {
            /* a live registration maps the last page (the object shrank since): the daemon may
             * have written there, so nothing found there proves anything */
            errbuf_set(err, errlen,
                       "shared memory '%s' is registered with a layout reaching into its last "
                       "4096 bytes (was it shrunk?): no proof of access is possible",
                       tmpl->shm_name);
            goto out;
        }
        int ok = proof_ok(fd, auth, &st, off, now_ns, nonce);
        if (ok < 0) {
            errbuf_set(err, errlen, "cannot compute the proof nonce");
            goto out;
        }
        if (ok == 0) {
            *proof_offset = off;
            errbuf_set(err, errlen,
                       "write the nonce at byte %llu of '%s' and register again to prove access",
                       (unsigned long long)off, tmpl->shm_name);
            rc = KV_REG_NEED_PROOF;
            goto out;
        }
    }

    /* Idempotent re-registration: the same shared-memory object (not only the same name: an
     * engine that restarted may have recreated it) and layout only refreshes liveness. */
    uint64_t dev = (uint64_t)st.st_dev, ino = (uint64_t)st.st_ino;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *o = r->head; o; o = o->next) {
        if (o->instance_id == tmpl->instance_id && !strcmp(o->shm_name, tmpl->shm_name) &&
            o->shm_dev == dev && o->shm_ino == ino && ino != 0 &&
            !strcmp(o->model_name, tmpl->model_name) && o->worker_id == tmpl->worker_id &&
            o->world_size == tmpl->world_size && same_layout(&o->layout, &tmpl->layout)) {
            atomic_store(&o->last_seen_ns, now_ns);
            add_owner(o, auth->peer);
            rc = 0;
            break;
        }
    }
    /* A new mapping: within the limits? (Each costs page tables and a mapping of the daemon's,
     * whatever the object's owner.) The registration it replaces does not count. */
    size_t mine = 0, total = 0;
    if (rc != 0) {
        for (struct kv_context *o = r->head; o; o = o->next) {
            if (o->instance_id == tmpl->instance_id) continue;
            total++;
            if (is_owner(o, auth->peer)) mine++;
        }
    }
    pthread_mutex_unlock(&r->lock);
    if (rc == 0) goto out;
    if ((auth->max_per_peer && mine >= auth->max_per_peer) ||
        (auth->max_total && total >= auth->max_total)) {
        errbuf_set(err, errlen,
                   "%zu KV caches registered by this connection, %zu in all: the limit is %zu per "
                   "connection and %zu in all (--max-kv-registrations-per-client, "
                   "--max-kv-registrations)",
                   mine, total, auth->max_per_peer, auth->max_total);
        rc = KV_REG_LIMIT;
        goto out;
    }

    c = calloc(1, sizeof(*c));
    if (!c) {
        errbuf_set(err, errlen, "out of memory");
        goto out;
    }
    *c = *tmpl;
    c->base = NULL;
    c->next = NULL;
    c->map_size = need;
    c->nowners = 0;
    c->warm_fd = -1;
    add_owner(c, auth->peer);
    c->shm_dev = (uint64_t)st.st_dev;
    c->shm_ino = (uint64_t)st.st_ino;
    void *p = mmap(NULL, c->map_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        errbuf_set(err, errlen, "cannot map shared memory '%s': %s", c->shm_name, strerror(errno));
        free(c);
        goto out;
    }
    c->base = p;
    atomic_store(&c->refs, 1);
    atomic_store(&c->last_seen_ns, now_ns);
    /* Faulted in by the `kv-warm` thread (kvwarm.c), not here: on a slow-paging VM that takes
     * seconds per GiB, which would hold this worker and its other clients. */
    kvwarm_queue(r, c, fd);

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
    ctx_retire(old);
    rc = 0;
out:
    close(fd);
    return rc;
}

int kvreg_unregister(struct kv_registry *r, int64_t instance_id, const unsigned char *peer) {
    struct kv_context *found = NULL;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context **pp = &r->head; *pp; pp = &(*pp)->next) {
        if ((*pp)->instance_id == instance_id) {
            if (peer && !is_owner(*pp, peer)) break;
            found = *pp;
            *pp = found->next;
            r->count--;
            break;
        }
    }
    pthread_mutex_unlock(&r->lock);
    ctx_retire(found);
    return found ? 0 : -1;
}

struct kv_context *kvreg_get(struct kv_registry *r, int64_t instance_id, uint64_t now_ns) {
    return kvreg_get_for(r, instance_id, NULL, now_ns);
}

struct kv_context *kvreg_get_for(struct kv_registry *r, int64_t instance_id,
                                 const unsigned char *peer, uint64_t now_ns) {
    struct kv_context *found = NULL;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        if (c->instance_id == instance_id) {
            if (peer && !is_owner(c, peer)) break;
            atomic_fetch_add(&c->refs, 1);
            atomic_store(&c->last_seen_ns, now_ns);
            found = c;
            break;
        }
    }
    pthread_mutex_unlock(&r->lock);
    return found;
}

int kvreg_ping(struct kv_registry *r, int64_t instance_id, const unsigned char *peer,
               uint64_t now_ns, int *warm_state) {
    int rc = -1;
    pthread_mutex_lock(&r->lock);
    for (struct kv_context *c = r->head; c; c = c->next) {
        if (c->instance_id == instance_id && (!peer || is_owner(c, peer))) {
            atomic_store(&c->last_seen_ns, now_ns);
            c->pinged = 1;
            if (warm_state) *warm_state = atomic_load(&c->warm_state);
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
        ctx_retire(dead);
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
                            json_pack("{s:s, s:i, s:i, s:s, s:o, s:s, s:I, s:I}", "model_name",
                                      c->model_name, "world_size", (int)c->world_size, "worker_id",
                                      (int)c->worker_id, "shm_name", c->shm_name, "kv_cache_layout",
                                      layout, "warm_state",
                                      kv_warm_state_name(atomic_load(&c->warm_state)),
                                      "warmed_bytes", (json_int_t)atomic_load(&c->warm_bytes),
                                      "mapped_bytes", (json_int_t)c->map_size));
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

/* The object is a sequence of units, one per (K/V, layer, block of the chunk) in that order,
 * each a block's tokens_per_block * bytes_per_token bytes: unit u = (k * layers + layer) *
 * blocks + b. A byte range of the object maps to a run of (parts of) units, so any split of
 * [0, object bytes) into ranges copies every byte exactly once. */
struct unit_walk {
    uint64_t bb;    /* bytes per unit */
    uint32_t nb;    /* blocks per chunk */
    uint64_t u;     /* current unit */
    uint64_t inner; /* offset within it */
};

static void walk_init(struct unit_walk *w, const struct kv_context *c, uint32_t chunk_size,
                      uint64_t from) {
    const struct kv_layout *l = &c->layout;
    w->bb = (uint64_t)l->tokens_per_block * l->bytes_per_token;
    w->nb = chunk_size / l->tokens_per_block;
    w->u = from / w->bb;
    w->inner = from - w->u * w->bb;
}

/* (layer, kv, block of the chunk) of the current unit. */
static void walk_unit(const struct unit_walk *w, const struct kv_context *c, uint32_t *layer,
                      uint32_t *kv, uint32_t *b) {
    uint64_t kl = w->u / w->nb;
    *b = (uint32_t)(w->u - kl * w->nb);
    *layer = (uint32_t)(kl % c->layout.num_layers);
    *kv = (uint32_t)(kl / c->layout.num_layers);
}

void kv_gather_range(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                     unsigned char *obj, uint64_t from, uint64_t to) {
    struct unit_walk w;
    walk_init(&w, c, chunk_size, from);
    while (from < to) {
        uint32_t layer, kv, b;
        walk_unit(&w, c, &layer, &kv, &b);
        uint64_t len = w.bb - w.inner < to - from ? w.bb - w.inner : to - from;
        memcpy(obj + from, kv_block_ptr(c, layer, kv, block_ids[b]) + w.inner, len);
        from += len;
        w.inner = 0;
        w.u++;
    }
}

void kv_scatter_range(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                      const unsigned char *obj, uint32_t skip_tokens, uint64_t from, uint64_t to) {
    const struct kv_layout *l = &c->layout;
    uint64_t bpt = l->bytes_per_token;
    struct unit_walk w;
    walk_init(&w, c, chunk_size, from);
    while (from < to) {
        uint32_t layer, kv, b;
        walk_unit(&w, c, &layer, &kv, &b);
        uint64_t len = w.bb - w.inner < to - from ? w.bb - w.inner : to - from;
        /* the tokens of the block below skip_tokens are not written */
        uint64_t first = (uint64_t)b * l->tokens_per_block;
        uint64_t skipped = skip_tokens > first ? skip_tokens - first : 0;
        if (skipped > l->tokens_per_block) skipped = l->tokens_per_block;
        uint64_t s = skipped * bpt > w.inner ? skipped * bpt : w.inner;
        if (s < w.inner + len)
            memcpy(kv_block_ptr(c, layer, kv, block_ids[b]) + s, obj + (from - w.inner) + s,
                   w.inner + len - s);
        from += len;
        w.inner = 0;
        w.u++;
    }
}

void kv_gather(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
               unsigned char *obj) {
    kv_gather_range(c, chunk_size, block_ids, obj, 0, kv_object_bytes(&c->layout, chunk_size));
}

void kv_scatter(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                const unsigned char *obj, uint32_t skip_tokens) {
    kv_scatter_range(c, chunk_size, block_ids, obj, skip_tokens, 0,
                     kv_object_bytes(&c->layout, chunk_size));
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

/* One guarded piece of a (possibly pooled) copy: bytes [i * piece, (i + 1) * piece) of the
 * object. Each thread that runs a piece guards it itself (the SIGBUS guard is per thread). */
struct copy_args {
    const struct kv_context *c;
    uint32_t chunk_size;
    const uint32_t *ids;
    unsigned char *obj;
    const unsigned char *cobj;
    uint32_t skip;
    uint64_t total, piece;
    uint64_t from, to; /* of the piece being run (per thread: a copy of the args) */
};

static void gather_cb(void *arg) {
    struct copy_args *a = arg;
    kv_gather_range(a->c, a->chunk_size, a->ids, a->obj, a->from, a->to);
}

static void scatter_cb(void *arg) {
    struct copy_args *a = arg;
    kv_scatter_range(a->c, a->chunk_size, a->ids, a->cobj, a->skip, a->from, a->to);
}

static int piece_run(void *arg, uint32_t i) {
    struct copy_args a = *(const struct copy_args *)arg;
    a.from = (uint64_t)i * a.piece;
    a.to = a.total - a.from < a.piece ? a.total : a.from + a.piece;
    return kv_guarded(a.obj ? gather_cb : scatter_cb, &a);
}

static int copy_pooled(struct copypool *p, struct copy_args *a) {
    uint32_t pieces;
    a->total = kv_object_bytes(&a->c->layout, a->chunk_size);
    a->piece = copypool_piece_bytes(p, a->total, &pieces);
    return copypool_run(p, pieces, piece_run, a);
}

int kv_gather_guarded(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                      unsigned char *obj) {
    return kv_gather_pooled(NULL, c, chunk_size, block_ids, obj);
}

int kv_scatter_guarded(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                       const unsigned char *obj, uint32_t skip_tokens) {
    return kv_scatter_pooled(NULL, c, chunk_size, block_ids, obj, skip_tokens);
}

int kv_gather_pooled(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                     const uint32_t *block_ids, unsigned char *obj) {
    struct copy_args a = {c, chunk_size, block_ids, obj, NULL, 0, 0, 0, 0, 0};
    return copy_pooled(p, &a);
}

int kv_scatter_pooled(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                      const uint32_t *block_ids, const unsigned char *obj, uint32_t skip_tokens) {
    struct copy_args a = {c, chunk_size, block_ids, NULL, obj, skip_tokens, 0, 0, 0, 0};
    return copy_pooled(p, &a);
}

/* ---- several chunks as one pooled job ---- */

struct many_args {
    const struct kv_context *c;
    uint32_t chunk_size;
    const uint32_t *const *ids;
    unsigned char *const *objs;        /* gather */
    const unsigned char *const *cobjs; /* scatter */
    const uint32_t *skips;
    uint64_t total, piece;
    uint32_t ppc;               /* pieces per chunk */
    _Atomic uint32_t first_bad; /* lowest chunk that faulted (n: none) */
};

static int many_piece(void *arg, uint32_t i) {
    struct many_args *m = arg;
    uint32_t ch = i / m->ppc;
    /* a chunk after a faulted one is not needed; an earlier one must be completed */
    if (ch > atomic_load_explicit(&m->first_bad, memory_order_relaxed)) return 0;
    struct copy_args a = {m->c,
                          m->chunk_size,
                          m->ids[ch],
                          m->objs ? m->objs[ch] : NULL,
                          m->cobjs ? m->cobjs[ch] : NULL,
                          m->skips ? m->skips[ch] : 0,
                          m->total,
                          m->piece,
                          0,
                          0};
    a.from = (uint64_t)(i % m->ppc) * m->piece;
    a.to = m->total - a.from < m->piece ? m->total : a.from + m->piece;
    if (kv_guarded(a.obj ? gather_cb : scatter_cb, &a) != 0) {
        uint32_t cur = atomic_load_explicit(&m->first_bad, memory_order_relaxed);
        while (ch < cur && !atomic_compare_exchange_weak_explicit(
                               &m->first_bad, &cur, ch, memory_order_relaxed, memory_order_relaxed))
            ;
    }
    return 0; /* never stops the job: the chunks before a fault must be completed */
}

static int copy_many(struct copypool *p, struct many_args *m, uint32_t n, uint32_t *done) {
    *done = 0;
    if (n == 0) return 0;
    m->total = kv_object_bytes(&m->c->layout, m->chunk_size);
    uint32_t pieces;
    m->piece = copypool_piece_bytes(p, m->total * n, &pieces);
    if (m->piece > m->total) m->piece = m->total ? m->total : 1;
    m->ppc = (uint32_t)((m->total + m->piece - 1) / m->piece);
    if (m->ppc == 0) m->ppc = 1;
    atomic_init(&m->first_bad, n);
    if ((uint64_t)m->ppc * n > UINT32_MAX) return -1; /* not reachable with bounded requests */
    copypool_run(p, m->ppc * n, many_piece, m);
    *done = atomic_load(&m->first_bad);
    return *done == n ? 0 : -1;
}

int kv_gather_many(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                   const uint32_t *const *block_ids, unsigned char *const *objs, uint32_t n,
                   uint32_t *done) {
    struct many_args m = {.c = c, .chunk_size = chunk_size, .ids = block_ids, .objs = objs};
    return copy_many(p, &m, n, done);
}

int kv_scatter_many(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                    const uint32_t *const *block_ids, const unsigned char *const *objs,
                    const uint32_t *skips, uint32_t n, uint32_t *done) {
    struct many_args m = {
        .c = c, .chunk_size = chunk_size, .ids = block_ids, .cobjs = objs, .skips = skips};
    return copy_many(p, &m, n, done);
}
