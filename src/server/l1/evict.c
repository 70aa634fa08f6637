/* L1 eviction: victims from the LRU / IsolatedLRU lists on allocation and on the periodic tick,
 * reclaim of lapsed write leases and doomed entries.
 *
 * Eviction without breaking the lock order (stripe -> LRU -> arena). A victim is chosen under the
 * LRU lock, but removing it needs its stripe lock, which must not be taken while holding the LRU
 * lock. So the evictor copies up to EVICT_BATCH keys from the list head (keys are immutable, so
 * reading them under the LRU lock alone is safe), drops the LRU lock, then takes each key's
 * stripe lock, looks the key up again and frees it if it is still resident and unlocked. A
 * locked candidate is moved to the MRU end (it is in use), so repeated passes make progress and
 * a pass over n entries examines each at most once. All counts of victims examined are bounded
 * by the caller (alloc_evict_max, or the list length at the start of a tick). */
#include "server/l1/l1_internal.h"

/* Which list a victim comes from. salt < 0 means the global LRU list, otherwise a salt's list;
 * -2 means the staging list (reclaiming expired write leases). */
#define LIST_GLOBAL  (-1)
#define LIST_STAGING (-2)
#define LIST_DOOMED  (-3)

static struct l1_list *list_by_id(struct l1 *l1, int id) {
    if (id == LIST_GLOBAL) return &l1->lru;
    if (id == LIST_STAGING) return &l1->staging;
    if (id == LIST_DOOMED) return &l1->doomed;
    return &l1->salts[id].list;
}

/* Examines up to EVICT_BATCH entries from the head of a list and frees the evictable ones
 * (staging list: expired write leases only), stopping once max_bytes were freed. Adds to
 * *examined and *bytes, returns the objects freed. Takes and releases the locks itself; the
 * caller holds none. */
static uint64_t evict_batch(struct l1 *l1, int list_id, uint64_t now, uint64_t max_bytes,
                            uint64_t *examined, uint64_t *bytes, bool *stop) {
    uint64_t got = 0;
    struct l1_key keys[EVICT_BATCH];
    int n = 0;
    pthread_mutex_lock(&l1->lru_mu);
    for (struct l1_entry *e = list_by_id(l1, list_id)->head; e && n < EVICT_BATCH; e = e->next)
        keys[n++] = e->key;
    pthread_mutex_unlock(&l1->lru_mu);
    if (n == 0) {
        *stop = true;
        return 0;
    }
    uint64_t freed = 0;
    for (int i = 0; i < n; i++) {
        uint64_t h = key_hash(&keys[i]);
        struct stripe *s = stripe_of(l1, h);
        pthread_mutex_lock(&s->mu);
        struct l1_entry *e = do_find(l1, s, &keys[i], h);
        if (e && list_id == LIST_STAGING) {
            if (e->state == ST_STAGING && e->deadline <= now) {
                got += rounded(l1, e->size);
                do_l1_remove(l1, s, e, h);
                freed++;
                cnt_add(&l1->reclaimed, 1);
            } else if (e->state == ST_STAGING) {
                *stop = true; /* the rest of the list expires later */
            }
        } else if (e && e->state == ST_RESIDENT) {
            if (!is_locked(e, now)) {
                uint16_t salt = e->key.salt_id;
                got += rounded(l1, e->size);
                do_l1_remove(l1, s, e, h);
                freed++;
                cnt_add(&l1->evicted_chunks, 1);
                cnt_add(&l1->salts[salt].evicted_chunks, 1);
            } else {
                do_l1_touch(l1, e, now, true); /* in use: out of the evictor's way */
            }
        }
        pthread_mutex_unlock(&s->mu);
        (*examined)++;
        if (*stop || got >= max_bytes) break;
    }
    *bytes += got;
    return freed;
}

/* Frees expired staging entries; returns how many. */
static uint64_t reclaim_staging(struct l1 *l1, uint64_t now, uint64_t max_examined) {
    uint64_t examined = 0, bytes = 0, freed = 0;
    bool stop = false;
    while (!stop && examined < max_examined)
        freed += evict_batch(l1, LIST_STAGING, now, UINT64_MAX, &examined, &bytes, &stop);
    return freed;
}

/* IsolatedLRU: the list to take the next victim from -- the salt furthest over its limit, else
 * `own` (the allocating salt), else the salt with the most bytes. -1 when nothing is listed. */
static int pick_salt(struct l1 *l1, int own) {
    uint32_t n = keys_intern_count(l1->salts_names);
    int best_over = -1, best_big = -1;
    uint64_t over_max = 0, big_max = 0;
    pthread_mutex_lock(&l1->lru_mu);
    for (uint32_t i = 0; i < n; i++) {
        struct l1_salt *s = &l1->salts[i];
        if (s->list.n == 0) continue;
        uint64_t lim = atomic_load_explicit(&s->limit, memory_order_relaxed);
        if (s->bytes > lim && s->bytes - lim > over_max) {
            over_max = s->bytes - lim;
            best_over = (int)i;
        }
        if (s->bytes > big_max) {
            big_max = s->bytes;
            best_big = (int)i;
        }
    }
    bool own_ok = own >= 0 && l1->salts[own].list.n > 0;
    pthread_mutex_unlock(&l1->lru_mu);
    if (best_over >= 0) return best_over;
    if (own_ok) return own;
    return best_big;
}

/* Allocates, evicting LRU-first when the arena is full. Caller holds no lock. */
int l1_alloc_evict(struct l1 *l1, uint64_t size, int salt, uint64_t now, uint64_t *off) {
    if (arena_alloc(l1->arena, size, off) == 0) return 0;
    if (l1->cfg.policy == L1_POLICY_NOOP) return -1;
    if (reclaim_staging(l1, now, l1->cfg.alloc_evict_max) > 0 &&
        arena_alloc(l1->arena, size, off) == 0)
        return 0;
    uint64_t examined = 0, bytes = 0;
    while (examined < l1->cfg.alloc_evict_max) {
        int id = LIST_GLOBAL;
        if (l1->cfg.policy == L1_POLICY_ISOLATED_LRU) {
            id = pick_salt(l1, salt);
            if (id < 0) return -1;
        }
        bool stop = false;
        uint64_t freed = evict_batch(l1, id, now, 1, &examined, &bytes, &stop);
        if (stop && freed == 0) return -1; /* list empty */
        if (freed && arena_alloc(l1->arena, size, off) == 0) return 0;
    }
    return arena_alloc(l1->arena, size, off);
}

static void refresh_limits(struct l1 *l1) {
    uint32_t n = keys_intern_count(l1->salts_names);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t lim = 0;
        char name[KEYS_SALT_MAX + 1];
        if (!l1_salt_name_copy(l1, i, name)) continue;
        if (l1->cfg.quota) quota_get(l1->cfg.quota, name, &lim);
        atomic_store_explicit(&l1->salts[i].limit, lim, memory_order_relaxed);
    }
}

void l1_quota_changed(struct l1 *l1) {
    CHECK_L1(l1);
    refresh_limits(l1);
}

static uint64_t list_len(struct l1 *l1, int id) {
    pthread_mutex_lock(&l1->lru_mu);
    uint64_t n = list_by_id(l1, id)->n;
    pthread_mutex_unlock(&l1->lru_mu);
    return n;
}

/* Frees doomed entries whose lease ran out (their holders are presumed gone, as for any lapsed
 * lease); the ones still in use move to the end of the list. Returns how many were freed. */
static uint64_t reclaim_doomed(struct l1 *l1, uint64_t now) {
    uint64_t budget = list_len(l1, LIST_DOOMED), examined = 0, freed = 0;
    while (examined < budget) {
        struct l1_key keys[EVICT_BATCH];
        int n = 0;
        pthread_mutex_lock(&l1->lru_mu);
        for (struct l1_entry *e = l1->doomed.head; e && n < EVICT_BATCH; e = e->next)
            keys[n++] = e->key;
        pthread_mutex_unlock(&l1->lru_mu);
        if (n == 0) break;
        for (int i = 0; i < n && examined < budget; i++, examined++) {
            uint64_t h = key_hash(&keys[i]);
            struct stripe *s = stripe_of(l1, h);
            pthread_mutex_lock(&s->mu);
            struct l1_entry *e = do_find(l1, s, &keys[i], h);
            if (e && e->state == ST_DOOMED) {
                if (!is_locked(e, now)) {
                    do_l1_remove(l1, s, e, h);
                    freed++;
                } else {
                    pthread_mutex_lock(&l1->lru_mu);
                    do_list_unlink(&l1->doomed, e);
                    do_list_push(&l1->doomed, e);
                    pthread_mutex_unlock(&l1->lru_mu);
                }
            }
            pthread_mutex_unlock(&s->mu);
        }
    }
    return freed;
}

int l1_evict_tick(struct l1 *l1, uint64_t now, struct l1_tick_report *out) {
    CHECK_L1(l1);
    struct l1_tick_report rep = {0};
    cnt_add(&l1->ticks, 1);
    uint64_t total = arena_total_bytes(l1->arena);
    rep.usage_before = (double)arena_used_bytes(l1->arena) / (double)total;
    rep.reclaimed_staging = reclaim_staging(l1, now, list_len(l1, LIST_STAGING) + EVICT_BATCH);
    rep.reclaimed_staging += reclaim_doomed(l1, now);

    if (l1->cfg.policy == L1_POLICY_ISOLATED_LRU) {
        refresh_limits(l1);
        uint32_t n = keys_intern_count(l1->salts_names);
        for (uint32_t i = 0; i < n; i++) {
            struct l1_salt *sa = &l1->salts[i];
            uint64_t budget = list_len(l1, (int)i) + EVICT_BATCH, examined = 0;
            for (;;) {
                pthread_mutex_lock(&l1->lru_mu);
                uint64_t lim = atomic_load(&sa->limit);
                uint64_t over = sa->bytes > lim ? sa->bytes - lim : 0;
                pthread_mutex_unlock(&l1->lru_mu);
                if (!over || examined >= budget) break;
                bool stop = false;
                uint64_t f =
                    evict_batch(l1, (int)i, now, over, &examined, &rep.evicted_bytes, &stop);
                rep.evicted_objects += f;
                rep.quota_evicted_objects += f;
                if (stop) break;
            }
        }
    }

    if (l1->cfg.policy != L1_POLICY_NOOP &&
        arena_used_bytes(l1->arena) >= (uint64_t)(l1->cfg.trigger_watermark * (double)total)) {
        rep.triggered = true;
        cnt_add(&l1->triggered, 1);
        uint64_t target =
            (uint64_t)((double)total * l1->cfg.trigger_watermark * (1 - l1->cfg.eviction_ratio));
        pthread_mutex_lock(&l1->lru_mu);
        uint64_t budget = l1->n_resident + EVICT_BATCH, examined = 0;
        pthread_mutex_unlock(&l1->lru_mu);
        uint64_t used;
        while ((used = arena_used_bytes(l1->arena)) > target && examined < budget) {
            int id = LIST_GLOBAL;
            if (l1->cfg.policy == L1_POLICY_ISOLATED_LRU && (id = pick_salt(l1, -1)) < 0) break;
            bool stop = false;
            uint64_t f =
                evict_batch(l1, id, now, used - target, &examined, &rep.evicted_bytes, &stop);
            rep.evicted_objects += f;
            if (stop && f == 0 && l1->cfg.policy != L1_POLICY_ISOLATED_LRU) break;
        }
    }
    rep.usage_after = (double)arena_used_bytes(l1->arena) / (double)total;
    if (l1->log && rep.evicted_objects)
        log_debug(l1->log, "evictor: %llu objects (%llu bytes) evicted, usage %.3f -> %.3f",
                  (unsigned long long)rep.evicted_objects, (unsigned long long)rep.evicted_bytes,
                  rep.usage_before, rep.usage_after);
    if (out) *out = rep;
    return 0;
}
