/* The data-plane operations that move KV (docs/protocol.md): registering an engine's shared
 * memory, store and retrieve through it (gathered and scattered by kvctx.h), and store_bytes /
 * retrieve_bytes with the chunks in the message. Handlers as ops.c describes: decode, call the
 * engine, fill the reply; -1 with err on failure. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "base/ratelimit.h"
#include "server/copypool.h"
#include "server/dataplane/dataplane.h"
#include "server/dataplane/ops.h"
#include "server/dataplane/wire.h"
#include "server/engine.h"
#include "server/keys.h"
#include "server/kvctx.h"

#define SHRUNK "the registered shared memory is smaller than its layout (it shrank)"

/* ---- registration ---- */

/* Parses a list option of uids; -1 when an entry is not one. */
static int parse_uids(json_t *list, uint32_t *out, size_t cap, size_t *n) {
    size_t i;
    json_t *v;
    *n = 0;
    json_array_foreach(list, i, v) {
        const char *str = json_string_value(v);
        char *end;
        if (!str || !*str || *n >= cap) return -1;
        unsigned long u = strtoul(str, &end, 10);
        if (*end || u > UINT32_MAX - 1) return -1;
        out[(*n)++] = (uint32_t)u;
    }
    return 0;
}

int dataplane_check_shm_options(const struct server_config *cfg, char *err, size_t errlen) {
    uint32_t uids[64];
    size_t n;
    if (cfg->shm_allowed_uids && parse_uids(cfg->shm_allowed_uids, uids, 64, &n) < 0) {
        errbuf_set(err, errlen, "--shm-allowed-uids: at most 64 numeric uids");
        return -1;
    }
    size_t i;
    json_t *v;
    json_array_foreach(cfg->shm_name_prefixes, i, v) {
        const char *pfx = json_string_value(v);
        if (!pfx || pfx[0] != '/' || strchr(pfx + 1, '/') || i >= 64) {
            errbuf_set(err, errlen, "--shm-name-prefixes: at most 64 prefixes, each '/' + name");
            return -1;
        }
    }
    return 0;
}

/* The checks of docs/security.md (shared-memory authorization) around the registration: the
 * operator's policy, the peer's credentials, and the proof-of-access round trip. */
static int register_checked(struct op_ctx *o, const struct kv_context *c) {
    const struct server_config *cfg = o->e->cfg;
    struct kv_auth a;
    uint32_t uids[64];
    const char *prefixes[64];
    memset(&a, 0, sizeof(a));
    if (o->peer && o->peer->has_cred) {
        a.has_cred = 1;
        a.peer_uid = o->peer->uid;
    }
    if (cfg->shm_allowed_uids && parse_uids(cfg->shm_allowed_uids, uids, 64, &a.n_allowed_uids) < 0)
        a.n_allowed_uids = 0; /* checked at start-up */
    a.allowed_uids = uids;
    size_t i;
    json_t *v;
    json_array_foreach(cfg->shm_name_prefixes, i, v) {
        if (a.n_prefixes < 64 && json_string_value(v))
            prefixes[a.n_prefixes++] = json_string_value(v);
    }
    a.prefixes = prefixes;
    a.need_proof =
        !strcmp(cfg->shm_proof, "always") || (!strcmp(cfg->shm_proof, "tcp") && !a.has_cred);
    a.reserve_proof_page = strcmp(cfg->shm_proof, "never") != 0;
    a.max_per_peer = (size_t)cfg->max_kv_registrations_per_client;
    a.max_total = (size_t)cfg->max_kv_registrations;
    memcpy(a.peer, op_owner(o), KV_PEER_KEY);
    unsigned char nonce[KV_PROOF_NONCE];
    uint64_t off = 0;
    int rc = engine_register_context(o->e, c, &a, o->now, nonce, &off, o->err->message,
                                     sizeof(o->err->message));
    if (rc == 0) return 0;
    if (rc == KV_REG_NEED_PROOF) {
        o->err->code = DP_PROOF_REQUIRED;
        dp_key(o->r, "nonce");
        msgpack_pack_bin(&o->r->pk, KV_PROOF_NONCE);
        msgpack_pack_bin_body(&o->r->pk, nonce, KV_PROOF_NONCE);
        dp_put_int(o->r, "proof_offset", (int64_t)off);
        return -1;
    }
    o->err->code = rc == KV_REG_BAD_NAME ? DP_BAD_REQUEST
                   : rc == KV_REG_LIMIT  ? DP_TOO_LARGE
                                         : DP_SHM_ERROR;
    /* refusals come at the rate a client chooses */
    static struct ratelimit refused_log = RATELIMIT_INIT(10.0, 10);
    unsigned long dropped;
    if (rc != KV_REG_BAD_NAME && ratelimit_allow(&refused_log, clock_mono(), &dropped))
        log_warn(o->e->lg_dp,
                 "register_kv_cache of instance %lld refused: %s (%lu similar "
                 "refusals not logged)",
                 (long long)c->instance_id, o->err->message, dropped);
    return -1;
}

int dp_op_register(struct op_ctx *o) {
    struct kv_context c;
    memset(&c, 0, sizeof(c));
    int64_t v;
    if (dp_int(o->m, "instance_id", 1, 0, INT64_MAX, &c.instance_id, o->err) < 0) return -1;
    if (op_parse_model(o, c.model_name, sizeof(c.model_name)) < 0) return -1;
    v = 1;
    if (dp_int(o->m, "world_size", 0, 1, 255, &v, o->err) < 0) return -1;
    c.world_size = (uint32_t)v;
    v = 0;
    if (dp_int(o->m, "worker_id", 0, 0, 254, &v, o->err) < 0) return -1;
    c.worker_id = (uint32_t)v;
    if (keys_kv_rank_pack(c.world_size, c.worker_id, &c.kv_rank, o->err->message,
                          sizeof(o->err->message)) < 0) {
        o->err->code = DP_BAD_REQUEST;
        return -1;
    }
    if (dp_cstr(o->m, "shm_name", 1, c.shm_name, sizeof(c.shm_name), o->err) < 0) return -1;
    struct kv_layout *l = &c.layout;
    if (dp_int(o->m, "num_layers", 1, 1, 100000, &v, o->err) < 0) return -1;
    l->num_layers = (uint32_t)v;
    if (dp_int(o->m, "num_blocks", 1, 1, UINT32_MAX, &v, o->err) < 0) return -1;
    l->num_blocks = (uint32_t)v;
    if (dp_int(o->m, "tokens_per_block", 1, 1, 1 << 20, &v, o->err) < 0) return -1;
    l->tokens_per_block = (uint32_t)v;
    if (dp_int(o->m, "bytes_per_token", 1, 1, 1LL << 30, &v, o->err) < 0) return -1;
    l->bytes_per_token = (uint64_t)v;
    v = 2;
    if (dp_int(o->m, "kv_count", 0, 1, 2, &v, o->err) < 0) return -1;
    l->kv_count = (uint32_t)v;
    char order[32] = "layer_major";
    if (dp_cstr(o->m, "block_order", 0, order, sizeof(order), o->err) < 0) return -1;
    if (!strcmp(order, "layer_major"))
        l->order = KV_LAYER_MAJOR;
    else if (!strcmp(order, "block_major"))
        l->order = KV_BLOCK_MAJOR;
    else {
        dp_fail(o->err, DP_BAD_REQUEST, "block_order must be \"layer_major\" or \"block_major\"");
        return -1;
    }
    if (dp_cstr(o->m, "dtype", 0, l->dtype, sizeof(l->dtype), o->err) < 0) return -1;
    if (kv_layout_check(l, (uint32_t)o->e->cfg->chunk_size, o->err->message,
                        sizeof(o->err->message)) < 0) {
        o->err->code = DP_BAD_REQUEST;
        return -1;
    }
    /* One chunk is one L1 object, and L1 objects are below 4 GiB. */
    uint64_t obj = kv_object_bytes(l, (uint32_t)o->e->cfg->chunk_size);
    if (obj > UINT32_MAX) {
        dp_fail(o->err, DP_BAD_REQUEST,
                "the layout makes objects of %llu bytes per chunk; at most %u are allowed",
                (unsigned long long)obj, UINT32_MAX);
        return -1;
    }
    if (register_checked(o, &c) < 0) return -1;
    /* The object is faulted in by the server's `kv-warm` thread after this reply: `warming`
     * until that is over (ping tells), copies meanwhile work and may pay per page. */
    int warm = KV_WARM_OFF;
    (void)engine_context_ping(o->e, c.instance_id, op_owner(o), o->now, &warm);
    dp_put_bool(o->r, "warming", warm == KV_WARM_QUEUED);
    log_info(o->e->lg_dp, "registered KV cache of instance %lld (%s, rank %u/%u, shm %s)",
             (long long)c.instance_id, c.model_name, c.worker_id, c.world_size, c.shm_name);
    return 0;
}

int dp_op_unregister(struct op_ctx *o) {
    int64_t id;
    if (dp_int(o->m, "instance_id", 1, 0, INT64_MAX, &id, o->err) < 0) return -1;
    if (engine_unregister_context(o->e, id, op_owner(o)) < 0) {
        dp_fail(o->err, DP_NOT_REGISTERED, "instance_id %lld is not registered", (long long)id);
        return -1;
    }
    return 0;
}

static struct kv_context *get_context(struct op_ctx *o) {
    int64_t id;
    if (dp_int(o->m, "instance_id", 1, 0, INT64_MAX, &id, o->err) < 0) return NULL;
    /* Only the connections that registered the instance use it; to others it is unknown. */
    struct kv_context *c = engine_context_get(o->e, id, op_owner(o), o->now);
    if (!c) dp_fail(o->err, DP_NOT_REGISTERED, "instance_id %lld is not registered", (long long)id);
    return c;
}

/* Validates block_ids for the range: B ids per chunk, each < num_blocks. */
static int parse_blocks(struct op_ctx *o, const struct kv_context *c,
                        const struct engine_prompt *cr, uint32_t **blocks) {
    uint32_t n = 0;
    const msgpack_object *a = NULL;
    const struct dp_rawarr *raw = dp_raw(o->m, "block_ids");
    if (raw)
        n = raw->n;
    else if (dp_array(o->m, "block_ids", 1, &a, &n, o->err) < 0)
        return -1;
    *blocks = malloc((n ? n : 1) * sizeof(**blocks));
    if (!*blocks) {
        dp_fail(o->err, DP_INTERNAL, "out of memory");
        return -1;
    }
    if (raw) { /* read in place: integers in [0, 2^32) */
        dp_raw_u32(raw, *blocks);
        for (uint32_t i = 0; i < n; i++)
            if ((*blocks)[i] >= c->layout.num_blocks) {
                dp_fail(o->err, DP_INVALID_BLOCKS, "block id %u out of range (num_blocks %u)",
                        (*blocks)[i], c->layout.num_blocks);
                return -1;
            }
    }
    /* A non-integer is a malformed request; an integer outside the cache is a bad block. */
    for (uint32_t i = 0; !raw && i < n; i++) {
        if (a[i].type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
            dp_fail(o->err, DP_INVALID_BLOCKS, "block id %lld is out of range",
                    (long long)a[i].via.i64);
            return -1;
        }
        if (a[i].type != MSGPACK_OBJECT_POSITIVE_INTEGER) {
            dp_fail(o->err, DP_BAD_REQUEST, "field 'block_ids'[%u] must be an integer", i);
            return -1;
        }
        if (a[i].via.u64 >= c->layout.num_blocks) {
            dp_fail(o->err, DP_INVALID_BLOCKS, "block id %llu out of range (num_blocks %u)",
                    (unsigned long long)a[i].via.u64, c->layout.num_blocks);
            return -1;
        }
        (*blocks)[i] = (uint32_t)a[i].via.u64;
    }
    uint64_t per = o->e->cfg->chunk_size / c->layout.tokens_per_block;
    uint64_t need = (uint64_t)(cr->end_chunk - cr->start_chunk) * per;
    if (n < need) {
        dp_fail(o->err, DP_INVALID_BLOCKS, "%u block ids for %u chunks, %llu needed", n,
                cr->end_chunk - cr->start_chunk, (unsigned long long)need);
        return -1;
    }
    return 0;
}

/* ---- store / retrieve through registered shared memory ---- */

static void observe_throughput(struct engine *e, int store, const char *model, uint64_t bytes,
                               uint64_t t0) {
    double dt = (double)(clock_mono_ns() - t0) / 1e9;
    if (bytes == 0 || dt <= 0) return;
    const char *labels[] = {model};
    metric_observe(metric_labels(store ? e->dpm.store_gbps : e->dpm.load_gbps, labels),
                   (double)bytes / dt);
}

/* Chunks a retrieve holds and copies at once (one copy-pool job per batch). */
#define DP_RETRIEVE_BATCH 32

/* store: chunks gathered from a registered engine cache. */
struct gather_src {
    struct copypool *pool;
    const struct kv_context *c;
    uint32_t cs, per;
    const uint32_t *blocks;
};

static uint64_t gather_size(void *arg, uint32_t i) {
    (void)i;
    const struct gather_src *g = arg;
    return kv_object_bytes(&g->c->layout, g->cs);
}

static int gather_fill(void *arg, uint32_t i, void *dst) {
    const struct gather_src *g = arg;
    return kv_gather_pooled(g->pool, g->c, g->cs, g->blocks + (size_t)i * g->per, dst);
}

static int gather_fill_many(void *arg, const uint32_t *idx, void *const *dsts, uint32_t n,
                            uint32_t *done) {
    const struct gather_src *g = arg;
    const uint32_t *ids[ENGINE_STORE_BATCH];
    if (n > ENGINE_STORE_BATCH) return -1; /* engine_store never asks for more */
    for (uint32_t j = 0; j < n; j++) ids[j] = g->blocks + (size_t)idx[j] * g->per;
    return kv_gather_many(g->pool, g->c, g->cs, ids, (unsigned char *const *)dsts, n, done);
}

/* store_bytes: chunks carried in the message (msgpack bins or frames after the payload). */
struct bin_src {
    struct copypool *pool;
    const struct dp_blob *chunks;
};

static uint64_t bin_size(void *arg, uint32_t i) {
    return ((const struct bin_src *)arg)->chunks[i].len;
}

static int bin_fill(void *arg, uint32_t i, void *dst) {
    const struct bin_src *s = arg;
    copypool_memcpy(s->pool, dst, s->chunks[i].data, s->chunks[i].len);
    return 0;
}

_Static_assert(ENGINE_STORE_BATCH <= COPYPOOL_MANY_MAX, "a store batch is one copy job");

/* A batch of chunks as one copy job (engine_store asks for at most ENGINE_STORE_BATCH). */
static int bin_fill_many(void *arg, const uint32_t *idx, void *const *dsts, uint32_t n,
                         uint32_t *done) {
    const struct bin_src *s = arg;
    const void *srcs[ENGINE_STORE_BATCH];
    size_t lens[ENGINE_STORE_BATCH];
    if (n > ENGINE_STORE_BATCH) return -1;
    for (uint32_t j = 0; j < n; j++) {
        srcs[j] = s->chunks[idx[j]].data;
        lens[j] = s->chunks[idx[j]].len;
    }
    copypool_memcpy_many(s->pool, dsts, srcs, lens, n);
    *done = n;
    return 0;
}

/* How long a store with wait_l2 waits for its write-through to every L2 tier. */
#define DP_WAIT_L2_NS (30ull * 1000 * 1000 * 1000)

/* A store's options (wait_l2) and how it may wait without holding this thread (o->park). */
static int parse_store_options(struct op_ctx *o, struct engine_source *src) {
    int wait = 0;
    if (dp_bool(o->m, "wait_l2", 0, &wait, o->err) < 0) return -1;
    src->wait_l2_ns = wait ? DP_WAIT_L2_NS : 0;
    if (o->park) { /* the worker goes on with other clients meanwhile (dataplane.c) */
        src->resume = &o->park->store;
        if (wait) {
            src->l2_notify = o->park->notify;
            src->l2_notify_arg = o->park->notify_arg;
        }
    }
    return 0;
}

/* Whether this run of a store goes on with a parked one (counted once, when it first ran). */
static int store_resumed(const struct op_ctx *o) { return o->park && o->park->store; }

/* The end of engine_store, the handler's result: 0 when the store parked (nothing is replied
 * yet), else its counts in the reply and 0, or -1 with the failure (shrunk: the message of a
 * source that failed, a registered region that shrank). */
static int store_replied(struct op_ctx *o, int erc, const struct engine_source *src,
                         const struct engine_store_result *res, const char *model, uint64_t t0,
                         const char *shrunk) {
    if (erc == ENGINE_AGAIN) {
        o->park->again = 1;
        return 0;
    }
    dp_put_int(o->r, "stored_chunks", res->stored);
    dp_put_int(o->r, "skipped_chunks", res->skipped);
    dp_put_int(o->r, "pending_chunks", res->pending);
    if (res->l2_wait) /* l2_stored_chunks: when the parked reply is finished */
        o->park->wait = res->l2_wait;
    else if (src->wait_l2_ns)
        dp_put_int(o->r, "l2_stored_chunks", res->l2_stored);
    observe_throughput(o->e, 1, model, res->bytes, o->park && o->park->t0 ? o->park->t0 : t0);
    if (erc == ENGINE_ERR_SOURCE && shrunk) {
        dp_fail(o->err, DP_SHM_ERROR, "%s", shrunk);
        return -1;
    }
    if (erc != ENGINE_OK) return op_engine_fail(o, erc);
    metric_inc(o->e->dpm.stores_finished, 1);
    return 0;
}

int dp_op_store(struct op_ctx *o) {
    struct engine_prompt cr;
    uint32_t *blocks = NULL;
    struct kv_context *c = get_context(o);
    int rc = -1;
    if (!c) return -1;
    memset(&cr, 0, sizeof(cr));
    if (!store_resumed(o)) metric_inc(o->e->dpm.stores_submitted, 1);
    if (op_parse_range(o, &cr, 1) < 0) goto out;
    if (parse_blocks(o, c, &cr, &blocks) < 0) goto out;
    uint32_t cs = (uint32_t)o->e->cfg->chunk_size, per = cs / c->layout.tokens_per_block;
    uint64_t t0 = clock_mono_ns();
    struct gather_src gs = {o->e->copypool, c, cs, per, blocks};
    struct engine_source src = {.size = gather_size,
                                .fill = gather_fill,
                                .arg = &gs,
                                .replace = true,
                                .fill_many = gather_fill_many};
    if (parse_store_options(o, &src) < 0) goto out;
    struct engine_store_result res;
    int erc = engine_store(o->e, &cr, c->model_name, c->world_size, c->worker_id, &src, o->now,
                           &res, o->err->message, sizeof(o->err->message));
    rc = store_replied(o, erc, &src, &res, c->model_name, t0, SHRUNK);
out:
    op_range_free(&cr);
    free(blocks);
    engine_context_put(c);
    return rc;
}

int dp_op_retrieve(struct op_ctx *o) {
    struct engine_prompt cr;
    uint32_t *blocks = NULL;
    char rid[ENGINE_REQUEST_ID_MAX + 1] = "";
    struct kv_context *c = get_context(o);
    int rc = -1;
    if (!c) return -1;
    memset(&cr, 0, sizeof(cr));
    metric_inc(o->e->dpm.retrieves_submitted, 1);
    int64_t skip = 0, done = 0;
    uint64_t t0 = clock_mono_ns(), bytes = 0;
    if (dp_cstr(o->m, "request_id", 0, rid, sizeof(rid), o->err) < 0) goto out;
    if (dp_int(o->m, "skip_first_n_tokens", 0, 0, INT64_MAX, &skip, o->err) < 0) goto out;
    if (op_parse_range(o, &cr, 1) < 0) goto out;
    if (parse_blocks(o, c, &cr, &blocks) < 0) goto out;
    uint32_t cs = (uint32_t)o->e->cfg->chunk_size, per = cs / c->layout.tokens_per_block;
    uint64_t size = kv_object_bytes(&c->layout, cs);
    /* Chunks are read-held in batches and each batch is copied as one pooled job; a miss or a
     * fault ends the request after the chunks before it were copied, as chunk by chunk. */
    struct engine_ref refs[DP_RETRIEVE_BATCH];
    const unsigned char *objs[DP_RETRIEVE_BATCH];
    const uint32_t *ids[DP_RETRIEVE_BATCH];
    uint32_t skips[DP_RETRIEVE_BATCH];
    int failed = 0;
    for (uint32_t ch = cr.start_chunk; ch < cr.end_chunk && !failed;) {
        uint32_t nb = 0;
        for (; ch < cr.end_chunk && nb < DP_RETRIEVE_BATCH; ch++) {
            int erc =
                engine_read(o->e, &cr, ch, c->model_name, c->world_size, c->worker_id, op_owner(o),
                            rid, o->now, &refs[nb], o->err->message, sizeof(o->err->message));
            if (erc == ENGINE_ERR_NOT_FOUND) {
                dp_fail(o->err, DP_NOT_FOUND, "chunk %u is not in the cache%s", ch,
                        *rid ? " or not locked by this lookup" : "");
                failed = 1;
                break;
            }
            if (erc != ENGINE_OK) {
                op_engine_fail(o, erc);
                failed = 1;
                break;
            }
            if (refs[nb].size != size) {
                engine_read_done(o->e, &refs[nb], o->now);
                dp_fail(o->err, DP_NOT_FOUND, "chunk %u was stored with another layout", ch);
                failed = 1;
                break;
            }
            uint64_t tok = (uint64_t)ch * cs;
            skips[nb] = (uint64_t)skip > tok
                            ? (uint32_t)((uint64_t)skip - tok > cs ? cs : (uint64_t)skip - tok)
                            : 0;
            objs[nb] = refs[nb].data;
            ids[nb] = blocks + (size_t)(ch - cr.start_chunk) * per;
            nb++;
        }
        uint32_t copied = 0;
        int bad = kv_scatter_many(o->e->copypool, c, cs, ids, objs, skips, nb, &copied);
        uint64_t now = clock_mono_ns();
        for (uint32_t j = 0; j < nb; j++) engine_read_done(o->e, &refs[j], now);
        done += copied;
        bytes += (uint64_t)copied * size;
        if (bad) { /* before any miss of the batch: the fault is what the client sees */
            dp_fail(o->err, DP_SHM_ERROR, SHRUNK);
            failed = 1;
        }
    }
    if (failed) goto out_counts;
    rc = 0;
    metric_inc(o->e->dpm.retrieves_finished, 1);
out_counts:
    dp_put_int(o->r, "retrieved_chunks", done);
    observe_throughput(o->e, 0, c->model_name, bytes, t0);
out:
    op_range_free(&cr);
    free(blocks);
    engine_context_put(c);
    return rc;
}

/* ---- bytes in the message ---- */

static int parse_rank(struct op_ctx *o, uint32_t *world_size, uint32_t *rank) {
    int64_t ws = 1, r = 0;
    if (dp_int(o->m, "world_size", 0, 1, 255, &ws, o->err) < 0) return -1;
    if (dp_int(o->m, "worker_id", 0, 0, 254, &r, o->err) < 0) return -1;
    if (r >= ws) {
        dp_fail(o->err, DP_BAD_REQUEST, "worker_id %lld is not below world_size %lld", (long long)r,
                (long long)ws);
        return -1;
    }
    *world_size = (uint32_t)ws;
    *rank = (uint32_t)r;
    return 0;
}

/* The chunks of a store_bytes: the `chunks` array of bins, or with `chunk_frames: N` the N
 * frames after the payload. One per chunk of the range, none empty. *out is malloc'd. */
static int parse_bytes_chunks(struct op_ctx *o, uint32_t want, struct dp_blob **out) {
    int64_t nf = -1;
    if (dp_int(o->m, "chunk_frames", 0, 0, UINT32_MAX, &nf, o->err) < 0) return -1;
    uint32_t n;
    const msgpack_object *arr = NULL;
    if (nf >= 0) {
        if (dp_get(o->m, "chunks")) {
            dp_fail(o->err, DP_BAD_REQUEST, "a request with chunk_frames carries no chunks field");
            return -1;
        }
        if ((uint64_t)nf != o->nframes) {
            dp_fail(o->err, DP_BAD_REQUEST, "chunk_frames is %lld but %u frames follow the payload",
                    (long long)nf, o->nframes);
            return -1;
        }
        n = o->nframes;
    } else {
        if (o->nframes) {
            dp_fail(o->err, DP_BAD_REQUEST,
                    "%u frames follow the payload of a request without chunk_frames", o->nframes);
            return -1;
        }
        if (dp_array(o->m, "chunks", 1, &arr, &n, o->err) < 0) return -1;
    }
    if (n != want) {
        dp_fail(o->err, DP_BAD_REQUEST, "%u chunks sent for a range of %u chunks", n, want);
        return -1;
    }
    struct dp_blob *c = malloc((size_t)(n ? n : 1) * sizeof(*c));
    if (!c) {
        dp_fail(o->err, DP_OUT_OF_MEMORY, "out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (arr && arr[i].type != MSGPACK_OBJECT_BIN)
            c[i].len = 0;
        else if (arr)
            c[i] = (struct dp_blob){arr[i].via.bin.ptr, arr[i].via.bin.size};
        else
            c[i] = o->frames[i];
        if (c[i].len == 0) {
            dp_fail(o->err, DP_BAD_REQUEST,
                    arr ? "chunks[%u] must be non-empty bin" : "chunk frame %u is empty", i);
            free(c);
            return -1;
        }
    }
    *out = c;
    return 0;
}

int dp_op_store_bytes(struct op_ctx *o) {
    char model[KEYS_MODEL_NAME_MAX + 1];
    uint32_t ws, rank;
    struct engine_prompt cr;
    struct dp_blob *chunks = NULL;
    int rc = -1;
    if (op_parse_model(o, model, sizeof(model)) < 0 || parse_rank(o, &ws, &rank) < 0) return -1;
    memset(&cr, 0, sizeof(cr));
    if (!store_resumed(o)) metric_inc(o->e->dpm.stores_submitted, 1);
    if (op_parse_range(o, &cr, 1) < 0) goto out;
    uint32_t n = cr.end_chunk - cr.start_chunk;
    if (parse_bytes_chunks(o, n, &chunks) < 0) goto out;
    /* An object of another size than the registered layout's could never be retrieved into
     * it, while lookups would count it: refuse it here rather than poison the key. */
    struct kv_layout layout;
    if (engine_context_layout(o->e, model, ws, &layout) == 0) {
        uint64_t want = kv_object_bytes(&layout, (uint32_t)o->e->cfg->chunk_size);
        for (uint32_t i = 0; i < n; i++)
            if (chunks[i].len != want) {
                dp_fail(o->err, DP_BAD_REQUEST,
                        "chunks[%u] is %zu bytes; the KV layout registered for model_name "
                        "'%.256s' with world_size %u makes objects of %llu bytes",
                        i, chunks[i].len, model, ws, (unsigned long long)want);
                goto out;
            }
    }
    uint64_t t0 = clock_mono_ns();
    struct bin_src bs = {o->e->copypool, chunks};
    struct engine_source src = {
        .size = bin_size, .fill = bin_fill, .arg = &bs, .fill_many = bin_fill_many};
    if (parse_store_options(o, &src) < 0) goto out;
    struct engine_store_result res;
    int erc = engine_store(o->e, &cr, model, ws, rank, &src, o->now, &res, o->err->message,
                           sizeof(o->err->message));
    rc = store_replied(o, erc, &src, &res, model, t0, NULL);
out:
    free(chunks);
    op_range_free(&cr);
    return rc;
}

uint64_t dp_max_reply_bytes(const struct server_config *cfg) {
    long mb = cfg->max_reply_mb > 0 ? cfg->max_reply_mb : cfg->max_message_mb;
    return (uint64_t)mb << 20;
}

/* The body of a bin into the reply (reserved beforehand): copied straight into the buffer,
 * split with the copy pool. */
static void reply_bin_body(struct op_ctx *o, const void *data, uint64_t size) {
    msgpack_sbuffer *b = &o->r->buf;
    if (b->alloc - b->size < size) { /* not reserved: msgpack grows the buffer */
        msgpack_pack_bin_body(&o->r->pk, data, (size_t)size);
        return;
    }
    copypool_memcpy(o->e->copypool, b->data + b->size, data, (size_t)size);
    b->size += (size_t)size;
}

/* Frame release callbacks (run by libzmq's I/O thread, or the sender when a send fails). */
static void release_pin(void *data, void *hint) {
    (void)data;
    engine_unpin(hint, clock_mono_ns());
}

static void release_copy(void *data, void *hint) {
    (void)hint;
    free(data);
}

/* The chunk frames of a retrieve_bytes reply: each chunk sent straight from L1 under a reply
 * pin, or, once the pinned bytes are at --l1-pinned-reply-ratio, from a copy. Called with the
 * chunks read-locked; the pins outlive the locks. *copied counts the copies. */
static int chunk_frames(struct op_ctx *o, const struct engine_ref *refs, uint32_t n,
                        uint32_t *copied) {
    *copied = 0;
    if (n == 0) return 0;
    struct dp_frame *fr = calloc(n, sizeof(*fr));
    if (!fr) goto oom;
    for (uint32_t i = 0; i < n; i++) {
        struct engine_pin *pin = engine_pin(o->e, &refs[i], o->now);
        if (pin) {
            fr[i] = (struct dp_frame){(void *)refs[i].data, refs[i].size, release_pin, pin};
            continue;
        }
        void *c = malloc(refs[i].size);
        if (!c) {
            dp_frames_release(fr, i);
            goto oom;
        }
        copypool_memcpy(o->e->copypool, c, refs[i].data, refs[i].size);
        fr[i] = (struct dp_frame){c, refs[i].size, release_copy, NULL};
        (*copied)++;
    }
    o->r->frames = fr;
    o->r->nframes = n;
    return 0;
oom:
    dp_fail(o->err, DP_INTERNAL, "out of memory for the frames of %u chunks", n);
    return -1;
}

int dp_op_retrieve_bytes(struct op_ctx *o) {
    char model[KEYS_MODEL_NAME_MAX + 1], rid[ENGINE_REQUEST_ID_MAX + 1] = "";
    uint32_t ws, rank, got = 0;
    struct engine_prompt cr;
    struct engine_ref *refs = NULL;
    uint64_t t0 = clock_mono_ns(), bytes = 0;
    int rc = -1, frames = 0;
    if (op_parse_model(o, model, sizeof(model)) < 0 || parse_rank(o, &ws, &rank) < 0) return -1;
    memset(&cr, 0, sizeof(cr));
    metric_inc(o->e->dpm.retrieves_submitted, 1);
    if (dp_cstr(o->m, "request_id", 0, rid, sizeof(rid), o->err) < 0) goto out;
    if (dp_bool(o->m, "chunk_frames", 0, &frames, o->err) < 0) goto out;
    if (op_parse_range(o, &cr, 1) < 0) goto out;
    /* Lock the leading present chunks first, so the reply can be sized exactly (and held to
     * --max-reply-mb before it is built) and each chunk copied once, straight from L1 into the
     * reply -- or, with chunk_frames, pinned and sent from L1. */
    uint32_t want = cr.end_chunk - cr.start_chunk;
    uint64_t cap = dp_max_reply_bytes(o->e->cfg);
    refs = calloc(want ? want : 1, sizeof(*refs));
    if (!refs) {
        dp_fail(o->err, DP_INTERNAL, "out of memory");
        goto out;
    }
    for (uint32_t ch = cr.start_chunk; ch < cr.end_chunk; ch++) {
        int erc = engine_read(o->e, &cr, ch, model, ws, rank, op_owner(o), rid, o->now, &refs[got],
                              o->err->message, sizeof(o->err->message));
        if (erc == ENGINE_ERR_NOT_FOUND) break; /* the reply holds the leading present chunks */
        if (erc != ENGINE_OK) {
            op_engine_fail(o, erc);
            goto out;
        }
        /* bin32 header per chunk, plus the reply map's other fields */
        if (bytes + refs[got].size + (uint64_t)(got + 1) * 8 + 256 > cap) {
            engine_read_done(o->e, &refs[got], o->now);
            dp_fail(o->err, DP_TOO_LARGE,
                    "the %u chunks present from chunk %u on exceed --max-reply-mb (%llu bytes); "
                    "ask for fewer",
                    got + 1, cr.start_chunk, (unsigned long long)cap);
            goto out;
        }
        bytes += refs[got].size;
        got++;
    }
    if (frames) {
        uint32_t copied = 0;
        if (chunk_frames(o, refs, got, &copied) < 0) goto out;
        dp_put_int(o->r, "chunk_frames", got);
        dp_put_int(o->r, "copied_chunks", copied);
    } else {
        if (dp_reply_reserve(o->r, bytes + 16 + (size_t)got * 8) < 0) {
            dp_fail(o->err, DP_INTERNAL, "out of memory for a %llu-byte reply",
                    (unsigned long long)bytes);
            goto out;
        }
        dp_key(o->r, "chunks");
        msgpack_pack_array(&o->r->pk, got);
        for (uint32_t i = 0; i < got; i++) {
            msgpack_pack_bin(&o->r->pk, refs[i].size);
            reply_bin_body(o, refs[i].data, refs[i].size);
        }
    }
    observe_throughput(o->e, 0, model, bytes, t0);
    metric_inc(o->e->dpm.retrieves_finished, 1);
    rc = 0;
out:
    if (got) {
        uint64_t now = clock_mono_ns();
        for (uint32_t i = 0; i < got; i++) engine_read_done(o->e, &refs[i], now);
    }
    free(refs);
    op_range_free(&cr);
    return rc;
}
