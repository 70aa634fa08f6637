/* The Device-DAX adapter's runtime reconfiguration: add, remove (migrate, evict or drain) and
 * resize devices, moving live slots between and within devices while stores and loads go on. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/errbuf.h"
#include "base/jfield.h"
#include "server/l2/dax_internal.h"

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
    if (allow_self && (ds = do_dax_slot_reserve(v)) != UINT32_MAX) di = src;
    if (di < 0) {
        di = do_dax_pick_device(d, src);
        if (di >= 0) ds = do_dax_slot_reserve(d->devs[di]);
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
    do_dax_slot_unpin(d, v, i);
    e = do_dax_find(d, &key, hv);
    int moved = 0;
    if (e && e->dev == (uint32_t)src && e->slot == i && e->gen == sgen) {
        do_dax_slot_release(v, i);
        e->dev = (uint32_t)di;
        e->slot = ds;
        e->gen = dgen;
        w->slots[ds].state = SLOT_LIVE;
        w->slots[ds].e = e;
        w->live++;
        *bytes += size;
        moved = 1;
    } else {
        do_dax_slot_release(w, ds);
    }
    struct dax_map *dead1 = do_map_unref(sm), *dead2 = do_map_unref(dm);
    do_wake(d);
    pthread_mutex_unlock(&d->mu);
    dax_map_free(dead1);
    dax_map_free(dead2);
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
            do_dax_delete_entry(d, v->slots[i].e);
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
    static const char *const ADD_FIELDS[] = {"device_path", "adapter_index", "size", NULL};
    static const char *const REMOVE_FIELDS[] = {"device_path", "adapter_index", "mode", "force",
                                                NULL};
    static const char *const RESIZE_FIELDS[] = {"device_path", "adapter_index", "size",
                                                "mode",        "force",         NULL};
    bool is_add = strcmp(op, "add") == 0, is_remove = strcmp(op, "remove") == 0;
    memset(r, 0, sizeof(*r));
    r->mode = MODE_MIGRATE;
    const char *k = jfield_unknown(body, is_add      ? ADD_FIELDS
                                         : is_remove ? REMOVE_FIELDS
                                                     : RESIZE_FIELDS);
    if (k) return fail(http, 422, "unknown field \"%s\" for dax %s", k, op);
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
    json_t *dev = do_dax_dev_json(d->devs[di]);
    pthread_mutex_unlock(&d->mu);
    return json_pack("{s:s, s:s, s:I, s:o}", "status", "ok", "operation", op, "adapter_index",
                     r->adapter_index, "device", dev);
}

static json_t *op_add(struct dax *d, const struct req *r, int *http) {
    pthread_mutex_lock(&d->mu);
    int di = do_dax_find_dev(d, r->device_path);
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
        do_dax_update_capacity(d);
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
    if (dax_dev_open(r->device_path, r->size, d->slot_size, &v, err, sizeof(err)) != 0)
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
    do_dax_update_capacity(d);
    pthread_mutex_unlock(&d->mu);
    dax_dev_free(old);
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
    do_dax_update_capacity(d);
    pthread_mutex_unlock(&d->mu);
    dax_map_free(dead);
}

/* Takes d->mu and finds the request's device: its index with mu held, or -1 with mu released
 * and *res the 404 reply. */
static int lock_attached(struct dax *d, const struct req *r, int *http, json_t **res) {
    pthread_mutex_lock(&d->mu);
    int di = do_dax_find_dev(d, r->device_path);
    if (di < 0) {
        pthread_mutex_unlock(&d->mu);
        *res = fail(http, 404, "%s is not attached", r->device_path);
    }
    return di;
}

static json_t *op_remove(struct dax *d, const struct req *r, int *http) {
    json_t *res404;
    int di = lock_attached(d, r, http, &res404);
    if (di < 0) return res404;
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
    do_dax_update_capacity(d);
    DO_WAIT_UNTIL(d, d->devs[di]->writing == 0);
    pthread_mutex_unlock(&d->mu);

    struct move_result mr = {0};
    empty_range(d, di, 0, r->mode == MODE_EVICT, r->force, false, &mr);
    if (mr.out_of_room) {
        pthread_mutex_lock(&d->mu);
        d->devs[di]->state = prev == ST_ACTIVE ? ST_DRAINING : prev;
        do_dax_update_capacity(d);
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
    json_t *res404;
    int di = lock_attached(d, r, http, &res404);
    if (di < 0) return res404;
    struct dax_dev *v = d->devs[di];
    if (v->state != ST_ACTIVE && v->state != ST_DRAINING) {
        pthread_mutex_unlock(&d->mu);
        return fail(http, 409, "%s is %s and cannot be resized", r->device_path,
                    dax_state_names[v->state]);
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
            errbuf_set(err, sizeof(err), "%s of %s failed: %s", why, r->device_path,
                       strerror(errno));
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
        do_dax_rebuild_free(v);
        struct dax_map *dead = do_map_unref(v->map);
        v->map = nm;
        v->state = prev;
        do_dax_update_capacity(d);
        pthread_mutex_unlock(&d->mu);
        dax_map_free(dead);
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
        do_dax_rebuild_free(v);
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
            do_dax_rebuild_free(v);
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
        do_dax_update_capacity(d);
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

json_t *dax_reconfigure(struct l2_adapter *a, const char *operation, const json_t *body,
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
