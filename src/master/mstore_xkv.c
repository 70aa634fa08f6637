/* The master store's external-KV index: hash-sharded tables of entries (placements per node
 * and tier, hit counters), the per-(node, tier) reverse index that makes revoke-all cheap, and
 * the batched, prefetching match. Layout: see mstore_mem.c. */
#include "master/mstore_match.h"
#include "master/mstore_mem_internal.h"

#define XENT(n) HTAB_ENTRY(n, struct xent, hn)

/* The tables' growth callback: entries keep their 32-bit hash. */
static uint64_t xent_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return XENT(n)->hv;
}

int mem_xshard_init(struct xshard *sh) {
    memset(sh, 0, sizeof(*sh));
    pthread_mutex_init(&sh->lock, NULL);
    int rc = htab_init(&sh->t, 16, xent_hash, NULL);
    sh->hint_b = sh->t.b;
    sh->hint_nb = sh->t.nb;
    return rc;
}

void mem_xshard_fini(struct xshard *xs) {
    for (size_t b = 0; b < xs->t.nb; b++)
        for (struct htab_node *n = xs->t.b[b], *nx; n; n = nx) {
            nx = n->next;
            free(XENT(n)->pl);
            free(XENT(n));
        }
    htab_fini(&xs->t);
    for (uint32_t n = 0; n < xs->nrev; n++)
        for (int t = 0; t < MSTORE_NTIERS; t++) free(xs->rev[n][t].v);
    free(xs->rev);
    xs->rev = NULL;
    xs->nrev = 0;
    pthread_mutex_destroy(&xs->lock);
}

/* ---- xshard helpers (caller holds the shard lock) ---- */

static struct xent *do_xfind(struct xshard *sh, const char *k, size_t klen, uint32_t hv) {
    for (struct htab_node *n = *htab_bucket(&sh->t, hv); n; n = n->next) {
        struct xent *e = XENT(n);
        if (e->hv == hv && e->klen == klen && memcmp(e->key, k, klen) == 0) return e;
    }
    return NULL;
}

static void do_xunlink_free(struct mem *m, struct xshard *sh, struct xent *e) {
    htab_remove(&sh->t, &e->hn, e->hv);
    atomic_fetch_sub(&m->xbytes,
                     sizeof(*e) + e->klen + 1 + (size_t)e->plcap * sizeof(struct xplace));
    free(e->pl);
    free(e);
}

static struct xplace *xplace_of(struct xent *e, uint32_t node) {
    for (uint32_t i = 0; i < e->nplace; i++)
        if (e->pl[i].node == node) return &e->pl[i];
    return NULL;
}

static struct xrev *do_xrev(struct xshard *sh, uint32_t node, int tier, bool create) {
    if (node >= sh->nrev) {
        if (!create) return NULL;
        /* Doubling: growing by a few rows per new node copied the rows quadratically. */
        uint32_t nn = sh->nrev ? sh->nrev : 8;
        while (nn && nn <= node) nn = cap_next(nn, 8);
        if (!nn) return NULL;
        void *r = realloc(sh->rev, (size_t)nn * sizeof(*sh->rev));
        if (!r) return NULL;
        sh->rev = r;
        memset(&sh->rev[sh->nrev], 0, (nn - sh->nrev) * sizeof(*sh->rev));
        sh->nrev = nn;
    }
    return &sh->rev[node][tier];
}

/* 0 ok, -1 no memory. */
static int do_xadd(struct mem *m, struct xshard *sh, const char *k, uint32_t hv, uint32_t node,
                   int tier) {
    size_t klen = strlen(k);
    if (klen > UINT16_MAX) klen = UINT16_MAX; /* hashes are short; longer ones truncate */
    struct xent *e = do_xfind(sh, k, klen, hv);
    if (!e) {
        e = calloc(1, sizeof(*e) + klen + 1);
        if (!e) return -1;
        memcpy(e->key, k, klen);
        e->klen = (uint16_t)klen;
        e->hv = hv;
        htab_insert(&sh->t, &e->hn, hv);
        atomic_store_explicit(&sh->hint_b, sh->t.b, memory_order_relaxed);
        atomic_store_explicit(&sh->hint_nb, sh->t.nb, memory_order_relaxed);
        atomic_fetch_add(&m->xbytes, sizeof(*e) + klen + 1);
    }
    struct xplace *p = xplace_of(e, node);
    if (p && (p->tiers & (1u << tier))) return 0;
    struct xrev *rv = do_xrev(sh, node, tier, true);
    if (!rv) goto nomem;
    if (rv->n == rv->cap) {
        uint32_t nc = cap_next(rv->cap, 16);
        void *v = nc ? realloc(rv->v, (size_t)nc * sizeof(*rv->v)) : NULL;
        if (!v) goto nomem;
        rv->v = v;
        rv->cap = nc;
    }
    if (!p) {
        if (e->nplace == e->plcap) {
            uint32_t nc = cap_next(e->plcap, 1);
            void *pl = nc ? realloc(e->pl, (size_t)nc * sizeof(*e->pl)) : NULL;
            if (!pl) goto nomem; /* e->pl is untouched: realloc failed or never ran */
            atomic_fetch_add(&m->xbytes, (size_t)(nc - e->plcap) * sizeof(struct xplace));
            e->pl = pl;
            e->plcap = nc;
        }
        p = &e->pl[e->nplace++];
        memset(p, 0, sizeof(*p));
        p->node = node;
    }
    p->tiers |= (uint8_t)(1u << tier);
    p->ridx[tier] = rv->n;
    rv->v[rv->n++] = e;
    return 0;
nomem:
    if (e->nplace == 0 && e->hits == 0) do_xunlink_free(m, sh, e);
    return -1;
}

/* Drops tier from e's placement for node. The reverse vector is maintained unless
 * keep_rev (the caller is clearing that whole vector). Frees e when nothing is left. */
static void do_xdrop(struct mem *m, struct xshard *sh, struct xent *e, uint32_t node, int tier,
                     bool keep_rev) {
    struct xplace *p = xplace_of(e, node);
    if (!p || !(p->tiers & (1u << tier))) return;
    if (!keep_rev) {
        struct xrev *rv = &sh->rev[node][tier];
        uint32_t pos = p->ridx[tier];
        struct xent *moved = rv->v[--rv->n];
        rv->v[pos] = moved;
        if (moved != e) xplace_of(moved, node)->ridx[tier] = pos;
    }
    p->tiers &= (uint8_t) ~(1u << tier);
    if (!p->tiers) *p = e->pl[--e->nplace];
    if (e->nplace == 0 && e->hits == 0) do_xunlink_free(m, sh, e);
}

static void do_xdrop_all_at(struct mem *m, struct xshard *sh, uint32_t node, int tier) {
    struct xrev *rv = do_xrev(sh, node, tier, false);
    if (!rv) return;
    uint32_t n = rv->n;
    rv->n = 0;
    for (uint32_t i = 0; i < n; i++) {
        struct xent *e = rv->v[i];
        struct xplace *p = xplace_of(e, node);
        p->tiers &= (uint8_t) ~(1u << tier);
        if (!p->tiers) *p = e->pl[--e->nplace];
        if (e->nplace == 0 && e->hits == 0) do_xunlink_free(m, sh, e);
    }
    if (rv->cap > 64) { /* give the memory of a wiped tier back */
        free(rv->v);
        rv->v = NULL;
        rv->cap = 0;
    }
}

static struct xshard *xshard_of(struct mem *m, uint64_t h) {
    return &m->xs[(h >> 40) & (m->nshards - 1)]; /* as mem_ext_match groups keys */
}

void mem_xkv_wipe_node(struct mem *m, uint32_t node) {
    for (uint32_t s = 0; s < m->nshards; s++) {
        struct xshard *sh = &m->xs[s];
        pthread_mutex_lock(&sh->lock);
        for (int t = 0; t < MSTORE_NTIERS; t++) do_xdrop_all_at(m, sh, node, t);
        pthread_mutex_unlock(&sh->lock);
    }
}

/* ---- ops ---- */

int mem_ext_report(struct mstore *s, const char *node_id, char *const *hashes, size_t n, int tier) {
    struct mem *m = MEM(s);
    int rc = 1;
    /* meta is held for reading across the writes, so the liveness check and the write
     * are one atomic step against expiry and unregister (which take it for writing). */
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    if (idx == UINT32_MAX || !m->nodes[idx]->present ||
        m->nodes[idx]->status != MSTORE_STATUS_ALIVE) {
        rc = 0;
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t h = hkey(hashes[i], strlen(hashes[i]));
        struct xshard *sh = xshard_of(m, h);
        pthread_mutex_lock(&sh->lock);
        int r = do_xadd(m, sh, hashes[i], (uint32_t)h, idx, tier);
        pthread_mutex_unlock(&sh->lock);
        if (r < 0) {
            rc = -1;
            break;
        }
    }
out:
    pthread_rwlock_unlock(&m->meta);
    return rc;
}

void mem_ext_revoke(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                    int tier) {
    struct mem *m = MEM(s);
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    for (size_t i = 0; idx != UINT32_MAX && i < n; i++) {
        size_t kl = strlen(hashes[i]);
        uint64_t h = hkey(hashes[i], kl);
        struct xshard *sh = xshard_of(m, h);
        pthread_mutex_lock(&sh->lock);
        struct xent *e = do_xfind(sh, hashes[i], kl > UINT16_MAX ? UINT16_MAX : kl, (uint32_t)h);
        if (e) do_xdrop(m, sh, e, idx, tier, false);
        pthread_mutex_unlock(&sh->lock);
    }
    pthread_rwlock_unlock(&m->meta);
}

void mem_ext_revoke_tier(struct mstore *s, const char *node_id, int tier) {
    struct mem *m = MEM(s);
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    for (uint32_t sidx = 0; idx != UINT32_MAX && sidx < m->nshards; sidx++) {
        struct xshard *sh = &m->xs[sidx];
        pthread_mutex_lock(&sh->lock);
        do_xdrop_all_at(m, sh, idx, tier);
        pthread_mutex_unlock(&sh->lock);
    }
    pthread_rwlock_unlock(&m->meta);
}

void mem_ext_revoke_node(struct mstore *s, const char *node_id) {
    struct mem *m = MEM(s);
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    if (idx != UINT32_MAX) mem_xkv_wipe_node(m, idx);
    pthread_rwlock_unlock(&m->meta);
}

void mstore_match_free(struct mstore_match *mt) {
    for (uint32_t i = 0; i < mt->nnodes; i++) free(mt->nodes[i].peer_address);
    free(mt->nodes);
    free(mt->pool);
    memset(mt, 0, sizeof(*mt));
}

int mstore_match_dedup(const struct mstore_key *k, size_t n, uint64_t *hv, bool *first) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    uint32_t *set = calloc(cap, sizeof(uint32_t));
    if (!set) return -1;
    for (size_t i = 0; i < n; i++) {
        hv[i] = hkey(k[i].p, k[i].n); /* over the whole key, as report hashes it */
        first[i] = false;
        for (size_t j = hv[i] & (cap - 1);; j = (j + 1) & (cap - 1)) {
            uint32_t v = set[j];
            if (!v) {
                set[j] = (uint32_t)i + 1;
                first[i] = true;
                break;
            }
            if (hv[v - 1] == hv[i] && k[v - 1].n == k[i].n &&
                memcmp(k[v - 1].p, k[i].p, k[i].n) == 0)
                break;
        }
    }
    free(set);
    return 0;
}

/* Node index -> slot in the result, for a handful of nodes per reply. */
static uint32_t slot_of(uint32_t *map, uint32_t cap, uint32_t node, uint32_t *nslots) {
    for (uint32_t j = (node * 0x9e3779b1u) & (cap - 1);; j = (j + 1) & (cap - 1)) {
        if (!map[j]) {
            map[j] = node + 1;
            map[cap + j] = (*nslots)++;
            return map[cap + j];
        }
        if (map[j] == node + 1) return map[cap + j];
    }
}

/* Slots in order of first appearance, per slot and tier a count, then offsets into one
 * pool filled in request order: a few allocations whatever the match's size. */
int mstore_match_group(const struct mstore_hitrec *h, size_t nh, struct mstore_match *mt) {
    memset(mt, 0, sizeof(*mt));
    if (nh > UINT32_MAX / 4) return -1; /* slot map and offsets are 32-bit */
    uint32_t mcap = 16, nslots = 0;
    while (mcap < nh * 2) mcap <<= 1;
    uint32_t *map = calloc((size_t)mcap * 2, sizeof(uint32_t));
    uint32_t *slot = malloc((nh + 1) * sizeof(uint32_t));
    size_t ntot = 0;
    int rc = map && slot ? 0 : -1;
    for (size_t k = 0; !rc && k < nh; k++) slot[k] = slot_of(map, mcap, h[k].node, &nslots);
    if (!rc) {
        mt->nodes = calloc(nslots + 1, sizeof(*mt->nodes));
        if (!mt->nodes) rc = -1;
    }
    for (size_t k = 0; !rc && k < nh; k++) {
        struct mstore_match_node *mn = &mt->nodes[slot[k]];
        mn->node = h[k].node;
        mn->distinct++;
        for (int t = 0; t < MSTORE_NTIERS; t++)
            if (h[k].tiers & (1u << t)) {
                mn->tiers[t].n++;
                ntot++;
            }
    }
    if (!rc) {
        mt->nnodes = nslots;
        mt->pool = malloc((ntot + 1) * sizeof(uint32_t));
        if (!mt->pool) rc = -1;
    }
    if (!rc) {
        uint32_t off = 0;
        for (uint32_t i = 0; i < nslots; i++)
            for (int t = 0; t < MSTORE_NTIERS; t++) {
                struct mstore_match_tier *b = &mt->nodes[i].tiers[t];
                b->tier = t;
                b->idx = mt->pool + off;
                off += b->n;
                b->n = 0;
            }
        for (size_t k = 0; k < nh; k++) {
            struct mstore_match_node *mn = &mt->nodes[slot[k]];
            for (int t = 0; t < MSTORE_NTIERS; t++)
                if (h[k].tiers & (1u << t)) mn->tiers[t].idx[mn->tiers[t].n++] = h[k].idx;
        }
    }
    free(map);
    free(slot);
    if (rc) mstore_match_free(mt);
    return rc;
}

void mstore_match_compact(struct mstore_match_node *mn) {
    uint32_t k = 0;
    for (int t = 0; t < MSTORE_NTIERS; t++)
        if (mn->tiers[t].n) mn->tiers[k++] = mn->tiers[t];
    for (uint32_t t = k; t < MSTORE_NTIERS; t++) mn->tiers[t] = (struct mstore_match_tier){0};
    mn->ntiers = k;
}

/* Two phases: the placements of every distinct key are copied out under their shard
 * lock, then grouped per node and tier into one index pool, so a match costs a few
 * allocations whatever its size. The lookups are memory-latency bound (an entry is a
 * bucket, a header and a placement array, each likely a cache miss), so the keys are
 * taken shard by shard, one lock each, with the bucket heads, entries and placement
 * arrays prefetched a stage ahead. Node ids and peers are read under meta afterwards; no
 * two locks are held together. */
int mem_ext_match(struct mstore *s, const struct mstore_key *keys, size_t n, bool count_as_hit,
                  int64_t now, struct mstore_match *mt) {
    struct mem *m = MEM(s);
    memset(mt, 0, sizeof(*mt));
    if (!n) return 0;
    if (n > UINT32_MAX / 8) return -1;
    uint64_t *hv = malloc(n * sizeof(*hv));
    bool *first = malloc(n * sizeof(*first));
    uint32_t *order = malloc(n * sizeof(*order)); /* key indices grouped by shard */
    uint32_t *sstart = calloc(m->nshards + 1, sizeof(*sstart));
    struct xent **ent = malloc(n * sizeof(*ent));     /* per key, under its shard lock */
    uint32_t *hoff = malloc((n + 1) * sizeof(*hoff)); /* key i's placements in h */
    size_t hcap = n * 2, nh = 0;
    struct mstore_hitrec *h = malloc(hcap * sizeof(*h));
    int rc = hv && first && order && sstart && ent && hoff && h
                 ? mstore_match_dedup(keys, n, hv, first)
                 : -1;
    uint32_t smask = m->nshards - 1;
    if (!rc) {
        for (size_t i = 0; i < n; i++)
            if (first[i]) sstart[((hv[i] >> 40) & smask) + 1]++;
        for (uint32_t k = 0; k < m->nshards; k++) sstart[k + 1] += sstart[k];
        uint32_t *pos = malloc(m->nshards * sizeof(*pos));
        if (!pos) {
            rc = -1;
        } else {
            memcpy(pos, sstart, m->nshards * sizeof(*pos));
            for (size_t i = 0; i < n; i++)
                if (first[i]) order[pos[(hv[i] >> 40) & smask]++] = (uint32_t)i;
            free(pos);
        }
        for (size_t i = 0; i < n; i++) hoff[i] = UINT32_MAX;
    }
    /* Unlocked prefetch of every bucket head, so the misses overlap across shards. A
     * concurrent regrow makes the address stale: a wasted hint, never a fault. */
    for (size_t i = 0; !rc && i < n; i++) {
        if (!first[i]) continue;
        struct xshard *sh = xshard_of(m, hv[i]);
        uintptr_t b = (uintptr_t)atomic_load_explicit(&sh->hint_b, memory_order_relaxed);
        size_t nb = atomic_load_explicit(&sh->hint_nb, memory_order_relaxed);
        __builtin_prefetch((const void *)(b + (hv[i] & (nb - 1)) * sizeof(struct htab_node *)));
    }
    for (uint32_t k = 0; !rc && k < m->nshards; k++) {
        uint32_t lo = sstart[k], hi = sstart[k + 1];
        if (lo == hi) continue;
        struct xshard *sh = &m->xs[k];
        pthread_mutex_lock(&sh->lock);
        for (uint32_t j = lo; j < hi; j++) {
            struct htab_node *e = *htab_bucket(&sh->t, (uint32_t)hv[order[j]]);
            if (e) { /* header and key: a 64-byte key straddles two lines */
                __builtin_prefetch(e);
                __builtin_prefetch((const char *)e + 64);
            }
        }
        for (uint32_t j = lo; j < hi; j++) {
            uint32_t i = order[j];
            size_t kl = keys[i].n > UINT16_MAX ? UINT16_MAX : keys[i].n;
            struct xent *e = do_xfind(sh, keys[i].p, kl, (uint32_t)hv[i]);
            ent[i] = e && e->nplace ? e : NULL;
            if (ent[i]) __builtin_prefetch(e->pl);
        }
        for (uint32_t j = lo; !rc && j < hi; j++) {
            uint32_t i = order[j];
            struct xent *e = ent[i];
            if (!e) continue;
            if (nh + e->nplace > UINT32_MAX / 4) { /* slot map and offsets are 32-bit */
                rc = -1;
                break;
            }
            if (nh + e->nplace > hcap) {
                size_t nc = (nh + e->nplace) * 2;
                void *p = realloc(h, nc * sizeof(*h));
                if (!p) {
                    rc = -1;
                    break;
                }
                h = p;
                hcap = nc;
            }
            hoff[i] = (uint32_t)nh;
            for (uint32_t p = 0; p < e->nplace; p++)
                h[nh++] = (struct mstore_hitrec){(uint32_t)i, e->pl[p].node, e->pl[p].tiers};
            if (count_as_hit) {
                e->hits++;
                if (now > e->last_seen) e->last_seen = now;
            }
        }
        pthread_mutex_unlock(&sh->lock);
    }
    /* Back to request order: hits of key i are h[hoff[i]] up to the next key's. */
    struct mstore_hitrec *ho = rc ? NULL : malloc((nh + 1) * sizeof(*ho));
    if (!rc && !ho) rc = -1;
    if (!rc) {
        size_t o = 0;
        for (size_t i = 0; i < n; i++) {
            if (hoff[i] == UINT32_MAX) continue;
            for (size_t k = hoff[i]; k < nh && h[k].idx == i; k++) ho[o++] = h[k];
        }
        free(h);
        h = ho;
    }
    free(hv);
    free(first);
    free(order);
    free(sstart);
    free(ent);
    free(hoff);
    if (!rc) rc = mstore_match_group(h, nh, mt);
    free(h);
    if (rc) {
        mstore_match_free(mt);
        return rc;
    }
    /* Compact the tier buckets (ascending) and attach node ids and live peers. */
    pthread_rwlock_rdlock(&m->meta);
    for (uint32_t i = 0; i < mt->nnodes; i++) {
        struct mstore_match_node *mn = &mt->nodes[i];
        struct node *nd = m->nodes[mn->node];
        mn->node_id = nd->id;
        bool alive = nd->present && nd->status == MSTORE_STATUS_ALIVE;
        mn->peer_address = strdup(alive ? nd->peer_address : "");
        if (!mn->peer_address) rc = -1;
        mstore_match_compact(mn);
    }
    pthread_rwlock_unlock(&m->meta);
    if (rc) mstore_match_free(mt);
    return rc;
}

int mem_hit_counts(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                   size_t *nout) {
    struct mem *m = MEM(s);
    *out = NULL;
    *nout = 0;
    if (!n) return 0;
    uint64_t *hv = malloc(n * sizeof(*hv));
    bool *first = malloc(n * sizeof(*first));
    struct mstore_key *keys = malloc(n * sizeof(*keys));
    struct mstore_hit *h = xcalloc(n, sizeof(*h));
    for (size_t i = 0; keys && i < n; i++)
        keys[i] = (struct mstore_key){hashes[i], strlen(hashes[i])};
    if (!hv || !first || !keys || !h || mstore_match_dedup(keys, n, hv, first)) {
        free(hv);
        free(first);
        free(keys);
        free(h);
        return -1;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (!first[i]) continue;
        size_t kl = strlen(hashes[i]);
        struct xshard *sh = xshard_of(m, hv[i]);
        pthread_mutex_lock(&sh->lock);
        struct xent *e =
            do_xfind(sh, hashes[i], kl > UINT16_MAX ? UINT16_MAX : kl, (uint32_t)hv[i]);
        if (e && e->hits) h[k++] = (struct mstore_hit){(uint32_t)i, e->hits};
        pthread_mutex_unlock(&sh->lock);
    }
    free(hv);
    free(first);
    free(keys);
    *out = h;
    *nout = k;
    return 0;
}

size_t mem_hit_gc(struct mstore *s, int64_t cutoff) {
    struct mem *m = MEM(s);
    size_t dropped = 0;
    for (uint32_t sidx = 0; sidx < m->nshards; sidx++) {
        struct xshard *sh = &m->xs[sidx];
        pthread_mutex_lock(&sh->lock);
        for (size_t b = 0; b < sh->t.nb; b++)
            for (struct htab_node *n = sh->t.b[b], *nx; n; n = nx) {
                nx = n->next;
                struct xent *e = XENT(n);
                if (!e->hits || e->last_seen >= cutoff) continue;
                e->hits = 0;
                dropped++;
                if (!e->nplace) do_xunlink_free(m, sh, e);
            }
        pthread_mutex_unlock(&sh->lock);
    }
    return dropped;
}

size_t mem_ext_count(struct mstore *s) {
    struct mem *m = MEM(s);
    size_t c = 0;
    for (uint32_t sidx = 0; sidx < m->nshards; sidx++) {
        struct xshard *sh = &m->xs[sidx];
        pthread_mutex_lock(&sh->lock);
        for (uint32_t n = 0; n < sh->nrev; n++)
            for (int t = 0; t < MSTORE_NTIERS; t++) c += sh->rev[n][t].n;
        pthread_mutex_unlock(&sh->lock);
    }
    return c;
}
