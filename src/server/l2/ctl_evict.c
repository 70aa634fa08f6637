/* The storage controller's L2 eviction trackers: per adapter, its objects in recency order (one
 * LRU list, or one per cache salt for IsolatedLRU) and the pass that picks and deletes victims. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/hash.h"
#include "base/htab.h"
#include "server/l2/ctl_internal.h"

#define EVICT_MAX_VICTIMS 4096

enum { EV_NONE = 0, EV_LRU = 1, EV_ISOLATED = 2 };

struct ev_node {
    struct htab_node hn; /* the tracker's index by name */
    struct ev_node *prev, *next;
    struct ev_list *list;
    uint64_t size;
    uint32_t h;
    struct keys_object_key key;
    char name[KEYS_L2_NAME_MAX];
};

struct ev_list {
    struct ev_node head; /* sentinel: head.next = LRU end, head.prev = MRU end */
    uint64_t bytes, objects;
    struct ev_list *snext; /* IsolatedLRU: next salt list */
    char salt[KEYS_SALT_MAX + 1];
};

struct ctl_evictor {
    int policy;
    double watermark, ratio;
    pthread_mutex_t mu;
    struct htab index; /* of ev_node by name hash */
    struct ev_list global;
    struct ev_list *salts;
};

#define NODE(n) HTAB_ENTRY(n, struct ev_node, hn)

static uint64_t node_hash(const struct htab_node *n, void *arg) {
    (void)arg;
    return NODE(n)->h;
}

static void list_init(struct ev_list *l) {
    memset(l, 0, sizeof(*l));
    l->head.next = l->head.prev = &l->head;
}

static void do_unlink(struct ev_node *n) {
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->list->bytes -= n->size;
    n->list->objects--;
}

static void do_push_mru(struct ev_list *l, struct ev_node *n) {
    n->list = l;
    n->prev = l->head.prev;
    n->next = &l->head;
    l->head.prev->next = n;
    l->head.prev = n;
    l->bytes += n->size;
    l->objects++;
}

static struct ev_node *do_ev_find(struct ctl_evictor *ev, const char *name, uint32_t h) {
    for (struct htab_node *n = *htab_bucket(&ev->index, h); n; n = n->next)
        if (NODE(n)->h == h && strcmp(NODE(n)->name, name) == 0) return NODE(n);
    return NULL;
}

static struct ev_list *do_list_for(struct ctl_evictor *ev, const char *salt) {
    if (ev->policy != EV_ISOLATED) return &ev->global;
    for (struct ev_list *l = ev->salts; l; l = l->snext)
        if (strcmp(l->salt, salt) == 0) return l;
    struct ev_list *l = malloc(sizeof(*l));
    if (!l) return NULL;
    list_init(l);
    snprintf(l->salt, sizeof(l->salt), "%s", salt);
    l->snext = ev->salts;
    ev->salts = l;
    return l;
}

/* The tracker's name of k (its L2 name) and the name's hash; -1 for a key without one. */
static int ev_name(const struct keys_object_key *k, char name[KEYS_L2_NAME_MAX], uint32_t *h) {
    if (keys_l2_name(k, name, KEYS_L2_NAME_MAX) < 0) return -1;
    *h = fnv1a32_str(name);
    return 0;
}

static void ev_on_stored(void *arg, int idx, const struct keys_object_key *k, uint64_t size) {
    struct ctl_evictor *ev = arg;
    char name[KEYS_L2_NAME_MAX];
    uint32_t h;
    if (ev_name(k, name, &h) < 0) return;
    pthread_mutex_lock(&ev->mu);
    struct ev_node *n = do_ev_find(ev, name, h);
    if (n) {
        do_unlink(n);
        n->size = size;
        do_push_mru(n->list, n);
    } else {
        struct ev_list *l = do_list_for(ev, k->cache_salt);
        n = l ? malloc(sizeof(*n)) : NULL;
        if (n) {
            n->size = size;
            n->h = h;
            n->key = *k;
            memcpy(n->name, name, strlen(name) + 1);
            htab_insert(&ev->index, &n->hn, h);
            do_push_mru(l, n);
        }
    }
    pthread_mutex_unlock(&ev->mu);
    (void)idx;
}

static void ev_touch_name(struct ctl_evictor *ev, const char *name) {
    uint32_t h = fnv1a32_str(name);
    pthread_mutex_lock(&ev->mu);
    struct ev_node *n = do_ev_find(ev, name, h);
    if (n) {
        struct ev_list *l = n->list;
        do_unlink(n);
        do_push_mru(l, n);
    }
    pthread_mutex_unlock(&ev->mu);
}

static void ev_on_accessed(void *arg, int idx, const struct keys_object_key *k) {
    char name[KEYS_L2_NAME_MAX];
    if (keys_l2_name(k, name, sizeof(name)) >= 0) ev_touch_name(arg, name);
    (void)idx;
}

static void ev_on_deleted(void *arg, int idx, const struct keys_object_key *k, uint64_t size) {
    struct ctl_evictor *ev = arg;
    char name[KEYS_L2_NAME_MAX];
    uint32_t h;
    if (ev_name(k, name, &h) < 0) return;
    pthread_mutex_lock(&ev->mu);
    struct ev_node *n = do_ev_find(ev, name, h);
    if (n) {
        htab_remove(&ev->index, &n->hn, h);
        do_unlink(n);
        free(n);
    }
    pthread_mutex_unlock(&ev->mu);
    (void)idx;
    (void)size;
}

void ctl_ev_free(struct ctl_evictor *ev) {
    if (!ev) return;
    for (size_t i = 0; i < ev->index.nb; i++)
        for (struct htab_node *n = ev->index.b[i], *nx; n; n = nx) {
            nx = n->next;
            free(NODE(n));
        }
    for (struct ev_list *l = ev->salts, *nx; l; l = nx) {
        nx = l->snext;
        free(l);
    }
    htab_fini(&ev->index);
    pthread_mutex_destroy(&ev->mu);
    free(ev);
}

int ctl_ev_parse(const json_t *cfg, struct ctl_evictor **out, char *err, size_t errlen) {
    *out = NULL;
    json_t *e = json_object_get(cfg, "eviction");
    if (!e || json_is_null(e)) return L2_OK;
    if (!json_is_object(e)) {
        errbuf_set(err, errlen, "\"eviction\" must be an object");
        return L2_ERR_INVAL;
    }
    const char *pol = json_string_value(json_object_get(e, "eviction_policy"));
    int policy = EV_LRU;
    if (pol && strcmp(pol, "LRU") == 0)
        policy = EV_LRU;
    else if (pol && strcmp(pol, "IsolatedLRU") == 0)
        policy = EV_ISOLATED;
    else if (pol && strcmp(pol, "noop") == 0)
        return L2_OK;
    else if (pol || json_object_get(e, "eviction_policy")) {
        errbuf_set(err, errlen, "\"eviction_policy\" must be LRU, IsolatedLRU or noop");
        return L2_ERR_INVAL;
    }
    double wm = 0.8, ratio = 0.2;
    json_t *v = json_object_get(e, "trigger_watermark");
    if (v) wm = json_is_number(v) ? json_number_value(v) : -1;
    json_t *r = json_object_get(e, "eviction_ratio");
    if (r) ratio = json_is_number(r) ? json_number_value(r) : -1;
    if (!(wm > 0 && wm <= 1) || !(ratio >= 0 && ratio <= 1)) {
        errbuf_set(err, errlen,
                   "\"trigger_watermark\" must be in (0, 1], \"eviction_ratio\" in [0, 1]");
        return L2_ERR_INVAL;
    }
    struct ctl_evictor *ev = calloc(1, sizeof(*ev));
    if (!ev || htab_init(&ev->index, 1024, node_hash, NULL) != 0) {
        free(ev);
        errbuf_set(err, errlen, "out of memory");
        return L2_ERR_NOMEM;
    }
    ev->policy = policy;
    ev->watermark = wm;
    ev->ratio = ratio;
    pthread_mutex_init(&ev->mu, NULL);
    list_init(&ev->global);
    *out = ev;
    return L2_OK;
}

/* Copies up to max keys from l's LRU end until `need` bytes are covered. Caller holds ev->mu. */
static size_t do_pick(struct ev_list *l, uint64_t need, struct keys_object_key *out, size_t max) {
    size_t k = 0;
    uint64_t got = 0;
    for (struct ev_node *n = l->head.next; n != &l->head && got < need && k < max; n = n->next) {
        out[k++] = n->key;
        got += n->size;
    }
    return k;
}

void ctl_ev_evict(struct ctl_evictor *ev, struct l2_adapter *ad, struct quota *quota,
                  struct l2ctl_tick_report *rep) {
    struct keys_object_key *victims = malloc(EVICT_MAX_VICTIMS * sizeof(*victims));
    uint8_t *del = malloc(EVICT_MAX_VICTIMS);
    if (!victims || !del) {
        free(victims);
        free(del);
        return;
    }
    size_t nv = 0;
    struct l2_usage u;
    l2_adapter_usage(ad, &u);
    pthread_mutex_lock(&ev->mu);
    if (ev->policy == EV_LRU) {
        double cap = (double)u.capacity_bytes;
        if (cap > 0 && (double)u.bytes_used >= ev->watermark * cap) {
            double target = cap * ev->watermark * (1.0 - ev->ratio);
            uint64_t need = (uint64_t)ceil((double)u.bytes_used - target);
            nv = do_pick(&ev->global, need, victims, EVICT_MAX_VICTIMS);
        }
    } else {
        for (struct ev_list *l = ev->salts; l && nv < EVICT_MAX_VICTIMS; l = l->snext) {
            if (!l->bytes) continue;
            uint64_t limit = 0;
            if (quota) quota_get(quota, l->salt, &limit);
            if ((double)l->bytes < ev->watermark * (double)limit) continue;
            double target = limit ? (double)limit * ev->watermark * (1.0 - ev->ratio) : 0;
            uint64_t need = (uint64_t)ceil((double)l->bytes - target);
            nv += do_pick(l, need, victims + nv, EVICT_MAX_VICTIMS - nv);
        }
    }
    pthread_mutex_unlock(&ev->mu);
    if (nv) {
        struct l2_usage before;
        l2_adapter_usage(ad, &before);
        size_t skipped = 0;
        l2_adapter_delete(ad, victims, nv, del, &skipped);
        struct l2_usage after;
        l2_adapter_usage(ad, &after);
        for (size_t i = 0; i < nv; i++) {
            if (del[i]) {
                rep->evicted_objects++;
                continue;
            }
            char name[KEYS_L2_NAME_MAX];
            if (keys_l2_name(&victims[i], name, sizeof(name)) >= 0) ev_touch_name(ev, name);
        }
        rep->evicted_bytes +=
            before.bytes_used > after.bytes_used ? before.bytes_used - after.bytes_used : 0;
        rep->skipped_locked += skipped;
    }
    free(victims);
    free(del);
}

void ctl_ev_attach(struct ctl_evictor *ev, struct l2_adapter *a) {
    struct l2_listener l = {ev_on_stored, ev_on_accessed, ev_on_deleted, ev};
    l2_adapter_add_listener(a, &l);
    /* objects found on disk at start (fs rescan) join the tracker in listing order */
    struct l2_usage u;
    l2_adapter_usage(a, &u);
    char *tok = NULL, err[256];
    while (u.objects && l2_adapter_can_list(a)) {
        struct l2_list_page pg;
        if (l2_adapter_list(a, NULL, L2_PAGE_SIZE_MAX, tok, &pg, err, sizeof(err)) != L2_OK) break;
        free(tok);
        tok = pg.next_token ? strdup(pg.next_token) : NULL;
        for (size_t k = 0; k < pg.count; k++)
            ev_on_stored(ev, a->index, &pg.entries[k].key, pg.entries[k].size);
        l2_list_page_free(&pg);
        if (!tok) break;
    }
    free(tok);
}

void ctl_ev_describe(const struct ctl_evictor *ev, json_t *out) {
    json_object_set_new(out, "eviction_policy",
                        json_string(!ev                    ? "none"
                                    : ev->policy == EV_LRU ? "LRU"
                                                           : "IsolatedLRU"));
    if (ev) {
        json_object_set_new(out, "trigger_watermark", json_real(ev->watermark));
        json_object_set_new(out, "eviction_ratio", json_real(ev->ratio));
    }
}
