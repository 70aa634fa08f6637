/* Private to the Device-DAX adapter's files (dax.c: index, slots, devices, data path, listing,
 * life cycle; dax_reconf.c: runtime add/remove/resize with migration, eviction and draining). */
#ifndef LMCACHE_SERVER_L2_DAX_INTERNAL_H
#define LMCACHE_SERVER_L2_DAX_INTERNAL_H

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/types.h>

#include "base/check.h"
#include "base/htab.h"
#include "base/log.h"
#include "server/l2/dax.h"

enum dax_state { ST_ACTIVE, ST_DRAINING, ST_REMOVING, ST_REMOVED, ST_RESIZING, ST_FAILED };
extern const char *const dax_state_names[]; /* by enum dax_state */

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

static inline struct dax *D(struct l2_adapter *a) { return (struct dax *)a; }

/* Drops one reference; returns the map when it must be unmapped (outside mu) by dax_map_free. */
static inline struct dax_map *do_map_unref(struct dax_map *m) {
    CHECK(m->refs > 0);
    return --m->refs == 0 ? m : NULL;
}

static inline char *slot_addr(const struct dax *d, const struct dax_dev *v, const struct dax_map *m,
                              uint32_t slot) {
    return m->base + v->data_off + (uint64_t)slot * d->slot_size;
}

static inline void do_wake(struct dax *d) {
    if (d->waiters) pthread_cond_broadcast(&d->cv);
}

static inline bool writable(const struct dax_dev *v) { return v->state == ST_ACTIVE; }

/* The usable size of a device: rounded down to the mapping granularity. */
static inline uint64_t dev_round(uint64_t size, uint64_t align) { return size / align * align; }

/* ---- dax.c; do_ functions need mu held ---- */
struct dax_entry *do_dax_find(struct dax *d, const struct keys_object_key *k, uint64_t hv);
/* A slot leaves its state: FREE when nothing pins it, else DEAD until the last unpin. */
void do_dax_slot_release(struct dax_dev *v, uint32_t i);
void do_dax_slot_unpin(struct dax *d, struct dax_dev *v, uint32_t i);
/* Pops a free slot below alloc_limit and reserves it (WRITING); UINT32_MAX when none. */
uint32_t do_dax_slot_reserve(struct dax_dev *v);
void do_dax_rebuild_free(struct dax_dev *v);
/* The least-full active device (other than exclude) with a free slot, or -1. */
int do_dax_pick_device(struct dax *d, int exclude);
void do_dax_update_capacity(struct dax *d);
/* Removes e from the index and its slot, firing the delete accounting, and frees it. */
void do_dax_delete_entry(struct dax *d, struct dax_entry *e);
/* One device's entry of the status and reconfiguration replies (a new JSON object). */
json_t *do_dax_dev_json(const struct dax_dev *v);
/* Index of the attached (not removed) device with this path or the same inode; -1. */
int do_dax_find_dev(struct dax *d, const char *path);
/* Opens path and maps size bytes of it (see dax.c). Returns 0 or -1 with err. */
int dax_dev_open(const char *path, uint64_t size, uint64_t slot_size, struct dax_dev **out,
                 char *err, size_t errlen);
void dax_dev_free(struct dax_dev *v);
void dax_map_free(struct dax_map *m);

/* ---- dax_reconf.c ---- */
/* The adapter's reconfigure operation (POST /reconfigure/dax/{add,remove,resize}). */
json_t *dax_reconfigure(struct l2_adapter *a, const char *operation, const json_t *body, int *http);

#endif
