/* The fleet listeners' table of placement hashes (see ptable.h). */
#include "server/fleet/ptable.h"

#include <stdlib.h>
#include <string.h>

static uint64_t hash_of(const uint8_t *h) {
    uint64_t v;
    memcpy(&v, h, sizeof(v)); /* already a SHA-256 digest */
    return v;
}

static uint64_t entry_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return HTAB_ENTRY(n, struct pt_entry, hn)->h;
}

int ptable_init(struct ptable *t) {
    return htab_init(&t->tab, 1024, entry_hash, NULL) < 0 ? -1 : 0;
}

void ptable_fini(struct ptable *t, size_t offset) {
    for (size_t b = 0; t->tab.b && b < t->tab.nb; b++)
        for (struct htab_node *n = t->tab.b[b], *nx; n; n = nx) {
            nx = n->next;
            free((char *)HTAB_ENTRY(n, struct pt_entry, hn) - offset);
        }
    htab_fini(&t->tab);
}

struct pt_entry *ptable_find(const struct ptable *t, const uint8_t hash[PT_HASH_LEN]) {
    uint64_t h = hash_of(hash);
    for (struct htab_node *n = *htab_bucket(&t->tab, h); n; n = n->next) {
        struct pt_entry *e = HTAB_ENTRY(n, struct pt_entry, hn);
        if (e->h == h && memcmp(e->hash, hash, PT_HASH_LEN) == 0) return e;
    }
    return NULL;
}

void ptable_insert(struct ptable *t, struct pt_entry *e, const uint8_t hash[PT_HASH_LEN]) {
    memcpy(e->hash, hash, PT_HASH_LEN);
    e->h = hash_of(hash);
    htab_insert(&t->tab, &e->hn, e->h);
}

void ptable_remove(struct ptable *t, struct pt_entry *e) { htab_remove(&t->tab, &e->hn, e->h); }

void ptable_each(const struct ptable *t, void (*fn)(struct pt_entry *e, void *arg), void *arg) {
    for (size_t b = 0; b < t->tab.nb; b++)
        for (struct htab_node *n = t->tab.b[b]; n; n = n->next)
            fn(HTAB_ENTRY(n, struct pt_entry, hn), arg);
}

size_t ptable_nbuckets(const struct ptable *t) { return t->tab.nb; }

bool ptable_each_in_bucket(const struct ptable *t, size_t b,
                           bool (*fn)(struct pt_entry *e, void *arg), void *arg) {
    for (struct htab_node *n = t->tab.b[b]; n; n = n->next)
        if (!fn(HTAB_ENTRY(n, struct pt_entry, hn), arg)) return false;
    return true;
}
