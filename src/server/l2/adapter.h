/* L2 adapter interface: what every L2 backend (fs, s3, dax) implements, and the common base every
 * adapter embeds (completion queue + eventfd, listeners, byte accounting in total and per
 * cache_salt, counters). The storage controller (controller.h) is the only caller of the data
 * operations; the HTTP layer reaches list/delete/usage/status through the engine.
 *
 * Asynchronous operations. store, lookup-and-lock and load are submitted as a struct l2_task that
 * the CALLER owns and keeps alive (with every array it points to) until the task comes back from
 * l2_adapter_drain(). submit never blocks on I/O: it queues the task and returns. When the task is
 * done the adapter calls l2_adapter_complete(), which appends it to the adapter's completion queue
 * and writes 1 to the notify eventfd (the adapter's own, or one the caller passed with
 * l2_adapter_set_notify_fd so that one poll covers several adapters). Every accepted task
 * completes exactly once, also at shutdown (with status L2_ERR_CLOSED).
 *
 *   store:  keys[i] <- bufs[i] (size bufs[i].size). ok[i] = 1 when stored (or already present).
 *           The adapter reads bufs[i] until completion; the caller holds L1 read locks meanwhile.
 *   lookup: ok[i] = 1 when keys[i] exists; the adapter then holds one lock on it (a delete skips
 *           locked keys) and sizes[i] = its size in bytes. The caller must release every lock it
 *           got with unlock() (after loading, or when it gives up).
 *   load:   bufs[i].data receives exactly bufs[i].size bytes of keys[i]; ok[i] = 1 on success. A
 *           size mismatch, a missing object or a failed checksum is ok[i] = 0 (never torn data:
 *           the caller must ignore bufs[i] when ok[i] = 0). The caller should hold a lookup lock.
 *
 * Thread-safety. Every operation may be called from any thread, concurrently. Listeners are
 * called from adapter threads or the submitting thread, possibly with adapter-internal locks
 * held: they must be quick, take only leaf locks and never call back into the adapter.
 *
 * Errors are values: L2_OK (0) or a negative L2_ERR_*; l2_strerror() names them. */
#ifndef LMCACHE_SERVER_L2_ADAPTER_H
#define LMCACHE_SERVER_L2_ADAPTER_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server/keys.h"

#define L2_ADAPTER_MAGIC  0x4c32414du /* "L2AM" */
#define L2_MAX_LISTENERS  8
#define L2_TYPE_NAME_MAX  32
#define L2_PAGE_SIZE_MAX  5000 /* GET /cache/objects page_size upper bound */
#define L2_PAGE_TOKEN_MAX 1024 /* longest opaque page token an adapter hands out */

enum {
    L2_OK = 0,
    L2_ERR_INVAL = -1,         /* bad argument or configuration (HTTP 400/422 material) */
    L2_ERR_NOT_SUPPORTED = -2, /* the adapter does not implement this (list -> HTTP 501) */
    L2_ERR_BAD_TOKEN = -3,     /* malformed page token (HTTP 400) */
    L2_ERR_NOSPC = -4,         /* out of space (ENOSPC, or max capacity reached) */
    L2_ERR_IO = -5,            /* an I/O or remote error */
    L2_ERR_NOMEM = -6,         /* out of memory */
    L2_ERR_CLOSED = -7,        /* the adapter is shutting down */
    L2_ERR_NOT_FOUND = -8,     /* no such key / adapter */
    L2_ERR_BUSY = -9,          /* locked, or too many operations in flight */
    L2_ERR_UNKNOWN_TYPE = -10  /* l2_adapter_create: no adapter of that "type" */
};

const char *l2_strerror(int rc);

enum l2_op { L2_OP_STORE = 0, L2_OP_LOOKUP = 1, L2_OP_LOAD = 2 };

/* One object's bytes: the source of a store, the destination of a load. */
struct l2_buf {
    void *data;
    uint64_t size;
};

/* An asynchronous request. The caller fills the first block, the adapter the second. */
struct l2_task {
    /* caller */
    enum l2_op op;
    size_t n;                           /* number of keys */
    const struct keys_object_key *keys; /* n keys (validated ObjectKeys) */
    struct l2_buf *bufs;                /* store/load: n buffers; lookup: NULL */
    uint8_t *ok;                        /* n result bytes (0/1), written by the adapter */
    uint64_t *sizes;                    /* lookup: n sizes, written for found keys; else NULL */
    void *user;                         /* the caller's cookie, untouched */
    /* adapter */
    int status;     /* L2_OK when every key succeeded, else the first error seen */
    uint64_t bytes; /* bytes transferred (stored or loaded) */
    uint32_t nok;   /* number of ok[i] == 1 */
    /* private: completion-queue link and adapter scratch */
    struct l2_task *next;
    void *priv;
    uint64_t priv_u64;
};

/* Listener callbacks: byte accounting per salt, eviction bookkeeping, event reporting. sizes
 * are object sizes in bytes (deleted: the size the adapter remembered). */
struct l2_listener {
    void (*on_stored)(void *arg, int adapter_index, const struct keys_object_key *key,
                      uint64_t size);
    void (*on_accessed)(void *arg, int adapter_index, const struct keys_object_key *key);
    void (*on_deleted)(void *arg, int adapter_index, const struct keys_object_key *key,
                       uint64_t size);
    void *arg;
};

/* One page of a listing. Free with l2_list_page_free(). */
struct l2_list_entry {
    struct keys_object_key key;
    uint64_t size;
};
struct l2_list_page {
    struct l2_list_entry *entries; /* malloc'd */
    size_t count;
    char *next_token; /* malloc'd opaque token, NULL when the listing is exhausted */
};
void l2_list_page_free(struct l2_list_page *p);

/* Usage of one adapter. capacity_bytes 0 = unknown (no watermark eviction by usage). */
struct l2_usage {
    uint64_t bytes_used;
    uint64_t objects;
    uint64_t capacity_bytes;
};

/* Monotonic counters of one adapter (relaxed atomics, maintained by the base). */
struct l2_counters {
    uint64_t store_tasks, store_keys_ok, store_keys_failed, store_bytes;
    uint64_t lookup_tasks, lookup_hits, lookup_misses;
    uint64_t load_tasks, load_keys_ok, load_keys_failed, load_bytes;
    uint64_t deleted_keys, delete_skipped_locked;
    uint64_t in_flight; /* tasks submitted and not yet completed (a gauge) */
};

struct l2_adapter;

/* The vtable. Required: type_name, submit, unlock, delete_keys, status, destroy. list,
 * reconfigure and reconfigure_status may be NULL (not supported). */
struct l2_adapter_ops {
    /* Name shown by GET /config/adapters and used as the ?adapter= selector ("fs", "S3L2Adapter",
     * "dax"). */
    const char *type_name;
    /* Queues t (l2_adapter_submit has already validated t and counted it in flight). Returns
     * L2_OK (t will complete through l2_adapter_complete) or an error (t was not accepted and
     * will not complete; the base then undoes the in-flight count). */
    int (*submit)(struct l2_adapter *a, struct l2_task *t);
    /* Releases one lookup lock on each of keys[0..n). Never fails from the caller's view (the
     * adapter retries internally if it must); unknown or unlocked keys are ignored. */
    void (*unlock)(struct l2_adapter *a, const struct keys_object_key *keys, size_t n);
    /* Deletes keys, synchronously (may block on I/O; not called from the data path). Keys that
     * are locked are skipped and counted in *skipped, absent keys are ignored; each deleted key
     * fires on_deleted (through l2_adapter_notify_deleted). deleted (may be NULL) gets n bytes:
     * 1 = this call deleted the key. Returns L2_OK or the first error (the other keys are still
     * attempted). */
    int (*delete_keys)(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                       uint8_t *deleted, size_t *skipped);
    /* One page of at most page_size (1..L2_PAGE_SIZE_MAX) entries, in an adapter-defined stable
     * order, optionally only keys whose model_name equals model_filter (NULL = all). token is
     * NULL for the first page, else a next_token from a previous page. Best-effort consistency:
     * concurrent stores/deletes may make keys appear, vanish or move between pages. Returns
     * L2_OK, L2_ERR_BAD_TOKEN, or another error with a message in err. NULL = not supported. */
    int (*list)(struct l2_adapter *a, const char *model_filter, size_t page_size, const char *token,
                struct l2_list_page *out, char *err, size_t errlen);
    /* Adapter-specific status fields (a new JSON object). It must contain "is_healthy"; the base
     * adds "type", "index", usage and counters (l2_adapter_status). */
    json_t *(*status)(struct l2_adapter *a);
    /* Runtime reconfiguration (POST /reconfigure/{backend}/{operation}). Returns a new JSON
     * result with *http_status = 200, or a new JSON error body ({"detail": ...}) with
     * *http_status 400/404/409/422/503. NULL = not reconfigurable. */
    json_t *(*reconfigure)(struct l2_adapter *a, const char *operation, const json_t *body,
                           int *http_status);
    /* GET /reconfigure/{backend}/status: this adapter's entry (a new JSON object). */
    json_t *(*reconfigure_status)(struct l2_adapter *a);
    /* Stops the adapter's threads, completes every pending task with L2_ERR_CLOSED, frees the
     * adapter-specific state and finally calls l2_adapter_base_fini(a) and frees a. */
    void (*destroy)(struct l2_adapter *a);
};

struct l2_salt_usage; /* per-salt accounting table, private to adapter.c */

/* The base every adapter embeds as its FIRST member. Adapters set ops, call
 * l2_adapter_base_init() and then only use the l2_adapter_* helpers; the fields are private to
 * adapter.c except where noted. */
struct l2_adapter {
    unsigned magic;
    const struct l2_adapter_ops *ops; /* set by the adapter */
    int index;                        /* position in the configuration (0 = primary); set by the
                                         controller, -1 until then */
    json_t *config;                   /* the adapter's JSON config (a reference the base owns) */
    /* completion queue */
    pthread_mutex_t cq_mu;
    struct l2_task *cq_head, *cq_tail;
    int own_fd;    /* the adapter's eventfd (EFD_NONBLOCK | EFD_CLOEXEC) */
    int notify_fd; /* where completions are signalled: own_fd or the caller's */
    /* listeners (registered before any task is submitted; read without a lock afterwards) */
    struct l2_listener listeners[L2_MAX_LISTENERS];
    size_t nlisteners;
    /* accounting: total and per salt, under acct_mu (a leaf lock) */
    pthread_mutex_t acct_mu;
    uint64_t bytes_used, objects;
    uint64_t capacity_bytes; /* set by the adapter (0 = unknown) */
    struct l2_salt_usage *salts;
    /* counters */
    _Atomic uint64_t c_store_tasks, c_store_ok, c_store_failed, c_store_bytes;
    _Atomic uint64_t c_lookup_tasks, c_lookup_hits, c_lookup_misses;
    _Atomic uint64_t c_load_tasks, c_load_ok, c_load_failed, c_load_bytes;
    _Atomic uint64_t c_deleted, c_delete_skipped, c_in_flight;
};

/* ---- creation ---------------------------------------------------------------------------------
 * l2_adapter_create: builds an adapter from one --l2-adapter JSON object, dispatching on its
 *   "type" through the factory table in adapter.c (one row per adapter type). Returns L2_OK,
 *   L2_ERR_UNKNOWN_TYPE, or another error with a message in err. */
int l2_adapter_create(const json_t *config, struct l2_adapter **out, char *err, size_t errlen);
/* destroy through the vtable (NULL is ignored). */
void l2_adapter_destroy(struct l2_adapter *a);

/* A factory: one row per adapter type. */
typedef int (*l2_adapter_factory)(const json_t *config, struct l2_adapter **out, char *err,
                                  size_t errlen);

/* ---- for adapter implementations --------------------------------------------------------------
 * l2_adapter_base_init: fills the base (creates the eventfd, takes a reference on config).
 *   Returns L2_OK or an error with a message in err.
 * l2_adapter_base_fini: releases what base_init made. Tasks still queued are dropped. */
int l2_adapter_base_init(struct l2_adapter *a, const struct l2_adapter_ops *ops,
                         const json_t *config, char *err, size_t errlen);
void l2_adapter_base_fini(struct l2_adapter *a);
/* Hands a finished task back: computes t->nok, updates the counters, queues t and signals the
 * notify fd. The adapter must not touch t afterwards. */
void l2_adapter_complete(struct l2_adapter *a, struct l2_task *t);
/* Accounting + listener fan-out. notify_stored is for a key that was NOT present before (a
 * re-store of a present key must not be re-counted); notify_deleted for a key that was present,
 * with its size. Adapters call these without holding the base's locks; they may hold their own. */
void l2_adapter_notify_stored(struct l2_adapter *a, const struct keys_object_key *k, uint64_t size);
void l2_adapter_notify_accessed(struct l2_adapter *a, const struct keys_object_key *k);
void l2_adapter_notify_deleted(struct l2_adapter *a, const struct keys_object_key *k,
                               uint64_t size);
/* Reads a non-negative size in GB ("max_capacity_gb") from config into bytes; absent -> 0.
 * Returns L2_OK or L2_ERR_INVAL with a message. */
int l2_config_capacity(const json_t *config, const char *field, uint64_t *bytes, char *err,
                       size_t errlen);

/* ---- for the controller and the engine --------------------------------------------------------
 * l2_adapter_submit: checks t, counts it in flight and calls ops->submit. L2_OK or an error
 *   (t not accepted, it will not complete).
 * l2_adapter_drain: pops every completed task (in completion order) as a list linked through
 *   t->next; NULL when none. Also clears the adapter's own eventfd counter (a shared notify fd is
 *   the caller's to read).
 * l2_adapter_add_listener: before the first submit; L2_ERR_BUSY when L2_MAX_LISTENERS are set.
 * l2_adapter_set_notify_fd: signal completions on fd instead of the adapter's own (before the
 *   first submit; fd stays the caller's). fd < 0 restores the adapter's own fd.
 * l2_adapter_event_fd: the fd completions are signalled on. */
int l2_adapter_submit(struct l2_adapter *a, struct l2_task *t);
struct l2_task *l2_adapter_drain(struct l2_adapter *a);
int l2_adapter_add_listener(struct l2_adapter *a, const struct l2_listener *l);
void l2_adapter_set_notify_fd(struct l2_adapter *a, int fd);
int l2_adapter_event_fd(const struct l2_adapter *a);

/* Blocking conveniences for admin paths and tests: submit t and wait (poll on the adapter's own
 * eventfd) until it completes. Only valid while nobody else drains this adapter. Returns
 * t->status or a submit error. */
int l2_adapter_run(struct l2_adapter *a, struct l2_task *t);

static inline const char *l2_adapter_type_name(const struct l2_adapter *a) {
    return a->ops->type_name;
}
static inline bool l2_adapter_can_list(const struct l2_adapter *a) { return a->ops->list != NULL; }
static inline bool l2_adapter_reconfigurable(const struct l2_adapter *a) {
    return a->ops->reconfigure != NULL;
}
int l2_adapter_unlock(struct l2_adapter *a, const struct keys_object_key *keys, size_t n);
/* delete_keys through the vtable (see l2_adapter_ops.delete_keys). */
int l2_adapter_delete(struct l2_adapter *a, const struct keys_object_key *keys, size_t n,
                      uint8_t *deleted, size_t *skipped);
/* list through the vtable; L2_ERR_NOT_SUPPORTED when the adapter cannot list, L2_ERR_INVAL when
 * page_size is outside 1..L2_PAGE_SIZE_MAX. */
int l2_adapter_list(struct l2_adapter *a, const char *model_filter, size_t page_size,
                    const char *token, struct l2_list_page *out, char *err, size_t errlen);
void l2_adapter_usage(struct l2_adapter *a, struct l2_usage *out);
/* Bytes of one salt ("" = the empty salt) in this adapter; 0 when none. */
uint64_t l2_adapter_salt_bytes(struct l2_adapter *a, const char *salt);
/* Calls fn for every salt with objects, under the accounting lock (fn must not call back). */
void l2_adapter_salt_foreach(struct l2_adapter *a,
                             void (*fn)(const char *salt, uint64_t bytes, uint64_t objects,
                                        void *arg),
                             void *arg);
void l2_adapter_counters(struct l2_adapter *a, struct l2_counters *out);
/* The adapter's status (a new JSON object): ops->status() plus "type", "index", "usage"
 * {bytes_used, objects, capacity_bytes}, "counters" {...}; always has "is_healthy". */
json_t *l2_adapter_status(struct l2_adapter *a);

#endif
