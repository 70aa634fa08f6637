/* Unread replies per data-plane client (see replies.h). */
#include "server/dataplane/replies.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/htab.h"

#define DPC_ID_MAX 255 /* ZMQ routing ids are 1..255 bytes */

struct dp_client {
    struct htab_node hn;
    uint64_t hash;
    const void *sock;
    int fd;
    size_t refs; /* under the table's mutex */
    _Atomic size_t unsent;
    uint8_t idlen;
    unsigned char id[DPC_ID_MAX];
};

struct dp_clients {
    pthread_mutex_t mu;
    struct htab tab;
};

struct dpc_hold {
    struct dp_clients *t;
    struct dp_client *c;
    size_t n;
};

static uint64_t client_hash(const void *sock, const void *id, size_t idlen) {
    uintptr_t s = (uintptr_t)sock;
    return fnv1a64_add(fnv1a64(&s, sizeof(s)), id, idlen);
}

static uint64_t node_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return HTAB_ENTRY(n, struct dp_client, hn)->hash;
}

struct dp_clients *dpc_new(void) {
    struct dp_clients *t = calloc(1, sizeof(*t));
    if (!t) return NULL;
    if (htab_init(&t->tab, 64, node_hash, NULL) != 0) {
        free(t);
        return NULL;
    }
    pthread_mutex_init(&t->mu, NULL);
    return t;
}

void dpc_free(struct dp_clients *t) {
    if (!t) return;
    for (size_t b = 0; b < t->tab.nb; b++)
        while (t->tab.b[b]) {
            struct dp_client *c = HTAB_ENTRY(t->tab.b[b], struct dp_client, hn);
            t->tab.b[b] = c->hn.next;
            free(c);
        }
    htab_fini(&t->tab);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

struct dp_client *dpc_get(struct dp_clients *t, const void *sock, const void *id, size_t idlen,
                          int fd) {
    if (!t || idlen > DPC_ID_MAX) return NULL;
    uint64_t h = client_hash(sock, id, idlen);
    pthread_mutex_lock(&t->mu);
    for (struct htab_node *n = *htab_bucket(&t->tab, h); n; n = n->next) {
        struct dp_client *c = HTAB_ENTRY(n, struct dp_client, hn);
        if (c->hash == h && c->sock == sock && c->idlen == idlen && !memcmp(c->id, id, idlen)) {
            c->refs++;
            if (fd >= 0) c->fd = fd;
            pthread_mutex_unlock(&t->mu);
            return c;
        }
    }
    struct dp_client *c = calloc(1, sizeof(*c));
    if (c) {
        c->hash = h;
        c->sock = sock;
        c->fd = fd;
        c->refs = 1;
        c->idlen = (uint8_t)idlen;
        memcpy(c->id, id, idlen);
        htab_insert(&t->tab, &c->hn, h);
    }
    pthread_mutex_unlock(&t->mu);
    return c;
}

void dpc_put(struct dp_clients *t, struct dp_client *c) {
    if (!c) return;
    pthread_mutex_lock(&t->mu);
    int last = --c->refs == 0;
    if (last) htab_remove(&t->tab, &c->hn, c->hash);
    pthread_mutex_unlock(&t->mu);
    if (last) free(c);
}

size_t dpc_unsent(const struct dp_client *c) {
    return c ? atomic_load_explicit(&c->unsent, memory_order_relaxed) : 0;
}

struct dpc_hold *dpc_hold_new(struct dp_clients *t, struct dp_client *c, size_t n) {
    struct dpc_hold *h = malloc(sizeof(*h));
    if (!h) {
        dpc_put(t, c);
        return NULL;
    }
    *h = (struct dpc_hold){t, c, n};
    atomic_fetch_add_explicit(&c->unsent, n, memory_order_relaxed);
    return h;
}

void dpc_release(struct dpc_hold *h) {
    if (!h) return;
    atomic_fetch_sub_explicit(&h->c->unsent, h->n, memory_order_relaxed);
    dpc_put(h->t, h->c);
    free(h);
}

size_t dpc_largest(struct dp_clients *t, int *fd, size_t *total) {
    size_t most = 0, all = 0;
    *fd = -1;
    pthread_mutex_lock(&t->mu);
    for (size_t b = 0; b < t->tab.nb; b++)
        for (struct htab_node *n = t->tab.b[b]; n; n = n->next) {
            struct dp_client *c = HTAB_ENTRY(n, struct dp_client, hn);
            size_t u = atomic_load_explicit(&c->unsent, memory_order_relaxed);
            all += u;
            if (c->fd >= 0 && u > most) {
                most = u;
                *fd = c->fd;
            }
        }
    pthread_mutex_unlock(&t->mu);
    *total = all;
    return most;
}
