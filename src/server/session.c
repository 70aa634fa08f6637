/* Lookup sessions: a hash table of request ids under one mutex. Work under the mutex is
 * bookkeeping only; L1 calls happen in the caller after it is dropped. */
#include "server/session.h"

#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "base/hash.h"

/* FNV-1a over the table's random seed, the owner and the id, then mixed (the splitmix64
 * finalizer) so that the low bits the buckets use depend on every bit. */
static uint64_t hash_of(const struct session_table *t, const uint8_t *owner, const char *id) {
    uint64_t h = fnv1a64_add(FNV1A64_INIT, t->seed, sizeof(t->seed));
    h = fnv1a64_add(fnv1a64_add(h, owner, SESSION_OWNER), id, strlen(id));
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

static uint64_t node_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return HTAB_ENTRY(n, struct session, hn)->hash;
}

/* Connections, not requests, make owners: a fixed table. */
static uint32_t owner_bucket(const uint8_t *owner) {
    return fnv1a32(owner, SESSION_OWNER) % SESSION_BUCKETS;
}

/* Caller holds t->lock. The owner's record (created when create is set), or NULL. */
static struct session_owner *do_owner(struct session_table *t, const uint8_t *owner, int create) {
    uint32_t b = owner_bucket(owner);
    for (struct session_owner *o = t->owners[b]; o; o = o->next)
        if (memcmp(o->owner, owner, SESSION_OWNER) == 0) return o;
    if (!create) return NULL;
    struct session_owner *o = calloc(1, sizeof(*o));
    if (!o) return NULL;
    memcpy(o->owner, owner, SESSION_OWNER);
    o->next = t->owners[b];
    t->owners[b] = o;
    return o;
}

/* Caller holds t->lock. s leaves the table: its memory no longer counts. */
static void do_uncount(struct session_table *t, const struct session *s) {
    t->count--;
    if (!s->job_reported) t->jobs--;
    t->bytes -= s->bytes;
    uint32_t b = owner_bucket(s->owner);
    for (struct session_owner **pp = &t->owners[b]; *pp; pp = &(*pp)->next) {
        struct session_owner *o = *pp;
        if (memcmp(o->owner, s->owner, SESSION_OWNER) != 0) continue;
        o->bytes -= s->bytes;
        if (--o->sessions == 0) {
            *pp = o->next;
            free(o);
        }
        return;
    }
}

int session_table_init(struct session_table *t) {
    memset(t, 0, sizeof(*t));
    if (getrandom(t->seed, sizeof(t->seed), 0) != (ssize_t)sizeof(t->seed)) {
        t->seed[0] = (uint64_t)(uintptr_t)t; /* no entropy: still per process, not per client */
        t->seed[1] = (uint64_t)(uintptr_t)&t;
    }
    pthread_mutex_init(&t->lock, NULL);
    return htab_init(&t->tab, SESSION_BUCKETS, node_hash, NULL);
}

void session_free(struct session *s) {
    if (!s) return;
    free(s->objs);
    free(s);
}

struct session *session_table_drain(struct session_table *t) {
    struct session *all = NULL;
    pthread_mutex_lock(&t->lock);
    for (size_t b = 0; b < t->tab.nb; b++) {
        while (t->tab.b[b]) {
            struct session *s = HTAB_ENTRY(t->tab.b[b], struct session, hn);
            t->tab.b[b] = s->hn.next;
            s->next = all;
            all = s;
        }
    }
    t->tab.count = 0;
    for (size_t b = 0; b < SESSION_BUCKETS; b++) {
        while (t->owners[b]) {
            struct session_owner *o = t->owners[b];
            t->owners[b] = o->next;
            free(o);
        }
    }
    t->count = t->jobs = t->bytes = 0;
    pthread_mutex_unlock(&t->lock);
    return all;
}

void session_table_destroy(struct session_table *t) {
    struct session *s = session_table_drain(t);
    while (s) {
        struct session *n = s->next;
        session_free(s);
        s = n;
    }
    htab_fini(&t->tab);
    pthread_mutex_destroy(&t->lock);
}

/* Caller holds t->lock. Unlinks and returns the session called id, or NULL. */
static struct session *do_find_h(struct session_table *t, const uint8_t *owner, const char *id,
                                 uint64_t h) {
    for (struct htab_node *n = *htab_bucket(&t->tab, h); n; n = n->next) {
        struct session *s = HTAB_ENTRY(n, struct session, hn);
        if (s->hash == h && strcmp(s->id, id) == 0 && memcmp(s->owner, owner, SESSION_OWNER) == 0)
            return s;
    }
    return NULL;
}

/* Caller holds t->lock. The session called id, or NULL. */
static struct session *do_find(struct session_table *t, const uint8_t *owner, const char *id) {
    return do_find_h(t, owner, id, hash_of(t, owner, id));
}

/* Caller holds t->lock. Unlinks and returns the session called id, or NULL. */
static struct session *do_unlink(struct session_table *t, const uint8_t *owner, const char *id) {
    struct session *s = do_find(t, owner, id);
    if (!s) return NULL;
    htab_remove(&t->tab, &s->hn, s->hash);
    s->next = NULL;
    do_uncount(t, s);
    return s;
}

int session_put(struct session_table *t, struct session *s, size_t max_owner_bytes,
                size_t max_bytes, struct session **old) {
    s->bytes = sizeof(*s) + (size_t)s->nchunks * s->world_size * sizeof(*s->objs);
    *old = NULL;
    pthread_mutex_lock(&t->lock);
    s->hash = hash_of(t, s->owner, s->id);
    struct session *prev = do_find_h(t, s->owner, s->id, s->hash);
    size_t replaced = prev ? prev->bytes : 0;
    const struct session_owner *known = do_owner(t, s->owner, 0);
    size_t owner_bytes = known ? known->bytes : 0;
    if ((max_owner_bytes && owner_bytes - replaced + s->bytes > max_owner_bytes) ||
        (max_bytes && t->bytes - replaced + s->bytes > max_bytes)) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    if (prev) *old = do_unlink(t, s->owner, s->id); /* may drop the owner's record */
    struct session_owner *o = do_owner(t, s->owner, 1);
    if (!o) {
        pthread_mutex_unlock(&t->lock);
        return -1;
    }
    htab_insert(&t->tab, &s->hn, s->hash);
    t->count++;
    if (!s->job_reported) t->jobs++;
    t->bytes += s->bytes;
    o->bytes += s->bytes;
    o->sessions++;
    pthread_mutex_unlock(&t->lock);
    return 0;
}

struct session *session_remove(struct session_table *t, const uint8_t *owner, const char *id) {
    pthread_mutex_lock(&t->lock);
    struct session *s = do_unlink(t, owner, id);
    pthread_mutex_unlock(&t->lock);
    return s;
}

uint64_t session_objects(struct session_table *t, const uint8_t *owner, const char *id) {
    pthread_mutex_lock(&t->lock);
    struct session *s = do_find(t, owner, id);
    uint64_t n = s ? (uint64_t)s->nchunks * s->world_size : 0;
    pthread_mutex_unlock(&t->lock);
    return n;
}

int session_query(struct session_table *t, const uint8_t *owner, const char *id, uint32_t *hits) {
    int ready = 1;
    *hits = 0;
    pthread_mutex_lock(&t->lock);
    struct session *s = do_find(t, owner, id);
    if (s && !s->job_reported) {
        if (s->job_ready) {
            *hits = s->hit_chunks;
            s->job_reported = 1;
            t->jobs--;
        } else {
            ready = 0;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return ready;
}

void session_job_done(struct session_table *t, const uint8_t *owner, const char *id,
                      uint32_t hits) {
    pthread_mutex_lock(&t->lock);
    struct session *s = do_find(t, owner, id);
    if (s) {
        s->hit_chunks = hits;
        s->job_ready = 1;
    }
    pthread_mutex_unlock(&t->lock);
}

int session_take_lock(struct session_table *t, const uint8_t *owner, const char *id, uint32_t chunk,
                      uint32_t rank, const struct l1_key *key) {
    int got = 0;
    pthread_mutex_lock(&t->lock);
    struct session *s = do_find(t, owner, id);
    if (s && chunk >= s->start_chunk && chunk - s->start_chunk < s->locked_chunks &&
        rank < s->world_size) {
        struct session_obj *o = &s->objs[(size_t)(chunk - s->start_chunk) * s->world_size + rank];
        if (o->locks > 0 && memcmp(&o->key, key, sizeof(*key)) == 0) {
            o->locks--;
            got = 1;
        }
    }
    pthread_mutex_unlock(&t->lock);
    return got;
}

uint64_t session_release_range(struct session_table *t, const uint8_t *owner, const char *id,
                               uint32_t from, uint32_t to, int64_t rank,
                               void (*fn)(const struct l1_key *key, uint32_t locks, void *arg),
                               void *arg) {
    struct session_obj *out = NULL;
    size_t n = 0;
    uint64_t total = 0;
    pthread_mutex_lock(&t->lock);
    struct session *s = do_find(t, owner, id);
    if (s && s->locked_chunks) {
        uint32_t lo = from > s->start_chunk ? from - s->start_chunk : 0;
        uint32_t hi = to > s->start_chunk ? to - s->start_chunk : 0;
        if (hi > s->locked_chunks) hi = s->locked_chunks;
        if (lo < hi) out = malloc((size_t)(hi - lo) * s->world_size * sizeof(*out));
        for (uint32_t c = lo; out && c < hi; c++)
            for (uint32_t r = 0; r < s->world_size; r++) {
                if (rank >= 0 && (uint32_t)rank != r) continue;
                struct session_obj *o = &s->objs[(size_t)c * s->world_size + r];
                if (!o->locks) continue;
                out[n++] = *o;
                total += o->locks;
                o->locks = 0;
            }
    }
    pthread_mutex_unlock(&t->lock);
    for (size_t i = 0; i < n; i++) fn(&out[i].key, out[i].locks, arg);
    free(out);
    return total;
}

struct session *session_expire(struct session_table *t, uint64_t before_ns) {
    struct session *dead = NULL;
    pthread_mutex_lock(&t->lock);
    for (size_t b = 0; b < t->tab.nb; b++) {
        for (struct htab_node **pp = &t->tab.b[b]; *pp;) {
            struct session *s = HTAB_ENTRY(*pp, struct session, hn);
            if (s->created_ns < before_ns) {
                *pp = s->hn.next;
                t->tab.count--;
                do_uncount(t, s);
                s->next = dead;
                dead = s;
            } else {
                pp = &s->hn.next;
            }
        }
    }
    pthread_mutex_unlock(&t->lock);
    return dead;
}

void session_counts(struct session_table *t, size_t *sessions, size_t *jobs) {
    pthread_mutex_lock(&t->lock);
    *sessions = t->count;
    *jobs = t->jobs;
    pthread_mutex_unlock(&t->lock);
}

void session_prefetch_done(struct session_table *t, const uint8_t *owner, const char *id,
                           uint64_t gen, const struct l1_key *keys, const uint8_t *ready,
                           size_t nkeys, uint32_t locks,
                           void (*release)(const struct l1_key *key, uint32_t locks, void *arg),
                           void *arg) {
    size_t kept = 0; /* keys [0, kept) now belong to the session */
    pthread_mutex_lock(&t->lock);
    struct session *s = do_find(t, owner, id);
    if (s && s->gen == gen) {
        uint32_t ws = s->world_size;
        size_t full = 0;
        while ((full + 1) * ws <= nkeys) {
            size_t r = 0;
            while (r < ws && ready[full * ws + r]) r++;
            if (r < ws) break;
            full++;
        }
        if (s->locked_chunks + full > s->nchunks) full = s->nchunks - s->locked_chunks;
        for (size_t i = 0; i < full * ws; i++) {
            struct session_obj *o = &s->objs[(size_t)s->locked_chunks * ws + i];
            o->key = keys[i];
            o->locks = locks;
        }
        s->locked_chunks += (uint32_t)full;
        s->hit_chunks = s->locked_chunks;
        s->job_ready = 1;
        kept = full * ws;
    }
    pthread_mutex_unlock(&t->lock);
    for (size_t i = kept; i < nkeys; i++)
        if (ready[i] && locks) release(&keys[i], locks, arg);
}
