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
#include "server/l2/dax.h"

#include <errno.h>
#include <stdarg.h>
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
#include "base/hash.h"
#include "base/htab.h"
#include "base/jfield.h"
#include "base/log.h"

#define DAX_MAGIC_STR "LMCACHE-DAX-ARENA-v1\n"

enum dax_state { ST_ACTIVE, ST_DRAINING, ST_REMOVING, ST_REMOVED, ST_RESIZING, ST_FAILED };
static const char *const STATE_NAMES[] = {"active",  "draining", "removing",
                                          "removed", "resizing", "failed"};

enum { SLOT_FREE = 0, SLOT_WRITING, SLOT_LIVE, SLOT_DEAD };

struct dax_map {
    char *base;
    size_t len;
    int fd; /* closed with the last reference */
    unsigned refs;
};

struct dax_entry;

struct dax_slot {
    struct dax_entry *e; /* LIVE: the entry stored here */
    uint32_t gen;        /* bumped on every reservation */
    uint32_t pins;       /* copies reading this slot */
    uint8_t state;
};

struct dax_dev {
    char path[PATH_MAX];
    bool is_devdax;
    dev_t st_dev;
    ino_t st_ino;
    uint64_t align;    /* mapping granularity */
    uint64_t data_off; /* first slot's offset in the mapping */
    uint64_t size;     /* bytes of the file/device in use */
    uint64_t dev_max;  /* Device-DAX: the device's size */
    struct dax_map *map;
    enum dax_state state;
    uint32_t nslots;      /* slots that exist */
    uint32_t alloc_limit; /* slots below this may be handed out (lower while shrinking) */
    uint32_t used;        /* slots not FREE */
    uint32_t live;        /* LIVE slots */
    uint32_t writing;     /* WRITING slots */
    uint32_t pins;        /* sum of the slots' pins */
    struct dax_slot *slots;
    uint32_t *free_stack;
    uint32_t nfree;
};

struct dax_entry {
    struct htab_node hn;
    uint64_t hv;
    struct keys_object_key key;
    uint64_t size;
    uint32_t dev, slot, gen;
    uint32_t locks;
};

struct dax {
    struct l2_adapter base; /* first */
    uint64_t slot_size;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* writing/pins went down; waited on by reconfiguration */
    unsigned waiters;
    pthread_mutex_t reconf_mu;
    struct dax_dev *devs[DAX_MAX_DEVICES];
    unsigned ndevs;
    struct htab index; /* of dax_entry by key_hash */
    /* worker queue (stores and loads) */
    pthread_mutex_t q_mu;
    pthread_cond_t q_cv;
    struct l2_task *q_head, *q_tail;
    bool stopping;
    pthread_t workers[16];
    unsigned nworkers;
    struct logger *lg;
};

static struct dax *D(struct l2_adapter *a) { return (struct dax *)a; }

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

static struct dax_entry *do_find(struct dax *d, const struct keys_object_key *k, uint64_t hv) {
    for (struct htab_node *n = *htab_bucket(&d->index, hv); n; n = n->next)
        if (ENTRY(n)->hv == hv && key_eq(&ENTRY(n)->key, k)) return ENTRY(n);
    return NULL;
}

static void do_insert(struct dax *d, struct dax_entry *e) { htab_insert(&d->index, &e->hn, e->hv); }

static void do_unlink(struct dax *d, struct dax_entry *e) { htab_remove(&d->index, &e->hn, e->hv); }

/* ---- mappings and slots ---------------------------------------------------------------------- */

/* Drops one reference; returns the map when it must be unmapped (outside mu) by map_free. */
static struct dax_map *do_map_unref(struct dax_map *m) {
    CHECK(m->refs > 0);
    return --m->refs == 0 ? m : NULL;
}

static void map_free(struct dax_map *m) {
    if (!m) return;
    if (m->base) munmap(m->base, m->len);
    if (m->fd >= 0) close(m->fd);
    free(m);
}

static char *slot_addr(const struct dax *d, const struct dax_dev *v, const struct dax_map *m,
                       uint32_t slot) {
    return m->base + v->data_off + (uint64_t)slot * d->slot_size;
}

static void do_wake(struct dax *d) {
    if (d->waiters) pthread_cond_broadcast(&d->cv);
}

/* A slot leaves its state: FREE when nothing pins it, else DEAD until the last unpin. */
static void do_slot_release(struct dax_dev *v, uint32_t i) {
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

static void do_slot_unpin(struct dax *d, struct dax_dev *v, uint32_t i) {
    struct dax_slot *s = &v->slots[i];
    CHECK(s->pins > 0);
    s->pins--;
    v->pins--;
    if (s->pins == 0 && s->state == SLOT_DEAD) do_slot_release(v, i);
    do_wake(d);
}

/* Pops a free slot below alloc_limit; UINT32_MAX when none. Reserves it (WRITING). */
static uint32_t do_slot_reserve(struct dax_dev *v) {
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

static void do_rebuild_free(struct dax_dev *v) {
    v->nfree = 0;
    for (uint32_t i = 0; i < v->alloc_limit && i < v->nslots; i++)
        if (v->slots[i].state == SLOT_FREE) v->free_stack[v->nfree++] = i;
}

static bool writable(const struct dax_dev *v) { return v->state == ST_ACTIVE; }

/* The least-full active device with a free slot, or -1. */
static int do_pick_device(struct dax *d, int exclude) {
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

static void do_update_capacity(struct dax *d) {
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

static bool sys_is_dax(const struct stat *st) {
    char p[128], link[PATH_MAX];
    snprintf(p, sizeof(p), "/sys/dev/char/%u:%u/subsystem", major(st->st_rdev), minor(st->st_rdev));
    ssize_t n = readlink(p, link, sizeof(link) - 1);
    if (n <= 0) return false;
    link[n] = 0;
    const char *b = strrchr(link, '/');
    return b && strcmp(b + 1, "dax") == 0;
}

static void dev_free(struct dax_dev *v) {
    if (!v) return;
    free(v->slots);
    free(v->free_stack);
    free(v);
}

/* The usable size of a device: rounded down to the mapping granularity. */
static uint64_t dev_round(uint64_t size, uint64_t align) { return size / align * align; }

/* Opens path and maps size bytes of it. A regular file is created when missing; an existing
 * non-empty file is used only when it carries the arena header (so a typo cannot clobber a
 * file); a character device must belong to the dax subsystem. Returns 0 or -1 with err. */
static int dev_open(const char *path, uint64_t size, uint64_t slot_size, struct dax_dev **out,
                    char *err, size_t errlen) {
    *out = NULL;
    if (strlen(path) >= PATH_MAX || path[0] == 0) {
        snprintf(err, errlen, "device_path must be a non-empty path");
        return -1;
    }
    int fd = open(path, O_RDWR | O_CLOEXEC);
    bool created = false;
    if (fd < 0 && errno == ENOENT) {
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        created = fd >= 0;
    }
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        snprintf(err, errlen, "fstat %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    struct dax_dev *v = calloc(1, sizeof(*v));
    if (!v) {
        snprintf(err, errlen, "out of memory");
        close(fd);
        return -1;
    }
    snprintf(v->path, sizeof(v->path), "%s", path);
    v->st_dev = st.st_dev;
    v->st_ino = st.st_ino;
    if (S_ISCHR(st.st_mode)) {
        if (!sys_is_dax(&st)) {
            snprintf(err, errlen, "%s is a character device but not a Device-DAX device", path);
            goto fail;
        }
        char p[128];
        v->is_devdax = true;
        snprintf(p, sizeof(p), "/sys/dev/char/%u:%u/align", major(st.st_rdev), minor(st.st_rdev));
        if (read_sys_u64(p, &v->align) != 0 || v->align == 0) v->align = DAX_DEFAULT_ALIGN;
        snprintf(p, sizeof(p), "/sys/dev/char/%u:%u/size", major(st.st_rdev), minor(st.st_rdev));
        if (read_sys_u64(p, &v->dev_max) != 0) v->dev_max = UINT64_MAX;
        v->data_off = 0;
        if (size > v->dev_max) {
            snprintf(err, errlen, "size %llu exceeds the size of %s (%llu bytes)",
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
                snprintf(err, errlen,
                         "%s exists and is not a DAX arena file (refusing to overwrite it)", path);
                goto fail;
            }
        }
    } else {
        snprintf(err, errlen, "%s is neither a Device-DAX device nor a regular file", path);
        goto fail;
    }
    v->size = dev_round(size, v->align);
    if (v->size < v->data_off + slot_size) {
        snprintf(err, errlen, "size %llu of %s holds no slot of %llu bytes",
                 (unsigned long long)size, path, (unsigned long long)slot_size);
        goto fail;
    }
    uint64_t nslots = (v->size - v->data_off) / slot_size;
    if (nslots > UINT32_MAX - 1) {
        snprintf(err, errlen, "size of %s gives too many slots", path);
        goto fail;
    }
    if (!v->is_devdax) {
        if (ftruncate(fd, (off_t)v->size) != 0) {
            snprintf(err, errlen, "ftruncate %s: %s", path, strerror(errno));
            goto fail;
        }
        if (pwrite(fd, DAX_MAGIC_STR, sizeof(DAX_MAGIC_STR) - 1, 0) !=
            (ssize_t)sizeof(DAX_MAGIC_STR) - 1) {
            snprintf(err, errlen, "cannot write the header of %s: %s", path, strerror(errno));
            goto fail;
        }
    }
    v->map = calloc(1, sizeof(*v->map));
    v->slots = calloc(nslots, sizeof(*v->slots));
    v->free_stack = calloc(nslots, sizeof(*v->free_stack));
    if (!v->map || !v->slots || !v->free_stack) {
        snprintf(err, errlen, "out of memory");
        free(v->map);
        goto fail;
    }
    void *base = mmap(NULL, v->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        snprintf(err, errlen, "mmap %s (%llu bytes): %s", path, (unsigned long long)v->size,
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
    dev_free(v);
    return -1;
}

/* ---- data path ------------------------------------------------------------------------------- */

static void run_store(struct dax *d, struct l2_task *t) {
    for (size_t i = 0; i < t->n; i++) {
        const struct keys_object_key *k = &t->keys[i];
        uint64_t hv = key_hash(k), size = t->bufs[i].size;
        pthread_mutex_lock(&d->mu);
        if (do_find(d, k, hv)) {
            pthread_mutex_unlock(&d->mu);
            t->ok[i] = 1;
            continue;
        }
        if (size > d->slot_size) {
            pthread_mutex_unlock(&d->mu);
            if (t->status == L2_OK) t->status = L2_ERR_INVAL;
            continue;
        }
        int di = do_pick_device(d, -1);
        uint32_t slot = di >= 0 ? do_slot_reserve(d->devs[di]) : UINT32_MAX;
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
        if (!e || do_find(d, k, hv)) {
            /* stored meanwhile by another task (ok), or no memory for the entry (failed) */
            do_slot_release(v, slot);
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
        map_free(dead);
    }
}

static void run_load(struct dax *d, struct l2_task *t) {
    for (size_t i = 0; i < t->n; i++) {
        const struct keys_object_key *k = &t->keys[i];
        uint64_t hv = key_hash(k);
        pthread_mutex_lock(&d->mu);
        struct dax_entry *e = do_find(d, k, hv);
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
        do_slot_unpin(d, d->devs[di], slot);
        struct dax_map *dead = do_map_unref(m);
        pthread_mutex_unlock(&d->mu);
        map_free(dead);
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

static void do_lookup(struct dax *d, struct l2_task *t) {
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < t->n; i++) {
        struct dax_entry *e = do_find(d, &t->keys[i], key_hash(&t->keys[i]));
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
        do_lookup(d, t);
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
        struct dax_entry *e = do_find(d, &keys[i], key_hash(&keys[i]));
        if (e && e->locks) e->locks--;
    }
    pthread_mutex_unlock(&d->mu);
}

/* Removes e from the index and its slot, firing the delete accounting. Caller holds mu. */
static void do_delete_entry(struct dax *d, struct dax_entry *e) {
    do_unlink(d, e);
    struct dax_dev *v = d->devs[e->dev];
    do_slot_release(v, e->slot);
    l2_adapter_notify_deleted(&d->base, &e->key, d->slot_size);
    free(e);
}

static int dax_delete(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                      uint8_t *deleted, size_t *skipped) {
    struct dax *d = D(a);
    pthread_mutex_lock(&d->mu);
    for (size_t i = 0; i < n; i++) {
        struct dax_entry *e = do_find(d, &keys[i], key_hash(&keys[i]));
        if (!e) continue;
        if (e->locks) {
            (*skipped)++;
            continue;
        }
        do_delete_entry(d, e);
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
            snprintf(err, errlen, "malformed page token");
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
        snprintf(err, errlen, "out of memory");
    }
    return rc;
}

/* ---- status ---------------------------------------------------------------------------------- */

static json_t *do_dev_json(const struct dax_dev *v) {
    return json_pack("{s:s, s:s, s:I, s:s, s:I, s:I, s:I, s:I, s:I}", "device_path", v->path,
                     "state", STATE_NAMES[v->state], "size_bytes", (json_int_t)v->size, "kind",
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
        json_array_append_new(devs, do_dev_json(v));
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

/* ---- reconfiguration ------------------------------------------------------------------------- */

static json_t *fail(int *http, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static json_t *fail(int *http, int status, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    *http = status;
    return json_pack("{s:s}", "detail", msg);
}

/* Index of the attached (not removed) device with this path or the same inode; -1. */
static int do_find_dev(struct dax *d, const char *path) {
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

/* Waits (mu held) until cond holds; every writer/unpinner broadcasts cv while waiters > 0. */
#define DO_WAIT_UNTIL(d, cond)                                                                     \
    do {                                                                                           \
        (d)->waiters++;                                                                            \
        while (!(cond)) pthread_cond_wait(&(d)->cv, &(d)->mu);                                     \
        (d)->waiters--;                                                                            \
    } while (0)

/* Moves the entry in slot i of device src to a free slot (dest device chosen under mu: src
 * itself below its alloc_limit first when allow_self, else the least-full active device).
 * Returns 1 moved, 0 the slot was no longer live (deleted meanwhile), -1 no room. */
static int migrate_slot(struct dax *d, int src, uint32_t i, bool allow_self, uint64_t *bytes) {
    pthread_mutex_lock(&d->mu);
    struct dax_dev *v = d->devs[src];
    if (v->slots[i].state != SLOT_LIVE) {
        pthread_mutex_unlock(&d->mu);
        return 0;
    }
    struct dax_entry *e = v->slots[i].e;
    int di = -1;
    uint32_t ds = UINT32_MAX;
    if (allow_self && (ds = do_slot_reserve(v)) != UINT32_MAX) di = src;
    if (di < 0) {
        di = do_pick_device(d, src);
        if (di >= 0) ds = do_slot_reserve(d->devs[di]);
    }
    if (ds == UINT32_MAX) {
        pthread_mutex_unlock(&d->mu);
        return -1;
    }
    struct dax_dev *w = d->devs[di];
    uint32_t sgen = v->slots[i].gen, dgen = w->slots[ds].gen;
    v->slots[i].pins++;
    v->pins++;
    struct dax_map *sm = v->map, *dm = w->map;
    sm->refs++;
    dm->refs++;
    const char *from = slot_addr(d, v, sm, i);
    char *to = slot_addr(d, w, dm, ds);
    uint64_t size = e->size;
    struct keys_object_key key = e->key;
    uint64_t hv = e->hv;
    pthread_mutex_unlock(&d->mu);

    memcpy(to, from, size);

    pthread_mutex_lock(&d->mu);
    v = d->devs[src];
    w = d->devs[di];
    w->writing--;
    do_slot_unpin(d, v, i);
    e = do_find(d, &key, hv);
    int moved = 0;
    if (e && e->dev == (uint32_t)src && e->slot == i && e->gen == sgen) {
        do_slot_release(v, i);
        e->dev = (uint32_t)di;
        e->slot = ds;
        e->gen = dgen;
        w->slots[ds].state = SLOT_LIVE;
        w->slots[ds].e = e;
        w->live++;
        *bytes += size;
        moved = 1;
    } else {
        do_slot_release(w, ds);
    }
    struct dax_map *dead1 = do_map_unref(sm), *dead2 = do_map_unref(dm);
    do_wake(d);
    pthread_mutex_unlock(&d->mu);
    map_free(dead1);
    map_free(dead2);
    return moved;
}

struct move_result {
    uint64_t moved_keys, moved_bytes, deleted_keys;
    bool out_of_room; /* a key found no free slot (without force) */
};

/* Empties slots [from, nslots) of device di by migrating (or evicting when evict, or when a
 * migration finds no room and force). The device must not take new stores (state set by the
 * caller) and must have no WRITING slots in the range. */
static void empty_range(struct dax *d, int di, uint32_t from, bool evict, bool force,
                        bool allow_self, struct move_result *r) {
    pthread_mutex_lock(&d->mu);
    uint32_t end = d->devs[di]->nslots;
    pthread_mutex_unlock(&d->mu);
    for (uint32_t i = from; i < end; i++) {
        if (!evict) {
            int m = migrate_slot(d, di, i, allow_self, &r->moved_bytes);
            if (m > 0) r->moved_keys++;
            if (m >= 0) continue;
            if (!force) {
                r->out_of_room = true;
                return;
            }
        }
        pthread_mutex_lock(&d->mu);
        struct dax_dev *v = d->devs[di];
        if (v->slots[i].state == SLOT_LIVE) {
            do_delete_entry(d, v->slots[i].e);
            r->deleted_keys++;
        }
        pthread_mutex_unlock(&d->mu);
    }
}

/* True when every slot of v in [from, nslots) is FREE (mu held). */
static bool do_range_free(const struct dax_dev *v, uint32_t from) {
    for (uint32_t i = from; i < v->nslots; i++)
        if (v->slots[i].state != SLOT_FREE) return false;
    return true;
}

/* Counts (mu held) live and locked slots of device v in [from, nslots). */
static void do_count_range(const struct dax_dev *v, uint32_t from, uint32_t *live,
                           uint32_t *locked) {
    *live = *locked = 0;
    for (uint32_t i = from; i < v->nslots; i++) {
        if (v->slots[i].state != SLOT_LIVE) continue;
        (*live)++;
        if (v->slots[i].e->locks) (*locked)++;
    }
}

/* Free slots on active devices other than exclude (mu held). */
static uint64_t do_room(const struct dax *d, int exclude) {
    uint64_t n = 0;
    for (unsigned i = 0; i < d->ndevs; i++)
        if ((int)i != exclude && writable(d->devs[i])) n += d->devs[i]->nfree;
    return n;
}

enum mode { MODE_MIGRATE, MODE_EVICT, MODE_DRAIN };

struct req {
    const char *device_path;
    uint64_t size;
    bool has_size;
    enum mode mode;
    bool force;
    json_int_t adapter_index;
};

/* Validates a body against the fields one operation accepts. Returns NULL (req filled) or an
 * error body with *http set (422 for shape, 400 for a bad size). */
static json_t *parse_req(const char *op, const json_t *body, struct req *r, int *http) {
    bool is_add = strcmp(op, "add") == 0, is_remove = strcmp(op, "remove") == 0;
    memset(r, 0, sizeof(*r));
    r->mode = MODE_MIGRATE;
    const char *k;
    json_t *val;
    json_object_foreach((json_t *)body, k, val) {
        bool known = strcmp(k, "device_path") == 0 || strcmp(k, "adapter_index") == 0 ||
                     (strcmp(k, "size") == 0 && !is_remove) ||
                     ((strcmp(k, "mode") == 0 || strcmp(k, "force") == 0) && !is_add);
        if (!known) return fail(http, 422, "unknown field \"%s\" for dax %s", k, op);
    }
    json_t *p = json_object_get(body, "device_path");
    if (!p) return fail(http, 422, "device_path is required");
    if (!json_is_string(p)) return fail(http, 422, "device_path must be a string");
    r->device_path = json_string_value(p);
    if (!*r->device_path) return fail(http, 400, "device_path must not be empty");
    json_t *ai = json_object_get(body, "adapter_index");
    if (ai && !json_is_integer(ai)) return fail(http, 422, "adapter_index must be an integer");
    r->adapter_index = ai ? json_integer_value(ai) : 0;
    if (!is_remove) {
        json_t *s = json_object_get(body, "size");
        if (!s) return fail(http, 422, "size is required");
        char err[256];
        int rc = jfield_size(s, "size", &r->size, err, sizeof(err));
        if (rc == -1) return fail(http, 422, "%s", err);
        if (rc == -2) return fail(http, 400, "%s", err);
        r->has_size = true;
    }
    if (!is_add) {
        json_t *m = json_object_get(body, "mode");
        if (m) {
            const char *ms = json_string_value(m);
            if (ms && strcmp(ms, "migrate") == 0)
                r->mode = MODE_MIGRATE;
            else if (ms && strcmp(ms, "evict") == 0)
                r->mode = MODE_EVICT;
            else if (ms && is_remove && strcmp(ms, "drain") == 0)
                r->mode = MODE_DRAIN;
            else
                return fail(http, 422, "mode must be one of %s",
                            is_remove ? "migrate, evict, drain" : "migrate, evict");
        }
        json_t *f = json_object_get(body, "force");
        if (f && !json_is_boolean(f)) return fail(http, 422, "force must be a boolean");
        r->force = f && json_is_true(f);
    }
    return NULL;
}

static const char *MODE_NAMES[] = {"migrate", "evict", "drain"};

static json_t *result(struct dax *d, const char *op, const struct req *r, int di) {
    pthread_mutex_lock(&d->mu);
    json_t *dev = do_dev_json(d->devs[di]);
    pthread_mutex_unlock(&d->mu);
    return json_pack("{s:s, s:s, s:I, s:o}", "status", "ok", "operation", op, "adapter_index",
                     r->adapter_index, "device", dev);
}

static json_t *op_add(struct dax *d, const struct req *r, int *http) {
    pthread_mutex_lock(&d->mu);
    int di = do_find_dev(d, r->device_path);
    if (di >= 0) {
        struct dax_dev *v = d->devs[di];
        uint64_t want = dev_round(r->size, v->align);
        if (want != v->size) {
            pthread_mutex_unlock(&d->mu);
            return fail(http, 409,
                        "%s is already attached with size %llu bytes; use resize to change it",
                        r->device_path, (unsigned long long)v->size);
        }
        if (v->state == ST_FAILED) {
            pthread_mutex_unlock(&d->mu);
            return fail(http, 409, "%s is attached and failed; remove it first", r->device_path);
        }
        v->state = ST_ACTIVE; /* idempotent, and re-activates a draining device */
        do_update_capacity(d);
        pthread_mutex_unlock(&d->mu);
        *http = 200;
        return result(d, "add", r, di);
    }
    /* a removed record is reused; otherwise a new one */
    int slot = -1;
    for (unsigned i = 0; i < d->ndevs && slot < 0; i++)
        if (d->devs[i]->state == ST_REMOVED && d->devs[i]->pins == 0 && d->devs[i]->used == 0)
            slot = (int)i;
    if (slot < 0 && d->ndevs >= DAX_MAX_DEVICES) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 409, "at most %d devices per adapter", DAX_MAX_DEVICES);
    }
    pthread_mutex_unlock(&d->mu);
    struct dax_dev *v;
    char err[512];
    if (dev_open(r->device_path, r->size, d->slot_size, &v, err, sizeof(err)) != 0)
        return fail(http, 400, "%s", err);
    pthread_mutex_lock(&d->mu);
    struct dax_dev *old = NULL;
    if (slot >= 0) {
        old = d->devs[slot];
        d->devs[slot] = v;
    } else {
        slot = (int)d->ndevs;
        d->devs[d->ndevs++] = v;
    }
    do_update_capacity(d);
    pthread_mutex_unlock(&d->mu);
    dev_free(old);
    log_info(d->lg, "dax: added %s (%llu bytes, %u slots)", v->path, (unsigned long long)v->size,
             v->nslots);
    *http = 200;
    return result(d, "add", r, slot);
}

/* After a device's slots are all FREE and unpinned: unmaps it and marks it removed. */
static void finish_remove(struct dax *d, int di) {
    pthread_mutex_lock(&d->mu);
    struct dax_dev *v = d->devs[di];
    DO_WAIT_UNTIL(d, v->pins == 0 && v->writing == 0);
    v->state = ST_REMOVED;
    v->alloc_limit = 0;
    v->nfree = 0;
    struct dax_map *dead = do_map_unref(v->map);
    v->map = NULL;
    do_update_capacity(d);
    pthread_mutex_unlock(&d->mu);
    map_free(dead);
}

static json_t *op_remove(struct dax *d, const struct req *r, int *http) {
    pthread_mutex_lock(&d->mu);
    int di = do_find_dev(d, r->device_path);
    if (di < 0) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 404, "%s is not attached", r->device_path);
    }
    struct dax_dev *v = d->devs[di];
    if (r->mode == MODE_DRAIN) {
        if (v->state == ST_FAILED) {
            pthread_mutex_unlock(&d->mu);
            return fail(http, 409, "%s has failed; remove it with mode evict", r->device_path);
        }
        v->state = ST_DRAINING;
        pthread_mutex_unlock(&d->mu);
        *http = 200;
        json_t *res = result(d, "remove", r, di);
        json_object_set_new(res, "mode", json_string("drain"));
        return res;
    }
    uint32_t live, locked;
    do_count_range(v, 0, &live, &locked);
    if (r->mode == MODE_EVICT && locked && !r->force) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 409, "%u keys on %s are locked by readers; retry or set force", locked,
                    r->device_path);
    }
    if (r->mode == MODE_MIGRATE && live > do_room(d, di) && !r->force) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 409,
                    "%u keys on %s do not fit in the free slots of the other active devices "
                    "(%llu); add a device, use mode evict, or set force",
                    live, r->device_path, (unsigned long long)do_room(d, di));
    }
    enum dax_state prev = v->state;
    v->state = ST_REMOVING;
    do_update_capacity(d);
    DO_WAIT_UNTIL(d, d->devs[di]->writing == 0);
    pthread_mutex_unlock(&d->mu);

    struct move_result mr = {0};
    empty_range(d, di, 0, r->mode == MODE_EVICT, r->force, false, &mr);
    if (mr.out_of_room) {
        pthread_mutex_lock(&d->mu);
        d->devs[di]->state = prev == ST_ACTIVE ? ST_DRAINING : prev;
        do_update_capacity(d);
        pthread_mutex_unlock(&d->mu);
        json_t *res = fail(http, 409,
                           "ran out of free slots after moving %llu keys off %s; the device is "
                           "left draining",
                           (unsigned long long)mr.moved_keys, r->device_path);
        json_object_set_new(res, "moved_keys", json_integer((json_int_t)mr.moved_keys));
        return res;
    }
    uint32_t freed;
    pthread_mutex_lock(&d->mu);
    freed = d->devs[di]->used;
    pthread_mutex_unlock(&d->mu);
    finish_remove(d, di);
    log_info(d->lg, "dax: removed %s (%s: %llu moved, %llu deleted)", r->device_path,
             MODE_NAMES[r->mode], (unsigned long long)mr.moved_keys,
             (unsigned long long)mr.deleted_keys);
    *http = 200;
    json_t *res = result(d, "remove", r, di);
    json_object_set_new(res, "mode", json_string(MODE_NAMES[r->mode]));
    json_object_set_new(res, "moved_keys", json_integer((json_int_t)mr.moved_keys));
    json_object_set_new(res, "moved_bytes", json_integer((json_int_t)mr.moved_bytes));
    json_object_set_new(res, "deleted_keys", json_integer((json_int_t)mr.deleted_keys));
    (void)freed;
    return res;
}

static json_t *op_resize(struct dax *d, const struct req *r, int *http) {
    pthread_mutex_lock(&d->mu);
    int di = do_find_dev(d, r->device_path);
    if (di < 0) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 404, "%s is not attached", r->device_path);
    }
    struct dax_dev *v = d->devs[di];
    if (v->state != ST_ACTIVE && v->state != ST_DRAINING) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 409, "%s is %s and cannot be resized", r->device_path,
                    STATE_NAMES[v->state]);
    }
    uint64_t new_size = dev_round(r->size, v->align), old_size = v->size;
    if (new_size > v->dev_max) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 400, "size exceeds the size of %s (%llu bytes)", r->device_path,
                    (unsigned long long)v->dev_max);
    }
    if (new_size < v->data_off + d->slot_size) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 400, "size %llu holds no slot of %llu bytes", (unsigned long long)r->size,
                    (unsigned long long)d->slot_size);
    }
    uint64_t n64 = (new_size - v->data_off) / d->slot_size;
    if (n64 > UINT32_MAX - 1) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 400, "size gives too many slots");
    }
    uint32_t nn = (uint32_t)n64, on = v->nslots;
    enum dax_state prev = v->state;
    uint64_t moved_keys = 0, moved_bytes = 0, deleted_keys = 0;
    if (nn > on || new_size > old_size) {
        /* Grow: enlarge the file, map the new size, swap the mapping (the old one is unmapped
         * when the last copy through it ends). */
        v->state = ST_RESIZING;
        int fd = v->map->fd;
        bool devdax = v->is_devdax;
        pthread_mutex_unlock(&d->mu);
        struct dax_slot *ns = calloc(nn, sizeof(*ns));
        uint32_t *nf = calloc(nn, sizeof(*nf));
        struct dax_map *nm = calloc(1, sizeof(*nm));
        int dupfd = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
        void *base = MAP_FAILED;
        const char *why = NULL;
        char err[256] = "";
        if (!ns || !nf || !nm)
            why = "out of memory";
        else if (dupfd < 0)
            why = "dup";
        else if (!devdax && ftruncate(fd, (off_t)new_size) != 0)
            why = "ftruncate";
        else if ((base = mmap(NULL, new_size, PROT_READ | PROT_WRITE, MAP_SHARED, dupfd, 0)) ==
                 MAP_FAILED)
            why = "mmap";
        if (why) {
            snprintf(err, sizeof(err), "%s of %s failed: %s", why, r->device_path, strerror(errno));
            if (!devdax && strcmp(why, "mmap") == 0 && ftruncate(fd, (off_t)old_size) != 0)
                why = "restore";
            if (dupfd >= 0) close(dupfd);
            free(ns);
            free(nf);
            free(nm);
            pthread_mutex_lock(&d->mu);
            d->devs[di]->state = strcmp(why, "restore") == 0 ? ST_FAILED : prev;
            pthread_mutex_unlock(&d->mu);
            return fail(http, 400, "%s", err);
        }
        nm->base = base;
        nm->len = new_size;
        nm->fd = dupfd;
        nm->refs = 1;
        pthread_mutex_lock(&d->mu);
        v = d->devs[di];
        memcpy(ns, v->slots, (size_t)on * sizeof(*ns));
        free(v->slots);
        free(v->free_stack);
        v->slots = ns;
        v->free_stack = nf;
        v->nslots = v->alloc_limit = nn;
        v->size = new_size;
        do_rebuild_free(v);
        struct dax_map *dead = do_map_unref(v->map);
        v->map = nm;
        v->state = prev;
        do_update_capacity(d);
        pthread_mutex_unlock(&d->mu);
        map_free(dead);
    } else if (nn < on) {
        uint32_t live, locked;
        do_count_range(v, nn, &live, &locked);
        if (r->mode == MODE_EVICT && locked && !r->force) {
            pthread_mutex_unlock(&d->mu);
            return fail(http, 409,
                        "%u keys beyond the new end of %s are locked by readers; "
                        "retry or set force",
                        locked, r->device_path);
        }
        uint32_t low_free = 0;
        for (uint32_t i = 0; i < nn; i++) low_free += v->slots[i].state == SLOT_FREE;
        if (r->mode == MODE_MIGRATE && live > low_free + do_room(d, di) && !r->force) {
            pthread_mutex_unlock(&d->mu);
            return fail(http, 409,
                        "%u keys beyond the new end of %s do not fit in free slots; use mode "
                        "evict or set force",
                        live, r->device_path);
        }
        v->state = ST_RESIZING;
        v->alloc_limit = nn;
        do_rebuild_free(v);
        DO_WAIT_UNTIL(d, d->devs[di]->writing == 0);
        pthread_mutex_unlock(&d->mu);
        struct move_result mr = {0};
        empty_range(d, di, nn, r->mode == MODE_EVICT, r->force, true, &mr);
        moved_keys = mr.moved_keys;
        moved_bytes = mr.moved_bytes;
        deleted_keys = mr.deleted_keys;
        pthread_mutex_lock(&d->mu);
        v = d->devs[di];
        if (mr.out_of_room) {
            v->alloc_limit = v->nslots;
            do_rebuild_free(v);
            v->state = prev;
            pthread_mutex_unlock(&d->mu);
            json_t *res =
                fail(http, 409, "ran out of free slots after moving %llu keys; %s keeps its size",
                     (unsigned long long)moved_keys, r->device_path);
            json_object_set_new(res, "moved_keys", json_integer((json_int_t)moved_keys));
            return res;
        }
        /* the tail is empty; wait for copies still reading DEAD tail slots */
        DO_WAIT_UNTIL(d, do_range_free(d->devs[di], nn));
        v = d->devs[di];
        if (!v->is_devdax && ftruncate(v->map->fd, (off_t)new_size) != 0)
            log_warn(d->lg, "dax: ftruncate %s to %llu: %s (space not returned)", v->path,
                     (unsigned long long)new_size, strerror(errno));
        v->nslots = nn;
        v->size = new_size;
        v->used = 0;
        for (uint32_t i = 0; i < nn; i++) v->used += v->slots[i].state != SLOT_FREE;
        v->state = prev;
        do_update_capacity(d);
        pthread_mutex_unlock(&d->mu);
    } else {
        v->size = new_size; /* same slot count: only the rounding changed */
        pthread_mutex_unlock(&d->mu);
    }
    log_info(d->lg, "dax: resized %s from %llu to %llu bytes", r->device_path,
             (unsigned long long)old_size, (unsigned long long)new_size);
    *http = 200;
    json_t *res = result(d, "resize", r, di);
    json_object_set_new(res, "mode", json_string(MODE_NAMES[r->mode]));
    json_object_set_new(res, "old_size_bytes", json_integer((json_int_t)old_size));
    json_object_set_new(res, "new_size_bytes", json_integer((json_int_t)new_size));
    json_object_set_new(res, "moved_keys", json_integer((json_int_t)moved_keys));
    json_object_set_new(res, "moved_bytes", json_integer((json_int_t)moved_bytes));
    json_object_set_new(res, "deleted_keys", json_integer((json_int_t)deleted_keys));
    return res;
}

static json_t *dax_reconfigure(struct l2_adapter *a, const char *operation, const json_t *body,
                               int *http) {
    struct dax *d = D(a);
    if (strcmp(operation, "add") != 0 && strcmp(operation, "remove") != 0 &&
        strcmp(operation, "resize") != 0)
        return fail(http, 400, "unsupported dax operation \"%s\" (add, remove, resize)", operation);
    if (!json_is_object(body)) return fail(http, 422, "the request body must be a JSON object");
    struct req r;
    json_t *bad = parse_req(operation, body, &r, http);
    if (bad) return bad;
    pthread_mutex_lock(&d->reconf_mu);
    json_t *res;
    if (strcmp(operation, "add") == 0)
        res = op_add(d, &r, http);
    else if (strcmp(operation, "remove") == 0)
        res = op_remove(d, &r, http);
    else
        res = op_resize(d, &r, http);
    pthread_mutex_unlock(&d->reconf_mu);
    return res;
}

/* ---- life cycle ------------------------------------------------------------------------------ */

static void dax_free_state(struct dax *d) {
    for (unsigned i = 0; i < d->ndevs; i++) {
        struct dax_dev *v = d->devs[i];
        if (v->map) map_free(v->map);
        dev_free(v);
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
        snprintf(err, errlen, "dax: unknown field \"%s\"", k);
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
        snprintf(err, errlen, "dax: \"devices\" must be an array of {device_path, size}");
        return -1;
    }
    if (json_array_size(devs) > DAX_MAX_DEVICES) {
        snprintf(err, errlen, "dax: at most %d devices", DAX_MAX_DEVICES);
        return -1;
    }
    size_t i;
    json_array_foreach(devs, i, v) {
        if (!json_is_object(v)) {
            snprintf(err, errlen, "dax: devices[%zu] must be an object", i);
            return -1;
        }
        if ((k = jfield_unknown(v, DEVICE_FIELDS))) {
            snprintf(err, errlen, "dax: devices[%zu]: unknown field \"%s\"", i, k);
            return -1;
        }
        if (!json_is_string(json_object_get(v, "device_path"))) {
            snprintf(err, errlen, "dax: devices[%zu].device_path must be a string", i);
            return -1;
        }
        if (!json_object_get(v, "size")) {
            snprintf(err, errlen, "dax: devices[%zu].size is required", i);
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
        snprintf(err, errlen, "out of memory");
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
        snprintf(err, errlen, "out of memory");
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
        if (src == 0 && do_find_dev(d, path) >= 0) {
            snprintf(e, sizeof(e), "%s is listed twice", path);
            src = -1;
        }
        if (src != 0 || dev_open(path, size, slot_size, &dv, e, sizeof(e)) != 0) {
            snprintf(err, errlen, "dax: devices[%zu]: %s", i, e);
            dax_free_state(d);
            l2_adapter_base_fini(&d->base);
            free(d);
            return L2_ERR_INVAL;
        }
        d->devs[d->ndevs++] = dv;
    }
    do_update_capacity(d);
    for (unsigned w = 0; w < workers; w++) {
        if (pthread_create(&d->workers[w], NULL, worker_main, d) != 0) {
            snprintf(err, errlen, "dax: cannot start worker threads");
            d->nworkers = w;
            dax_destroy(&d->base);
            return L2_ERR_NOMEM;
        }
        d->nworkers = w + 1;
    }
    *out = &d->base;
    return L2_OK;
}
