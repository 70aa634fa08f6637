/* In-memory metadata store: client records under one rwlock, the external-KV index and
 * the block index in hash-sharded tables with one mutex per shard. This file holds the
 * records, the block index and the store's life cycle; mstore_xkv.c the external-KV index
 * (structures shared through mstore_mem_internal.h).
 *
 * Lock order: meta -> xshard, meta -> bshard; never two shards at once. Node ids are
 * interned to small integers (struct node, never freed) so index entries stay small and
 * readers can hand out stable node_id pointers.
 *
 * External-KV layout: an entry per hash holds its placements (node, tier bitmask) and its
 * hit counter, so a revoked hash keeps its counter until the hit GC drops it. Each shard
 * keeps a reverse index per (node, tier): a vector of entries, each placement remembering
 * its slot in it, so revoke-all-at-tier costs O(that node's entries at that tier). */
#include "master/mstore_mem_internal.h"

#define MEM_MAGIC 0x4d53544fu

static const char *TIER_LABELS[MSTORE_NTIERS] = {"UNKNOWN", "HBM", "DRAM", "SSD"};

const char *mstore_tier_label(int tier) {
    return mstore_tier_valid(tier) ? TIER_LABELS[tier] : "UNKNOWN";
}

static char *xstrdup(const char *s) { return strdup(s ? s : ""); }

/* Caller holds meta (any mode). UINT32_MAX when absent. */
uint32_t mem_node_find(struct mem *m, const char *id) {
    size_t len = strlen(id);
    uint32_t mask = m->nmap_cap - 1;
    for (uint32_t i = (uint32_t)hkey(id, len) & mask;; i = (i + 1) & mask) {
        uint32_t v = m->nmap[i];
        if (!v) return UINT32_MAX;
        if (strcmp(m->nodes[v - 1]->id, id) == 0) return v - 1;
    }
}

static int do_nmap_insert(uint32_t *map, uint32_t cap, struct node **nodes, uint32_t idx) {
    const char *id = nodes[idx]->id;
    uint32_t mask = cap - 1;
    for (uint32_t i = (uint32_t)hkey(id, strlen(id)) & mask;; i = (i + 1) & mask)
        if (!map[i]) {
            map[i] = idx + 1;
            return 0;
        }
}

/* Caller holds meta for writing. Returns the node index or UINT32_MAX on no memory. */
static uint32_t do_node_intern(struct mem *m, const char *id) {
    uint32_t idx = mem_node_find(m, id);
    if (idx != UINT32_MAX) return idx;
    if (m->nnodes >= UINT32_MAX / 4) return UINT32_MAX; /* the id map's size stays in 32 bits */
    if ((m->nnodes + 1) * 2 > m->nmap_cap) {
        uint32_t ncap = m->nmap_cap * 2;
        uint32_t *nm = xcalloc(ncap, sizeof(*nm));
        if (!nm) return UINT32_MAX;
        for (uint32_t i = 0; i < m->nnodes; i++) do_nmap_insert(nm, ncap, m->nodes, i);
        free(m->nmap);
        m->nmap = nm;
        m->nmap_cap = ncap;
    }
    if (m->nnodes == m->ncap) {
        uint32_t nc = cap_next(m->ncap, 16);
        struct node **nn = nc ? realloc(m->nodes, (size_t)nc * sizeof(*nn)) : NULL;
        if (!nn) return UINT32_MAX;
        m->nodes = nn;
        m->ncap = nc;
    }
    struct node *n = calloc(1, sizeof(*n));
    if (!n || !(n->id = strdup(id))) {
        free(n);
        return UINT32_MAX;
    }
    m->nodes[m->nnodes] = n;
    do_nmap_insert(m->nmap, m->nmap_cap, m->nodes, m->nnodes);
    return m->nnodes++;
}

static void free_tags(char **tags, size_t n) {
    for (size_t i = 0; i < n; i++) free(tags[i]);
    free(tags);
}

static void do_record_clear(struct node *n);

static size_t do_record_bytes(const struct node *n) {
    if (!n->present) return 0;
    size_t b = n->engine_len + strlen(n->node_address) + strlen(n->peer_address) + 2 +
               n->ntags * sizeof(char *);
    for (size_t i = 0; i < n->ntags; i++) b += strlen(n->tags[i]) + 1;
    return b;
}

/* Caller holds meta for writing: deletes n's record, keeping the interned id. */
static void do_record_drop(struct mem *m, struct node *n) {
    m->rbytes -= do_record_bytes(n);
    do_record_clear(n);
}

static void do_record_clear(struct node *n) {
    free(n->node_address);
    free(n->peer_address);
    free(n->engine);
    free_tags(n->tags, n->ntags);
    n->node_address = n->peer_address = NULL;
    n->engine = NULL;
    n->tags = NULL;
    n->engine_len = n->ntags = 0;
    n->present = false;
    n->status = MSTORE_STATUS_UNKNOWN;
}

/* ---- block index (caller holds the shard lock) ---- */

#define BENT(n) HTAB_ENTRY(n, struct bent, hn)

/* The tables' growth callback: entries keep their 32-bit hash. */
static uint64_t bent_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return BENT(n)->hv;
}

static struct bent *do_bfind(struct bshard *sh, const char *k, uint32_t hv) {
    for (struct htab_node *n = *htab_bucket(&sh->t, hv); n; n = n->next) {
        struct bent *e = BENT(n);
        if (e->hv == hv && strcmp(e->key, k) == 0) return e;
    }
    return NULL;
}

static void do_bunlink_free(struct bshard *sh, struct bent *e) {
    htab_remove(&sh->t, &e->hn, e->hv);
    free(e->locs);
    free(e);
}

static struct bshard *bshard_of(struct mem *m, uint64_t h) {
    return &m->bs[(h >> 40) & (m->nshards - 1)];
}

/* overwrite: a full sync replaces the size of a duplicate ADD; a delta ADD keeps it. */
static int block_add(struct mem *m, const char *k, uint32_t node, int tier, uint64_t size,
                     int64_t now, bool overwrite) {
    uint64_t h = hkey(k, strlen(k));
    struct bshard *sh = bshard_of(m, h);
    int rc = 0;
    pthread_mutex_lock(&sh->lock);
    struct bent *e = do_bfind(sh, k, (uint32_t)h);
    if (!e) {
        size_t kl = strlen(k);
        e = calloc(1, sizeof(*e) + kl + 1);
        if (!e) {
            rc = -1;
            goto out;
        }
        memcpy(e->key, k, kl);
        e->hv = (uint32_t)h;
        e->created = e->lacc = now;
        htab_insert(&sh->t, &e->hn, e->hv);
    }
    for (uint32_t i = 0; i < e->nloc; i++)
        if (e->locs[i].node == node && e->locs[i].tier == tier) {
            if (overwrite) e->locs[i].size = size;
            goto out;
        }
    if (e->nloc == e->loccap) {
        uint32_t nc = cap_next(e->loccap, 2);
        void *l = nc ? realloc(e->locs, (size_t)nc * sizeof(*e->locs)) : NULL;
        if (!l) {
            if (!e->nloc) do_bunlink_free(sh, e);
            rc = -1;
            goto out;
        }
        e->locs = l;
        e->loccap = nc;
    }
    e->locs[e->nloc++] = (struct bloc){node, tier, size};
out:
    pthread_mutex_unlock(&sh->lock);
    return rc;
}

static void block_remove(struct mem *m, const char *k, uint32_t node, int tier) {
    uint64_t h = hkey(k, strlen(k));
    struct bshard *sh = bshard_of(m, h);
    pthread_mutex_lock(&sh->lock);
    struct bent *e = do_bfind(sh, k, (uint32_t)h);
    if (e) {
        for (uint32_t i = 0; i < e->nloc; i++)
            if (e->locs[i].node == node && e->locs[i].tier == tier) {
                e->locs[i] = e->locs[--e->nloc];
                break;
            }
        if (!e->nloc) do_bunlink_free(sh, e);
    }
    pthread_mutex_unlock(&sh->lock);
}

/* A full scan: node-wide block wipes are rare (unregister, expiry, full sync). */
static void wipe_blocks_node(struct mem *m, uint32_t node) {
    for (uint32_t s = 0; s < m->nshards; s++) {
        struct bshard *sh = &m->bs[s];
        pthread_mutex_lock(&sh->lock);
        for (size_t i = 0; i < sh->t.nb; i++)
            for (struct htab_node *n = sh->t.b[i], *nx; n; n = nx) {
                nx = n->next;
                struct bent *e = BENT(n);
                for (uint32_t j = 0; j < e->nloc;)
                    if (e->locs[j].node == node)
                        e->locs[j] = e->locs[--e->nloc];
                    else
                        j++;
                if (!e->nloc) do_bunlink_free(sh, e);
            }
        pthread_mutex_unlock(&sh->lock);
    }
}

/* ---- ops ---- */

static void mem_destroy(struct mstore *s) {
    struct mem *m = MEM(s);
    if (!m) return;
    for (uint32_t i = 0; i < m->nshards; i++) {
        mem_xshard_fini(&m->xs[i]);
        struct bshard *bs = &m->bs[i];
        for (size_t b = 0; b < bs->t.nb; b++)
            for (struct htab_node *n = bs->t.b[b], *nx; n; n = nx) {
                nx = n->next;
                free(BENT(n)->locs);
                free(BENT(n));
            }
        htab_fini(&bs->t);
        pthread_mutex_destroy(&bs->lock);
    }
    for (uint32_t i = 0; i < m->nnodes; i++) {
        do_record_clear(m->nodes[i]);
        free(m->nodes[i]->id);
        free(m->nodes[i]);
    }
    free(m->nodes);
    free(m->nmap);
    free(m->xs);
    free(m->bs);
    pthread_rwlock_destroy(&m->meta);
    free(m);
}

static int mem_register(struct mstore *s, const struct mstore_reg *r, int64_t now,
                        int64_t stale_after) {
    struct mem *m = MEM(s);
    int rc = 0;
    pthread_rwlock_wrlock(&m->meta);
    uint32_t idx = do_node_intern(m, r->node_id ? r->node_id : "");
    if (idx == UINT32_MAX) {
        rc = -1;
        goto out;
    }
    struct node *n = m->nodes[idx];
    if (n->present && n->status == MSTORE_STATUS_ALIVE && now - n->last_hb <= stale_after) {
        rc = 1;
        goto out;
    }
    struct node fresh = {.id = n->id};
    fresh.node_address = xstrdup(r->node_address);
    fresh.peer_address = xstrdup(r->peer_address);
    fresh.tags = xcalloc(r->ntags, sizeof(char *));
    if (r->engine_desc_len) fresh.engine = malloc(r->engine_desc_len);
    bool ok = fresh.node_address && fresh.peer_address && fresh.tags &&
              (!r->engine_desc_len || fresh.engine);
    for (size_t i = 0; ok && i < r->ntags; i++, fresh.ntags++)
        ok = (fresh.tags[i] = strdup(r->tags[i])) != NULL;
    if (!ok) {
        do_record_clear(&fresh);
        rc = -1;
        goto out;
    }
    if (r->engine_desc_len) memcpy(fresh.engine, r->engine_desc, r->engine_desc_len);
    fresh.engine_len = r->engine_desc_len;
    fresh.present = true;
    fresh.status = MSTORE_STATUS_ALIVE;
    fresh.last_hb = fresh.reg_at = now;
    fresh.last_seq = 0;
    fresh.caps = r->caps;
    do_record_drop(m, n);
    *n = fresh;
    m->rbytes += do_record_bytes(n);
out:
    pthread_rwlock_unlock(&m->meta);
    return rc;
}

static bool mem_unregister(struct mstore *s, const char *node_id) {
    struct mem *m = MEM(s);
    bool had = false;
    pthread_rwlock_wrlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    if (idx != UINT32_MAX && m->nodes[idx]->present) {
        had = true;
        do_record_drop(m, m->nodes[idx]);
        mem_xkv_wipe_node(m, idx);
        wipe_blocks_node(m, idx);
    }
    pthread_rwlock_unlock(&m->meta);
    return had;
}

static enum mstore_hb mem_heartbeat(struct mstore *s, const char *node_id, uint64_t seq,
                                    int64_t now, const struct mstore_caps *caps,
                                    const struct mstore_event *ev, size_t nev, bool full,
                                    uint64_t *acked) {
    struct mem *m = MEM(s);
    enum mstore_hb res;
    bool revived = false;
    /* The write lock makes the sequence check and the event application one CAS. */
    pthread_rwlock_wrlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    struct node *n = idx != UINT32_MAX ? m->nodes[idx] : NULL;
    if (!n || !n->present) {
        *acked = 0;
        res = MSTORE_HB_UNKNOWN;
        goto out;
    }
    revived = n->status == MSTORE_STATUS_EXPIRED;
    n->last_hb = now;
    n->status = MSTORE_STATUS_ALIVE;
    if (!full && seq != n->last_seq + 1) {
        *acked = n->last_seq;
        res = MSTORE_HB_SEQ_GAP;
        goto out;
    }
    if (caps)
        n->caps = *caps;
    else
        memset(&n->caps, 0, sizeof(n->caps));
    n->last_seq = seq;
    if (full) wipe_blocks_node(m, idx);
    for (size_t i = 0; i < nev; i++) {
        const struct mstore_event *e = &ev[i];
        if (e->kind == MSTORE_EV_REMOVE) {
            if (!full) block_remove(m, e->key, idx, e->tier);
        } else {
            (void)block_add(m, e->key, idx, e->tier, e->size, now, full);
        }
    }
    *acked = seq;
    res = MSTORE_HB_APPLIED;
out:
    pthread_rwlock_unlock(&m->meta);
    return revived && res != MSTORE_HB_UNKNOWN ? MSTORE_HB_REVIVED : res;
}

static size_t mem_expire(struct mstore *s, int64_t cutoff, int64_t forget_before,
                         void (*fn)(const char *, void *), void *arg) {
    struct mem *m = MEM(s);
    size_t cnt = 0;
    pthread_rwlock_wrlock(&m->meta);
    for (uint32_t i = 0; i < m->nnodes; i++) {
        struct node *n = m->nodes[i];
        if (!n->present) continue;
        if (n->status == MSTORE_STATUS_ALIVE && n->last_hb < cutoff) {
            /* What an expired node keeps is what a heartbeat needs to revive it (the
             * reference's rule): ids, addresses, tags, sequence. Nothing reads engine_desc
             * back, and the index entries are wiped as the reference wipes them. */
            n->status = MSTORE_STATUS_EXPIRED;
            m->rbytes -= n->engine_len;
            free(n->engine);
            n->engine = NULL;
            n->engine_len = 0;
            mem_xkv_wipe_node(m, i);
            wipe_blocks_node(m, i);
            cnt++;
            if (fn) fn(n->id, arg);
        }
        if (n->status == MSTORE_STATUS_EXPIRED && n->last_hb < forget_before) do_record_drop(m, n);
    }
    pthread_rwlock_unlock(&m->meta);
    return cnt;
}

static size_t mem_alive_count(struct mstore *s) {
    struct mem *m = MEM(s);
    size_t c = 0;
    pthread_rwlock_rdlock(&m->meta);
    for (uint32_t i = 0; i < m->nnodes; i++)
        c += m->nodes[i]->present && m->nodes[i]->status == MSTORE_STATUS_ALIVE;
    pthread_rwlock_unlock(&m->meta);
    return c;
}

static int mem_client_status(struct mstore *s, const char *node_id) {
    struct mem *m = MEM(s);
    int st = MSTORE_STATUS_UNKNOWN;
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    if (idx != UINT32_MAX && m->nodes[idx]->present) st = m->nodes[idx]->status;
    pthread_rwlock_unlock(&m->meta);
    return st;
}

static int mem_client_tags(struct mstore *s, const char *node_id, char ***tags, size_t *ntags) {
    struct mem *m = MEM(s);
    int rc = 0;
    *tags = NULL;
    *ntags = 0;
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = mem_node_find(m, node_id);
    if (idx != UINT32_MAX && m->nodes[idx]->present && m->nodes[idx]->ntags) {
        struct node *n = m->nodes[idx];
        char **t = xcalloc(n->ntags, sizeof(*t));
        size_t k = 0;
        if (!t) rc = -1;
        for (; t && k < n->ntags; k++)
            if (!(t[k] = strdup(n->tags[k]))) {
                rc = -1;
                break;
            }
        if (rc) {
            free_tags(t, k);
        } else {
            *tags = t;
            *ntags = k;
        }
    }
    pthread_rwlock_unlock(&m->meta);
    return rc;
}

static int mem_list_alive(struct mstore *s, struct mstore_alive **out, size_t *nout) {
    struct mem *m = MEM(s);
    int rc = 0;
    pthread_rwlock_rdlock(&m->meta);
    struct mstore_alive *a = xcalloc(m->nnodes, sizeof(*a));
    size_t k = 0;
    for (uint32_t i = 0; a && i < m->nnodes; i++) {
        struct node *n = m->nodes[i];
        if (!n->present || n->status != MSTORE_STATUS_ALIVE) continue;
        a[k] = (struct mstore_alive){.node = i, .node_id = n->id, .caps = n->caps};
        if (!(a[k].peer_address = strdup(n->peer_address))) {
            rc = -1;
            break;
        }
        k++;
    }
    pthread_rwlock_unlock(&m->meta);
    if (!a || rc) {
        for (size_t i = 0; a && i < k; i++) free(a[i].peer_address);
        free(a);
        return -1;
    }
    *out = a;
    *nout = k;
    return 0;
}

static bool excluded(uint32_t node, const uint32_t *ex, size_t nex) {
    for (size_t i = 0; i < nex; i++)
        if (ex[i] == node) return true;
    return false;
}

static int mem_route_get(struct mstore *s, char *const *keys, size_t n, char *const *excl,
                         size_t nexcl, int64_t now, int64_t lease_until, struct mstore_loc **locs,
                         size_t *nlocs) {
    struct mem *m = MEM(s);
    uint32_t *ex = xcalloc(nexcl, sizeof(*ex));
    if (!ex) return -1;
    size_t nex = 0;
    pthread_rwlock_rdlock(&m->meta);
    for (size_t i = 0; i < nexcl; i++) {
        uint32_t idx = mem_node_find(m, excl[i]);
        if (idx != UINT32_MAX) ex[nex++] = idx;
    }
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        locs[i] = NULL;
        nlocs[i] = 0;
        uint64_t h = hkey(keys[i], strlen(keys[i]));
        struct bshard *sh = bshard_of(m, h);
        pthread_mutex_lock(&sh->lock);
        struct bent *e = do_bfind(sh, keys[i], (uint32_t)h);
        if (e && e->nloc) {
            struct mstore_loc *l = malloc(e->nloc * sizeof(*l));
            size_t k = 0;
            for (uint32_t j = 0; l && j < e->nloc; j++) {
                if (excluded(e->locs[j].node, ex, nex)) continue;
                l[k++] = (struct mstore_loc){m->nodes[e->locs[j].node]->id, e->locs[j].node,
                                             e->locs[j].tier, e->locs[j].size};
            }
            if (!l) rc = -1;
            if (k && lease_until > 0) {
                e->lease = lease_until;
                e->lacc = now;
                e->acnt++;
            }
            if (k) {
                locs[i] = l;
                nlocs[i] = k;
            } else {
                free(l);
            }
        }
        pthread_mutex_unlock(&sh->lock);
    }
    pthread_rwlock_unlock(&m->meta);
    free(ex);
    return rc;
}

static void mem_block_exists(struct mstore *s, char *const *keys, size_t n, bool *found) {
    struct mem *m = MEM(s);
    for (size_t i = 0; i < n; i++) {
        uint64_t h = hkey(keys[i], strlen(keys[i]));
        struct bshard *sh = bshard_of(m, h);
        pthread_mutex_lock(&sh->lock);
        struct bent *e = do_bfind(sh, keys[i], (uint32_t)h);
        found[i] = e && e->nloc;
        pthread_mutex_unlock(&sh->lock);
    }
}

static const struct mstore_ops MEM_OPS = {
    .name = "inmemory",
    .destroy = mem_destroy,
    .register_client = mem_register,
    .unregister_client = mem_unregister,
    .apply_heartbeat = mem_heartbeat,
    .expire_stale = mem_expire,
    .alive_count = mem_alive_count,
    .client_status = mem_client_status,
    .client_tags = mem_client_tags,
    .list_alive = mem_list_alive,
    .ext_report = mem_ext_report,
    .ext_revoke = mem_ext_revoke,
    .ext_revoke_tier = mem_ext_revoke_tier,
    .ext_revoke_node = mem_ext_revoke_node,
    .ext_match = mem_ext_match,
    .hit_counts = mem_hit_counts,
    .hit_gc = mem_hit_gc,
    .ext_count = mem_ext_count,
    .block_route_get = mem_route_get,
    .block_exists = mem_block_exists,
};

struct mstore *mstore_mem_create(const struct mstore_mem_cfg *cfg) {
    uint32_t want = cfg && cfg->shards ? cfg->shards : 64, ns = 1;
    if (want > 4096) want = 4096;
    while (ns < want) ns <<= 1;
    struct mem *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->base.ops = &MEM_OPS;
    m->magic = MEM_MAGIC;
    m->nshards = ns;
    m->nmap_cap = 64;
    m->nmap = xcalloc(m->nmap_cap, sizeof(*m->nmap));
    m->xs = aligned_alloc(64, ns * sizeof(*m->xs));
    m->bs = aligned_alloc(64, ns * sizeof(*m->bs));
    if (!m->nmap || !m->xs || !m->bs || pthread_rwlock_init(&m->meta, NULL)) {
        free(m->nmap);
        free(m->xs);
        free(m->bs);
        free(m);
        return NULL;
    }
    memset(m->bs, 0, ns * sizeof(*m->bs));
    for (uint32_t i = 0; i < ns; i++) {
        pthread_mutex_init(&m->bs[i].lock, NULL);
        int xr = mem_xshard_init(&m->xs[i]);
        int br = htab_init(&m->bs[i].t, 16, bent_hash, NULL);
        if (xr != 0 || br != 0) {
            m->nshards = i + 1;
            mem_destroy(&m->base);
            return NULL;
        }
    }
    return &m->base;
}

size_t mstore_mem_record_bytes(struct mstore *s) {
    struct mem *m = MEM(s);
    if (m->magic != MEM_MAGIC) return 0;
    pthread_rwlock_rdlock(&m->meta);
    size_t b = m->rbytes;
    pthread_rwlock_unlock(&m->meta);
    return b;
}

size_t mstore_mem_bytes(struct mstore *s) {
    struct mem *m = MEM(s);
    if (m->magic != MEM_MAGIC) return 0;
    size_t b = atomic_load(&m->xbytes);
    for (uint32_t i = 0; i < m->nshards; i++) {
        struct xshard *sh = &m->xs[i];
        pthread_mutex_lock(&sh->lock);
        b += sh->t.nb * sizeof(void *);
        for (uint32_t n = 0; n < sh->nrev; n++)
            for (int t = 0; t < MSTORE_NTIERS; t++) b += sh->rev[n][t].cap * sizeof(void *);
        pthread_mutex_unlock(&sh->lock);
    }
    return b;
}
