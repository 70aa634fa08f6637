/* L1 entry life cycle: write leases (reserve/finish/abort), read leases, touch, delete and clear.
 *
 * Doomed entries. A forced clear or delete must not free memory a lease holder may still copy
 * (the bytes would then show up in another object, or another object's bytes in a reply). It
 * moves such an entry to state DOOMED instead: the entry stays in its hash chain, so releases
 * and the finishing writer find it by key, but every call that would start a new use (reads,
 * writes, touch, delete, eviction) treats it as absent, and a new writer of the key gets BUSY
 * until it is gone. It leaves its LRU/staging list for the doomed list; the last release, the
 * writer's finish or abort, or the evictor once its lease ran out frees it. Its bytes count
 * for its salt until then, since they are still in use. */
#include "server/l1/l1_internal.h"

#include <stdlib.h>
#include <string.h>

static bool do_count_lock(struct l1 *l1, struct l1_entry *e);

/* Caller holds the LRU lock. Takes the entry's bytes out of its salt's locked bytes. */
static void do_uncount_lock(struct l1 *l1, struct l1_entry *e) {
    if (!(e->flags & F_LCOUNT)) return;
    l1->salts[e->key.salt_id].locked_bytes -= rounded(l1, e->size);
    e->flags &= (uint8_t)~F_LCOUNT;
}

/* Tells the listener about a non-temporary entry that turns resident or leaves. The caller holds
 * the entry's stripe mutex; the entry still counts for its names, so they are valid. */
static void do_notify(struct l1 *l1, const struct l1_entry *e, bool present) {
    if (!l1->cfg.listener.on_change || (e->flags & F_TEMP) || e->state != ST_RESIDENT) return;
    const char *model = keys_intern_str(l1->models, e->key.model_id);
    const char *salt = keys_intern_str(l1->salts_names, e->key.salt_id);
    l1->cfg.listener.on_change(l1->cfg.listener.arg, &e->key, model ? model : "", salt ? salt : "",
                               present);
}

/* Unhashes, unlists and frees an entry and its memory. */
void do_l1_remove(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h) {
    CHECK_ENTRY(e);
    do_notify(l1, e, false);
    do_unhash(l1, s, e, h);
    uint64_t bytes = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    struct l1_salt *salt = &l1->salts[e->key.salt_id];
    if (e->state == ST_STAGING) {
        do_list_unlink(&l1->staging, e);
        l1->n_staging--;
        l1->staging_bytes -= bytes;
    } else if (e->state == ST_DOOMED) {
        do_list_unlink(&l1->doomed, e);
        l1->n_doomed--;
    } else {
        do_list_unlink(resident_list(l1, e), e);
        l1->n_resident--;
        if (e->flags & F_TEMP) l1->n_temp--;
    }
    salt->bytes -= bytes;
    salt->objects--;
    l1->model_objects[e->key.model_id]--;
    do_uncount_lock(l1, e);
    pthread_mutex_unlock(&l1->lru_mu);
    if (arena_free(l1->arena, (uint64_t)e->off_units << l1->unit_shift, e->size) != 0 && l1->log)
        log_error(l1->log, "arena refused to free an L1 object at unit %u (%u bytes)", e->off_units,
                  e->size);
    e->magic = 0;
    free(e);
}

/* Takes a locked entry out of view without freeing its memory (see "Doomed entries"). */
static void do_doom(struct l1 *l1, struct l1_entry *e) {
    CHECK_ENTRY(e);
    do_notify(l1, e, false);
    uint64_t bytes = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    if (e->state == ST_STAGING) {
        do_list_unlink(&l1->staging, e);
        l1->n_staging--;
        l1->staging_bytes -= bytes;
        e->flags |= F_WRITER;
    } else {
        do_list_unlink(resident_list(l1, e), e);
        l1->n_resident--;
        if (e->flags & F_TEMP) l1->n_temp--;
    }
    do_list_push(&l1->doomed, e);
    l1->n_doomed++;
    pthread_mutex_unlock(&l1->lru_mu);
    e->state = ST_DOOMED;
}

/* Removes an entry for a forced clear or delete: frees it, or dooms it while it is locked. */
static void do_remove_forced(struct l1 *l1, struct stripe *s, struct l1_entry *e, uint64_t h,
                             uint64_t now) {
    if (!is_locked(e, now))
        do_l1_remove(l1, s, e, h);
    else if (e->state != ST_DOOMED)
        do_doom(l1, e);
}

/* Moves a resident entry to the MRU end unless it moved within touch_interval. */
void do_l1_touch(struct l1 *l1, struct l1_entry *e, uint64_t now, bool force) {
    uint32_t t = (uint32_t)(now >> 20);
    uint32_t iv = (uint32_t)(l1->cfg.touch_interval_ns >> 20);
    if (!force && l1->cfg.touch_interval_ns && (uint32_t)(t - e->touched) < iv) return;
    e->touched = t;
    pthread_mutex_lock(&l1->lru_mu);
    struct l1_list *l = resident_list(l1, e);
    if (l->tail != e) {
        do_list_unlink(l, e);
        do_list_push(l, e);
    }
    pthread_mutex_unlock(&l1->lru_mu);
}

static uint32_t new_token(struct l1 *l1) {
    uint32_t t;
    do t = atomic_fetch_add_explicit(&l1->next_token, 1, memory_order_relaxed);
    while (t == 0);
    return t;
}

int l1_reserve_write(struct l1 *l1, const struct l1_key *key, uint64_t size, bool temporary,
                     uint64_t now, struct l1_ref *out) {
    CHECK_L1(l1);
    if (size == 0 || size > MAX_OBJECT_BYTES || size > arena_total_bytes(l1->arena) ||
        !l1_key_ok(l1, key))
        return L1_ERR_INVAL;
    uint64_t h = key_hash(key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    struct l1_entry *e = do_find(l1, s, key, h);
    if (e && e->state == ST_DOOMED) {
        if (is_locked(e, now)) {
            pthread_mutex_unlock(&s->mu);
            return L1_ERR_BUSY;
        }
        do_l1_remove(l1, s, e, h); /* a doomed entry whose lease ran out */
        e = NULL;
    }
    if (e) {
        if (e->state == ST_RESIDENT) {
            pthread_mutex_unlock(&s->mu);
            return L1_EXISTS;
        }
        if (e->deadline > now) {
            pthread_mutex_unlock(&s->mu);
            return L1_ERR_BUSY;
        }
        /* An expired write lease: the entry goes to the new writer. */
        cnt_add(&l1->reclaimed, 1);
        if (rounded(l1, e->size) == rounded(l1, size)) {
            e->token = new_token(l1);
            e->size = (uint32_t)size;
            e->flags = temporary ? F_TEMP : 0;
            e->deadline = now + l1->cfg.write_ttl_ns;
            pthread_mutex_lock(&l1->lru_mu);
            do_list_unlink(&l1->staging, e);
            do_list_push(&l1->staging, e);
            pthread_mutex_unlock(&l1->lru_mu);
            fill_ref(l1, e, out);
            pthread_mutex_unlock(&s->mu);
            return L1_OK;
        }
        do_l1_remove(l1, s, e, h);
    }
    pthread_mutex_unlock(&s->mu);

    struct l1_entry *ne = malloc(sizeof(*ne));
    if (!ne) return L1_ERR_NOMEM;
    uint64_t off;
    if (l1_alloc_evict(l1, size, key->salt_id, now, &off) != 0) {
        free(ne);
        cnt_add(&l1->alloc_failures, 1);
        return L1_ERR_NOMEM;
    }
    memset(ne, 0, sizeof(*ne));
    ne->magic = ENTRY_MAGIC;
    ne->state = ST_STAGING;
    ne->flags = temporary ? F_TEMP : 0;
    ne->key = *key;
    ne->off_units = (uint32_t)(off >> l1->unit_shift);
    ne->size = (uint32_t)size;
    ne->token = new_token(l1);
    ne->deadline = now + l1->cfg.write_ttl_ns;
    ne->touched = (uint32_t)(now >> 20);

    pthread_mutex_lock(&s->mu);
    e = do_find(l1, s, key, h);
    if (e) { /* another writer won the race while we allocated */
        int rc = e->state == ST_RESIDENT ? L1_EXISTS : L1_ERR_BUSY;
        pthread_mutex_unlock(&s->mu);
        arena_free(l1->arena, off, size);
        free(ne);
        return rc;
    }
    uint64_t bytes = rounded(l1, size);
    pthread_mutex_lock(&l1->lru_mu);
    if (!do_l1_names_current(l1, key)) { /* a name was dropped since the key was made */
        pthread_mutex_unlock(&l1->lru_mu);
        pthread_mutex_unlock(&s->mu);
        arena_free(l1->arena, off, size);
        free(ne);
        return L1_ERR_TOO_MANY_NAMES;
    }
    do_insert(l1, s, ne, h);
    l1->model_objects[key->model_id]++;
    do_list_push(&l1->staging, ne);
    l1->n_staging++;
    l1->staging_bytes += bytes;
    l1->salts[key->salt_id].bytes += bytes;
    l1->salts[key->salt_id].objects++;
    pthread_mutex_unlock(&l1->lru_mu);
    fill_ref(l1, ne, out);
    pthread_mutex_unlock(&s->mu);
    return L1_OK;
}

int l1_finish_write(struct l1 *l1, const struct l1_key *key, uint32_t token, uint32_t read_locks,
                    uint64_t now) {
    CHECK_L1(l1);
    uint64_t h = key_hash(key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    struct l1_entry *e = do_find(l1, s, key, h);
    if (e && e->state == ST_DOOMED && (e->flags & F_WRITER) && e->token == token) {
        do_l1_remove(l1, s, e, h); /* cleared while being written: its writer is done with it */
        e = NULL;
    }
    if (!e || e->state != ST_STAGING || e->token != token) {
        pthread_mutex_unlock(&s->mu);
        return L1_ERR_NOT_FOUND;
    }
    if (e->deadline <= now) {
        pthread_mutex_unlock(&s->mu);
        return L1_ERR_EXPIRED;
    }
    e->state = ST_RESIDENT;
    e->pins = 0; /* the token's word: the writer is done */
    e->readers = read_locks;
    int rc = L1_OK;
    if (e->readers && !do_count_lock(l1, e)) {
        e->readers = 0;
        rc = L1_ERR_OVER_QUOTA;
    }
    e->deadline = e->readers ? now + l1->cfg.read_ttl_ns : 0;
    e->touched = (uint32_t)(now >> 20);
    uint64_t bytes = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    do_list_unlink(&l1->staging, e);
    do_list_push(resident_list(l1, e), e);
    l1->n_staging--;
    l1->staging_bytes -= bytes;
    l1->n_resident++;
    if (e->flags & F_TEMP) l1->n_temp++;
    pthread_mutex_unlock(&l1->lru_mu);
    cnt_add(&l1->write_chunks, 1);
    cnt_add(&l1->salts[key->salt_id].write_chunks, 1);
    do_notify(l1, e, true);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_abort_write(struct l1 *l1, const struct l1_key *key, uint32_t token) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->token == token &&
        (e->state == ST_STAGING || (e->state == ST_DOOMED && (e->flags & F_WRITER)))) {
        do_l1_remove(l1, s, e, h);
        rc = L1_OK;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* ---- reply pins ----
 * A pin keeps an object's memory for a reply that libzmq sends straight from L1: unlike a read
 * lease it never expires (a reply queued for a client that stops reading may wait any time),
 * so it makes the entry locked for eviction, delete and clear, which doom it instead of freeing
 * it; the last unpin frees a doomed entry. Pins are released by whichever thread drops the
 * message (libzmq's I/O thread), by the handle alone. The bytes pinned are capped
 * (pin_max_bytes, one object's size per pin). */
struct l1_pin {
    struct l1 *l1;
    struct l1_entry *e;
    uint32_t size;
};

int l1_pin(struct l1 *l1, const struct l1_key *key, uint64_t now, struct l1_pin **out) {
    CHECK_L1(l1);
    struct l1_pin *p = malloc(sizeof(*p));
    if (!p) return L1_ERR_NOMEM;
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && !has_writer(e) && (e->state == ST_RESIDENT || e->state == ST_DOOMED)) {
        if (!(e->readers > 0 && e->deadline > now)) {
            rc = e->state == ST_DOOMED ? L1_ERR_NOT_FOUND : L1_ERR_NOT_READABLE;
        } else if (e->pins == UINT32_MAX) {
            rc = L1_ERR_BUSY;
        } else {
            /* The cap: reserve first, so concurrent pins never pass it together. */
            uint64_t cur = atomic_fetch_add(&l1->pinned_bytes, e->size);
            if (cur + e->size > l1->cfg.pin_max_bytes) {
                atomic_fetch_sub(&l1->pinned_bytes, e->size);
                cnt_add(&l1->pin_refused, 1);
                rc = L1_ERR_PIN_CAP;
            } else {
                e->pins++;
                cnt_add(&l1->pins, 1);
                *p = (struct l1_pin){l1, e, e->size};
                rc = L1_OK;
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    if (rc == L1_OK)
        *out = p;
    else
        free(p);
    return rc;
}

void l1_unpin(struct l1_pin *p, uint64_t now) {
    if (!p) return;
    struct l1 *l1 = p->l1;
    struct l1_entry *e = p->e;
    CHECK_L1(l1);
    CHECK_ENTRY(e); /* a pinned entry is never freed: its key, hence its stripe, is still valid */
    uint64_t h = key_hash(&e->key);
    struct stripe *s = stripe_of(l1, h);
    pthread_mutex_lock(&s->mu);
    assert(e->pins > 0 && !has_writer(e));
    e->pins--;
    if (e->pins == 0 && e->state == ST_DOOMED && !is_locked(e, now)) do_l1_remove(l1, s, e, h);
    pthread_mutex_unlock(&s->mu);
    atomic_fetch_sub(&l1->pinned_bytes, p->size);
    atomic_fetch_sub(&l1->pins, 1);
    free(p);
}

/* Caller holds the stripe lock. IsolatedLRU: counts e's bytes into its salt's locked bytes
 * unless that would exceed the salt's quota (returns false). The limit is re-read from the
 * quota table before refusing, so a quota set moments ago already counts. */
static bool do_count_lock(struct l1 *l1, struct l1_entry *e) {
    if (l1->cfg.policy != L1_POLICY_ISOLATED_LRU || (e->flags & F_LCOUNT)) return true;
    uint64_t b = rounded(l1, e->size);
    pthread_mutex_lock(&l1->lru_mu);
    struct l1_salt *sa = &l1->salts[e->key.salt_id];
    uint64_t lim = atomic_load_explicit(&sa->limit, memory_order_relaxed);
    if (sa->locked_bytes + b > lim && l1->cfg.quota) {
        const char *name = keys_intern_str(l1->salts_names, e->key.salt_id);
        lim = 0;
        if (name) quota_get(l1->cfg.quota, name, &lim);
        atomic_store_explicit(&sa->limit, lim, memory_order_relaxed);
    }
    bool ok = sa->locked_bytes + b <= lim;
    if (ok) sa->locked_bytes += b;
    pthread_mutex_unlock(&l1->lru_mu);
    if (ok) e->flags |= F_LCOUNT;
    return ok;
}

/* Caller holds the stripe lock; e is RESIDENT. Refuses rather than saturate the count (a
 * saturated count would let one holder's release wipe out another's locks): L1_ERR_BUSY, or
 * L1_ERR_OVER_QUOTA from do_count_lock. */
static int do_take_read(struct l1 *l1, struct l1_entry *e, uint32_t n, uint64_t now) {
    uint32_t r = e->deadline > now ? e->readers : 0;
    if (n > MAX_READERS - r) return L1_ERR_BUSY;
    if (n && !do_count_lock(l1, e)) return L1_ERR_OVER_QUOTA;
    e->readers = r + n;
    e->deadline = now + l1->cfg.read_ttl_ns;
    return L1_OK;
}

/* Read counters are bumped once per call, not per key: shared atomics are the one thing two
 * lookups on different stripes would otherwise contend on. */
static void count_reads(struct l1 *l1, uint16_t salt_id, uint64_t n) {
    if (!n) return;
    cnt_add(&l1->read_chunks, n);
    cnt_add(&l1->salts[salt_id].read_chunks, n);
}

static int reserve_read_one(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now,
                            struct l1_ref *out) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state == ST_RESIDENT) {
        rc = do_take_read(l1, e, n, now);
        if (rc == L1_OK) fill_ref(l1, e, out);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_reserve_read(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now,
                    struct l1_ref *out) {
    int rc = reserve_read_one(l1, key, n, now, out);
    if (rc == L1_OK) count_reads(l1, key->salt_id, 1);
    return rc;
}

size_t l1_reserve_read_prefix(struct l1 *l1, const struct l1_key *keys, size_t count, uint32_t n,
                              uint64_t now) {
    size_t i = 0;
    while (i < count && reserve_read_one(l1, &keys[i], n, now, NULL) == L1_OK) i++;
    if (i) count_reads(l1, keys[0].salt_id, i);
    return i;
}

int l1_read_locked(struct l1 *l1, const struct l1_key *key, uint64_t now, struct l1_ref *out) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    /* A doomed entry is still readable by the holders of its read locks. */
    if (e && (e->state == ST_RESIDENT || (e->state == ST_DOOMED && !(e->flags & F_WRITER)))) {
        if (e->readers > 0 && e->deadline > now) {
            fill_ref(l1, e, out);
            rc = L1_OK;
        } else {
            rc = e->state == ST_DOOMED ? L1_ERR_NOT_FOUND : L1_ERR_NOT_READABLE;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_finish_read(struct l1 *l1, const struct l1_key *key, uint32_t n, uint64_t now) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state == ST_DOOMED && !(e->flags & F_WRITER)) {
        rc = L1_OK;
        uint32_t r = e->deadline > now ? e->readers : 0;
        e->readers = r > n ? r - n : 0;
        if (e->readers == 0 && !e->pins)
            do_l1_remove(l1, s, e, h); /* the last user of a cleared object */
    } else if (e && e->state == ST_RESIDENT) {
        rc = L1_OK;
        uint32_t r = e->deadline > now ? e->readers : 0;
        e->readers = r > n ? r - n : 0;
        if (e->readers == 0 && (e->flags & F_TEMP) && !e->pins) {
            do_l1_remove(l1, s, e, h);
        } else {
            if (e->readers == 0 && (e->flags & F_LCOUNT)) {
                pthread_mutex_lock(&l1->lru_mu);
                do_uncount_lock(l1, e);
                pthread_mutex_unlock(&l1->lru_mu);
            }
            if (e->readers == 0 && (e->flags & F_TEMP))
                do_doom(l1, e); /* a reply still sends it: freed by the last unpin */
            else
                do_l1_touch(l1, e, now, false);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_delete(struct l1 *l1, const struct l1_key *key, bool force, uint64_t now) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state != ST_DOOMED) {
        if (!force && is_locked(e, now)) {
            rc = L1_ERR_BUSY;
        } else {
            do_remove_forced(l1, s, e, h, now);
            rc = L1_OK;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int l1_touch(struct l1 *l1, const struct l1_key *key, uint64_t now) {
    uint64_t h;
    struct stripe *s;
    struct l1_entry *e = lock_find(l1, key, &s, &h);
    int rc = L1_ERR_NOT_FOUND;
    if (e && e->state == ST_RESIDENT) {
        do_l1_touch(l1, e, now, false);
        rc = L1_OK;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

size_t l1_clear(struct l1 *l1, bool force, uint64_t now) {
    CHECK_L1(l1);
    size_t freed = 0;
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        pthread_mutex_lock(&s->mu);
        for (size_t b = 0; b < s->t.nb; b++) {
            for (struct htab_node *n = s->t.b[b], *next; n; n = next) {
                next = n->next;
                struct l1_entry *e = ENTRY_OF(n);
                if (e->state == ST_DOOMED) {
                    if (!is_locked(e, now)) do_l1_remove(l1, s, e, key_hash(&e->key));
                } else if (force || !is_locked(e, now)) {
                    do_remove_forced(l1, s, e, key_hash(&e->key), now);
                    freed++;
                }
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    if (l1->log && freed)
        log_info(l1->log, "L1 clear%s: %zu objects removed", force ? " (forced)" : "", freed);
    return freed;
}
