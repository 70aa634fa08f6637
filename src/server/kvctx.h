/* Registered KV contexts (the engine's floor): an engine's paged KV cache in a named shared-memory
 * object, its layout, the registry of them, and the gather/scatter copies between engine blocks
 * and L1 objects. The engine owns the registry; front ends reach it through engine.h. */
#ifndef LMCACHE_SERVER_KVCTX_H
#define LMCACHE_SERVER_KVCTX_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

enum kv_block_order { KV_LAYER_MAJOR = 0, KV_BLOCK_MAJOR = 1 };

struct kv_layout {
    uint32_t num_layers;
    uint32_t num_blocks;
    uint32_t tokens_per_block;
    uint64_t bytes_per_token; /* of K (or V) for one token of one layer */
    uint32_t kv_count;        /* 2, or 1 for MLA */
    enum kv_block_order order;
    char dtype[32];
};

struct kv_context {
    int64_t instance_id;
    char model_name[257];
    uint32_t world_size, worker_id, kv_rank;
    char shm_name[256];
    struct kv_layout layout;
    unsigned char *base; /* the mapping */
    size_t map_size;
    uint64_t shm_dev, shm_ino;     /* identity of the object mapped (a recreated one differs) */
    _Atomic int refs;              /* the registry's reference + one per operation in flight */
    _Atomic uint64_t last_seen_ns; /* liveness: register, ping, store, retrieve */
    int pinged;                    /* ever pinged (reaping uses the longer grace otherwise) */
    /* The connections that registered it (struct dp_peer keys, newest last; under the registry
     * lock): only they may store, retrieve or unregister through it. */
    unsigned char owners[8][32];
    unsigned nowners;
    struct kv_context *next;
    /* Warming (kvwarm.c): a KV_WARM_* state, the bytes faulted in so far, and whether the
     * registry has dropped the context (the warmer then stops early). */
    _Atomic int warm_state;
    _Atomic uint64_t warm_bytes;
    _Atomic int retired;
    int warm_fd;                  /* the object, open while it is queued or being warmed */
    struct kv_context *warm_next; /* the warmer's queue (under its mutex) */
};

/* The `kv-warm` thread: faults registered objects in after their registration was answered. */
struct kv_warmer {
    pthread_mutex_t mu; /* leaf: guards the queue and the stop flag */
    pthread_cond_t cv;
    struct kv_context *head, *tail; /* one reference each */
    int stop, running;
    pthread_t tid;
};

struct kv_registry {
    pthread_mutex_t lock;
    struct kv_context *head;
    size_t count;
    struct kv_warmer warm;
};

/* Warm states of a registered context. */
#define KV_WARM_OFF     0 /* no warmer runs (it is warmed by its first copies) */
#define KV_WARM_QUEUED  1 /* faulting in: copies work, and may pay per page meanwhile */
#define KV_WARM_DONE    2 /* every page the object held at registration is faulted in */
#define KV_WARM_FAILED  3 /* the object shrank under the warmer (copies fail with shm_error) */
#define KV_WARM_DROPPED 4 /* unregistered or replaced before the warmer finished */

/* Starts the `kv-warm` thread; until then (and after kvwarm_stop) registrations are not warmed.
 * 0, or -1 with errno. */
int kvwarm_start(struct kv_registry *r);
/* Stops it (the object being warmed is left where it is) and drops the queue. */
void kvwarm_stop(struct kv_registry *r);
/* kvreg_register's hand-over: queues a new context (the queue holds a reference and a
 * duplicate of fd, the object's descriptor). */
void kvwarm_queue(struct kv_registry *r, struct kv_context *c, int fd);
/* Faults in bytes [off, off + len) of c's mapping, writable and touched as base/prefault.h does,
 * without allocating a page of the object on the client's behalf: all of them when `whole` (the
 * caller saw the object fully allocated), else only the pages the object holds written
 * (mincore). Runs under the SIGBUS guard. Returns 0 and adds the bytes faulted in to *warmed,
 * or -1 when the object no longer covers the range. */
int kv_warm_range(const struct kv_context *c, uint64_t off, uint64_t len, int whole,
                  uint64_t *warmed);
/* "off", "warming", "warm", "failed" or "dropped". */
const char *kv_warm_state_name(int state);

void kvreg_init(struct kv_registry *r);
void kvreg_destroy(struct kv_registry *r);

/* Validates the layout (chunk_size a multiple of tokens_per_block, sizes that do not
 * overflow); 0 or -1 with a message. */
int kv_layout_check(const struct kv_layout *l, uint32_t chunk_size, char *err, size_t errlen);
/* Bytes the shared-memory object must hold. */
uint64_t kv_layout_bytes(const struct kv_layout *l);
/* Bytes of one L1 object (one chunk): kv_count * layers * chunk_size * bytes_per_token. */
uint64_t kv_object_bytes(const struct kv_layout *l, uint32_t chunk_size);

/* Bytes of the proof page an object carries after its layout when the client must prove write
 * access (docs/protocol.md, "Proof of access"); the nonce is its first KV_PROOF_NONCE bytes. */
#define KV_PROOF_PAGE   4096u
#define KV_PROOF_NONCE  32u
#define KV_PEER_KEY     32u
#define KV_SHM_DIR      "/dev/shm" /* where glibc's shm_open keeps POSIX shared memory */
#define KV_SHM_NAME_MAX 200

/* Who asks to register, and the operator's policy (docs/security.md, dataplane-shm). */
struct kv_auth {
    int has_cred;                 /* the peer's SO_PEERCRED is known (ipc endpoint) */
    uint32_t peer_uid;            /* valid with has_cred */
    const uint32_t *allowed_uids; /* owners allowed for peers without credentials */
    size_t n_allowed_uids;        /* 0: the daemon's effective uid only */
    const char *const *prefixes;  /* allowed shm_name prefixes; none: any valid name */
    size_t n_prefixes;
    int need_proof;                  /* the client must write the nonce into the proof page */
    int reserve_proof_page;          /* every layout must end before the object's last page
                                      * (proofs are accepted for some peers: the daemon must
                                      * never write where a proof is read) */
    unsigned char peer[KV_PEER_KEY]; /* the connection's identity: binds the nonce to it */
    size_t max_per_peer;             /* registrations one connection may own (0: no limit) */
    size_t max_total;                /* registrations in all (0: no limit) */
};

/* Outcomes of kvreg_register besides 0 (registered) and -1 (refused: shm_error). */
#define KV_REG_BAD_NAME   (-2) /* shm_name is not a valid name: bad_request */
#define KV_REG_LIMIT      (-3) /* max_per_peer or max_total reached: too_large */
#define KV_REG_NEED_PROOF 1    /* nonce and *proof_offset set: the client writes it and retries */

/* 0 when name is "/" + 1..200 of [A-Za-z0-9._-], not "." or ".."; else -1 with a message. */
int kv_shm_name_check(const char *name, char *err, size_t errlen);

/* Registers (or refreshes, or replaces) instance c->instance_id. Before a byte of the object is
 * read or written: the name is checked, the object is opened without following links or
 * blocking, it must be a regular file of /dev/shm owned as auth allows and, with
 * auth->need_proof, hold this peer's nonce in its proof page. Then it is mapped; on success the
 * registry owns a copy. Returns 0, KV_REG_NEED_PROOF (nonce and *proof_offset filled),
 * KV_REG_BAD_NAME, or -1, with a message. */
int kvreg_register(struct kv_registry *r, const struct kv_context *c, const struct kv_auth *auth,
                   uint64_t now_ns, unsigned char nonce[KV_PROOF_NONCE], uint64_t *proof_offset,
                   char *err, size_t errlen);
/* Returns 0, or -1 when unknown, or (peer not NULL) not registered by that connection. */
int kvreg_unregister(struct kv_registry *r, int64_t instance_id, const unsigned char *peer);
/* Takes a reference on a registered context (NULL when unknown) and refreshes its liveness. */
struct kv_context *kvreg_get(struct kv_registry *r, int64_t instance_id, uint64_t now_ns);
/* The same for a data-plane client: NULL as well when peer is not among the context's owners. */
struct kv_context *kvreg_get_for(struct kv_registry *r, int64_t instance_id,
                                 const unsigned char *peer, uint64_t now_ns);
void kvreg_put(struct kv_context *c);
/* ping: refreshes liveness; 0, or -1 when unknown or (peer not NULL) not registered by that
 * connection (a stranger's pings must not keep a registration alive). With warm_state not
 * NULL, the registration's KV_WARM_* state. */
int kvreg_ping(struct kv_registry *r, int64_t instance_id, const unsigned char *peer,
               uint64_t now_ns, int *warm_state);
/* Drops registrations silent for longer than timeout_ns (grace_ns if never pinged). Returns
 * how many were dropped. */
size_t kvreg_reap(struct kv_registry *r, uint64_t now_ns, uint64_t timeout_ns, uint64_t grace_ns);
/* /status: registered instance ids, and per instance its meta. */
json_t *kvreg_ids(struct kv_registry *r);
json_t *kvreg_meta(struct kv_registry *r);
/* First registered layout for (model_name, world_size); 0 when found. */
int kvreg_find_layout(struct kv_registry *r, const char *model, uint32_t world_size,
                      struct kv_layout *out);

/* Gather: copies the blocks of one chunk (block_ids[0..chunk_size/tokens_per_block)) into obj
 * in the L1 layout [K|V][layer][token][bytes]. */
void kv_gather(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
               unsigned char *obj);
/* Scatter: the reverse; tokens of the chunk whose index within the chunk is below skip_tokens
 * are not written. */
void kv_scatter(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                const unsigned char *obj, uint32_t skip_tokens);
/* The same copies restricted to bytes [from, to) of the object (any split of the object into
 * ranges copies every byte once; a copy pool runs the ranges on several threads). */
void kv_gather_range(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                     unsigned char *obj, uint64_t from, uint64_t to);
void kv_scatter_range(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                      const unsigned char *obj, uint32_t skip_tokens, uint64_t from, uint64_t to);
/* The engine owns its shared memory and may shrink it under us: a copy touching pages beyond
 * the object's new end gets SIGBUS. kv_guard_init installs a handler that turns such a fault,
 * inside a guarded region of the same thread, into a failed call; other SIGBUS stay fatal.
 * The guarded variants return 0, or -1 when the mapping faulted (the copy is partial). */
int kv_guard_init(void);
int kv_gather_guarded(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                      unsigned char *obj);
int kv_scatter_guarded(const struct kv_context *c, uint32_t chunk_size, const uint32_t *block_ids,
                       const unsigned char *obj, uint32_t skip_tokens);
/* The guarded copies split between the caller and a copy pool (p NULL, or a copy below
 * COPYPOOL_MIN_BYTES: on the caller alone). Every piece is guarded on the thread that runs it;
 * returns when all pieces are done: 0, or -1 when any faulted (the copy is partial). The
 * caller's L1 lease or read lock covers the helpers' work, since they are done by then. */
struct copypool;
int kv_gather_pooled(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                     const uint32_t *block_ids, unsigned char *obj);
int kv_scatter_pooled(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                      const uint32_t *block_ids, const unsigned char *obj, uint32_t skip_tokens);
/* The guarded copies of n chunks of one request as a single pooled job (one wake-up of the
 * helpers and one wait for the last piece per batch, not per chunk; pieces never straddle a
 * chunk). Chunk j uses the blocks block_ids[j] and objs[j] (scatter: skips[j] tokens, skips
 * NULL: none). Returns 0 with *done = n, or -1 when a piece of chunk
 * *done faulted: chunks [0, *done) are complete, the later ones may be partial (their pieces
 * are skipped once a fault is seen, those of earlier chunks never are). */
int kv_gather_many(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                   const uint32_t *const *block_ids, unsigned char *const *objs, uint32_t n,
                   uint32_t *done);
int kv_scatter_many(struct copypool *p, const struct kv_context *c, uint32_t chunk_size,
                    const uint32_t *const *block_ids, const unsigned char *const *objs,
                    const uint32_t *skips, uint32_t n, uint32_t *done);
/* Runs fn(arg) with the guard; 0, or -1 when it faulted on a mapping. */
int kv_guarded(void (*fn)(void *arg), void *arg);

/* Pointer to (layer, kv, block) in the engine cache. */
unsigned char *kv_block_ptr(const struct kv_context *c, uint32_t layer, uint32_t kv,
                            uint32_t block);

#endif
