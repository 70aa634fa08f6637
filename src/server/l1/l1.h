/* L1: the DRAM cache engine -- arena, key table with striped locks, LRU / IsolatedLRU eviction by
 * bytes, per-salt usage and quota enforcement. The one header the engine includes for L1.
 *
 * Objects. One object holds the KV bytes of one chunk for one (model, kv_rank, object group,
 * cache_salt). An entry is STAGING while its writer copies bytes in (it holds the write lease;
 * readers cannot see it) and RESIDENT afterwards (readable; may hold read leases).
 *
 * Forced removal. A forced clear or delete never frees memory a lease holder may still be
 * copying: a locked entry is taken out of view instead (new readers miss it, a new writer of the
 * same key gets L1_ERR_BUSY) and "doomed"; its memory is freed when its last read lock is
 * released, when its writer finishes or aborts, or when its lease runs out (l1_evict_tick).
 * So one key names at most one entry at any time, and a release by key always reaches the entry
 * its holder locked, unless that holder outlived its lease.
 *
 * Names. Model names and salts are interned into small ids with a generation (struct l1_key).
 * Only stores intern (l1_key_make); reads build keys with l1_key_lookup, which never adds a
 * name. A name no object uses any more is dropped when the table needs room for a new one; its
 * id may then name another string, but with a new generation, so a key kept from before never
 * matches the new string's objects.
 *
 * Time. Every call that depends on time takes now_ns (monotonic nanoseconds, e.g.
 * clock_mono_ns()); leases and lazy LRU updates are computed from it, so tests need no sleeps.
 *
 * Locking. All functions are thread-safe. Entry state is changed only under the entry's stripe
 * mutex; LRU lists, per-salt usage and list lengths under the one LRU mutex; the allocator under
 * the arena mutex. Order: stripe -> LRU -> arena (docs/threads.md). No function holds a lock when
 * it returns, and KV bytes are never copied under a lock: the caller copies between
 * l1_reserve_write and l1_finish_write (write lease) or between l1_reserve_read and
 * l1_finish_read (read leases). A lease that expires makes the object reclaimable; a caller that
 * still copies after its lease expired may read or write memory that now belongs to another
 * object, so leases must be much longer than any copy. The library starts no thread: the
 * daemon calls l1_evict_tick() periodically.
 *
 * Return values: L1_OK (0) or L1_EXISTS (1) on success, a negative L1_ERR_* otherwise;
 * l1_strerror() names them. */
#ifndef LMCACHE_SERVER_L1_L1_H
#define LMCACHE_SERVER_L1_L1_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server/keys.h"
#include "server/l1/quota.h"

enum {
    L1_OK = 0,
    L1_EXISTS = 1,              /* reserve_write: already resident, nothing to copy */
    L1_ERR_NOT_FOUND = -1,      /* no such entry (or not in the state the call needs) */
    L1_ERR_BUSY = -2,           /* locked: another live writer, or read/write leases held */
    L1_ERR_NOMEM = -3,          /* nothing evictable is left to make room */
    L1_ERR_EXPIRED = -4,        /* finish_write after the write lease expired */
    L1_ERR_NOT_READABLE = -5,   /* resident, but holds no live read lock */
    L1_ERR_INVAL = -6,          /* size 0 or larger than an object may be */
    L1_ERR_TOO_MANY_NAMES = -7, /* every name id is used by objects (or the key's name was
                                   dropped meanwhile) */
    L1_ERR_OVER_QUOTA = -8,     /* IsolatedLRU: the read lock would pin more than the salt's
                                   quota */
    L1_ERR_PIN_CAP = -9         /* l1_pin: the pinned bytes would exceed pin_max_bytes */
};

enum l1_policy { L1_POLICY_LRU = 0, L1_POLICY_ISOLATED_LRU = 1, L1_POLICY_NOOP = 2 };

struct l1_key;

/* Told when a non-temporary object becomes resident (present = true) and when such an object
 * leaves (freed or doomed; present = false). Called with the object's stripe mutex held: it must
 * be quick and may take only leaf locks. model and salt are the object's names, valid for the
 * call. */
struct l1_listener {
    void (*on_change)(void *arg, const struct l1_key *k, const char *model, const char *salt,
                      bool present);
    void *arg;
};

struct l1_config {
    uint64_t size_bytes;        /* --l1-size-gb in bytes */
    uint32_t unit;              /* allocation unit/alignment, power of two >= 4096; 0 = 4096 */
    bool use_hugepages;         /* --l1-use-hugepages (falls back cleanly) */
    bool lock_memory;           /* mlock the arena (failure logged) */
    enum l1_policy policy;      /* --eviction-policy */
    double trigger_watermark;   /* usage ratio that triggers the evictor; 0 = 0.8 */
    double eviction_ratio;      /* when triggered, evict down to total*watermark*(1-ratio);
                                   0 = 0.1 */
    uint64_t read_ttl_ns;       /* read lease; 0 = 300 s */
    uint64_t write_ttl_ns;      /* write lease; 0 = 600 s */
    uint64_t touch_interval_ns; /* lazy LRU: skip moving an entry touched this recently; 0 = no
                                   skipping (exact LRU) */
    uint32_t stripes;           /* key-table stripes, rounded up to a power of two; 0 = 1024 */
    uint32_t alloc_evict_max;   /* victims examined per allocation before giving up; 0 = 4096 */
    uint32_t max_salts;         /* distinct cache_salts (<= 65535); 0 = 4096 */
    uint32_t max_models;        /* distinct model names (<= 65535); 0 = 1024 */
    uint64_t pin_max_bytes;     /* reply pins (l1_pin) may hold at most this many bytes; 0: no
                                   pins */
    struct quota *quota;        /* borrowed, may be NULL (every salt then has limit 0); read by
                                   l1_evict_tick and l1_quota_changed only */
    /* optional: told of resident objects coming and going (on_change NULL: none) */
    struct l1_listener listener;
};

/* The compact key the table stores: the chunk hash plus interned model name and salt. Make it
 * with l1_key_make(); it is plain data (memcmp-comparable, every byte initialised). */
struct l1_key {
    uint8_t hash[KEYS_HASH_MAX];
    uint32_t kv_rank;
    uint32_t object_group_id;
    uint16_t model_id;
    uint16_t salt_id;
    uint8_t hash_len;
    uint8_t model_gen; /* generations of the ids (low bits): a key made before its name was */
    uint16_t salt_gen; /* dropped and the id reused never matches the new name's objects */
};

/* Where the caller copies to (after reserve_write) or from (after reserve_read). */
struct l1_ref {
    void *data;
    uint64_t size;  /* the object's size as requested by its writer */
    uint32_t token; /* write token: pass it back to finish_write/abort_write */
};

struct l1_stats {
    uint64_t objects;         /* resident objects */
    uint64_t staging_objects; /* objects being written */
    uint64_t staging_bytes;
    uint64_t temporary_objects;
    uint64_t read_locked_objects;  /* resident with a live read lease */
    uint64_t write_locked_objects; /* staging with a live write lease */
    uint64_t locked_objects;       /* read_locked + write_locked */
    uint64_t doomed_objects;       /* removed by a forced clear/delete, still in use */
    uint64_t pinned_objects;       /* objects with reply pins (l1_pin) */
    uint64_t pins;                 /* reply pins held */
    uint64_t pinned_bytes;         /* bytes the pins hold (one object's size per pin) */
    uint64_t bytes_used;           /* arena bytes in use (resident + staging, unit-rounded) */
    uint64_t bytes_total;
    double usage_ratio;
    bool hugetlb;
    /* monotonic counters */
    uint64_t read_chunks;        /* successful reserve_read calls (one per key) */
    uint64_t write_chunks;       /* successful finish_write calls */
    uint64_t evicted_chunks;     /* objects removed by eviction (allocation or tick) */
    uint64_t alloc_failures;     /* reserve_write calls that ended in L1_ERR_NOMEM */
    uint64_t reclaimed_staging;  /* expired write leases reclaimed */
    uint64_t eviction_ticks;     /* l1_evict_tick calls */
    uint64_t eviction_triggered; /* ticks that found usage above the watermark */
    uint64_t pins_refused;       /* l1_pin calls refused by pin_max_bytes */
};

struct l1_salt_stats {
    uint32_t id;      /* the salt's id; after the salt is dropped the id may name another salt, */
    uint32_t gen;     /* with another gen and counters restarted at 0 */
    uint64_t bytes;   /* resident + staging bytes of this salt */
    uint64_t objects; /* resident + staging objects */
    uint64_t read_chunks, write_chunks, evicted_chunks;
};

struct l1_tick_report {
    uint64_t evicted_objects;
    uint64_t evicted_bytes;
    uint64_t reclaimed_staging;
    uint64_t quota_evicted_objects; /* part of evicted_objects done for IsolatedLRU quotas */
    bool triggered;                 /* usage was at or above the watermark */
    double usage_before, usage_after;
};

struct l1;

/* Maps the arena and builds the table. Returns 0, or -1 with a message in err. */
int l1_create(const struct l1_config *cfg, struct l1 **out, char *err, size_t errlen);
/* Frees everything. No other call may be running or follow. */
void l1_destroy(struct l1 *l1);

/* Builds the compact key of a validated ObjectKey for a store, interning its model name and
 * salt; when a table is full, names no object uses are dropped first. Returns L1_OK or
 * L1_ERR_TOO_MANY_NAMES (every id is used by objects). */
int l1_key_make(struct l1 *l1, const struct keys_object_key *k, struct l1_key *out);
/* Builds the key for a read, interning nothing: when the model name or salt is unknown, *out is
 * a key no object has (reads miss, releases do nothing). Always L1_OK. */
int l1_key_lookup(struct l1 *l1, const struct keys_object_key *k, struct l1_key *out);
/* The interned names behind a key's ids (NULL for unknown ids). The string is valid while an
 * object of that name exists. */
const char *l1_model_name(struct l1 *l1, uint16_t model_id);
const char *l1_salt_name(struct l1 *l1, uint16_t salt_id);

/* ---- store ------------------------------------------------------------------------------------
 * l1_reserve_write: L1_OK -> a STAGING object of `size` bytes with the write lease is in *out;
 *   copy the bytes to out->data, then l1_finish_write(out->token) (or l1_abort_write).
 *   L1_EXISTS -> the key is resident already: skip the copy, the store succeeded.
 *   L1_ERR_BUSY -> another writer holds a live lease on this key.
 *   L1_ERR_NOMEM -> the allocation did not fit even after evicting (evict-on-allocate).
 *   L1_ERR_BUSY also while a forced clear's doomed entry of this key is still in use.
 *   L1_ERR_TOO_MANY_NAMES -> the key's name was dropped after l1_key_make (the name table was
 *   full and the name unused): make the key again.
 *   A STAGING entry whose lease expired is handed to the new writer.
 *   temporary: the object is freed when its last read lock is released (prefetched data).
 * l1_finish_write: STAGING -> RESIDENT (MRU), taking read_locks read locks atomically (0 for a
 *   plain store). Under IsolatedLRU, when the locks would exceed the salt's quota (see
 *   l1_reserve_read), the object is stored without them and L1_ERR_OVER_QUOTA is returned.
 * L1_ERR_NOT_FOUND when the token no longer names a staging entry (it was reclaimed or cleared),
 * L1_ERR_EXPIRED when the lease ran out (the entry stays for the evictor to reclaim).
 * l1_abort_write: drops the staging entry. L1_OK or L1_ERR_NOT_FOUND. */
int l1_reserve_write(struct l1 *l1, const struct l1_key *key, uint64_t size, bool temporary,
                     uint64_t now_ns, struct l1_ref *out);
int l1_finish_write(struct l1 *l1, const struct l1_key *key, uint32_t token, uint32_t read_locks,
                    uint64_t now_ns);
int l1_abort_write(struct l1 *l1, const struct l1_key *key, uint32_t token);

/* ---- read -------------------------------------------------------------------------------------
 * l1_reserve_read: takes n read locks on a RESIDENT key and renews its read lease (one deadline
 *   for all holders); *out (may be NULL) tells where the bytes are. L1_ERR_NOT_FOUND for absent
 *   or staging keys. Under IsolatedLRU the bytes of a salt's read-locked objects may not exceed
 *   its quota (0 without one): locking one more object past it gives L1_ERR_OVER_QUOTA, so a
 *   tenant cannot pin memory its eviction must be able to reclaim.
 * l1_reserve_read_prefix: reserve_read on keys[0..count) until the first miss; returns the
 *   number of leading hits, each holding n locks (a lookup of one prompt; the hits are counted
 *   as reads of keys[0]'s salt).
 * l1_read_locked: the bytes of a key that currently holds a live read lock, without taking one
 *   (the retrieve after a lookup). L1_ERR_NOT_READABLE when no live read lock is held.
 * l1_finish_read: releases n locks (extra releases and releases after the lease expired are
 *   harmless), frees a temporary object whose count reaches 0, and counts as an access for LRU.
 */
int l1_reserve_read(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now_ns,
                    struct l1_ref *out);
size_t l1_reserve_read_prefix(struct l1 *l1, const struct l1_key *keys, size_t count, uint32_t n,
                              uint64_t now_ns);
int l1_read_locked(struct l1 *l1, const struct l1_key *key, uint64_t now_ns, struct l1_ref *out);
int l1_finish_read(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now_ns);

/* ---- reply pins ------------------------------------------------------------------------------
 * l1_pin: while the caller holds a live read lock on key (RESIDENT, or DOOMED after a forced
 *   clear), pins the object for a reply sent straight from its memory. A pin does not expire:
 *   the entry counts as locked (never evicted, delete needs force, clear dooms it) until
 *   l1_unpin, and a doomed or temporary entry is freed by its last unpin. The read lock may be
 *   released once the pin is taken. L1_OK with *out set; L1_ERR_PIN_CAP when the pinned bytes
 *   would pass pin_max_bytes (send a copy instead); L1_ERR_NOT_READABLE / L1_ERR_NOT_FOUND
 *   without a live read lock; L1_ERR_NOMEM; L1_ERR_BUSY when the count is full.
 * l1_unpin: releases a pin; thread-safe, callable from any thread holding no L1 lock (libzmq's
 *   message free callback). Every pin must be released before l1_destroy. */
struct l1_pin;
int l1_pin(struct l1 *l1, const struct l1_key *key, uint64_t now_ns, struct l1_pin **out);
void l1_unpin(struct l1_pin *pin, uint64_t now_ns);

/* ---- maintenance ------------------------------------------------------------------------------
 * l1_delete: frees a key. Without force, a key with live leases gives L1_ERR_BUSY; force removes
 *   it anyway (a locked entry is doomed: gone for new callers, freed when its holders finish).
 * l1_touch: marks a resident key as used (LRU MRU, lazily). L1_OK or L1_ERR_NOT_FOUND.
 * l1_clear: force -> removes every object, locked or staging (POST /cache/clear): unlocked
 *   ones are freed, locked ones doomed; otherwise only unlocked residents and expired staging
 *   entries. Returns the number of objects removed. */
int l1_delete(struct l1 *l1, const struct l1_key *key, bool force, uint64_t now_ns);
int l1_touch(struct l1 *l1, const struct l1_key *key, uint64_t now_ns);
size_t l1_clear(struct l1 *l1, bool force, uint64_t now_ns);

/* One pass of the background evictor (the daemon's `l1-evictor` periodic thread calls it every
 * 100 ms - 1 s): reclaims expired write leases; under IsolatedLRU refreshes the salt limits
 * from the quota table and evicts each salt down to its limit (unregistered: 0); when usage is
 * at or above the watermark, evicts LRU-first down to total*watermark*(1-ratio); frees doomed
 * entries whose lease ran out. Never evicts a locked entry. Fills *out (may be NULL) and returns 0.
 */
int l1_evict_tick(struct l1 *l1, uint64_t now_ns, struct l1_tick_report *out);

/* Re-reads the salt limits from the quota table now (call after PUT/DELETE /quota) instead of
 * waiting for the next tick. */
void l1_quota_changed(struct l1 *l1);

/* ---- stats ------------------------------------------------------------------------------------
 * l1_get_stats: counters are read without locks; the locked counts need a walk over every
 *   stripe (each locked briefly), O(objects). */
void l1_get_stats(struct l1 *l1, uint64_t now_ns, struct l1_stats *st);
/* Calls fn for every interned salt, in id order, with its usage and counters. Takes the LRU
 * lock per salt, not across fn. */
void l1_salt_foreach(struct l1 *l1,
                     void (*fn)(const char *salt, const struct l1_salt_stats *st, void *arg),
                     void *arg);
/* Current bytes of one salt ("" = the empty salt); 0 for a salt never seen. For GET /quota. */
uint64_t l1_salt_usage_bytes(struct l1 *l1, const char *salt);

/* The arena mapping (for a background prefault with MADV_POPULATE_WRITE, which keeps contents). */
void l1_arena_region(struct l1 *l1, void **base, uint64_t *len);

const char *l1_strerror(int rc);
/* Bytes of table metadata per object (entry + allocator + hash bucket), for benchmarks. */
size_t l1_entry_overhead_bytes(void);

#endif
