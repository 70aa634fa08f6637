/* C client of the UMBP master on the gRPC C core: one channel per client, unary calls as
 * one six-op batch plucked from the client's own completion queue. */
#include "lmcache/umbp_client.h"

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/grpcu.h"
#include "base/pbwire.h"
#include "umbp.pb-c.h"

struct umbp_client {
    grpc_channel *ch;
    grpc_completion_queue *cq;
    char *node_id, *node_address;
    char *peer_address; /* NULL: none sent */
    uint32_t timeout_ms;
    uint32_t heartbeat_interval_ms; /* from the last RegisterClient */
    bool registered;
    bool full_sync_requested; /* request_full_sync of the last answered heartbeat */
};

static pthread_once_t g_init_once = PTHREAD_ONCE_INIT;
static void do_grpc_init(void) { grpc_init(); }

static void set_err(char *err, size_t errlen, const char *rpc, const char *msg) {
    if (err && errlen) snprintf(err, errlen, "%s failed: %s", rpc, msg);
}

struct umbp_client *umbp_client_new(const char *master_address, const char *node_id,
                                    const char *node_address) {
    pthread_once(&g_init_once, do_grpc_init);
    struct umbp_client *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    c->node_id = strdup(node_id ? node_id : "");
    c->node_address = strdup(node_address ? node_address : "");
    /* A connection of its own: clients used from different threads do not serialise on
     * one HTTP/2 connection. */
    grpc_arg args[3];
    args[0].type = args[1].type = args[2].type = GRPC_ARG_INTEGER;
    args[0].key = (char *)GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[1].key = (char *)GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[0].value.integer = args[1].value.integer = 64 << 20;
    args[2].key = (char *)GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
    args[2].value.integer = 1;
    grpc_channel_args ca = {3, args};
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    c->ch = creds ? grpc_channel_create(master_address, creds, &ca) : NULL;
    if (creds) grpc_channel_credentials_release(creds);
    c->cq = grpc_completion_queue_create_for_pluck(NULL);
    if (!c->node_id || !c->node_address || !c->ch || !c->cq) {
        umbp_client_free(c);
        return NULL;
    }
    return c;
}

void umbp_client_free(struct umbp_client *c) {
    if (!c) return;
    if (c->ch) grpc_channel_destroy(c->ch);
    if (c->cq) {
        grpc_completion_queue_shutdown(c->cq);
        while (grpc_completion_queue_pluck(c->cq, NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL)
                   .type != GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(c->cq);
    }
    free(c->node_id);
    free(c->node_address);
    free(c->peer_address);
    free(c);
}

void umbp_client_set_timeout_ms(struct umbp_client *c, uint32_t ms) { c->timeout_ms = ms; }

bool umbp_client_is_registered(const struct umbp_client *c) { return c->registered; }

int umbp_client_set_peer_address(struct umbp_client *c, const char *peer_address) {
    char *p = strdup(peer_address);
    if (!p) return -1;
    free(c->peer_address);
    c->peer_address = p;
    return 0;
}

uint32_t umbp_client_heartbeat_interval_ms(const struct umbp_client *c) {
    return c->heartbeat_interval_ms;
}

/* One in-flight unary call. */
struct ucall {
    struct grpcu_call g;
    uint64_t t0;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int ucall_start(struct umbp_client *c, grpc_completion_queue *cq, struct ucall *u,
                       const char *rpc, const ProtobufCMessage *req, void *tag) {
    char path[96];
    snprintf(path, sizeof(path), "/umbp.UMBPMaster/%s", rpc);
    memset(u, 0, sizeof(*u));
    size_t n = protobuf_c_message_get_packed_size(req);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return -1;
    protobuf_c_message_pack(req, buf);
    grpc_slice s = grpc_slice_new(buf, n, free);
    u->g.req = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    gpr_timespec deadline = c->timeout_ms
                                ? gpr_time_add(gpr_now(GPR_CLOCK_REALTIME),
                                               gpr_time_from_millis(c->timeout_ms, GPR_TIMESPAN))
                                : gpr_inf_future(GPR_CLOCK_REALTIME);
    grpc_slice method = grpc_slice_from_copied_string(path);
    u->t0 = now_ns();
    int rc = grpcu_start(&u->g, c->ch, cq, method, deadline, tag);
    grpc_slice_unref(method);
    return rc;
}

static void ucall_cleanup(struct ucall *u) { grpcu_cleanup(&u->g); }

/* 0 on OK, else the status with its message in err. */
static int ucall_status(struct ucall *u, const char *rpc, char *err, size_t errlen) {
    if (u->g.status == GRPC_STATUS_OK) return 0;
    char *msg = grpc_slice_to_c_string(u->g.details);
    set_err(err, errlen, rpc, msg ? msg : "?");
    gpr_free(msg);
    return (int)u->g.status;
}

/* Status handling after completion; on OK decodes the reply with desc into *out. */
static int ucall_finish(struct ucall *u, const char *rpc, const ProtobufCMessageDescriptor *desc,
                        ProtobufCMessage **out, char *err, size_t errlen) {
    int st = ucall_status(u, rpc, err, errlen);
    if (st) return st;
    grpc_slice s = grpc_empty_slice();
    if (u->g.resp) {
        grpc_byte_buffer_reader rd;
        if (!grpc_byte_buffer_reader_init(&rd, u->g.resp)) {
            set_err(err, errlen, rpc, "unreadable reply");
            return -1;
        }
        s = grpc_byte_buffer_reader_readall(&rd);
        grpc_byte_buffer_reader_destroy(&rd);
    }
    ProtobufCMessage *m =
        protobuf_c_message_unpack(desc, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    if (!m) {
        set_err(err, errlen, rpc, "reply could not be decoded");
        return -1;
    }
    if (out)
        *out = m;
    else
        protobuf_c_message_free_unpacked(m, NULL);
    return 0;
}

static int unary(struct umbp_client *c, const char *rpc, const ProtobufCMessage *req,
                 const ProtobufCMessageDescriptor *desc, ProtobufCMessage **out, char *err,
                 size_t errlen) {
    struct ucall u;
    int rc;
    if (ucall_start(c, c->cq, &u, rpc, req, &u)) {
        set_err(err, errlen, rpc, "cannot start the call");
        rc = -1;
    } else {
        grpc_event ev =
            grpc_completion_queue_pluck(c->cq, &u, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        rc = ev.type == GRPC_OP_COMPLETE && ev.success
                 ? ucall_finish(&u, rpc, desc, out, err, errlen)
                 : (set_err(err, errlen, rpc, "call failed"), -1);
    }
    ucall_cleanup(&u);
    return rc;
}

/* caps[0..ncaps) as protobuf messages (*tc) and the pointer array a request holds (*ptc);
 * free both after the call. -1 when out of memory. */
static int caps_to_pb(const struct umbp_tier_capacity *caps, size_t ncaps, Umbp__TierCapacity **tc,
                      Umbp__TierCapacity ***ptc) {
    *tc = calloc(ncaps + 1, sizeof(**tc));
    *ptc = calloc(ncaps + 1, sizeof(**ptc));
    if (!*tc || !*ptc) {
        free(*tc);
        free(*ptc);
        return -1;
    }
    for (size_t i = 0; i < ncaps; i++) {
        umbp__tier_capacity__init(&(*tc)[i]);
        (*tc)[i].tier = (Umbp__TierType)caps[i].tier;
        (*tc)[i].total_capacity_bytes = caps[i].total_bytes;
        (*tc)[i].available_capacity_bytes = caps[i].available_bytes;
        (*ptc)[i] = &(*tc)[i];
    }
    return 0;
}

int umbp_client_register(struct umbp_client *c, const struct umbp_tier_capacity *caps, size_t ncaps,
                         char *err, size_t errlen) {
    Umbp__TierCapacity *tc, **ptc;
    if (caps_to_pb(caps, ncaps, &tc, &ptc) < 0) {
        set_err(err, errlen, "RegisterClient", "out of memory");
        return -1;
    }
    Umbp__RegisterClientRequest q = UMBP__REGISTER_CLIENT_REQUEST__INIT;
    q.node_id = c->node_id;
    q.node_address = c->node_address;
    if (c->peer_address) q.peer_address = c->peer_address;
    q.n_tier_capacities = ncaps;
    q.tier_capacities = ptc;
    ProtobufCMessage *out = NULL;
    int rc = unary(c, "RegisterClient", &q.base, &umbp__register_client_response__descriptor, &out,
                   err, errlen);
    if (rc == 0) {
        c->registered = true;
        c->heartbeat_interval_ms =
            (uint32_t)((Umbp__RegisterClientResponse *)out)->heartbeat_interval_ms;
        protobuf_c_message_free_unpacked(out, NULL);
    }
    free(tc);
    free(ptc);
    return rc;
}

int umbp_client_unregister(struct umbp_client *c, char *err, size_t errlen) {
    if (!c->registered) return 0;
    Umbp__UnregisterClientRequest q = UMBP__UNREGISTER_CLIENT_REQUEST__INIT;
    q.node_id = c->node_id;
    int rc = unary(c, "UnregisterClient", &q.base, &umbp__unregister_client_response__descriptor,
                   NULL, err, errlen);
    if (rc == 0) c->registered = false;
    return rc;
}

bool umbp_client_full_sync_requested(const struct umbp_client *c) { return c->full_sync_requested; }

int umbp_client_keepalive(struct umbp_client *c, bool *alive, char *err, size_t errlen) {
    Umbp__HeartbeatRequest q = UMBP__HEARTBEAT_REQUEST__INIT;
    q.node_id = c->node_id;
    ProtobufCMessage *out = NULL;
    int rc =
        unary(c, "Heartbeat", &q.base, &umbp__heartbeat_response__descriptor, &out, err, errlen);
    if (rc == 0) {
        const Umbp__HeartbeatResponse *hr = (const Umbp__HeartbeatResponse *)out;
        *alive = hr->status == UMBP__CLIENT_STATUS__CLIENT_STATUS_ALIVE;
        c->full_sync_requested = hr->request_full_sync;
        protobuf_c_message_free_unpacked(out, NULL);
    }
    return rc;
}

int umbp_client_heartbeat_caps(struct umbp_client *c, const struct umbp_tier_capacity *caps,
                               size_t ncaps, bool *alive, char *err, size_t errlen) {
    Umbp__TierCapacity *tc, **ptc;
    if (caps_to_pb(caps, ncaps, &tc, &ptc) < 0) {
        set_err(err, errlen, "Heartbeat", "out of memory");
        return -1;
    }
    Umbp__HeartbeatRequest q = UMBP__HEARTBEAT_REQUEST__INIT;
    q.node_id = c->node_id;
    q.is_full_sync = true; /* no bundles, baseline 0: no block-index entries, fresh capacities */
    q.n_tier_capacities = ncaps;
    q.tier_capacities = ptc;
    ProtobufCMessage *out = NULL;
    int rc =
        unary(c, "Heartbeat", &q.base, &umbp__heartbeat_response__descriptor, &out, err, errlen);
    if (rc == 0) {
        const Umbp__HeartbeatResponse *hr = (const Umbp__HeartbeatResponse *)out;
        *alive = hr->status == UMBP__CLIENT_STATUS__CLIENT_STATUS_ALIVE;
        c->full_sync_requested = hr->request_full_sync;
        protobuf_c_message_free_unpacked(out, NULL);
    }
    free(tc);
    free(ptc);
    return rc;
}

int umbp_report_external_kv_blocks(struct umbp_client *c, const char *node_id,
                                   const char *const *hashes, size_t n, enum umbp_tier tier,
                                   char *err, size_t errlen) {
    Umbp__ReportExternalKvBlocksRequest q = UMBP__REPORT_EXTERNAL_KV_BLOCKS_REQUEST__INIT;
    q.node_id = (char *)(node_id ? node_id : "");
    q.n_hashes = n;
    q.hashes = (char **)hashes;
    q.tier = (Umbp__TierType)tier;
    return unary(c, "ReportExternalKvBlocks", &q.base,
                 &umbp__report_external_kv_blocks_response__descriptor, NULL, err, errlen);
}

int umbp_revoke_external_kv_blocks(struct umbp_client *c, const char *node_id,
                                   const char *const *hashes, size_t n, enum umbp_tier tier,
                                   char *err, size_t errlen) {
    Umbp__RevokeExternalKvBlocksRequest q = UMBP__REVOKE_EXTERNAL_KV_BLOCKS_REQUEST__INIT;
    q.node_id = (char *)(node_id ? node_id : "");
    q.n_hashes = n;
    q.hashes = (char **)hashes;
    q.tier = (Umbp__TierType)tier;
    return unary(c, "RevokeExternalKvBlocks", &q.base,
                 &umbp__revoke_external_kv_blocks_response__descriptor, NULL, err, errlen);
}

int umbp_revoke_all_external_kv_blocks_at_tier(struct umbp_client *c, const char *node_id,
                                               enum umbp_tier tier, char *err, size_t errlen) {
    Umbp__RevokeAllExternalKvBlocksAtTierRequest q =
        UMBP__REVOKE_ALL_EXTERNAL_KV_BLOCKS_AT_TIER_REQUEST__INIT;
    q.node_id = (char *)(node_id ? node_id : "");
    q.tier = (Umbp__TierType)tier;
    return unary(c, "RevokeAllExternalKvBlocksAtTier", &q.base,
                 &umbp__revoke_all_external_kv_blocks_at_tier_response__descriptor, NULL, err,
                 errlen);
}

int umbp_revoke_all_external_kv_blocks_for_node(struct umbp_client *c, const char *node_id,
                                                char *err, size_t errlen) {
    Umbp__RevokeAllExternalKvBlocksForNodeRequest q =
        UMBP__REVOKE_ALL_EXTERNAL_KV_BLOCKS_FOR_NODE_REQUEST__INIT;
    q.node_id = (char *)(node_id ? node_id : "");
    return unary(c, "RevokeAllExternalKvBlocksForNode", &q.base,
                 &umbp__revoke_all_external_kv_blocks_for_node_response__descriptor, NULL, err,
                 errlen);
}

int umbp_unregister_node(struct umbp_client *c, const char *node_id, char *err, size_t errlen) {
    Umbp__UnregisterClientRequest q = UMBP__UNREGISTER_CLIENT_REQUEST__INIT;
    q.node_id = (char *)(node_id ? node_id : "");
    return unary(c, "UnregisterClient", &q.base, &umbp__unregister_client_response__descriptor,
                 NULL, err, errlen);
}

void umbp_match_result_free(struct umbp_match_result *r) {
    if (!r) return;
    free(r->nodes); /* one block: nodes, buckets, hash pointers, strings */
    r->nodes = NULL;
    r->n = 0;
}

size_t umbp_node_match_count(const struct umbp_node_match *m) {
    size_t n = 0;
    for (size_t t = 0; t < m->ntiers; t++)
        for (size_t k = 0; k < m->tiers[t].n; k++) {
            bool dup = false;
            for (size_t u = 0; u < t && !dup; u++)
                for (size_t j = 0; j < m->tiers[u].n && !dup; j++)
                    dup = strcmp(m->tiers[u].hashes[j], m->tiers[t].hashes[k]) == 0;
            n += !dup;
        }
    return n;
}

/* ---- MatchExternalKvResponse decoding: the replies are large (every matched hash once per
 * node and tier), so they are read straight off the wire into one allocation instead of
 * a protobuf-c tree plus copies. ---- */

struct mdec {
    size_t nodes, tiers, hashes, bytes; /* counts (first pass) */
    struct umbp_node_match *nd;         /* fill cursors (second pass) */
    struct umbp_tier_hashes *th;
    char **hp;
    char *sp;
};

static char *mdec_str(struct mdec *d, const struct pbw_field *f) {
    char *s = d->sp;
    memcpy(s, f->ptr, f->v);
    s[f->v] = 0;
    d->sp += f->v + 1;
    return s;
}

/* One pass over the reply: counts when fill is false, writes through d's cursors when it
 * is true (the counts of the first pass sized them). */
static int mdec_pass(const uint8_t *buf, size_t len, struct mdec *d, bool fill) {
    const uint8_t *p = buf, *end = buf + len;
    struct pbw_field f;
    int r;
    while ((r = pbw_next(&p, end, &f)) > 0) {
        if (f.num != 1) continue;
        if (f.wt != 2) return -1;
        struct umbp_node_match *nm = fill ? d->nd++ : NULL;
        if (nm) {
            nm->node_id = nm->peer_address = d->sp; /* "" until set */
            *d->sp++ = 0;
            nm->tiers = d->th;
        } else {
            d->nodes++;
            d->bytes++;
        }
        const uint8_t *q = f.ptr, *qend = f.ptr + f.v;
        struct pbw_field g;
        int r2;
        while ((r2 = pbw_next(&q, qend, &g)) > 0) {
            if (g.num == 1 || g.num == 2) {
                if (g.wt != 2) return -1;
                if (!nm)
                    d->bytes += g.v + 1;
                else if (g.num == 1)
                    nm->node_id = mdec_str(d, &g);
                else
                    nm->peer_address = mdec_str(d, &g);
            } else if (g.num == 3) {
                if (g.wt != 2) return -1;
                struct umbp_tier_hashes *th = nm ? d->th++ : NULL;
                if (th) {
                    th->tier = UMBP_TIER_UNKNOWN;
                    th->n = 0;
                    th->hashes = d->hp;
                    nm->ntiers++;
                } else {
                    d->tiers++;
                }
                const uint8_t *t = g.ptr, *tend = g.ptr + g.v;
                struct pbw_field h;
                int r3;
                while ((r3 = pbw_next(&t, tend, &h)) > 0) {
                    if (h.num == 1) {
                        if (h.wt != 0) return -1;
                        if (th) th->tier = (enum umbp_tier)(int32_t)h.v;
                    } else if (h.num == 2) {
                        if (h.wt != 2) return -1;
                        if (th) {
                            *d->hp++ = mdec_str(d, &h);
                            th->n++;
                        } else {
                            d->hashes++;
                            d->bytes += h.v + 1;
                        }
                    }
                }
                if (r3 < 0) return -1;
            }
        }
        if (r2 < 0) return -1;
    }
    return r;
}

static int cmp_tier(const void *a, const void *b) {
    return (int)((const struct umbp_tier_hashes *)a)->tier -
           (int)((const struct umbp_tier_hashes *)b)->tier;
}

/* 0, -1 malformed, -2 no memory. */
static int decode_match(const uint8_t *buf, size_t len, struct umbp_match_result *out) {
    memset(out, 0, sizeof(*out));
    struct mdec d = {0};
    if (mdec_pass(buf, len, &d, false)) return -1;
    if (!d.nodes) return 0;
    size_t sz = d.nodes * sizeof(struct umbp_node_match) +
                d.tiers * sizeof(struct umbp_tier_hashes) + d.hashes * sizeof(char *) + d.bytes;
    char *blk = malloc(sz);
    if (!blk) return -2;
    d.nd = (struct umbp_node_match *)blk;
    d.th = (struct umbp_tier_hashes *)(d.nd + d.nodes);
    d.hp = (char **)(d.th + d.tiers);
    d.sp = (char *)(d.hp + d.hashes);
    memset(blk, 0, d.nodes * sizeof(struct umbp_node_match));
    if (mdec_pass(buf, len, &d, true)) {
        free(blk);
        return -1;
    }
    out->nodes = (struct umbp_node_match *)blk;
    out->n = d.nodes;
    for (size_t i = 0; i < out->n; i++)
        if (out->nodes[i].ntiers > 1)
            qsort(out->nodes[i].tiers, out->nodes[i].ntiers, sizeof(struct umbp_tier_hashes),
                  cmp_tier);
    return 0;
}

/* Reads a reply byte buffer and decodes it as a MatchExternalKvResponse. */
static int read_match(grpc_byte_buffer *bb, struct umbp_match_result *out, char *err,
                      size_t errlen) {
    grpc_slice s = grpc_empty_slice();
    if (bb) {
        grpc_byte_buffer_reader rd;
        if (!grpc_byte_buffer_reader_init(&rd, bb)) {
            set_err(err, errlen, "MatchExternalKv", "unreadable reply");
            return -1;
        }
        s = grpc_byte_buffer_reader_readall(&rd);
        grpc_byte_buffer_reader_destroy(&rd);
    }
    int rc = decode_match(GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), out);
    grpc_slice_unref(s);
    if (rc)
        set_err(err, errlen, "MatchExternalKv",
                rc == -2 ? "out of memory" : "reply could not be decoded");
    return rc ? -1 : 0;
}

int umbp_match_external_kv(struct umbp_client *c, const char *const *hashes, size_t n,
                           bool count_as_hit, struct umbp_match_result *out, char *err,
                           size_t errlen) {
    memset(out, 0, sizeof(*out));
    if (!n) return 0;
    Umbp__MatchExternalKvRequest q = UMBP__MATCH_EXTERNAL_KV_REQUEST__INIT;
    q.n_hashes = n;
    q.hashes = (char **)hashes;
    q.count_as_hit = count_as_hit;
    struct ucall u;
    int rc;
    if (ucall_start(c, c->cq, &u, "MatchExternalKv", &q.base, &u)) {
        set_err(err, errlen, "MatchExternalKv", "cannot start the call");
        rc = -1;
    } else {
        grpc_event ev =
            grpc_completion_queue_pluck(c->cq, &u, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE || !ev.success) {
            set_err(err, errlen, "MatchExternalKv", "call failed");
            rc = -1;
        } else {
            rc = ucall_status(&u, "MatchExternalKv", err, errlen);
            if (!rc) rc = read_match(u.g.resp, out, err, errlen);
        }
    }
    ucall_cleanup(&u);
    return rc;
}

void umbp_hit_counts_free(struct umbp_hit_count *h, size_t n) {
    for (size_t i = 0; h && i < n; i++) free(h[i].hash);
    free(h);
}

int umbp_get_external_kv_hit_counts(struct umbp_client *c, const char *const *hashes, size_t n,
                                    struct umbp_hit_count **out, size_t *nout, char *err,
                                    size_t errlen) {
    *out = NULL;
    *nout = 0;
    Umbp__GetExternalKvHitCountsRequest q = UMBP__GET_EXTERNAL_KV_HIT_COUNTS_REQUEST__INIT;
    q.n_hashes = n;
    q.hashes = (char **)hashes;
    ProtobufCMessage *resp = NULL;
    int rc = unary(c, "GetExternalKvHitCounts", &q.base,
                   &umbp__get_external_kv_hit_counts_response__descriptor, &resp, err, errlen);
    if (rc) return rc;
    const Umbp__GetExternalKvHitCountsResponse *r = (const void *)resp;
    struct umbp_hit_count *h = calloc(r->n_entries + 1, sizeof(*h));
    size_t k = 0;
    for (; h && k < r->n_entries; k++) {
        h[k].hit_count_total = r->entries[k]->hit_count_total;
        if (!(h[k].hash = strdup(r->entries[k]->hash))) break;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    if (!h || k < r->n_entries) {
        umbp_hit_counts_free(h, k);
        set_err(err, errlen, "GetExternalKvHitCounts", "out of memory");
        return -1;
    }
    *out = h;
    *nout = k;
    return 0;
}

int umbp_match_external_kv_pipelined(struct umbp_client *c, const char *const *const *qhashes,
                                     const size_t *qlen, size_t nq, bool count_as_hit,
                                     unsigned depth, uint64_t *lat_ns, uint64_t *nmatched,
                                     uint64_t *reply_bytes, char *err, size_t errlen) {
    if (!depth) depth = 1;
    uint64_t bytes = 0;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    struct ucall *calls = calloc(depth, sizeof(*calls));
    size_t *qidx = calloc(depth, sizeof(*qidx));
    int rc = (!cq || !calls || !qidx) ? -1 : 0;
    size_t next = 0, inflight = 0;
    uint64_t matched = 0;
    Umbp__MatchExternalKvRequest q = UMBP__MATCH_EXTERNAL_KV_REQUEST__INIT;
    q.count_as_hit = count_as_hit;
    for (unsigned s = 0; !rc && s < depth && next < nq; s++, next++, inflight++) {
        q.n_hashes = qlen[next];
        q.hashes = (char **)qhashes[next];
        qidx[s] = next;
        if (ucall_start(c, cq, &calls[s], "MatchExternalKv", &q.base, &calls[s])) rc = -1;
    }
    while (inflight) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (ev.type != GRPC_OP_COMPLETE) break;
        struct ucall *u = ev.tag;
        size_t s = (size_t)(u - calls);
        inflight--;
        if (lat_ns) lat_ns[qidx[s]] = now_ns() - u->t0;
        if (u->g.resp) bytes += grpc_byte_buffer_length(u->g.resp);
        struct umbp_match_result res = {0};
        int r = ev.success ? ucall_status(u, "MatchExternalKv", err, errlen) : -1;
        if (!r) r = read_match(u->g.resp, &res, err, errlen);
        matched += res.n;
        umbp_match_result_free(&res);
        ucall_cleanup(u);
        if (r && !rc) rc = r;
        if (!rc && next < nq) {
            q.n_hashes = qlen[next];
            q.hashes = (char **)qhashes[next];
            qidx[s] = next++;
            if (ucall_start(c, cq, u, "MatchExternalKv", &q.base, u))
                rc = -1;
            else
                inflight++;
        }
    }
    if (cq) {
        grpc_completion_queue_shutdown(cq);
        while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_REALTIME), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(cq);
    }
    free(calls);
    free(qidx);
    if (nmatched) *nmatched = matched;
    if (reply_bytes) *reply_bytes = bytes;
    if (rc == -1 && err && !*err) set_err(err, errlen, "MatchExternalKv", "local failure");
    return rc;
}
