/* The Device-DAX L2 adapter: every device (a /dev/daxX.Y character device or a regular file) is
 * mapped MAP_SHARED and carved into fixed slots of slot_size bytes, each holding one object. An
 * in-memory index maps keys to (device, slot, generation, size).
 *
 * Locking. One adapter mutex (mu) guards the index, the device table and every slot's metadata;
 * it is held only for hash look-ups and bookkeeping, never across a copy. A copy pins what it
 * touches under mu first: a load pins the source slot (pins > 0), a store or a migration reserves
 * its destination slot (state WRITING), and both take a reference on the device's current mapping
 * (struct dax_map). A slot whose entry is deleted while pinned becomes DEAD and returns to the
 * free stack only when its last pin goes, so a read never sees a slot being reused; a mapping
 * replaced by a resize is unmapped only when its last reference goes. Lookup locks (the
 * interface's) are a count on the index entry: delete and evict skip or refuse locked keys;
 * migration moves the entry with its locks, so a locked key stays loadable.
 * Reconfiguration operations are serialised by reconf_mu (taken before mu) and copy outside mu.
 * Lock order: reconf_mu -> mu -> the base's acct_mu (listeners are called under mu) -> q_mu is
 * never held together with mu. */
#include "server/l2/dax_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "base/check.h"
#include "base/errbuf.h"
#include "base/hash.h"
#include "base/htab.h"
#include "base/jfield.h"
#include "base/log.h"

#define DAX_MAGIC_STR "LMCACHE-DAX-ARENA-v1\n"

const char *const dax_state_names[] = {"active",  "draining", "removing",
                                       "removed", "resizing", "failed"};

/* ---- index ----------------------------------------------------------------------------------- */

static uint64_t key_hash(const struct keys_object_key *k) {
    static const uint8_t sep = 0xff; /* between the two strings */
    uint64_t h = fnv1a64(k->hash, k->hash_len);
    h = fnv1a64_add(h, &k->kv_rank, sizeof(k->kv_rank));
    h = fnv1a64_add(h, &k->object_group_id, sizeof(k->object_group_id));
    h = fnv1a64_add(h, k->model_name, strlen(k->model_name));
    h = fnv1a64_add(h, &sep, 1);
    return fnv1a64_add(h, k->cache_salt, strlen(k->cache_salt));
}

static bool key_eq(const struct keys_object_key *a, const struct keys_object_key *b) {
    return a->hash_len == b->hash_len && memcmp(a->hash, b->hash, a->hash_len) == 0 &&
           a->kv_rank == b->kv_rank && a->object_group_id == b->object_group_id &&
           strcmp(a->model_name, b->model_name) == 0 && strcmp(a->cache_salt, b->cache_salt) == 0;
}

#define ENTRY(n) HTAB_ENTRY(n, struct dax_entry, hn)

static uint64_t entry_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return ENTRY(n)->hv;
}

struct dax_entry *do_dax_find(struct dax *d, const struct keys_object_key *k, uint64_t hv) {
    for (struct htab_node *n = *htab_bucket(&d->index, hv); n; n = n->next)
        if (ENTRY(n)->hv == hv && key_eq(&ENTRY(n)->key, k)) return ENTRY(n);
    return NULL;
}

static void do_insert(struct dax *d, struct dax_entry *e) { htab_insert(&d->index, &e->hn, e->hv); }

static void do_unlink(struct dax *d, struct dax_entry *e) { htab_remove(&d->index, &e->hn, e->hv); }

/* ---- mappings and slots ---------------------------------------------------------------------- */

void dax_map_free(struct dax_map *m) {
    if (!m) return;
    if (m->base) munmap(m->base, m->len);
    if (m->fd >= 0) close(m->fd);
    free(m);
}

/* A slot leaves its state: FREE when nothing pins it, else DEAD until the last unpin. */
void do_dax_slot_release(struct dax_dev *v, uint32_t i) {
    struct dax_slot *s = &v->slots[i];
    if (s->state == SLOT_LIVE) v->live--;
    s->e = NULL;
    if (s->pins) {
        s->state = SLOT_DEAD;
        return;
    }
    s->state = SLOT_FREE;
    v->used--;
    if (i < v->alloc_limit) v->free_stack[v->nfree++] = i;
}

void do_dax_slot_unpin(struct dax *d, struct dax_dev *v, uint32_t i) {
    struct dax_slot *s = &v->slots[i];
    CHECK(s->pins > 0);
    s->pins--;
    v->pins--;
    if (s->pins == 0 && s->state == SLOT_DEAD) do_dax_slot_release(v, i);
    do_wake(d);
}

/* Pops a free slot below alloc_limit; UINT32_MAX when none. Reserves it (WRITING). */
uint32_t do_dax_slot_reserve(struct dax_dev *v) {
    while (v->nfree) {
        uint32_t i = v->free_stack[--v->nfree];
        if (i >= v->alloc_limit || v->slots[i].state != SLOT_FREE) continue;
        struct dax_slot *s = &v->slots[i];
        s->state = SLOT_WRITING;
        s->gen++;
        v->used++;
        v->writing++;
        return i;
    }
    return UINT32_MAX;
}

void do_dax_rebuild_free(struct dax_dev *v) {
    v->nfree = 0;
    for (uint32_t i = 0; i < v->alloc_limit && i < v->nslots; i++)
        if (v->slots[i].state == SLOT_FREE) v->free_stack[v->nfree++] = i;
}

/* The least-full active device with a free slot, or -1. */
int do_dax_pick_device(struct dax *d, int exclude) {
    int best = -1;
    double best_ratio = 2.0;
    for (unsigned i = 0; i < d->ndevs; i++) {
        struct dax_dev *v = d->devs[i];
        if ((int)i == exclude || !writable(v) || v->nfree == 0) continue;
        double r = (double)v->used / (double)v->nslots;
        if (r < best_ratio) {
            best_ratio = r;
            best = (int)i;
        }
    }
    return best;
}

void do_dax_update_capacity(struct dax *d) {
    uint64_t cap = 0;
    for (unsigned i = 0; i < d->ndevs; i++) {
        const struct dax_dev *v = d->devs[i];
        if (v->state == ST_ACTIVE || v->state == ST_DRAINING || v->state == ST_RESIZING)
            cap += (uint64_t)v->nslots * d->slot_size;
    }
    pthread_mutex_lock(&d->base.acct_mu);
    d->base.capacity_bytes = cap;
    pthread_mutex_unlock(&d->base.acct_mu);
}

/* ---- opening devices ------------------------------------------------------------------------- */

static int read_sys_u64(const char *path, uint64_t *out) {
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    unsigned long long v = 0;
    int n = fscanf(f, "%llu", &v);
    fclose(f);
    if (n != 1) return -1;
    *out = v;
    return 0;
}

/* The sysfs directory describing a Device-DAX candidate, into node; false when path is not
 * one. A character device's is <sysfs>/dev/char/<major>:<minor>. Tests inject a fake tree:
 * LMCACHE_DAX_SYSFS_ROOT replaces /sys, and LMCACHE_DAX_DEV_PREFIX names a path prefix under
 * which an existing regular file stands in for a character device whose node is
 * <sysfs>/dev/char/<file name>. Both are unset in production. */
static bool devdax_node(const char *path, const struct stat *st, bool created, char *node,
                        size_t len) {
    const char *root = getenv("LMCACHE_DAX_SYSFS_ROOT");
    if (!root || !*root) root = "/sys";
    if (S_ISCHR(st->st_mode))
        return snprintf(node, len, "%s/dev/char/%u:%u", root, major(st->st_rdev),
                        minor(st->st_rdev)) < (int)len;
    const char *prefix = getenv("LMCACHE_DAX_DEV_PREFIX");
    if (!prefix || !*prefix || created || !S_ISREG(st->st_mode) ||
        strncmp(path, prefix, strlen(prefix)) != 0)
        return false;
    const char *name = strrchr(path, '/');
    return snprintf(node, len, "%s/dev/char/%s", root, name ? name + 1 : path) < (int)len;
}

/* True when the node's subsystem link ends in "dax". */
static bool sys_is_dax(const char *node) {
    char p[PATH_MAX + 16], link[PATH_MAX];
    snprintf(p, sizeof(p), "%s/subsystem", node);
    ssize_t n = readlink(p, link, sizeof(link) - 1);
    if (n <= 0) return false;
    link[n] = 0;
    const char *b = strrchr(link, '/');
    return b && strcmp(b + 1, "dax") == 0;
}

void dax_dev_free(struct dax_dev *v) {
    if (!v) return;
    free(v->slots);
    free(v->free_stack);
    free(v);
}

/* Opens path and maps size bytes of it. A regular file is created when missing; an existing
 * non-empty file is used only when it carries the arena header (so a typo cannot clobber a
 * file); a character device must belong to the dax subsystem. Returns 0 or -1 with err. */
int dax_dev_open(const char *path, uint64_t size, uint64_t slot_size, struct dax_dev **out,
                 char *err, size_t errlen) {
    *out = NULL;
    if (strlen(path) >= PATH_MAX || path[0] == 0) {
        errbuf_set(err, errlen, "device_path must be a non-empty path");
        return -1;
    }
    int fd = open(path, O_RDWR | O_CLOEXEC);
    bool created = false;
    if (fd < 0 && errno == ENOENT) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        created = fd >= 0;
    }
    if (fd < 0) {
        errbuf_set(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        errbuf_set(err, errlen, "fstat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    struct dax_dev *v = calloc(1, sizeof(*v));
    if (!v) {
        errbuf_set(err, errlen, "out of memory");
        close(fd);
        return -1;
    }
    snprintf(v->path, sizeof(v->path), "%s", path);
    v->st_dev = st.st_dev;
    v->st_ino = st.st_ino;
    char node[PATH_MAX];
    if (devdax_node(path, &st, created, node, sizeof(node))) {
        if (!sys_is_dax(node)) {
            errbuf_set(err, errlen, "%s is a character device but not a Device-DAX device", path);
            goto fail;
        }
        char p[PATH_MAX + 16];
        v->is_devdax = true;
        snprintf(p, sizeof(p), "%s/align", node);
        if (read_sys_u64(p, &v->align) != 0 || v->align == 0) v->align = DAX_DEFAULT_ALIGN;
        snprintf(p, sizeof(p), "%s/size", node);
        if (read_sys_u64(p, &v->dev_max) != 0) v->dev_max = UINT64_MAX;
        v->data_off = 0;
        if (size > v->dev_max) {
            errbuf_set(err, errlen, "size %llu exceeds the size of %s (%llu bytes)",
                       (unsigned long long)size, path, (unsigned long long)v->dev_max);
            goto fail;
        }
    } else if (S_ISREG(st.st_mode)) {
        v->align = 4096;
        v->data_off = DAX_FILE_HEADER;
        v->dev_max = UINT64_MAX;
        if (!created && st.st_size > 0) {
            char hdr[sizeof(DAX_MAGIC_STR)] = {0};
            ssize_t n = pread(fd, hdr, sizeof(DAX_MAGIC_STR) - 1, 0);
            if (n != (ssize_t)sizeof(DAX_MAGIC_STR) - 1 ||
                memcmp(hdr, DAX_MAGIC_STR, sizeof(DAX_MAGIC_STR) - 1) != 0) {
                errbuf_set(err, errlen,
                           "%s exists and is not a DAX arena file (refusing to overwrite it)",
                           path);
                goto fail;
            }
        }
    } else {
        errbuf_set(err, errlen, "%s is neither a Device-DAX device nor a regular file", path);
        goto fail;
    }
    v->size = dev_round(size, v->align);
    if (v->size < v->data_off + slot_size) {
        errbuf_set(err, errlen, "size %llu of %s holds no slot of %llu bytes",
                   (unsigned long long)size, path, (unsigned long long)slot_size);
        goto fail;
    }
    uint64_t nslots = (v->size - v->data_off) / slot_size;
    if (nslots > UINT32_MAX - 1) {
        errbuf_set(err, errlen, "size of %s gives too many slots", path);
        goto fail;
    }
    if (!v->is_devdax) {
        if (ftruncate(fd, (off_t)v->size) != 0) {
            errbuf_set(err, errlen, "ftruncate %s: %s", path, strerror(errno));
            goto fail;
        }
        if (pwrite(fd, DAX_MAGIC_STR, sizeof(DAX_MAGIC_STR) - 1, 0) !=
            (ssize_t)sizeof(DAX_MAGIC_STR) - 1) {
            errbuf_set(err, errlen, "cannot write the header of %s: %s", path, strerror(errno));
            goto fail;
        }
    }
    v->map = calloc(1, sizeof(*v->map));
    v->slots = calloc(nslots, sizeof(*v->slots));
    v->free_stack = calloc(nslots, sizeof(*v->free_stack));
    if (!v->map || !v->slots || !v->free_stack) {
        errbuf_set(err, errlen, "out of memory");
        free(v->map);
        goto fail;
    }
    void *base = mmap(NULL, v->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        errbuf_set(err, errlen, "mmap %s (%llu bytes): %s", path, (unsigned long long)v->size,
                   strerror(errno));
        free(v->map);
        goto fail;
    }
    v->map->base = base;
    v->map->len = v->size;
    v->map->fd = fd;
    v->map->refs = 1;
    v->nslots = v->alloc_limit = (uint32_t)nslots;
    v->state = ST_ACTIVE;
    for (uint32_t i = 0; i < v->nslots; i++) v->free_stack[i] = v->nslots - 1 - i;
    v->nfree = v->nslots;
    *out = v;
    return 0;
fail:
    close(fd);
    if (created) unlink(path);
    dax_dev_free(v);
    return -1;
}

/* ---- data path ------------------------------------------------------------------------------- */

static void run_store(struct dax *d, struct l2_task *t) {
    for (size_t i = 0; i < t->n; i++) {
        const struct keys_object_key *k = &t->keys[i];
        uint64_t hv = key_hash(k), size = t->bufs[i].size;
        pthread_mutex_lock(&d->mu);
        if (do_dax_find(d, k, hv)) {
            pthread_mutex_unlock(&d->mu);
            t->ok[i] = 1;
            continue;
        }
        if (size > d->slot_size) {
            pthread_mutex_unlock(&d->mu);
            if (t->status == L2_OK) t->status = L2_ERR_INVAL;
            continue;
        }
        int di = do_dax_pick_device(d, -1);
        uint32_t slot = di >= 0 ? do_dax_slot_reserve(d->devs[di]) : UINT32_MAX;
        if (slot == UINT32_MAX) {
            pthread_mutex_unlock(&d->mu);
            if (t->status == L2_OK) t->status = L2_ERR_NOSPC;
            continue;
        }
        struct dax_dev *v = d->devs[di];
        struct dax_map *m = v->map;
        m->refs++;
        uint32_t gen = v->slots[slot].gen;
        char *dst = slot_addr(d, v, m, slot);
        pthread_mutex_unlock(&d->mu);

        memcpy(dst, t->bufs[i].data, size);

        struct dax_entry *e = malloc(sizeof(*e));
        pthread_mutex_lock(&d->mu);
        v = d->devs[di];
        v->writing--;
        bool fresh = false;
        if (!e || do_dax_find(d, k, hv)) {
            /* stored meanwhile by another task (ok), or no memory for the entry (failed) */
            do_dax_slot_release(v, slot);
            if (e) t->ok[i] = 1;
        } else {
            e->hv = hv;
            e->key = *k;
            e->size = size;
            e->dev = (uint32_t)di;
            e->slot = slot;
            e->gen = gen;
            e->locks = 0;
            do_insert(d, e);
            v->slots[slot].state = SLOT_LIVE;
            v->slots[slot].e = e;
            v->live++;
            t->ok[i] = 1;
            t->bytes += size;
            fresh = true;
            e = NULL;
            l2_adapter_notify_stored(&d->base, k, d->slot_size);
        }
        struct dax_map *dead = do_map_unref(m);
        do_wake(d);
        pthread_mutex_unlock(&d->mu);
        if (!fresh && !t->ok[i] && t->status == L2_OK) t->status = L2_ERR_NOMEM;
        free(e);
        dax_map_free(dead);
    }
}

static void run_load(struct dax *d, struct l2_task *t) {
    for (size_t i = 0; i < t->n; i++) {
        const struct keys_object_key *k = &t->keys[i];
        uint64_t hv = key_hash(k);
        pthread_mutex_lock(&d->mu);
        struct dax_entry *e = do_dax_find(d, k, hv);
        if (!e || e->size != t->bufs[i].size) {
            pthread_mutex_unlock(&d->mu);
            if (t->status == L2_OK) t->status = e ? L2_ERR_INVAL : L2_ERR_NOT_FOUND;
            continue;
        }
        uint32_t di = e->dev, slot = e->slot;
        struct dax_dev *v = d->devs[di];
        v->slots[slot].pins++;
        v->pins++;
        struct dax_map *m = v->map;
        m->refs++;
        const char *src = slot_addr(d, v, m, slot);
        uint64_t size = e->size;
        pthread_mutex_unlock(&d->mu);

        memcpy(t->bufs[i].data, src, size);

        pthread_mutex_lock(&d->mu);
        do_dax_slot_unpin(d, d->devs[di], slot);
        struct dax_map *dead = do_map_unref(m);
        pthread_mutex_unlock(&d->mu);
        dax_map_free(dead);
        t->ok[i] = 1;
        t->bytes += size;
        l2_adapter_notify_accessed(&d->base, k);
    }
}

static void *worker_main(void *arg) {
    struct dax *d = arg;
    for (;;) {
        pthread_mutex_lock(&d->q_mu);
        while (!d->q_head && !d->stopping) pthread_cond_wait(&d->q_cv, &d->q_mu);
        struct l2_task *t = d->q_head;
        if (t) {
            d->q_head = t->next;
            if (!d->q_head) d->q_tail = NULL;
        }
        pthread_mutex_unlock(&d->q_mu);
        if (!t) return NULL; /* stopping and the queue is empty */
        t->next = NULL;
        if (d->stopping)
            t->status = L2_ERR_CLOSED;
        else if (t->op == L2_OP_STORE)
            run_store(d, t);
        else
            run_load(d, t);
        l2_adapter_complete(&d->base, t);
    }
}

static void index_lookup(struct dax *d, struct l2_task *t) {
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < t->n; i++) {
        struct dax_entry *e = do_dax_find(d, &t->keys[i], key_hash(&t->keys[i]));
        if (!e) continue;
        e->locks++;
        t->sizes[i] = e->size;
        t->ok[i] = 1;
    }
    pthread_mutex_unlock(&d->mu);
}

static int dax_submit(struct l2_adapter *a, struct l2_task *t) {
    struct dax *d = D(a);
    if (t->op == L2_OP_LOOKUP) {
        /* an index look-up: no I/O, completed inline */
        index_lookup(d, t);
        l2_adapter_complete(a, t);
        return L2_OK;
    }
    pthread_mutex_lock(&d->q_mu);
    if (d->stopping) {
        pthread_mutex_unlock(&d->q_mu);
        return L2_ERR_CLOSED;
    }
    t->next = NULL;
    if (d->q_tail)
        d->q_tail->next = t;
    else
        d->q_head = t;
    d->q_tail = t;
    pthread_cond_signal(&d->q_cv);
    pthread_mutex_unlock(&d->q_mu);
    return L2_OK;
}

static void dax_unlock(struct l2_adapter *a, const struct keys_object_key *keys, size_t n) {
    struct dax *d = D(a);
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < n; i++) {
        struct dax_entry *e = do_dax_find(d, &keys[i], key_hash(&keys[i]));
        if (e && e->locks) e->locks--;
    }
    pthread_mutex_unlock(&d->mu);
}

/* Removes e from the index and its slot, firing the delete accounting. Caller holds mu. */
void do_dax_delete_entry(struct dax *d, struct dax_entry *e) {
    do_unlink(d, e);
    struct dax_dev *v = d->devs[e->dev];
    do_dax_slot_release(v, e->slot);
    l2_adapter_notify_deleted(&d->base, &e->key, d->slot_size);
    free(e);
}

static int dax_delete(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                      uint8_t *deleted, size_t *skipped) {
    struct dax *d = D(a);
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < n; i++) {
        struct dax_entry *e = do_dax_find(d, &keys[i], key_hash(&keys[i]));
        if (!e) continue;
        if (e->locks) {
            (*skipped)++;
            continue;
        }
        do_dax_delete_entry(d, e);
        if (deleted) deleted[i] = 1;
    }
    do_wake(d);
    pthread_mutex_unlock(&d->mu);
    return L2_OK;
}

/* ---- listing: L2-name order, the token is the last name of the previous page ----------------- */

struct name_ent {
    char *name;
    uint64_t size;
};

static int cmp_names(const void *x, const void *y) {
    return strcmp(((const struct name_ent *)x)->name, ((const struct name_ent *)y)->name);
}

static int dax_list(struct l2_adapter *a, const char *model_filter, size_t page_size,
                    const char *token, struct l2_list_page *out, char *err, size_t errlen) {
    struct dax *d = D(a);
    if (token) {
        struct keys_object_key tk;
        char e[KEYS_ERR_MAX];
        if (keys_l2_name_parse(token, strlen(token), &tk, e, sizeof(e)) != 0) {
            errbuf_set(err, errlen, "malformed page token");
            return L2_ERR_BAD_TOKEN;
        }
    }
    pthread_mutex_lock(&d->mu);
    struct name_ent *v = calloc(d->index.count + 1, sizeof(*v));
    size_t n = 0;
    int rc = L2_OK;
    if (!v) rc = L2_ERR_NOMEM;
    for (size_t b = 0; rc == L2_OK && b < d->index.nb; b++) {
        for (struct htab_node *hn = d->index.b[b]; hn; hn = hn->next) {
            const struct dax_entry *e = ENTRY(hn);
            if (model_filter && strcmp(e->key.model_name, model_filter) != 0) continue;
            char name[KEYS_L2_NAME_MAX];
            if (keys_l2_name(&e->key, name, sizeof(name)) < 0) continue;
            if (token && strcmp(name, token) <= 0) continue;
            v[n].name = strdup(name);
            if (!v[n].name) {
                rc = L2_ERR_NOMEM;
                break;
            }
            v[n++].size = e->size;
        }
    }
    pthread_mutex_unlock(&d->mu);
    if (rc == L2_OK) {
        qsort(v, n, sizeof(*v), cmp_names);
        size_t take = n < page_size ? n : page_size;
        out->entries = calloc(take ? take : 1, sizeof(*out->entries));
        if (!out->entries) rc = L2_ERR_NOMEM;
        for (size_t i = 0; rc == L2_OK && i < take; i++) {
            char e[KEYS_ERR_MAX];
            if (keys_l2_name_parse(v[i].name, strlen(v[i].name), &out->entries[i].key, e,
                                   sizeof(e)) != 0)
                continue;
            out->entries[out->count].key = out->entries[i].key;
            out->entries[out->count++].size = v[i].size;
        }
        if (rc == L2_OK && n > page_size) {
            out->next_token = strdup(v[take - 1].name);
            if (!out->next_token) rc = L2_ERR_NOMEM;
        }
    }
    for (size_t i = 0; i < n; i++) free(v[i].name);
    free(v);
    if (rc != L2_OK) {
        l2_list_page_free(out);
        errbuf_set(err, errlen, "out of memory");
    }
    return rc;
}

/* ---- status ---------------------------------------------------------------------------------- */

json_t *do_dax_dev_json(const struct dax_dev *v) {
    return json_pack("{s:s, s:s, s:I, s:s, s:I, s:I, s:I, s:I, s:I}", "device_path", v->path,
                     "state", dax_state_names[v->state], "size_bytes", (json_int_t)v->size, "kind",
                     v->is_devdax ? "devdax" : "file", "align_bytes", (json_int_t)v->align,
                     "slot_count", (json_int_t)v->nslots, "used_slots", (json_int_t)v->used,
                     "free_slots", (json_int_t)(v->nslots - v->used), "keys", (json_int_t)v->live);
}

static json_t *dax_reconfigure_status(struct l2_adapter *a) {
    struct dax *d = D(a);
    json_t *devs = json_array();
    uint64_t cap = 0, used = 0;
    unsigned attached = 0;
    pthread_mutex_lock(&d->mu);
    for (unsigned i = 0; i < d->ndevs; i++) {
        const struct dax_dev *v = d->devs[i];
        json_array_append_new(devs, do_dax_dev_json(v));
        if (v->state == ST_REMOVED) continue;
        attached++;
        cap += (uint64_t)v->nslots * d->slot_size;
        used += (uint64_t)v->used * d->slot_size;
    }
    size_t keys = d->index.count;
    pthread_mutex_unlock(&d->mu);
    return json_pack("{s:i, s:s, s:I, s:i, s:I, s:I, s:I, s:o}", "adapter_index", 0, "type", "dax",
                     "slot_size", (json_int_t)d->slot_size, "num_devices", (int)attached,
                     "capacity_bytes", (json_int_t)cap, "used_bytes", (json_int_t)used, "keys",
                     (json_int_t)keys, "devices", devs);
}

static json_t *dax_status(struct l2_adapter *a) {
    struct dax *d = D(a);
    json_t *s = dax_reconfigure_status(a);
    json_object_del(s, "adapter_index");
    json_object_del(s, "type");
    bool healthy = true;
    pthread_mutex_lock(&d->mu);
    for (unsigned i = 0; i < d->ndevs; i++)
        if (d->devs[i]->state == ST_FAILED) healthy = false;
    pthread_mutex_unlock(&d->mu);
    json_object_set_new(s, "is_healthy", json_boolean(healthy));
    return s;
}

/* Index of the attached (not removed) device with this path or the same inode; -1. */
int do_dax_find_dev(struct dax *d, const char *path) {
    struct stat st;
    bool have = stat(path, &st) == 0;
    for (unsigned i = 0; i < d->ndevs; i++) {
        const struct dax_dev *v = d->devs[i];
        if (v->state == ST_REMOVED) continue;
        if (strcmp(v->path, path) == 0) return (int)i;
        if (have && v->st_dev == st.st_dev && v->st_ino == st.st_ino) return (int)i;
    }
    return -1;
}

/* ---- life cycle ------------------------------------------------------------------------------ */

static void dax_free_state(struct dax *d) {
    for (unsigned i = 0; i < d->ndevs; i++) {
        struct dax_dev *v = d->devs[i];
        if (v->map) dax_map_free(v->map);
        dax_dev_free(v);
    }
    d->ndevs = 0;
    for (size_t b = 0; b < d->index.nb; b++) {
        for (struct htab_node *n = d->index.b[b], *next; n; n = next) {
            next = n->next;
            free(ENTRY(n));
        }
    }
    htab_fini(&d->index);
    pthread_mutex_destroy(&d->mu);
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->reconf_mu);
    pthread_mutex_destroy(&d->q_mu);
    pthread_cond_destroy(&d->q_cv);
}

static void dax_destroy(struct l2_adapter *a) {
    struct dax *d = D(a);
    pthread_mutex_lock(&d->q_mu);
    d->stopping = true;
    pthread_cond_broadcast(&d->q_cv);
    pthread_mutex_unlock(&d->q_mu);
    for (unsigned i = 0; i < d->nworkers; i++) pthread_join(d->workers[i], NULL);
    dax_free_state(d);
    l2_adapter_base_fini(a);
    free(d);
}

static const struct l2_adapter_ops DAX_OPS = {
    .type_name = "dax",
    .submit = dax_submit,
    .unlock = dax_unlock,
    .delete_keys = dax_delete,
    .list = dax_list,
    .status = dax_status,
    .reconfigure = dax_reconfigure,
    .reconfigure_status = dax_reconfigure_status,
    .destroy = dax_destroy,
};

static const char *const CONFIG_FIELDS[] = {
    "type",         "devices", "slot_size", "workers", "eviction", "persist_enabled",
    "affinity_tag", "serde",   "shared",    NULL,
};
static const char *const DEVICE_FIELDS[] = {"device_path", "size", NULL};

static int parse_config(const json_t *cfg, uint64_t *slot_size, unsigned *workers, char *err,
                        size_t errlen) {
    const char *k = jfield_unknown(cfg, CONFIG_FIELDS);
    json_t *v, *s;
    if (k) {
        errbuf_set(err, errlen, "dax: unknown field \"%s\"", k);
        return -1;
    }
    *slot_size = DAX_DEFAULT_SLOT;
    s = json_object_get(cfg, "slot_size");
    if (s && jfield_size(s, "dax: slot_size", slot_size, err, errlen) != 0) return -1;
    *slot_size = (*slot_size + DAX_SLOT_ALIGN - 1) / DAX_SLOT_ALIGN * DAX_SLOT_ALIGN;
    long w = DAX_DEFAULT_WORKER;
    if (jfield_int(cfg, "workers", 1, 16, &w, "dax", err, errlen) != 0) return -1;
    *workers = (unsigned)w;
    json_t *devs = json_object_get(cfg, "devices");
    if (!json_is_array(devs)) {
        errbuf_set(err, errlen, "dax: \"devices\" must be an array of {device_path, size}");
        return -1;
    }
    if (json_array_size(devs) > DAX_MAX_DEVICES) {
        errbuf_set(err, errlen, "dax: at most %d devices", DAX_MAX_DEVICES);
        return -1;
    }
    size_t i;
    json_array_foreach(devs, i, v) {
        if (!json_is_object(v)) {
            errbuf_set(err, errlen, "dax: devices[%zu] must be an object", i);
            return -1;
        }
        if ((k = jfield_unknown(v, DEVICE_FIELDS))) {
            errbuf_set(err, errlen, "dax: devices[%zu]: unknown field \"%s\"", i, k);
            return -1;
        }
        if (!json_is_string(json_object_get(v, "device_path"))) {
            errbuf_set(err, errlen, "dax: devices[%zu].device_path must be a string", i);
            return -1;
        }
        if (!json_object_get(v, "size")) {
            errbuf_set(err, errlen, "dax: devices[%zu].size is required", i);
            return -1;
        }
    }
    return 0;
}

int dax_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen) {
    *out = NULL;
    uint64_t slot_size;
    unsigned workers;
    if (parse_config(config, &slot_size, &workers, err, errlen) != 0) return L2_ERR_INVAL;
    struct dax *d = calloc(1, sizeof(*d));
    if (!d) {
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    int rc = l2_adapter_base_init(&d->base, &DAX_OPS, config, err, errlen);
    if (rc != L2_OK) {
        free(d);
        return rc;
    }
    d->slot_size = slot_size;
    d->lg = log_get("lmcache.l2.dax");
    if (htab_init(&d->index, 1024, entry_hash, NULL) != 0 ||
        pthread_mutex_init(&d->mu, NULL) != 0 || pthread_cond_init(&d->cv, NULL) != 0 ||
        pthread_mutex_init(&d->reconf_mu, NULL) != 0 || pthread_mutex_init(&d->q_mu, NULL) != 0 ||
        pthread_cond_init(&d->q_cv, NULL) != 0) {
        errbuf_set(err, errlen, "out of memory");
        htab_fini(&d->index);
        l2_adapter_base_fini(&d->base);
        free(d);
        return L2_ERR_NOMEM;
    }
    json_t *devs = json_object_get(config, "devices"), *v;
    size_t i;
    json_array_foreach(devs, i, v) {
        const char *path = json_string_value(json_object_get(v, "device_path"));
        uint64_t size;
        char e[256];
        int src = jfield_size(json_object_get(v, "size"), "size", &size, e, sizeof(e));
        struct dax_dev *dv = NULL;
        if (src == 0 && do_dax_find_dev(d, path) >= 0) {
            snprintf(e, sizeof(e), "%s is listed twice", path);
            src = -1;
        }
        if (src != 0 || dax_dev_open(path, size, slot_size, &dv, e, sizeof(e)) != 0) {
            errbuf_set(err, errlen, "dax: devices[%zu]: %s", i, e);
            dax_free_state(d);
            l2_adapter_base_fini(&d->base);
            free(d);
            return L2_ERR_INVAL;
        }
        d->devs[d->ndevs++] = dv;
    }
    do_dax_update_capacity(d);
    for (unsigned w = 0; w < workers; w++) {
        if (pthread_create(&d->workers[w], NULL, worker_main, d) != 0) {
            errbuf_set(err, errlen, "dax: cannot start worker threads");
            d->nworkers = w;
            dax_destroy(&d->base);
            return L2_ERR_NOMEM;
        }
        d->nworkers = w + 1;
    }
    *out = &d->base;
    return L2_OK;
}
