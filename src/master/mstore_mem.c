/* In-memory metadata store: client records under one rwlock, the external-KV index and
 * the block index in hash-sharded tables with one mutex per shard.
 *
 * Lock order: meta -> xshard, meta -> bshard; never two shards at once. Node ids are
 * interned to small integers (struct node, never freed) so index entries stay small and
 * readers can hand out stable node_id pointers.
 *
 * External-KV layout: an entry per hash holds its placements (node, tier bitmask) and its
 * hit counter, so a revoked hash keeps its counter until the hit GC drops it. Each shard
 * keeps a reverse index per (node, tier): a vector of entries, each placement remembering
 * its slot in it, so revoke-all-at-tier costs O(that node's entries at that tier). */
#include "master/mstore.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/htab.h"

#define MEM_MAGIC 0x4d53544fu

static const char *TIER_LABELS[MSTORE_NTIERS] = {"UNKNOWN", "HBM", "DRAM", "SSD"};

const char *mstore_tier_label(int tier) {
    return mstore_tier_valid(tier) ? TIER_LABELS[tier] : "UNKNOWN";
}

static uint64_t hkey(const char *k, size_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, k, 8);
        h = (h ^ w) * 0xff51afd7ed558ccdull;
        h ^= h >> 32;
        k += 8;
        n -= 8;
    }
    uint64_t w = 0;
    memcpy(&w, k, n);
    h = (h ^ w) * 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 29;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 32;
    return h;
}

/* ---- nodes and client records (under meta) ---- */

struct node {
    char *id;
    bool present; /* a client record exists */
    int status;
    int64_t last_hb, reg_at;
    uint64_t last_seq;
    char *node_address, *peer_address;
    uint8_t *engine;
    size_t engine_len;
    char **tags;
    size_t ntags;
    struct mstore_caps caps;
};

/* ---- external-KV entries (under their xshard lock) ---- */

struct xplace {
    uint32_t node;
    uint8_t tiers;
    uint32_t ridx[MSTORE_NTIERS]; /* slot in the shard's reverse vector per tier */
};

struct xent {
    struct htab_node hn; /* first: a bucket head points at the entry itself */
    struct xplace *pl;
    uint64_t hits;
    int64_t last_seen;
    uint32_t hv;
    uint16_t nplace, plcap;
    uint16_t klen;
    char key[];
};

struct xrev {
    struct xent **v;
    uint32_t n, cap;
};

struct xshard {
    pthread_mutex_t lock;
    struct htab t; /* of xent, by hv */
    /* Copies of t.b and t.nb that mem_ext_match may read unlocked for a prefetch hint;
     * refreshed under lock after every insert. */
    struct htab_node **_Atomic hint_b;
    _Atomic size_t hint_nb;
    struct xrev (*rev)[MSTORE_NTIERS]; /* indexed by node */
    uint32_t nrev;
} __attribute__((aligned(64)));

/* ---- block index (under its bshard lock) ---- */

struct bloc {
    uint32_t node;
    int32_t tier;
    uint64_t size;
};

struct bent {
    struct htab_node hn;
    struct bloc *locs;
    uint32_t nloc, loccap;
    uint32_t hv;
    int64_t lease, lacc, created;
    uint64_t acnt;
    char key[];
};

struct bshard {
    pthread_mutex_t lock;
    struct htab t; /* of bent, by hv */
} __attribute__((aligned(64)));

struct mem {
    struct mstore base;
    uint32_t magic;
    pthread_rwlock_t meta;
    struct node **nodes;
    uint32_t nnodes, ncap;
    uint32_t *nmap; /* open addressing: node index + 1, 0 = empty */
    uint32_t nmap_cap;
    uint32_t nshards;
    struct xshard *xs;
    struct bshard *bs;
    _Atomic size_t xbytes;
    size_t rbytes; /* client records' heap bytes (do_record_bytes); under meta */
};

#define MEM(s) ((struct mem *)(s))

static void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

static char *xstrdup(const char *s) { return strdup(s ? s : ""); }

/* Caller holds meta (any mode). UINT32_MAX when absent. */
static uint32_t do_node_find(struct mem *m, const char *id) {
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
    uint32_t idx = do_node_find(m, id);
    if (idx != UINT32_MAX) return idx;
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
        uint32_t nc = m->ncap ? m->ncap * 2 : 16;
        struct node **nn = realloc(m->nodes, nc * sizeof(*nn));
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

/* ---- xshard helpers (caller holds the shard lock) ---- */

#define XENT(n) HTAB_ENTRY(n, struct xent, hn)
#define BENT(n) HTAB_ENTRY(n, struct bent, hn)

/* The tables' growth callbacks: entries keep their 32-bit hash. */
static uint64_t xent_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return XENT(n)->hv;
}

static uint64_t bent_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return BENT(n)->hv;
}

static struct xent *do_xfind(struct xshard *sh, const char *k, size_t klen, uint32_t hv) {
    for (struct htab_node *n = *htab_bucket(&sh->t, hv); n; n = n->next) {
        struct xent *e = XENT(n);
        if (e->hv == hv && e->klen == klen && memcmp(e->key, k, klen) == 0) return e;
    }
    return NULL;
}

static void do_xunlink_free(struct mem *m, struct xshard *sh, struct xent *e) {
    htab_remove(&sh->t, &e->hn, e->hv);
    atomic_fetch_sub(&m->xbytes, sizeof(*e) + e->klen + 1 + e->plcap * sizeof(struct xplace));
    free(e->pl);
    free(e);
}

static struct xplace *xplace_of(struct xent *e, uint32_t node) {
    for (uint16_t i = 0; i < e->nplace; i++)
        if (e->pl[i].node == node) return &e->pl[i];
    return NULL;
}

static struct xrev *do_xrev(struct xshard *sh, uint32_t node, int tier, bool create) {
    if (node >= sh->nrev) {
        if (!create) return NULL;
        uint32_t nn = node + 8;
        void *r = realloc(sh->rev, nn * sizeof(*sh->rev));
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
        uint32_t nc = rv->cap ? rv->cap * 2 : 16;
        void *v = realloc(rv->v, nc * sizeof(*rv->v));
        if (!v) goto nomem;
        rv->v = v;
        rv->cap = nc;
    }
    if (!p) {
        if (e->nplace == e->plcap) {
            uint16_t nc = e->plcap ? (uint16_t)(e->plcap * 2) : 1;
            void *pl = realloc(e->pl, nc * sizeof(*e->pl));
            if (!pl) goto nomem;
            atomic_fetch_add(&m->xbytes, (nc - e->plcap) * sizeof(struct xplace));
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

static void wipe_ext_node(struct mem *m, uint32_t node) {
    for (uint32_t s = 0; s < m->nshards; s++) {
        struct xshard *sh = &m->xs[s];
        pthread_mutex_lock(&sh->lock);
        for (int t = 0; t < MSTORE_NTIERS; t++) do_xdrop_all_at(m, sh, node, t);
        pthread_mutex_unlock(&sh->lock);
    }
}

/* ---- bshard helpers ---- */

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
        uint32_t nc = e->loccap ? e->loccap * 2 : 2;
        void *l = realloc(e->locs, nc * sizeof(*e->locs));
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
        struct xshard *xs = &m->xs[i];
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
        pthread_mutex_destroy(&xs->lock);
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
    uint32_t idx = do_node_find(m, node_id);
    if (idx != UINT32_MAX && m->nodes[idx]->present) {
        had = true;
        do_record_drop(m, m->nodes[idx]);
        wipe_ext_node(m, idx);
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
    /* The write lock makes the sequence check and the event application one CAS. */
    pthread_rwlock_wrlock(&m->meta);
    uint32_t idx = do_node_find(m, node_id);
    struct node *n = idx != UINT32_MAX ? m->nodes[idx] : NULL;
    if (!n || !n->present) {
        *acked = 0;
        res = MSTORE_HB_UNKNOWN;
        goto out;
    }
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
    return res;
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
            wipe_ext_node(m, i);
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
    uint32_t idx = do_node_find(m, node_id);
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
    uint32_t idx = do_node_find(m, node_id);
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

static int mem_ext_report(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                          int tier) {
    struct mem *m = MEM(s);
    int rc = 1;
    /* meta is held for reading across the writes, so the liveness check and the write
     * are one atomic step against expiry and unregister (which take it for writing). */
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = do_node_find(m, node_id);
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

static void mem_ext_revoke(struct mstore *s, const char *node_id, char *const *hashes, size_t n,
                           int tier) {
    struct mem *m = MEM(s);
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = do_node_find(m, node_id);
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

static void mem_ext_revoke_tier(struct mstore *s, const char *node_id, int tier) {
    struct mem *m = MEM(s);
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = do_node_find(m, node_id);
    for (uint32_t sidx = 0; idx != UINT32_MAX && sidx < m->nshards; sidx++) {
        struct xshard *sh = &m->xs[sidx];
        pthread_mutex_lock(&sh->lock);
        do_xdrop_all_at(m, sh, idx, tier);
        pthread_mutex_unlock(&sh->lock);
    }
    pthread_rwlock_unlock(&m->meta);
}

static void mem_ext_revoke_node(struct mstore *s, const char *node_id) {
    struct mem *m = MEM(s);
    pthread_rwlock_rdlock(&m->meta);
    uint32_t idx = do_node_find(m, node_id);
    if (idx != UINT32_MAX) wipe_ext_node(m, idx);
    pthread_rwlock_unlock(&m->meta);
}

void mstore_match_free(struct mstore_match *mt) {
    for (uint32_t i = 0; i < mt->nnodes; i++) free(mt->nodes[i].peer_address);
    free(mt->nodes);
    free(mt->pool);
    memset(mt, 0, sizeof(*mt));
}

/* Marks the first occurrence of every distinct hash; returns NULL on no memory. */
static bool *dedup_first(char *const *hashes, size_t n, uint64_t *hv) {
    bool *first = xcalloc(n, sizeof(bool));
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    uint32_t *set = xcalloc(cap, sizeof(uint32_t));
    if (!first || !set) {
        free(first);
        free(set);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        hv[i] = hkey(hashes[i], strlen(hashes[i]));
        for (size_t j = hv[i] & (cap - 1);; j = (j + 1) & (cap - 1)) {
            uint32_t v = set[j];
            if (!v) {
                set[j] = (uint32_t)i + 1;
                first[i] = true;
                break;
            }
            if (hv[v - 1] == hv[i] && strcmp(hashes[v - 1], hashes[i]) == 0) break;
        }
    }
    free(set);
    return first;
}

/* One placement seen by a match: request index, node, tier bitmask. */
struct xhit {
    uint32_t idx, node;
    uint8_t tiers;
};

/* Open-addressing set over the request: marks the first occurrence of each distinct key
 * (the other occurrences get hv = 0 and are skipped). -1 on no memory. */
static int dedup_keys(const struct mstore_key *k, size_t n, uint64_t *hv, bool *first) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    uint32_t *set = calloc(cap, sizeof(uint32_t));
    if (!set) return -1;
    for (size_t i = 0; i < n; i++) {
        size_t kl = k[i].n > UINT16_MAX ? UINT16_MAX : k[i].n; /* as stored by report */
        hv[i] = hkey(k[i].p, kl);
        first[i] = false;
        for (size_t j = hv[i] & (cap - 1);; j = (j + 1) & (cap - 1)) {
            uint32_t v = set[j];
            if (!v) {
                set[j] = (uint32_t)i + 1;
                first[i] = true;
                break;
            }
            size_t ol = k[v - 1].n > UINT16_MAX ? UINT16_MAX : k[v - 1].n;
            if (hv[v - 1] == hv[i] && ol == kl && memcmp(k[v - 1].p, k[i].p, kl) == 0) break;
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

/* Two phases: the placements of every distinct key are copied out under their shard
 * lock, then grouped per node and tier into one index pool, so a match costs a few
 * allocations whatever its size. The lookups are memory-latency bound (an entry is a
 * bucket, a header and a placement array, each likely a cache miss), so the keys are
 * taken shard by shard, one lock each, with the bucket heads, entries and placement
 * arrays prefetched a stage ahead. Node ids and peers are read under meta afterwards; no
 * two locks are held together. */
static int mem_ext_match(struct mstore *s, const struct mstore_key *keys, size_t n,
                         bool count_as_hit, int64_t now, struct mstore_match *mt) {
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
    struct xhit *h = malloc(hcap * sizeof(*h));
    int rc =
        hv && first && order && sstart && ent && hoff && h ? dedup_keys(keys, n, hv, first) : -1;
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
            for (uint16_t p = 0; p < e->nplace; p++)
                h[nh++] = (struct xhit){(uint32_t)i, e->pl[p].node, e->pl[p].tiers};
            if (count_as_hit) {
                e->hits++;
                if (now > e->last_seen) e->last_seen = now;
            }
        }
        pthread_mutex_unlock(&sh->lock);
    }
    /* Back to request order: hits of key i are h[hoff[i]] up to the next key's. */
    struct xhit *ho = rc ? NULL : malloc((nh + 1) * sizeof(*ho));
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
    /* Group: slots in order of first appearance, per slot and tier a count, then offsets
     * into one pool filled in request order. */
    uint32_t mcap = 16, nslots = 0;
    while (mcap < nh * 2) mcap <<= 1;
    uint32_t *map = rc ? NULL : calloc((size_t)mcap * 2, sizeof(uint32_t));
    uint32_t *slot = rc ? NULL : malloc((nh + 1) * sizeof(uint32_t));
    size_t ntot = 0;
    if (!rc && (!map || !slot)) rc = -1;
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
    free(h);
    free(map);
    free(slot);
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
        uint32_t k = 0;
        for (int t = 0; t < MSTORE_NTIERS; t++)
            if (mn->tiers[t].n) mn->tiers[k++] = mn->tiers[t];
        for (uint32_t t = k; t < MSTORE_NTIERS; t++) mn->tiers[t] = (struct mstore_match_tier){0};
        mn->ntiers = k;
    }
    pthread_rwlock_unlock(&m->meta);
    if (rc) mstore_match_free(mt);
    return rc;
}

static int mem_hit_counts(struct mstore *s, char *const *hashes, size_t n, struct mstore_hit **out,
                          size_t *nout) {
    struct mem *m = MEM(s);
    *out = NULL;
    *nout = 0;
    if (!n) return 0;
    uint64_t *hv = malloc(n * sizeof(*hv));
    bool *first = hv ? dedup_first(hashes, n, hv) : NULL;
    struct mstore_hit *h = first ? xcalloc(n, sizeof(*h)) : NULL;
    if (!h) {
        free(hv);
        free(first);
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
    *out = h;
    *nout = k;
    return 0;
}

static size_t mem_hit_gc(struct mstore *s, int64_t cutoff) {
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

static size_t mem_ext_count(struct mstore *s) {
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
        uint32_t idx = do_node_find(m, excl[i]);
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
    memset(m->xs, 0, ns * sizeof(*m->xs));
    memset(m->bs, 0, ns * sizeof(*m->bs));
    for (uint32_t i = 0; i < ns; i++) {
        pthread_mutex_init(&m->xs[i].lock, NULL);
        pthread_mutex_init(&m->bs[i].lock, NULL);
        int xr = htab_init(&m->xs[i].t, 16, xent_hash, NULL);
        int br = htab_init(&m->bs[i].t, 16, bent_hash, NULL);
        m->xs[i].hint_b = m->xs[i].t.b;
        m->xs[i].hint_nb = m->xs[i].t.nb;
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
