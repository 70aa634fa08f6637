/* L1 name ids: model names and cache salts interned into small ids with generations, and the
 * keys built from them.
 *
 * An entry pins its model and salt ids (per-id object counts under the LRU lock); a
 * name with no object left is dropped only when its table is full and a new name needs the
 * room. Ids are dropped under the LRU lock, which is also what a store holds while it checks
 * that its key's generations are still current and counts its object in. */
#include "server/l1/l1_internal.h"

#include <stdio.h>
#include <string.h>

/* Drops every name of one table that no object uses; returns how many. The LRU lock excludes
 * a store counting in its object meanwhile (it checks its key's generations under it). */
static uint32_t reclaim_names(struct l1 *l1, bool salts) {
    struct keys_intern *t = salts ? l1->salts_names : l1->models;
    uint32_t n = keys_intern_count(t), dropped = 0;
    pthread_mutex_lock(&l1->lru_mu);
    for (uint32_t i = 0; i < n; i++) {
        if ((salts ? l1->salts[i].objects : l1->model_objects[i]) != 0 || !keys_intern_str(t, i))
            continue;
        if (keys_intern_remove(t, i) != 0) continue;
        dropped++;
        if (!salts) continue;
        struct l1_salt *sa = &l1->salts[i];
        sa->bytes = sa->locked_bytes = 0;
        atomic_store_explicit(&sa->limit, 0, memory_order_relaxed);
        atomic_store_explicit(&sa->read_chunks, 0, memory_order_relaxed);
        atomic_store_explicit(&sa->write_chunks, 0, memory_order_relaxed);
        atomic_store_explicit(&sa->evicted_chunks, 0, memory_order_relaxed);
    }
    pthread_mutex_unlock(&l1->lru_mu);
    if (l1->log && dropped)
        log_info(l1->log, "%u unused %s dropped from a full name table", dropped,
                 salts ? "cache salts" : "model names");
    return dropped;
}

static int intern_name(struct l1 *l1, bool salts, const char *s, uint32_t *id, uint32_t *gen) {
    struct keys_intern *t = salts ? l1->salts_names : l1->models;
    if (keys_intern(t, s, strlen(s), id, gen) == 0) return 0;
    if (reclaim_names(l1, salts) == 0) return -1;
    return keys_intern(t, s, strlen(s), id, gen);
}

static void key_fill(const struct keys_object_key *k, uint32_t mid, uint32_t mgen, uint32_t sid,
                     uint32_t sgen, struct l1_key *out) {
    memset(out, 0, sizeof(*out));
    memcpy(out->hash, k->hash, k->hash_len);
    out->hash_len = k->hash_len;
    out->kv_rank = k->kv_rank;
    out->object_group_id = k->object_group_id;
    out->model_id = (uint16_t)mid;
    out->salt_id = (uint16_t)sid;
    out->model_gen = (uint8_t)mgen;
    out->salt_gen = (uint16_t)sgen;
}

int l1_key_make(struct l1 *l1, const struct keys_object_key *k, struct l1_key *out) {
    CHECK_L1(l1);
    uint32_t mid, sid, mgen, sgen;
    if (intern_name(l1, false, k->model_name, &mid, &mgen) != 0 ||
        intern_name(l1, true, k->cache_salt, &sid, &sgen) != 0)
        return L1_ERR_TOO_MANY_NAMES;
    key_fill(k, mid, mgen, sid, sgen, out);
    return L1_OK;
}

int l1_key_lookup(struct l1 *l1, const struct keys_object_key *k, struct l1_key *out) {
    CHECK_L1(l1);
    uint32_t mid, sid, mgen, sgen;
    if (keys_intern_find(l1->models, k->model_name, strlen(k->model_name), &mid, &mgen) != 0 ||
        keys_intern_find(l1->salts_names, k->cache_salt, strlen(k->cache_salt), &sid, &sgen) != 0) {
        mid = sid = NO_NAME;
        mgen = sgen = 0;
    }
    key_fill(k, mid, mgen, sid, sgen, out);
    return L1_OK;
}

const char *l1_model_name(struct l1 *l1, uint16_t id) { return keys_intern_str(l1->models, id); }
const char *l1_salt_name(struct l1 *l1, uint16_t id) {
    return keys_intern_str(l1->salts_names, id);
}

bool l1_key_ok(struct l1 *l1, const struct l1_key *k) {
    return k->salt_id < keys_intern_count(l1->salts_names) &&
           k->model_id < keys_intern_count(l1->models);
}

/* Caller holds the LRU lock. Whether the key's names are still the ones it was made with. */
bool do_l1_names_current(struct l1 *l1, const struct l1_key *k) {
    return keys_intern_str(l1->salts_names, k->salt_id) &&
           (uint16_t)keys_intern_gen(l1->salts_names, k->salt_id) == k->salt_gen &&
           keys_intern_str(l1->models, k->model_id) &&
           (uint8_t)keys_intern_gen(l1->models, k->model_id) == k->model_gen;
}

/* Copies the name of a salt id into buf ("" and false for a free id). Names are dropped only
 * under the LRU lock, so the string stays valid while it is held. */
bool l1_salt_name_copy(struct l1 *l1, uint32_t id, char buf[KEYS_SALT_MAX + 1]) {
    pthread_mutex_lock(&l1->lru_mu);
    const char *s = keys_intern_str(l1->salts_names, id);
    snprintf(buf, KEYS_SALT_MAX + 1, "%s", s ? s : "");
    pthread_mutex_unlock(&l1->lru_mu);
    return s != NULL;
}
