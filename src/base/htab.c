/* A chained hash table of intrusive nodes (see htab.h). */
#include "base/htab.h"

#include <stdlib.h>

#include "base/check.h"

int htab_init(struct htab *t, size_t nb, htab_hash_fn hash, void *arg) {
    size_t n = 1;
    while (n < nb) n *= 2;
    *t = (struct htab){.hash = hash, .arg = arg};
    t->b = calloc(n, sizeof(*t->b));
    if (!t->b) return -1;
    t->nb = n;
    return 0;
}

void htab_fini(struct htab *t) {
    free(t->b);
    t->b = NULL;
    t->nb = t->count = 0;
}

bool htab_grow(struct htab *t) {
    size_t nb = t->nb * 2;
    struct htab_node **b = calloc(nb, sizeof(*b));
    if (!b) return false;
    for (size_t i = 0; i < t->nb; i++) {
        for (struct htab_node *n = t->b[i], *next; n; n = next) {
            next = n->next;
            struct htab_node **head = &b[t->hash(n, t->arg) & (nb - 1)];
            n->next = *head;
            *head = n;
        }
    }
    free(t->b);
    t->b = b;
    t->nb = nb;
    return true;
}

void htab_insert(struct htab *t, struct htab_node *n, uint64_t h) {
    if (t->count >= t->nb) (void)htab_grow(t);
    struct htab_node **head = htab_bucket(t, h);
    n->next = *head;
    *head = n;
    t->count++;
}

void htab_remove(struct htab *t, struct htab_node *n, uint64_t h) {
    struct htab_node **pp = htab_bucket(t, h);
    while (*pp && *pp != n) pp = &(*pp)->next;
    CHECK(*pp == n);
    *pp = n->next;
    n->next = NULL;
    t->count--;
}
