/* The table of placement hashes both fleet listeners keep (the master reporter and the KV-event
 * publisher): 32-byte chunk digests, each held by an owner entry that embeds a struct pt_entry
 * and keeps its own per-tier counts beside it. The digest is already uniform, so its first 8
 * bytes are the table hash. Not thread-safe: the owner's mutex covers it.
 *
 *     struct entry { struct pt_entry pe; uint32_t cnt[3]; };
 *     struct pt_entry *p = ptable_find(&t, hash);
 *     struct entry *en = p ? PT_OWNER(p, struct entry, pe) : NULL;
 */
#ifndef LMCACHE_SERVER_FLEET_PTABLE_H
#define LMCACHE_SERVER_FLEET_PTABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/htab.h"

#define PT_HASH_LEN 32

struct pt_entry {
    struct htab_node hn;
    uint64_t h;
    uint8_t hash[PT_HASH_LEN];
};

struct ptable {
    struct htab tab;
};

/* The owner entry of type `type` whose member `member` is the pt_entry at ptr. */
#define PT_OWNER(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

/* Returns 0, or -1 when out of memory (ptable_fini is then harmless). */
int ptable_init(struct ptable *t);
/* Frees every owner entry (the pt_entry sits at `offset` in it) and the buckets. */
void ptable_fini(struct ptable *t, size_t offset);

struct pt_entry *ptable_find(const struct ptable *t, const uint8_t hash[PT_HASH_LEN]);
/* Sets e's digest and links it; the digest must not be in the table yet. */
void ptable_insert(struct ptable *t, struct pt_entry *e, const uint8_t hash[PT_HASH_LEN]);
void ptable_remove(struct ptable *t, struct pt_entry *e);

/* Calls fn on every entry (fn must not insert or remove). */
void ptable_each(const struct ptable *t, void (*fn)(struct pt_entry *e, void *arg), void *arg);

/* A walk that may drop the owner's lock between buckets: visit buckets 0, 1, ... while
 * b < ptable_nbuckets(t), re-read after every retake of the lock. Every entry that stays in the
 * table throughout is visited at least once even when inserts grow the table in between (growth
 * doubles the buckets: bucket b's entries move to b or b + the old count, so none moves behind
 * the walk); an entry may be visited twice. Entries must not be removed while a walk is open. */
size_t ptable_nbuckets(const struct ptable *t);
/* Calls fn on bucket b's entries until it returns false; returns false when fn stopped. fn must
 * not insert or remove. */
bool ptable_each_in_bucket(const struct ptable *t, size_t b,
                           bool (*fn)(struct pt_entry *e, void *arg), void *arg);

#endif
