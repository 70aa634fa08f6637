/* L1 cache object: creation and destruction, statistics, per-salt usage. The pieces live in
 * names.c, lease.c and evict.c; l1_internal.h describes the shared structures. */
#include "base/errbuf.h"
#include "server/l1/l1_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The stripe table's hash of an entry, recomputed from its key when the table grows, so entries
 * do not carry it. */
static uint64_t entry_rehash(const struct htab_node *n, void *arg) {
    const struct l1 *l1 = arg;
    return key_hash(&ENTRY_OF(n)->key) >> l1->stripe_bits;
}

/* ---- public API ---------------------------------------------------------------------------- */

int l1_create(const struct l1_config *cfg, struct l1 **out, char *err, size_t errlen) {
    struct l1 *l1 = calloc(1, sizeof(*l1));
    if (!l1) {
        errbuf_set(err, errlen, "out of memory");
        return -1;
    }
    l1->cfg = *cfg;
    struct l1_config *c = &l1->cfg;
    if (c->trigger_watermark <= 0 || c->trigger_watermark > 1) c->trigger_watermark = 0.8;
    if (c->eviction_ratio <= 0 || c->eviction_ratio >= 1) c->eviction_ratio = 0.1;
    if (!c->read_ttl_ns) c->read_ttl_ns = 300ull * 1000000000ull;
    if (!c->write_ttl_ns) c->write_ttl_ns = 600ull * 1000000000ull;
    if (!c->stripes) c->stripes = 1024;
    if (c->stripes > (1u << 20)) c->stripes = 1u << 20;
    if (!c->alloc_evict_max) c->alloc_evict_max = 4096;
    if (!c->max_salts) c->max_salts = 4096;
    if (!c->max_models) c->max_models = 1024;
    if (c->max_salts > UINT16_MAX) c->max_salts = UINT16_MAX;
    if (c->max_models > UINT16_MAX) c->max_models = UINT16_MAX;
    if (c->policy != L1_POLICY_LRU && c->policy != L1_POLICY_ISOLATED_LRU &&
        c->policy != L1_POLICY_NOOP) {
        errbuf_set(err, errlen, "unknown eviction policy %d", (int)c->policy);
        free(l1);
        return -1;
    }
    l1->magic = L1_MAGIC;
    l1->log = log_get("lmcache.l1");
    atomic_init(&l1->next_token, 1);
    struct arena_config ac = {.size_bytes = c->size_bytes,
                              .unit = c->unit,
                              .use_hugepages = c->use_hugepages,
                              .lock_memory = c->lock_memory};
    if (arena_create(&ac, &l1->arena, err, errlen) != 0) {
        free(l1);
        return -1;
    }
    l1->unit_shift = (uint32_t)__builtin_ctz(arena_unit(l1->arena));
    l1->nstripes = 1;
    while (l1->nstripes < c->stripes) l1->nstripes <<= 1;
    l1->stripe_bits = (uint32_t)__builtin_ctz(l1->nstripes);
    l1->stripes = aligned_alloc(64, l1->nstripes * sizeof(struct stripe));
    l1->models = keys_intern_create(c->max_models);
    l1->salts_names = keys_intern_create(c->max_salts);
    l1->salts = calloc(c->max_salts, sizeof(struct l1_salt));
    l1->model_objects = calloc(c->max_models, sizeof(*l1->model_objects));
    if (!l1->stripes || !l1->models || !l1->salts_names || !l1->salts || !l1->model_objects ||
        pthread_mutex_init(&l1->lru_mu, NULL) != 0) {
        errbuf_set(err, errlen, "out of memory for the L1 table");
        goto fail;
    }
    memset(l1->stripes, 0, l1->nstripes * sizeof(struct stripe));
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        if (htab_init(&s->t, 16, entry_rehash, l1) != 0 || pthread_mutex_init(&s->mu, NULL) != 0) {
            errbuf_set(err, errlen, "out of memory for the L1 table");
            for (uint32_t j = 0; j <= i; j++) htab_fini(&l1->stripes[j].t);
            for (uint32_t j = 0; j < i; j++) pthread_mutex_destroy(&l1->stripes[j].mu);
            pthread_mutex_destroy(&l1->lru_mu);
            free(l1->stripes);
            l1->stripes = NULL;
            goto fail;
        }
    }
    *out = l1;
    if (l1->log)
        log_info(l1->log, "L1: %llu bytes, %u stripes, policy %s%s",
                 (unsigned long long)arena_total_bytes(l1->arena), l1->nstripes,
                 c->policy == L1_POLICY_LRU            ? "LRU"
                 : c->policy == L1_POLICY_ISOLATED_LRU ? "IsolatedLRU"
                                                       : "noop",
                 c->use_hugepages ? " (huge pages requested)" : "");
    return 0;
fail:
    free(l1->stripes);
    keys_intern_destroy(l1->models);
    keys_intern_destroy(l1->salts_names);
    free(l1->salts);
    free(l1->model_objects);
    arena_destroy(l1->arena);
    free(l1);
    return -1;
}

void l1_destroy(struct l1 *l1) {
    if (!l1) return;
    CHECK_L1(l1);
    if (cnt_get(&l1->pins) && l1->log)
        log_error(l1->log, "L1 destroyed with %llu reply pins held",
                  (unsigned long long)cnt_get(&l1->pins));
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        for (size_t b = 0; b < s->t.nb; b++) {
            for (struct htab_node *n = s->t.b[b], *next; n; n = next) {
                next = n->next;
                free(ENTRY_OF(n));
            }
        }
        htab_fini(&s->t);
        pthread_mutex_destroy(&s->mu);
    }
    free(l1->stripes);
    pthread_mutex_destroy(&l1->lru_mu);
    keys_intern_destroy(l1->models);
    keys_intern_destroy(l1->salts_names);
    free(l1->salts);
    free(l1->model_objects);
    arena_destroy(l1->arena);
    l1->magic = 0;
    free(l1);
}

void l1_get_stats(struct l1 *l1, uint64_t now, struct l1_stats *st) {
    CHECK_L1(l1);
    memset(st, 0, sizeof(*st));
    for (uint32_t i = 0; i < l1->nstripes; i++) {
        struct stripe *s = &l1->stripes[i];
        pthread_mutex_lock(&s->mu);
        for (size_t b = 0; b < s->t.nb; b++)
            for (struct htab_node *n = s->t.b[b]; n; n = n->next) {
                const struct l1_entry *e = ENTRY_OF(n);
                if (pins_of(e)) st->pinned_objects++;
                if (e->state == ST_DOOMED || e->deadline <= now) continue;
                if (e->state == ST_STAGING)
                    st->write_locked_objects++;
                else if (e->readers > 0)
                    st->read_locked_objects++; /* pins are counted apart */
            }
        pthread_mutex_unlock(&s->mu);
    }
    st->locked_objects = st->read_locked_objects + st->write_locked_objects;
    pthread_mutex_lock(&l1->lru_mu);
    st->objects = l1->n_resident;
    st->staging_objects = l1->n_staging;
    st->staging_bytes = l1->staging_bytes;
    st->temporary_objects = l1->n_temp;
    st->doomed_objects = l1->n_doomed;
    pthread_mutex_unlock(&l1->lru_mu);
    struct arena_stats as;
    arena_get_stats(l1->arena, &as);
    st->bytes_used = as.used_bytes;
    st->bytes_total = as.total_bytes;
    st->usage_ratio = (double)as.used_bytes / (double)as.total_bytes;
    st->hugetlb = as.hugetlb;
    st->read_chunks = cnt_get(&l1->read_chunks);
    st->write_chunks = cnt_get(&l1->write_chunks);
    st->evicted_chunks = cnt_get(&l1->evicted_chunks);
    st->alloc_failures = cnt_get(&l1->alloc_failures);
    st->reclaimed_staging = cnt_get(&l1->reclaimed);
    st->eviction_ticks = cnt_get(&l1->ticks);
    st->eviction_triggered = cnt_get(&l1->triggered);
    st->pins = cnt_get(&l1->pins);
    st->pinned_bytes = cnt_get(&l1->pinned_bytes);
    st->pins_refused = cnt_get(&l1->pin_refused);
}

void l1_salt_foreach(struct l1 *l1,
                     void (*fn)(const char *salt, const struct l1_salt_stats *st, void *arg),
                     void *arg) {
    CHECK_L1(l1);
    uint32_t n = keys_intern_count(l1->salts_names);
    for (uint32_t i = 0; i < n; i++) {
        struct l1_salt *sa = &l1->salts[i];
        struct l1_salt_stats st;
        char name[KEYS_SALT_MAX + 1];
        pthread_mutex_lock(&l1->lru_mu);
        const char *s = keys_intern_str(l1->salts_names, i);
        if (s) snprintf(name, sizeof(name), "%s", s);
        st.id = i;
        st.gen = keys_intern_gen(l1->salts_names, i);
        st.bytes = sa->bytes;
        st.objects = sa->objects;
        pthread_mutex_unlock(&l1->lru_mu);
        if (!s) continue;
        st.read_chunks = cnt_get(&sa->read_chunks);
        st.write_chunks = cnt_get(&sa->write_chunks);
        st.evicted_chunks = cnt_get(&sa->evicted_chunks);
        fn(name, &st, arg);
    }
}

uint64_t l1_salt_usage_bytes(struct l1 *l1, const char *salt) {
    CHECK_L1(l1);
    uint32_t id;
    if (keys_intern_find(l1->salts_names, salt, strlen(salt), &id, NULL) != 0) return 0;
    pthread_mutex_lock(&l1->lru_mu);
    uint64_t b = l1->salts[id].bytes;
    pthread_mutex_unlock(&l1->lru_mu);
    return b;
}

const char *l1_strerror(int rc) {
    switch (rc) {
    case L1_OK:
        return "ok";
    case L1_EXISTS:
        return "already resident";
    case L1_ERR_NOT_FOUND:
        return "not found";
    case L1_ERR_BUSY:
        return "locked by another holder";
    case L1_ERR_NOMEM:
        return "out of memory (nothing evictable left)";
    case L1_ERR_EXPIRED:
        return "lease expired";
    case L1_ERR_NOT_READABLE:
        return "not read-locked";
    case L1_ERR_INVAL:
        return "invalid object size";
    case L1_ERR_TOO_MANY_NAMES:
        return "too many distinct model names or cache salts in use";
    case L1_ERR_OVER_QUOTA:
        return "read locks would exceed the cache salt's quota";
    case L1_ERR_PIN_CAP:
        return "pinned reply bytes at their cap";
    default:
        return "unknown error";
    }
}

size_t l1_entry_overhead_bytes(void) {
    /* The entry rounded to malloc's 16-byte chunks plus its 8-byte header, and one bucket
     * pointer (load factor <= 1). The arena's 12 bytes per unit are reported separately. */
    size_t e = (sizeof(struct l1_entry) + 8 + 15) / 16 * 16;
    return e + sizeof(struct htab_node *);
}

void l1_arena_region(struct l1 *l1, void **base, uint64_t *len) {
    *base = arena_base(l1->arena);
    *len = arena_total_bytes(l1->arena);
}
