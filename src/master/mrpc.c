/* UMBPMaster handlers: decode, validate (the status messages are part of the contract),
 * run against the store, encode. The method table at the bottom is the one list of RPCs. */
#include "master/mrpc.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "master/mrelay.h"
#include "master/mroute.h"
#include "master/mstore.h"
#include "master/mwire.h"
#include "umbp.pb-c.h"

typedef void (*mrpc_fn)(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r);

/* ---- native metrics (reference names, types and labels) ---- */

static const char *const L_NODE[] = {"node", NULL};
static const char *const L_NODE_TIER[] = {"node", "tier", NULL};
static const char *const L_NODE_TIER_RESULT[] = {"node", "tier", "result", NULL};

/* X(field, kind, name, labels, help) */
#define MMET_LIST(X)                                                                               \
    X(client_count, gauge, "mori_umbp_client_count", NULL, "Registered ALIVE clients")             \
    X(cap_total, gauge, "mori_umbp_client_capacity_total_bytes", L_NODE_TIER,                      \
      "Reported tier capacity in bytes")                                                           \
    X(cap_avail, gauge, "mori_umbp_client_capacity_available_bytes", L_NODE_TIER,                  \
      "Reported available tier capacity in bytes")                                                 \
    X(cap_used, gauge, "mori_umbp_client_capacity_used_bytes", L_NODE_TIER,                        \
      "Reported used tier capacity in bytes")                                                      \
    X(cap_util, gauge, "mori_umbp_client_capacity_utilization_ratio", L_NODE_TIER,                 \
      "Used over total tier capacity")                                                             \
    X(seq_gap, counter, "mori_umbp_heartbeat_seq_gap_total", L_NODE,                               \
      "Heartbeats answered with request_full_sync")                                                \
    X(events_applied, counter, "mori_umbp_heartbeat_events_applied_total", L_NODE,                 \
      "KV events received in heartbeats")                                                          \
    X(route_put, counter, "mori_umbp_client_route_put_total", L_NODE, "RoutePut routed to node")   \
    X(route_get, counter, "mori_umbp_client_route_get_total", L_NODE, "RouteGet found on node")    \
    X(batch_route_put, counter, "mori_umbp_client_batch_route_put_total", L_NODE,                  \
      "BatchRoutePut keys routed to node")                                                         \
    X(batch_route_get, counter, "mori_umbp_client_batch_route_get_total", L_NODE,                  \
      "BatchRouteGet keys found on node")                                                          \
    X(client_lookup, counter, "mori_umbp_client_lookup_total", L_NODE,                             \
      "BatchLookup calls by requesting node")                                                      \
    X(batch_lookup, counter, "mori_umbp_batch_lookup_total", NULL, "BatchLookup calls")            \
    X(batch_lookup_keys, counter, "mori_umbp_batch_lookup_keys_total", NULL,                       \
      "Keys queried by BatchLookup")                                                               \
    X(batch_lookup_found, counter, "mori_umbp_batch_lookup_found_total", NULL,                     \
      "Keys found by BatchLookup")                                                                 \
    X(xreport, counter, "mori_umbp_external_kv_report_total", L_NODE_TIER_RESULT,                  \
      "ReportExternalKvBlocks calls")                                                              \
    X(xreport_blocks, counter, "mori_umbp_external_kv_report_blocks_total", L_NODE_TIER,           \
      "Hashes reported")                                                                           \
    X(xrevoke, counter, "mori_umbp_external_kv_revoke_total", L_NODE_TIER_RESULT,                  \
      "Revoke calls (tier ALL for RevokeAllExternalKvBlocksForNode)")                              \
    X(xrevoke_blocks, counter, "mori_umbp_external_kv_revoke_blocks_total", L_NODE_TIER,           \
      "Hashes revoked by RevokeExternalKvBlocks")                                                  \
    X(xmatch, counter, "mori_umbp_external_kv_match_total", NULL, "MatchExternalKv calls")         \
    X(xmatch_queried, counter, "mori_umbp_external_kv_match_queried_blocks_total", NULL,           \
      "Hashes queried by MatchExternalKv")                                                         \
    X(xmatch_matched, counter, "mori_umbp_external_kv_match_matched_blocks_total", NULL,           \
      "Sum over nodes of the distinct hashes matched")

struct mmet {
#define MMET_FIELD(f, kind, name, labels, help) struct metric_family *f;
    MMET_LIST(MMET_FIELD)
#undef MMET_FIELD
    struct metric *client_count_s, *batch_lookup_s, *batch_lookup_keys_s, *batch_lookup_found_s;
    struct metric *xmatch_s, *xmatch_queried_s, *xmatch_matched_s;
    struct metric_family *xlive;
};

static double ext_live_gauge(void *arg) {
    struct master *m = arg;
    return (double)m->store->ops->ext_count(m->store);
}

int mrpc_metrics_init(struct master *m) {
    if (!m->metrics) return 0;
    struct mmet *t = calloc(1, sizeof(*t));
    if (!t) return -1;
#define metrics_gauge_h(reg, name, help, labels, buckets, nb) metrics_gauge(reg, name, help, labels)
#define metrics_counter_h(reg, name, help, labels, buckets, nb)                                    \
    metrics_counter(reg, name, help, labels)
#define MMET_REG(f, kind, name, labels, help)                                                      \
    if (!(t->f = metrics_##kind##_h(m->metrics, name, help, labels, NULL, 0))) goto fail;
    MMET_LIST(MMET_REG)
#undef MMET_REG
    t->xlive =
        metrics_gauge_fn(m->metrics, "mori_umbp_external_kv_live_count",
                         "External-KV (hash, node, tier) placements held", ext_live_gauge, m);
    t->client_count_s = metric_series(t->client_count);
    t->batch_lookup_s = metric_series(t->batch_lookup);
    t->batch_lookup_keys_s = metric_series(t->batch_lookup_keys);
    t->batch_lookup_found_s = metric_series(t->batch_lookup_found);
    t->xmatch_s = metric_series(t->xmatch);
    t->xmatch_queried_s = metric_series(t->xmatch_queried);
    t->xmatch_matched_s = metric_series(t->xmatch_matched);
    if (!t->xlive || !t->client_count_s || !t->xmatch_s || !t->xmatch_queried_s ||
        !t->xmatch_matched_s || !t->batch_lookup_s || !t->batch_lookup_keys_s ||
        !t->batch_lookup_found_s)
        goto fail;
    metric_set(t->client_count_s, 0);
    if (m->relay) {
        static const char *const names[] = {
#define MMET_NAME(f, kind, name, labels, help) name,
            MMET_LIST(MMET_NAME)
#undef MMET_NAME
                "mori_umbp_external_kv_live_count"};
        for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
            if (mrelay_reserve(m->relay, names[i])) goto fail;
    }
    m->met = t;
    return 0;
fail:
    free(t);
    return -1;
}

void mrpc_metrics_free(struct master *m) {
    free(m->met);
    m->met = NULL;
}

static void met_add(struct metric_family *f, const char *const *v, double d) {
    if (f) metrics_add(f, v, d);
}

static void met_set(struct metric_family *f, const char *const *v, double d) {
    if (f) metrics_set(f, v, d);
}

static bool labelled_by_node(const char *const *labels) {
    return labels && labels[0] && !strcmp(labels[0], "node");
}

/* A node left (unregistered, or expired by the reaper): its series of every per-node family go,
 * so departed nodes neither stay on /metrics nor fill the families' METRIC_MAX_SERIES. Those
 * families are only updated by label (metrics_add, metrics_set), never through a kept pointer.
 * A node that comes back gets them anew. */
static void met_forget(struct master *m, const char *node) {
    if (!m->met) return;
#define MMET_FORGET(f, kind, name, labels, help)                                                   \
    if (labelled_by_node(labels)) metrics_remove_label(m->met->f, 0, node);
    MMET_LIST(MMET_FORGET)
#undef MMET_FORGET
}

static void met_inc(struct metric *s, double d) {
    if (s) metric_inc(s, d);
}

static void met_caps(struct master *m, const char *node, const struct mstore_caps *c) {
    if (!m->met) return;
    for (int t = 0; t < MSTORE_NTIERS; t++) {
        if (!(c->mask & (1u << t))) continue;
        const char *v[] = {node, mstore_tier_label(t)};
        uint64_t used = c->total[t] > c->avail[t] ? c->total[t] - c->avail[t] : 0;
        met_set(m->met->cap_total, v, (double)c->total[t]);
        met_set(m->met->cap_avail, v, (double)c->avail[t]);
        met_set(m->met->cap_used, v, (double)used);
        met_set(m->met->cap_util, v, c->total[t] ? (double)used / (double)c->total[t] : 0.0);
    }
}

static void met_client_count(struct master *m) {
    if (m->met) metric_set(m->met->client_count_s, (double)m->store->ops->alive_count(m->store));
}

/* ---- helpers ---- */

static void fail(struct mrpc_reply *r, int status, const char *msg) {
    r->status = status;
    snprintf(r->msg, sizeof(r->msg), "%s", msg);
}

/* INVALID_ARGUMENT for a string that is not text (mwire_text_check). */
static void text_fail(struct mrpc_reply *r, int t, const char *field) {
    r->status = MRPC_INVALID_ARGUMENT;
    if (t == MWIRE_TEXT_LONG)
        snprintf(r->msg, sizeof(r->msg), "%s exceeds %d bytes", field, MWIRE_MAX_NODE_ID);
    else
        snprintf(r->msg, sizeof(r->msg), "%s %s", field,
                 t == MWIRE_TEXT_NUL ? "must not contain NUL bytes" : "must be valid UTF-8");
}

#define FAIL(r, st, msg)                                                                           \
    do {                                                                                           \
        fail(r, st, msg);                                                                          \
        return;                                                                                    \
    } while (0)

static void reply(struct mrpc_reply *r, const ProtobufCMessage *msg) {
    size_t n = protobuf_c_message_get_packed_size(msg);
    r->buf = malloc(n ? n : 1);
    if (!r->buf) {
        fail(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
        return;
    }
    r->len = protobuf_c_message_pack(msg, r->buf);
    r->status = MRPC_OK;
}

static bool check_tier(int tier, struct mrpc_reply *r) {
    if (mstore_tier_valid(tier)) return true;
    fail(r, MRPC_INVALID_ARGUMENT, "tier must be TIER_UNKNOWN, TIER_HBM, TIER_DRAM or TIER_SSD");
    return false;
}

static void caps_from(Umbp__TierCapacity **tc, size_t n, struct mstore_caps *c) {
    memset(c, 0, sizeof(*c));
    for (size_t i = 0; i < n; i++) {
        int t = (int)tc[i]->tier;
        if (!mstore_tier_valid(t)) continue;
        c->mask |= (uint8_t)(1u << t);
        c->total[t] = tc[i]->total_capacity_bytes;
        c->avail[t] = tc[i]->available_capacity_bytes;
    }
}

static int64_t stale_after_ms(const struct master *m) {
    return (int64_t)(m->cfg.heartbeat_ttl_sec * m->cfg.max_missed_heartbeats * 1000);
}

/* ---- membership ---- */

/* The sizes a registration may have (its record lives until unregister or expiry). */
static bool check_registration(const struct master *m, const Umbp__RegisterClientRequest *q,
                               struct mrpc_reply *r) {
    char msg[128];
    if (q->engine_desc.len > m->cfg.max_engine_desc_bytes) {
        snprintf(msg, sizeof(msg), "engine_desc exceeds LMCACHE_MASTER_MAX_ENGINE_DESC_BYTES=%llu",
                 (unsigned long long)m->cfg.max_engine_desc_bytes);
        fail(r, MRPC_INVALID_ARGUMENT, msg);
        return false;
    }
    const char *names[] = {"node_address", "peer_address"}; /* node_id: mwire_check_strings */
    const char *vals[] = {q->node_address, q->peer_address};
    for (size_t i = 0; i < 2; i++)
        if (strlen(vals[i]) > MSTORE_MAX_STRING) {
            snprintf(msg, sizeof(msg), "%s exceeds %d bytes", names[i], MSTORE_MAX_STRING);
            fail(r, MRPC_INVALID_ARGUMENT, msg);
            return false;
        }
    if (q->n_tags > MSTORE_MAX_TAGS) {
        snprintf(msg, sizeof(msg), "tags: more than %d", MSTORE_MAX_TAGS);
        fail(r, MRPC_INVALID_ARGUMENT, msg);
        return false;
    }
    for (size_t i = 0; i < q->n_tags; i++)
        if (strlen(q->tags[i]) > MSTORE_MAX_STRING) {
            snprintf(msg, sizeof(msg), "tags entry exceeds %d bytes", MSTORE_MAX_STRING);
            fail(r, MRPC_INVALID_ARGUMENT, msg);
            return false;
        }
    return true;
}

static void h_register(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__RegisterClientRequest *q = (const void *)in;
    if (!check_registration(m, q, r)) return;
    struct mstore_reg reg = {
        .node_id = q->node_id,
        .node_address = q->node_address,
        .peer_address = q->peer_address,
        .engine_desc = q->engine_desc.data,
        .engine_desc_len = q->engine_desc.len,
        .tags = q->tags,
        .ntags = q->n_tags,
    };
    caps_from(q->tier_capacities, q->n_tier_capacities, &reg.caps);
    int rc = m->store->ops->register_client(m->store, &reg, m->now_ms(), stale_after_ms(m));
    if (rc == 1) FAIL(r, MRPC_ALREADY_EXISTS, "node is already alive and cannot be re-registered");
    if (rc < 0) FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    log_info(m->lg, "[Master] Registered client %s (address %s, peer %s)", q->node_id,
             q->node_address, q->peer_address);
    met_client_count(m);
    met_caps(m, q->node_id, &reg.caps);
    Umbp__RegisterClientResponse resp = UMBP__REGISTER_CLIENT_RESPONSE__INIT;
    resp.heartbeat_interval_ms =
        m->cfg.heartbeat_ttl_sec * 1000 / m->cfg.heartbeat_interval_divisor;
    resp.ack_seq = 0;
    reply(r, &resp.base);
}

static void h_unregister(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__UnregisterClientRequest *q = (const void *)in;
    if (m->store->ops->unregister_client(m->store, q->node_id)) {
        log_info(m->lg, "[Master] Unregistered client %s", q->node_id);
        met_forget(m, q->node_id);
    }
    met_client_count(m);
    Umbp__UnregisterClientResponse resp = UMBP__UNREGISTER_CLIENT_RESPONSE__INIT;
    reply(r, &resp.base);
}

static int events_of(const Umbp__EventBundle *b, struct mstore_event *ev) {
    for (size_t i = 0; i < b->n_events; i++) {
        const Umbp__KvEvent *e = b->events[i];
        ev[i] = (struct mstore_event){e->kind == UMBP__KV_EVENT__KIND__REMOVE ? MSTORE_EV_REMOVE
                                                                              : MSTORE_EV_ADD,
                                      e->key, (int)e->tier, e->size};
    }
    return (int)b->n_events;
}

/* Labels of a relayed series: node, then the node's tags split at the first '=' (tags
 * without one, with a name that is not a valid label name, with the name of a label the
 * master sets itself, or repeating an earlier tag's name are skipped). tags are cut in
 * place. Returns the count (at most cap). */
static bool tag_label_reserved(const char *name) {
    return !strcmp(name, "node") || !strcmp(name, "le") || !strcmp(name, "tier");
}

static bool label_present(const struct mrelay_label *l, size_t n, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(l[i].name, name)) return true;
    return false;
}

static size_t base_labels(const char *node, char **tags, size_t ntags, struct mrelay_label *l,
                          size_t cap) {
    size_t n = 0;
    l[n++] = (struct mrelay_label){"node", node};
    for (size_t i = 0; i < ntags && n < cap; i++) {
        char *eq = strchr(tags[i], '=');
        if (!eq) continue;
        *eq = 0;
        if (!mrelay_label_name_ok(tags[i]) || tag_label_reserved(tags[i]) ||
            label_present(l, n, tags[i]))
            continue;
        l[n++] = (struct mrelay_label){tags[i], eq + 1};
    }
    return n;
}

static void met_kv_live(struct master *m, const Umbp__HeartbeatRequest *q) {
    if (!m->relay || !q->n_tier_kv_counts) return;
    char **tags = NULL;
    size_t ntags = 0;
    if (m->store->ops->client_tags(m->store, q->node_id, &tags, &ntags)) return;
    struct mrelay_label l[MSTORE_MAX_TAGS + 2];
    size_t nl = base_labels(q->node_id, tags, ntags, l, MSTORE_MAX_TAGS + 1);
    const char *why;
    double sum = 0;
    for (size_t i = 0; i < q->n_tier_kv_counts; i++) {
        l[nl] = (struct mrelay_label){"tier", mstore_tier_label((int)q->tier_kv_counts[i]->tier)};
        sum += (double)q->tier_kv_counts[i]->count;
        mrelay_gauge_set(m->relay, "mori_umbp_client_kv_live_count",
                         "Live KV blocks reported by the client per tier", l, nl + 1,
                         (double)q->tier_kv_counts[i]->count, &why);
    }
    mrelay_gauge_set(m->relay, "mori_umbp_client_kv_live_count_total",
                     "Live KV blocks reported by the client", l, nl, sum, &why);
    for (size_t i = 0; i < ntags; i++) free(tags[i]);
    free(tags);
}

static void h_heartbeat(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__HeartbeatRequest *q = (const void *)in;
    struct mstore *s = m->store;
    struct mstore_caps caps;
    caps_from(q->tier_capacities, q->n_tier_capacities, &caps);
    size_t total = 0;
    /* Every event is checked before any applies, so a rejected heartbeat changes nothing. */
    for (size_t i = 0; i < q->n_bundles; i++) {
        const Umbp__EventBundle *b = q->bundles[i];
        for (size_t k = 0; k < b->n_events; k++) {
            if (!*b->events[k]->key) FAIL(r, MRPC_INVALID_ARGUMENT, "event key cannot be empty");
            if (!check_tier((int)b->events[k]->tier, r)) return;
        }
        total += b->n_events;
    }
    struct mstore_event *ev = calloc(total ? total : 1, sizeof(*ev));
    if (!ev) FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    int64_t now = m->now_ms();
    uint64_t acked = 0;
    enum mstore_hb res;
    bool full_sync_wanted = false;
    if (q->is_full_sync) {
        size_t k = 0;
        for (size_t i = 0; i < q->n_bundles; i++) k += (size_t)events_of(q->bundles[i], ev + k);
        res = s->ops->apply_heartbeat(s, q->node_id, q->delta_seq_baseline, now, &caps, ev, k, true,
                                      &acked);
    } else if (!q->n_bundles) {
        /* Keepalive: seq 0 never applies, so only liveness is refreshed. */
        res = s->ops->apply_heartbeat(s, q->node_id, 0, now, &caps, NULL, 0, false, &acked);
    } else {
        res = MSTORE_HB_APPLIED;
        for (size_t i = 0; i < q->n_bundles; i++) {
            int k = events_of(q->bundles[i], ev);
            res = s->ops->apply_heartbeat(s, q->node_id, q->bundles[i]->seq, now, &caps, ev,
                                          (size_t)k, false, &acked);
            if (res != MSTORE_HB_APPLIED) break;
        }
        full_sync_wanted = res == MSTORE_HB_SEQ_GAP;
    }
    free(ev);
    if (res == MSTORE_HB_REVIVED) {
        /* Its placements were wiped at expiry: the node reports them again. */
        full_sync_wanted = true;
        log_info(m->lg, "[Master] Expired client %s is alive again; asked for a full sync",
                 q->node_id);
        met_client_count(m);
    }
    /* No per-node series for a node the master does not know: made-up ids would fill the
     * families (METRIC_MAX_SERIES) for good. */
    if (res != MSTORE_HB_UNKNOWN) met_caps(m, q->node_id, &caps);
    met_kv_live(m, q);
    if (m->met && res != MSTORE_HB_UNKNOWN) {
        const char *v[] = {q->node_id};
        if (full_sync_wanted) met_add(m->met->seq_gap, v, 1);
        if (total) met_add(m->met->events_applied, v, (double)total);
    }
    Umbp__HeartbeatResponse resp = UMBP__HEARTBEAT_RESPONSE__INIT;
    resp.status = res == MSTORE_HB_UNKNOWN ? UMBP__CLIENT_STATUS__CLIENT_STATUS_UNKNOWN
                                           : UMBP__CLIENT_STATUS__CLIENT_STATUS_ALIVE;
    resp.acked_seq = res == MSTORE_HB_UNKNOWN ? 0 : acked;
    resp.request_full_sync = full_sync_wanted;
    reply(r, &resp.base);
}

/* ---- block routing ---- */

static const char *peer_of(const struct mstore_alive *a, size_t n, uint32_t node) {
    for (size_t i = 0; i < n; i++)
        if (a[i].node == node) return a[i].peer_address;
    return "";
}

static void free_alive(struct mstore_alive *a, size_t n) {
    for (size_t i = 0; i < n; i++) free(a[i].peer_address);
    free(a);
}

/* Shared by RouteGet and BatchRouteGet: picks[i] = chosen location or NULL. */
struct gets {
    struct mstore_loc **locs;
    size_t *nlocs;
    const struct mstore_loc **pick;
    struct mstore_alive *alive;
    size_t nalive;
};

static void gets_free(struct gets *g, size_t n) {
    for (size_t i = 0; g->locs && i < n; i++) free(g->locs[i]);
    free(g->locs);
    free(g->nlocs);
    free(g->pick);
    free_alive(g->alive, g->nalive);
}

static int route_gets(struct master *m, char *const *keys, size_t n, char *const *excl,
                      size_t nexcl, const char *requester, struct gets *g) {
    memset(g, 0, sizeof(*g));
    g->locs = calloc(n ? n : 1, sizeof(*g->locs));
    g->nlocs = calloc(n ? n : 1, sizeof(*g->nlocs));
    g->pick = calloc(n ? n : 1, sizeof(*g->pick));
    if (!g->locs || !g->nlocs || !g->pick) return -1;
    if (m->store->ops->list_alive(m->store, &g->alive, &g->nalive)) return -1;
    int64_t now = m->now_ms();
    if (m->store->ops->block_route_get(m->store, keys, n, excl, nexcl, now,
                                       now + (int64_t)m->cfg.lease_duration_sec * 1000, g->locs,
                                       g->nlocs))
        return -1;
    for (size_t i = 0; i < n; i++)
        if (g->nlocs[i])
            g->pick[i] =
                &g->locs[i][mroute_get_pick(g->locs[i], g->nlocs[i], requester, m->rand64)];
    return 0;
}

static void h_route_get(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__RouteGetRequest *q = (const void *)in;
    if (!*q->key) FAIL(r, MRPC_INVALID_ARGUMENT, "key cannot be empty");
    struct gets g;
    char *key = q->key;
    if (route_gets(m, &key, 1, q->exclude_nodes, q->n_exclude_nodes, q->node_id, &g)) {
        gets_free(&g, 1);
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    Umbp__RouteGetResponse resp = UMBP__ROUTE_GET_RESPONSE__INIT;
    if (g.pick[0]) {
        resp.found = true;
        resp.node_id = (char *)g.pick[0]->node_id;
        resp.tier = (Umbp__TierType)g.pick[0]->tier;
        resp.size = g.pick[0]->size;
        resp.peer_address = (char *)peer_of(g.alive, g.nalive, g.pick[0]->node);
        if (m->met) met_add(m->met->route_get, (const char *const[]){resp.node_id}, 1);
    }
    reply(r, &resp.base);
    gets_free(&g, 1);
}

static void h_batch_route_get(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__BatchRouteGetRequest *q = (const void *)in;
    size_t n = q->n_keys;
    struct gets g;
    Umbp__NodeInfo *infos = calloc(n ? n : 1, sizeof(*infos));
    Umbp__NodeInfo **pinfos = calloc(n ? n : 1, sizeof(*pinfos));
    uint32_t *ref = calloc(n ? n : 1, sizeof(*ref));
    Umbp__TierType *tier = calloc(n ? n : 1, sizeof(*tier));
    uint64_t *size = calloc(n ? n : 1, sizeof(*size));
    int rc = route_gets(m, q->keys, n, q->exclude_nodes, q->n_exclude_nodes, q->node_id, &g);
    if (rc || !infos || !pinfos || !ref || !tier || !size) {
        fail(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
        goto out;
    }
    size_t ninfo = 0;
    for (size_t i = 0; i < n; i++) {
        const struct mstore_loc *p = g.pick[i];
        if (!p) continue;
        const char *peer = peer_of(g.alive, g.nalive, p->node);
        size_t k = 0;
        while (k < ninfo &&
               (strcmp(infos[k].node_id, p->node_id) || strcmp(infos[k].peer_address, peer)))
            k++;
        if (k == ninfo) {
            umbp__node_info__init(&infos[k]);
            infos[k].node_id = (char *)p->node_id;
            infos[k].peer_address = (char *)peer;
            pinfos[k] = &infos[k];
            ninfo++;
        }
        ref[i] = (uint32_t)k + 1;
        tier[i] = (Umbp__TierType)p->tier;
        size[i] = p->size;
        if (m->met) met_add(m->met->batch_route_get, (const char *const[]){p->node_id}, 1);
    }
    Umbp__BatchRouteGetResponse resp = UMBP__BATCH_ROUTE_GET_RESPONSE__INIT;
    resp.n_nodes = ninfo;
    resp.nodes = pinfos;
    resp.n_node_ref = resp.n_tier = resp.n_size = n;
    resp.node_ref = ref;
    resp.tier = tier;
    resp.size = size;
    reply(r, &resp.base);
out:
    gets_free(&g, n);
    free(infos);
    free(pinfos);
    free(ref);
    free(tier);
    free(size);
}

static void h_batch_lookup(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__BatchLookupRequest *q = (const void *)in;
    bool *found = calloc(q->n_keys ? q->n_keys : 1, sizeof(bool));
    protobuf_c_boolean *pf = calloc(q->n_keys ? q->n_keys : 1, sizeof(*pf));
    if (!found || !pf) {
        free(found);
        free(pf);
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    m->store->ops->block_exists(m->store, q->keys, q->n_keys, found);
    size_t nf = 0;
    for (size_t i = 0; i < q->n_keys; i++) nf += pf[i] = found[i];
    if (m->met) {
        met_inc(m->met->batch_lookup_s, 1);
        met_inc(m->met->batch_lookup_keys_s, (double)q->n_keys);
        met_inc(m->met->batch_lookup_found_s, (double)nf);
        met_add(m->met->client_lookup, (const char *const[]){q->node_id}, 1);
    }
    Umbp__BatchLookupResponse resp = UMBP__BATCH_LOOKUP_RESPONSE__INIT;
    resp.n_found = q->n_keys;
    resp.found = pf;
    reply(r, &resp.base);
    free(found);
    free(pf);
}

static enum mroute_algo algo_of(const struct master *m) {
    return strcmp(m->cfg.route_put_select_algo, "random") == 0 ? MROUTE_RANDOM
                                                               : MROUTE_MOST_AVAILABLE;
}

static enum mroute_affinity aff_of(const struct master *m) {
    if (strcmp(m->cfg.route_put_node_affinity, "same") == 0) return MROUTE_AFF_SAME;
    if (strcmp(m->cfg.route_put_node_affinity, "local") == 0) return MROUTE_AFF_LOCAL;
    return MROUTE_AFF_NONE;
}

/* Plans n puts; on success picks/alive are owned by the caller. */
static int plan_puts(struct master *m, char *const *keys, const uint64_t *sizes, size_t n,
                     char *const *excl, size_t nexcl, const char *requester,
                     struct mroute_pick **picks, struct mstore_alive **alive, size_t *nalive) {
    bool *exists = calloc(n ? n : 1, sizeof(bool));
    *picks = calloc(n ? n : 1, sizeof(**picks));
    *alive = NULL;
    *nalive = 0;
    int rc = -1;
    if (!exists || !*picks) goto out;
    m->store->ops->block_exists(m->store, keys, n, exists);
    if (m->store->ops->list_alive(m->store, alive, nalive)) goto out;
    rc = mroute_put_plan(*alive, *nalive, sizes, exists, n, excl, nexcl, requester, algo_of(m),
                         aff_of(m), m->rand64, *picks);
    for (size_t i = 0; !rc && i < n; i++) {
        if (exists[i])
            (*picks)[i].tier = -2; /* marks ALREADY_EXISTS */
        else if ((*picks)[i].cand < 0)
            log_warn(m->lg, "[Router] no node can take key %s (%llu bytes) among %zu alive",
                     keys[i], (unsigned long long)sizes[i], *nalive);
    }
out:
    free(exists);
    if (rc) {
        free(*picks);
        *picks = NULL;
        free_alive(*alive, *nalive);
        *alive = NULL;
        *nalive = 0;
    }
    return rc;
}

static Umbp__RoutePutOutcome outcome_of(const struct mroute_pick *p) {
    if (p->tier == -2) return UMBP__ROUTE_PUT_OUTCOME__ROUTE_PUT_OUTCOME_ALREADY_EXISTS;
    return p->cand >= 0 ? UMBP__ROUTE_PUT_OUTCOME__ROUTE_PUT_OUTCOME_ROUTED
                        : UMBP__ROUTE_PUT_OUTCOME__ROUTE_PUT_OUTCOME_UNAVAILABLE;
}

static void h_route_put(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__RoutePutRequest *q = (const void *)in;
    if (!*q->key) FAIL(r, MRPC_INVALID_ARGUMENT, "key cannot be empty");
    struct mroute_pick *picks;
    struct mstore_alive *alive;
    size_t nalive;
    char *key = q->key;
    if (plan_puts(m, &key, &q->block_size, 1, q->exclude_nodes, q->n_exclude_nodes, q->node_id,
                  &picks, &alive, &nalive))
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    Umbp__RoutePutResponse resp = UMBP__ROUTE_PUT_RESPONSE__INIT;
    resp.outcome = outcome_of(&picks[0]);
    if (resp.outcome == UMBP__ROUTE_PUT_OUTCOME__ROUTE_PUT_OUTCOME_ROUTED) {
        const struct mstore_alive *a = &alive[picks[0].cand];
        resp.node_id = (char *)a->node_id;
        resp.tier = (Umbp__TierType)picks[0].tier;
        resp.peer_address = a->peer_address;
        if (m->met) met_add(m->met->route_put, (const char *const[]){a->node_id}, 1);
        log_info(m->lg, "[Router] RoutePut %s -> %s (%s)", key, a->node_id,
                 mstore_tier_label(picks[0].tier));
    }
    reply(r, &resp.base);
    free(picks);
    free_alive(alive, nalive);
}

static void h_batch_route_put(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__BatchRoutePutRequest *q = (const void *)in;
    if (q->n_keys != q->n_block_sizes)
        FAIL(r, MRPC_INVALID_ARGUMENT, "keys and block_sizes must have the same length");
    size_t n = q->n_keys;
    struct mroute_pick *picks;
    struct mstore_alive *alive;
    size_t nalive;
    if (plan_puts(m, q->keys, q->block_sizes, n, q->exclude_nodes, q->n_exclude_nodes, q->node_id,
                  &picks, &alive, &nalive))
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    Umbp__BatchRoutePutEntry *ents = calloc(n ? n : 1, sizeof(*ents));
    Umbp__BatchRoutePutEntry **pents = calloc(n ? n : 1, sizeof(*pents));
    if (!ents || !pents) {
        fail(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        umbp__batch_route_put_entry__init(&ents[i]);
        pents[i] = &ents[i];
        ents[i].outcome = outcome_of(&picks[i]);
        if (ents[i].outcome != UMBP__ROUTE_PUT_OUTCOME__ROUTE_PUT_OUTCOME_ROUTED) continue;
        const struct mstore_alive *a = &alive[picks[i].cand];
        ents[i].node_id = (char *)a->node_id;
        ents[i].tier = (Umbp__TierType)picks[i].tier;
        ents[i].peer_address = a->peer_address;
        if (m->met) met_add(m->met->batch_route_put, (const char *const[]){a->node_id}, 1);
    }
    Umbp__BatchRoutePutResponse resp = UMBP__BATCH_ROUTE_PUT_RESPONSE__INIT;
    resp.n_entries = n;
    resp.entries = pents;
    reply(r, &resp.base);
out:
    free(ents);
    free(pents);
    free(picks);
    free_alive(alive, nalive);
}

/* ---- external KV ---- */

static void h_xreport(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__ReportExternalKvBlocksRequest *q = (const void *)in;
    if (!*q->node_id) FAIL(r, MRPC_INVALID_ARGUMENT, "node_id must not be empty");
    if (!q->n_hashes) FAIL(r, MRPC_INVALID_ARGUMENT, "hashes must not be empty");
    if (!check_tier((int)q->tier, r)) return;
    int rc = m->store->ops->ext_report(m->store, q->node_id, q->hashes, q->n_hashes, (int)q->tier);
    if (rc < 0) FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    const char *tl = mstore_tier_label((int)q->tier);
    if (rc == 0) {
        log_warn(m->lg, "[Master] ReportExternalKvBlocks from %s ignored: node is not alive",
                 q->node_id);
        if (m->met)
            met_add(m->met->xreport, (const char *const[]){q->node_id, tl, "rejected_not_alive"},
                    1);
    } else if (m->met) {
        met_add(m->met->xreport_blocks, (const char *const[]){q->node_id, tl}, (double)q->n_hashes);
        met_add(m->met->xreport, (const char *const[]){q->node_id, tl, "ok"}, 1);
    }
    Umbp__ReportExternalKvBlocksResponse resp = UMBP__REPORT_EXTERNAL_KV_BLOCKS_RESPONSE__INIT;
    reply(r, &resp.base);
}

static void h_xrevoke(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__RevokeExternalKvBlocksRequest *q = (const void *)in;
    if (!*q->node_id) FAIL(r, MRPC_INVALID_ARGUMENT, "node_id must not be empty");
    if (!q->n_hashes) FAIL(r, MRPC_INVALID_ARGUMENT, "hashes must not be empty");
    if (!check_tier((int)q->tier, r)) return;
    m->store->ops->ext_revoke(m->store, q->node_id, q->hashes, q->n_hashes, (int)q->tier);
    if (m->met) {
        const char *tl = mstore_tier_label((int)q->tier);
        met_add(m->met->xrevoke_blocks, (const char *const[]){q->node_id, tl}, (double)q->n_hashes);
        met_add(m->met->xrevoke, (const char *const[]){q->node_id, tl, "ok"}, 1);
    }
    Umbp__RevokeExternalKvBlocksResponse resp = UMBP__REVOKE_EXTERNAL_KV_BLOCKS_RESPONSE__INIT;
    reply(r, &resp.base);
}

static void h_xrevoke_tier(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__RevokeAllExternalKvBlocksAtTierRequest *q = (const void *)in;
    if (!*q->node_id) FAIL(r, MRPC_INVALID_ARGUMENT, "node_id must not be empty");
    if (!check_tier((int)q->tier, r)) return;
    m->store->ops->ext_revoke_tier(m->store, q->node_id, (int)q->tier);
    if (m->met)
        met_add(m->met->xrevoke,
                (const char *const[]){q->node_id, mstore_tier_label((int)q->tier), "ok"}, 1);
    Umbp__RevokeAllExternalKvBlocksAtTierResponse resp =
        UMBP__REVOKE_ALL_EXTERNAL_KV_BLOCKS_AT_TIER_RESPONSE__INIT;
    reply(r, &resp.base);
}

static void h_xrevoke_node(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__RevokeAllExternalKvBlocksForNodeRequest *q = (const void *)in;
    if (!*q->node_id) FAIL(r, MRPC_INVALID_ARGUMENT, "node_id must not be empty");
    m->store->ops->ext_revoke_node(m->store, q->node_id);
    if (m->met) met_add(m->met->xrevoke, (const char *const[]){q->node_id, "ALL", "ok"}, 1);
    Umbp__RevokeAllExternalKvBlocksForNodeResponse resp =
        UMBP__REVOKE_ALL_EXTERNAL_KV_BLOCKS_FOR_NODE_RESPONSE__INIT;
    reply(r, &resp.base);
}

/* MatchExternalKv carries the big replies (every matched hash once per node and tier), so
 * it skips protobuf-c: hashes are read in place and the reply is written directly. */
static void h_xmatch_wire(struct master *m, const uint8_t *data, size_t len, struct mrpc_reply *r) {
    struct mstore_key *keys;
    size_t nk;
    bool hit;
    int w = mwire_match_request(data, len, &keys, &nk, &hit);
    if (w == MWIRE_MALFORMED)
        FAIL(r, MRPC_INVALID_ARGUMENT, "MatchExternalKv: request could not be decoded");
    if (w) FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < nk; i++) {
        int t = mwire_text_check(keys[i].p, keys[i].n);
        if (t) {
            free(keys);
            text_fail(r, t, "hashes");
            return;
        }
    }
    struct mstore_match mt;
    if (m->store->ops->ext_match(m->store, keys, nk, hit, m->now_ms(), &mt)) {
        free(keys);
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    if (m->met) {
        size_t matched = 0;
        for (uint32_t i = 0; i < mt.nnodes; i++) matched += mt.nodes[i].distinct;
        met_inc(m->met->xmatch_s, 1);
        met_inc(m->met->xmatch_queried_s, (double)nk);
        met_inc(m->met->xmatch_matched_s, (double)matched);
    }
    if (mwire_match_reply(&mt, keys, &r->buf, &r->len))
        fail(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    else
        r->status = MRPC_OK;
    mstore_match_free(&mt);
    free(keys);
}

static void h_hit_counts(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__GetExternalKvHitCountsRequest *q = (const void *)in;
    if (q->n_hashes > m->cfg.hit_query_max_batch) {
        char msg[128];
        snprintf(msg, sizeof(msg), "hashes size exceeds UMBP_HIT_QUERY_MAX_BATCH=%llu",
                 (unsigned long long)m->cfg.hit_query_max_batch);
        FAIL(r, MRPC_INVALID_ARGUMENT, msg);
    }
    struct mstore_hit *h;
    size_t n;
    if (m->store->ops->hit_counts(m->store, q->hashes, q->n_hashes, &h, &n))
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    Umbp__HitCountEntry *e = calloc(n + 1, sizeof(*e));
    Umbp__HitCountEntry **pe = calloc(n + 1, sizeof(*pe));
    if (!e || !pe) {
        fail(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    } else {
        for (size_t i = 0; i < n; i++) {
            umbp__hit_count_entry__init(&e[i]);
            e[i].hash = q->hashes[h[i].idx];
            e[i].hit_count_total = h[i].count;
            pe[i] = &e[i];
        }
        Umbp__GetExternalKvHitCountsResponse resp = UMBP__GET_EXTERNAL_KV_HIT_COUNTS_RESPONSE__INIT;
        resp.n_entries = n;
        resp.entries = pe;
        reply(r, &resp.base);
    }
    free(e);
    free(pe);
    free(h);
}

/* ---- ReportMetrics: relay into the master's registry ---- */

/* NULL when sample s can be relayed on its own merits, else why (the call is then
 * rejected). Conflicts with what is already registered are not checked here. */
static const char *sample_defect(const Umbp__MetricSample *s, char *buf, size_t len) {
    if (strlen(s->name) > MRELAY_MAX_NAME || !mrelay_metric_name_ok(s->name))
        return "name is not a valid metric name";
    if (strlen(s->help) > MRELAY_MAX_HELP) return "help is too long";
    if (s->n_labels > MRELAY_MAX_LABELS) return "too many labels";
    for (size_t k = 0; k < s->n_labels; k++) {
        const char *ln = s->labels[k]->name;
        if (strlen(ln) > MRELAY_MAX_NAME || !mrelay_label_name_ok(ln)) {
            errbuf_set(buf, len, "label name \"%.64s\" is not valid", ln);
            return buf;
        }
        if (!strcmp(ln, "node") ||
            (!strcmp(ln, "le") &&
             s->value_case == UMBP__METRIC_SAMPLE__VALUE_HISTOGRAM_AGGREGATE)) {
            errbuf_set(buf, len, "label name \"%s\" is reserved", ln);
            return buf;
        }
        if (strlen(s->labels[k]->value) > MRELAY_MAX_VALUE) return "label value is too long";
        for (size_t j = 0; j < k; j++)
            if (!strcmp(s->labels[j]->name, ln)) {
                errbuf_set(buf, len, "label name \"%.64s\" is repeated", ln);
                return buf;
            }
    }
    if (s->value_case == UMBP__METRIC_SAMPLE__VALUE_HISTOGRAM_AGGREGATE) {
        const Umbp__HistogramAggregate *h = s->histogram_aggregate;
        if (h->n_bounds > MRELAY_MAX_BOUNDS) return "too many histogram bounds";
        const char *d = mrelay_hist_defect(h->bounds, h->n_bounds, h->bucket_counts,
                                           h->n_bucket_counts, h->count);
        if (d) return d;
    }
    return NULL;
}

static void h_report_metrics(struct master *m, const ProtobufCMessage *in, struct mrpc_reply *r) {
    const Umbp__ReportMetricsRequest *q = (const void *)in;
    static atomic_int warned;
    Umbp__ReportMetricsResponse resp = UMBP__REPORT_METRICS_RESPONSE__INIT;
    /* A sample that is wrong by itself rejects the call before anything is relayed. */
    for (size_t i = 0; i < q->n_metrics; i++) {
        char buf[128];
        const char *d = sample_defect(q->metrics[i], buf, sizeof(buf));
        if (d) {
            r->status = MRPC_INVALID_ARGUMENT;
            snprintf(r->msg, sizeof(r->msg), "metrics[%zu]: %s", i, d);
            return;
        }
    }
    if (!m->relay) {
        reply(r, &resp.base);
        return;
    }
    char **tags = NULL;
    size_t ntags = 0;
    if (m->store->ops->client_tags(m->store, q->node_id, &tags, &ntags))
        FAIL(r, MRPC_RESOURCE_EXHAUSTED, "out of memory");
    struct mrelay_label l[MSTORE_MAX_TAGS + 1 + MRELAY_MAX_LABELS];
    size_t base = base_labels(q->node_id, tags, ntags, l, MSTORE_MAX_TAGS + 1);
    for (size_t i = 0; i < q->n_metrics; i++) {
        const Umbp__MetricSample *s = q->metrics[i];
        size_t nl = base;
        /* A label named like one of the node's tags loses to the tag. */
        for (size_t k = 0; k < s->n_labels; k++)
            if (!label_present(l, base, s->labels[k]->name))
                l[nl++] = (struct mrelay_label){s->labels[k]->name, s->labels[k]->value};
        const char *why = NULL;
        int rc = 0;
        switch (s->value_case) {
        case UMBP__METRIC_SAMPLE__VALUE_COUNTER_DELTA:
            rc = mrelay_counter_add(m->relay, s->name, s->help, l, nl, s->counter_delta, &why);
            break;
        case UMBP__METRIC_SAMPLE__VALUE_GAUGE_VALUE:
            rc = mrelay_gauge_set(m->relay, s->name, s->help, l, nl, s->gauge_value, &why);
            break;
        case UMBP__METRIC_SAMPLE__VALUE_HISTOGRAM_AGGREGATE: {
            const Umbp__HistogramAggregate *h = s->histogram_aggregate;
            rc = mrelay_hist_merge(m->relay, s->name, s->help, l, nl, h->bounds, h->n_bounds,
                                   h->bucket_counts, h->n_bucket_counts, h->count, h->sum, &why);
            break;
        }
        default:
            break; /* an unset value is ignored */
        }
        if (rc && atomic_exchange(&warned, 1) == 0)
            log_warn(m->lg, "[Master] ReportMetrics from %s: dropped sample %s: %s (warned once)",
                     q->node_id, s->name, why ? why : "?");
    }
    for (size_t i = 0; i < ntags; i++) free(tags[i]);
    free(tags);
    reply(r, &resp.base);
}

/* ---- background ticks ---- */

static void log_expired(const char *id, void *arg) {
    struct master *m = arg;
    log_warn(m->lg, "[Reaper] Expired client: %s", id);
    met_forget(m, id);
}

size_t mrpc_reap(struct master *m, int64_t now_ms) {
    int64_t cutoff = now_ms - stale_after_ms(m);
    char why[192];
    mstore_take_error(m->store, why, sizeof(why));
    size_t n = m->store->ops->expire_stale(
        m->store, cutoff, cutoff - (int64_t)m->cfg.expired_retention_sec * 1000, log_expired, m);
    if (n) met_client_count(m);
    if (mstore_take_error(m->store, why, sizeof(why)))
        log_warn(m->lg, "[Reaper] metadata store unavailable: %s", why);
    return n;
}

size_t mrpc_hit_gc(struct master *m, int64_t now_ms) {
    char why[192];
    mstore_take_error(m->store, why, sizeof(why));
    size_t n = m->store->ops->hit_gc(m->store, now_ms - (int64_t)m->cfg.hit_index_ttl_sec * 1000);
    if (mstore_take_error(m->store, why, sizeof(why)))
        log_warn(m->lg, "[Master] hit index GC: metadata store unavailable: %s", why);
    log_debug(m->lg, "[Master] hit index GC dropped %zu entries", n);
    return n;
}

/* ---- the method table ---- */

/* X(Name, request descriptor, handler) in the service's order. */
#define MRPC_LIST(X)                                                                               \
    X(RegisterClient, umbp__register_client_request__descriptor, h_register)                       \
    X(UnregisterClient, umbp__unregister_client_request__descriptor, h_unregister)                 \
    X(Heartbeat, umbp__heartbeat_request__descriptor, h_heartbeat)                                 \
    X(RouteGet, umbp__route_get_request__descriptor, h_route_get)                                  \
    X(RoutePut, umbp__route_put_request__descriptor, h_route_put)                                  \
    X(BatchRoutePut, umbp__batch_route_put_request__descriptor, h_batch_route_put)                 \
    X(BatchRouteGet, umbp__batch_route_get_request__descriptor, h_batch_route_get)                 \
    X(BatchLookup, umbp__batch_lookup_request__descriptor, h_batch_lookup)                         \
    X(ReportExternalKvBlocks, umbp__report_external_kv_blocks_request__descriptor, h_xreport)      \
    X(RevokeExternalKvBlocks, umbp__revoke_external_kv_blocks_request__descriptor, h_xrevoke)      \
    X(RevokeAllExternalKvBlocksAtTier,                                                             \
      umbp__revoke_all_external_kv_blocks_at_tier_request__descriptor, h_xrevoke_tier)             \
    X(RevokeAllExternalKvBlocksForNode,                                                            \
      umbp__revoke_all_external_kv_blocks_for_node_request__descriptor, h_xrevoke_node)            \
    X(MatchExternalKv, umbp__match_external_kv_request__descriptor, NULL)                          \
    X(GetExternalKvHitCounts, umbp__get_external_kv_hit_counts_request__descriptor, h_hit_counts)  \
    X(ReportMetrics, umbp__report_metrics_request__descriptor, h_report_metrics)

const struct mrpc_method MRPC_METHODS[] = {
#define MRPC_ROW(name, desc, fn) {#name, "/umbp.UMBPMaster/" #name},
    MRPC_LIST(MRPC_ROW)
#undef MRPC_ROW
};
const size_t MRPC_NMETHODS = sizeof(MRPC_METHODS) / sizeof(MRPC_METHODS[0]);

static const struct {
    const ProtobufCMessageDescriptor *desc;
    mrpc_fn fn;
} IMPL[] = {
#define MRPC_IMPL(name, desc, fn) {&desc, fn},
    MRPC_LIST(MRPC_IMPL)
#undef MRPC_IMPL
};

/* Methods that decode their own requests. */
typedef void (*mrpc_wire_fn)(struct master *m, const uint8_t *data, size_t len,
                             struct mrpc_reply *r);
enum {
#define MRPC_ENUM(name, desc, fn) M_##name,
    MRPC_LIST(MRPC_ENUM)
#undef MRPC_ENUM
};
static const mrpc_wire_fn WIRE[sizeof(IMPL) / sizeof(IMPL[0])] = {
    [M_MatchExternalKv] = h_xmatch_wire,
};

int mrpc_find(const char *path, size_t len) {
    for (size_t i = 0; i < MRPC_NMETHODS; i++)
        if (strlen(MRPC_METHODS[i].path) == len && memcmp(MRPC_METHODS[i].path, path, len) == 0)
            return (int)i;
    return -1;
}

static void dispatch(struct master *m, size_t method, const uint8_t *data, size_t len,
                     struct mrpc_reply *r) {
    if (WIRE[method]) {
        WIRE[method](m, data, len, r);
        return;
    }
    ProtobufCMessage *in = protobuf_c_message_unpack(IMPL[method].desc, NULL, len, data);
    if (!in) {
        snprintf(r->msg, sizeof(r->msg), "%s: request could not be decoded",
                 MRPC_METHODS[method].name);
        r->status = MRPC_INVALID_ARGUMENT;
        return;
    }
    /* protobuf-c hands strings over NUL-terminated: check them on the wire, with their
     * lengths, before anything reads them as C strings. */
    const char *field;
    int t = mwire_check_strings(IMPL[method].desc, data, len, &field);
    if (t)
        text_fail(r, t, field);
    else
        IMPL[method].fn(m, in, r);
    protobuf_c_message_free_unpacked(in, NULL);
}

/* A store failure during the call (a remote backend down) replaces whatever the handler
 * answered: the results it saw were empty, not real. */
void mrpc_dispatch(struct master *m, size_t method, const uint8_t *data, size_t len,
                   struct mrpc_reply *r) {
    memset(r, 0, sizeof(*r));
    if (method >= MRPC_NMETHODS) FAIL(r, 12 /* UNIMPLEMENTED */, "unknown method");
    char why[192];
    mstore_take_error(m->store, why, sizeof(why));
    dispatch(m, method, data, len, r);
    if (mstore_take_error(m->store, why, sizeof(why))) {
        free(r->buf);
        r->buf = NULL;
        r->len = 0;
        r->status = MRPC_UNAVAILABLE;
        snprintf(r->msg, sizeof(r->msg), "%s: metadata store unavailable: %s",
                 MRPC_METHODS[method].name, why);
    }
}
