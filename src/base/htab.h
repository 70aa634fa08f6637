/* A chained hash table of intrusive nodes: the owner embeds a struct htab_node in its entries,
 * keeps the hash (or can recompute it) and the table keeps the buckets, doubling them when the
 * load factor reaches 1. It allocates nothing per entry and knows nothing of keys: look-ups walk
 * htab_bucket(t, h) and compare in the caller. Not thread-safe: the owner's lock covers it.
 *
 *     struct item { struct htab_node hn; uint64_t h; char key[32]; };
 *     static uint64_t item_hash(const struct htab_node *n, void *arg) {
 *         return HTAB_ENTRY(n, struct item, hn)->h;
 *     }
 *     htab_init(&t, 1024, item_hash, NULL);
 *     htab_insert(&t, &it->hn, it->h);
 *     for (struct htab_node *n = *htab_bucket(&t, h); n; n = n->next) ...
 */
#ifndef LMCACHE_BASE_HTAB_H
#define LMCACHE_BASE_HTAB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct htab_node {
    struct htab_node *next;
};

/* Gives a node's hash back when the table grows: the stored value, or one recomputed from the
 * entry (a table that saves the bytes of a stored hash). Must equal the h the node was inserted
 * with. */
typedef uint64_t (*htab_hash_fn)(const struct htab_node *n, void *arg);

struct htab {
    struct htab_node **b; /* nb chain heads; nb is a power of two */
    size_t nb, count;
    htab_hash_fn hash;
    void *arg;
};

/* The entry of type `type` whose member `member` is the node at ptr. */
#define HTAB_ENTRY(ptr, type, member) ((type *)(void *)((char *)(ptr)-offsetof(type, member)))

/* Allocates nb buckets (rounded up to a power of two, at least 1). Returns 0, or -1 when out of
 * memory (t is then empty and htab_fini is harmless). */
int htab_init(struct htab *t, size_t nb, htab_hash_fn hash, void *arg);
/* Frees the buckets; the entries belong to the caller (walk them first to free them). */
void htab_fini(struct htab *t);

/* The head of the chain that holds (or would hold) hash h. */
static inline struct htab_node **htab_bucket(const struct htab *t, uint64_t h) {
    return &t->b[h & (t->nb - 1)];
}

/* Links n with hash h at the head of its chain, first doubling the buckets when count >= nb. A
 * failed growth is not an error: the table keeps working with longer chains. */
void htab_insert(struct htab *t, struct htab_node *n, uint64_t h);
/* Unlinks n, which must be in the table under hash h. */
void htab_remove(struct htab *t, struct htab_node *n, uint64_t h);
/* Doubles the buckets and moves every node to its new chain. Returns false (table unchanged)
 * when the new bucket array cannot be allocated. */
bool htab_grow(struct htab *t);

#endif
