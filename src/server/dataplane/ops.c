/* The data-plane operations of docs/protocol.md: one table, one handler per operation. A
 * handler decodes its fields, calls the engine API (engine.h) and the KV-context copies
 * (kvctx.h), and fills the reply; on failure it sets err and returns -1 (the reply then carries
 * ok=false, code, message plus whatever counts the handler already put). Errors inside a
 * handler go to one cleanup label; a handler with nothing to clean up returns at once.
 * Here: the table and the running of a request (handle, parking), the fields most requests
 * share (the chunk range, model_name), lookups and sessions, and the small operations; the
 * handlers that move KV are in ops_kv.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/metrics.h"
#include "server/dataplane/dataplane.h"
#include "server/dataplane/ops.h"
#include "server/dataplane/wire.h"
#include "server/engine.h"
#include "server/keys.h"

/* The key sessions are bound to: the connection's (all zero for an anonymous peer). */
const uint8_t *op_owner(const struct op_ctx *o) {
    static const uint8_t anonymous[ENGINE_OWNER_LEN];
    return o->peer ? o->peer->key : anonymous;
}

/* The reply code of an engine failure (its message is already in o->err). */
int op_engine_fail(struct op_ctx *o, int rc) {
    o->err->code = rc == ENGINE_ERR_FULL             ? DP_OUT_OF_MEMORY
                   : rc == ENGINE_ERR_TOO_MANY_NAMES ? DP_TOO_MANY_NAMES
                   : rc == ENGINE_ERR_INVAL          ? DP_BAD_REQUEST
                   : rc == ENGINE_ERR_SOURCE         ? DP_SHM_ERROR
                   : rc == ENGINE_ERR_NOT_FOUND      ? DP_NOT_FOUND
                   : rc == ENGINE_ERR_LIMIT          ? DP_TOO_LARGE
                                                     : DP_INTERNAL;
    return -1;
}

/* ---- chunk fields: token_ids | chunk_hashes, start, end, cache_salt ---- */

void op_range_free(struct engine_prompt *cr) {
    free(cr->hashes);
    free(cr->hash_len);
}

/* Orders chunk hashes by (length, bytes) to find repeats. */
struct hash_ref {
    const uint8_t *h;
    uint8_t len;
    uint32_t idx;
};

static int hash_ref_cmp(const void *a, const void *b) {
    const struct hash_ref *x = a, *y = b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    int c = memcmp(x->h, y->h, x->len);
    if (c) return c;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* A chunk named twice in one range would be locked, copied or replied twice: every count and
 * size a request causes must follow from distinct objects. */
static int check_distinct(struct op_ctx *o, const struct engine_prompt *cr) {
    uint32_t n = cr->end_chunk - cr->start_chunk;
    int rc = -1;
    if (n < 2) return 0;
    struct hash_ref *v = malloc((size_t)n * sizeof(*v));
    if (!v) {
        dp_fail(o->err, DP_INTERNAL, "out of memory");
        return -1;
    }
    for (uint32_t i = 0; i < n; i++) {
        v[i].h = cr->hashes[cr->start_chunk + i];
        v[i].len = cr->hash_len[cr->start_chunk + i];
        v[i].idx = cr->start_chunk + i;
    }
    qsort(v, n, sizeof(*v), hash_ref_cmp);
    for (uint32_t i = 1; i < n; i++)
        if (v[i].len == v[i - 1].len && !memcmp(v[i].h, v[i - 1].h, v[i].len)) {
            dp_fail(o->err, DP_BAD_REQUEST, "chunk_hashes[%u] repeats chunk_hashes[%u]", v[i].idx,
                    v[i - 1].idx);
            goto out;
        }
    rc = 0;
out:
    free(v);
    return rc;
}

/* ranks: objects per chunk the operation touches (world_size for lookup, else 1). Every
 * allocation is sized by the chunks of the prompt up to `end` (what the client sent) and the
 * range is held to --max-request-objects before anything proportional to it is allocated. On
 * failure nothing stays allocated. */
int op_parse_range(struct op_ctx *o, struct engine_prompt *cr, uint32_t ranks) {
    memset(cr, 0, sizeof(*cr));
    uint32_t cs = (uint32_t)o->e->cfg->chunk_size;
    if (dp_cstr(o->m, "cache_salt", 0, cr->salt, sizeof(cr->salt), o->err) < 0) goto fail;
    if (keys_check_cache_salt(cr->salt, strlen(cr->salt), o->err->message,
                              sizeof(o->err->message)) < 0) {
        o->err->code = DP_BAD_REQUEST;
        goto fail;
    }
    const msgpack_object *hv = dp_get(o->m, "chunk_hashes");
    const msgpack_object *tv = dp_get(o->m, "token_ids");
    if (hv && tv) {
        dp_fail(o->err, DP_BAD_REQUEST, "send either 'token_ids' or 'chunk_hashes', not both");
        goto fail;
    }
    if (!hv && !tv) {
        dp_fail(o->err, DP_BAD_REQUEST, "missing required field 'token_ids' (or 'chunk_hashes')");
        goto fail;
    }
    const msgpack_object *arr = hv ? hv : tv;
    if (arr->type != MSGPACK_OBJECT_ARRAY) {
        dp_fail(o->err, DP_BAD_REQUEST, "field '%s' must be an array",
                hv ? "chunk_hashes" : "token_ids");
        goto fail;
    }
    uint64_t total = hv ? arr->via.array.size : arr->via.array.size / cs; /* chunks sent */
    if (total > DP_MAX_PROMPT_CHUNKS) {
        dp_fail(o->err, DP_TOO_LARGE, "the prompt has %llu chunks, over the limit of %u",
                (unsigned long long)total, DP_MAX_PROMPT_CHUNKS);
        goto fail;
    }
    int64_t start = 0, end = (int64_t)total * cs;
    if (dp_int(o->m, "start", 0, 0, INT64_MAX, &start, o->err) < 0) goto fail;
    if (dp_int(o->m, "end", 0, 0, INT64_MAX, &end, o->err) < 0) goto fail;
    if (start % cs) {
        dp_fail(o->err, DP_BAD_REQUEST, "start %lld is not a multiple of chunk_size %u",
                (long long)start, cs);
        goto fail;
    }
    uint64_t end_chunk = (uint64_t)end / cs;
    if (end_chunk > total) end_chunk = total;
    if ((uint64_t)start / cs > end_chunk) {
        dp_fail(o->err, DP_BAD_REQUEST, "start is beyond end");
        goto fail;
    }
    cr->start_chunk = (uint32_t)(start / cs);
    cr->end_chunk = (uint32_t)end_chunk;
    uint64_t objects = (uint64_t)(cr->end_chunk - cr->start_chunk) * ranks;
    if (o->small_objects && objects > o->small_objects) { /* not here: on a worker */
        o->deferred = 1;
        goto fail;
    }
    if (objects > (uint64_t)o->e->cfg->max_request_objects) {
        dp_fail(o->err, DP_TOO_LARGE,
                "%u chunks x %u ranks = %llu objects, over --max-request-objects %ld",
                cr->end_chunk - cr->start_chunk, ranks, (unsigned long long)objects,
                o->e->cfg->max_request_objects);
        goto fail;
    }
    /* Hashes of chunks [0, end_chunk) only: chunks past the range are never needed. */
    uint32_t nh = cr->end_chunk;
    cr->hashes = calloc(nh ? nh : 1, sizeof(*cr->hashes));
    cr->hash_len = calloc(nh ? nh : 1, 1);
    if (!cr->hashes || !cr->hash_len) {
        dp_fail(o->err, DP_INTERNAL, "out of memory");
        goto fail;
    }
    if (hv) {
        for (uint32_t i = 0; i < hv->via.array.size; i++) {
            const msgpack_object *h = &hv->via.array.ptr[i];
            const char *p = h->type == MSGPACK_OBJECT_BIN ? h->via.bin.ptr : NULL;
            uint32_t n = h->type == MSGPACK_OBJECT_BIN ? h->via.bin.size : 0;
            if (!p || n == 0 || n > KEYS_HASH_LEN) {
                dp_fail(o->err, DP_BAD_REQUEST, "chunk_hashes[%u] must be bin of 1..32 bytes", i);
                goto fail;
            }
            if (i < nh) {
                memcpy(cr->hashes[i], p, n);
                cr->hash_len[i] = (uint8_t)n;
            }
        }
    } else {
        uint32_t *tokens = NULL, ntok = 0;
        if (dp_u32_array(o->m, "token_ids", 1, &tokens, &ntok, o->err) < 0) goto fail;
        long got = keys_prefix_hashes(o->e->seed, tokens, ntok, cs, cr->hashes, nh);
        free(tokens);
        if (got < 0 || (uint32_t)got != nh) {
            dp_fail(o->err, DP_INTERNAL, "hashing failed");
            goto fail;
        }
        memset(cr->hash_len, KEYS_HASH_LEN, nh ? nh : 1);
    }
    if (hv && check_distinct(o, cr) < 0) goto fail;
    return 0;
fail:
    op_range_free(cr);
    memset(cr, 0, sizeof(*cr));
    return -1;
}

int op_parse_model(struct op_ctx *o, char *model, size_t cap) {
    if (dp_cstr(o->m, "model_name", 1, model, cap, o->err) < 0) return -1;
    if (keys_check_model_name(model, strlen(model), o->err->message, sizeof(o->err->message)) < 0) {
        o->err->code = DP_BAD_REQUEST;
        return -1;
    }
    return 0;
}

/* ---- lookup sessions ---- */

/* On the loop thread (small_objects set), a request that would release the locks of a session
 * spanning more objects than that is left to a worker: a lookup replacing a session of the same
 * id, free_lookup_locks and end_session each do one L1 call per object. */
static int session_too_big(struct op_ctx *o, const char *rid) {
    if (!o->small_objects || engine_session_objects(o->e, op_owner(o), rid) <= o->small_objects)
        return 0;
    o->deferred = 1;
    return 1;
}

static int op_lookup(struct op_ctx *o) {
    char model[KEYS_MODEL_NAME_MAX + 1], rid[ENGINE_REQUEST_ID_MAX + 1];
    int64_t ws = 1, readers = 1;
    struct engine_prompt cr;
    if (dp_cstr(o->m, "request_id", 1, rid, sizeof(rid), o->err) < 0) return -1;
    if (op_parse_model(o, model, sizeof(model)) < 0) return -1;
    if (dp_int(o->m, "world_size", 0, 1, 255, &ws, o->err) < 0) return -1;
    if (dp_int(o->m, "num_kv_readers", 0, 1, DP_MAX_KV_READERS, &readers, o->err) < 0) return -1;
    if (op_parse_range(o, &cr, (uint32_t)ws) < 0) return -1;
    if (session_too_big(o, rid)) {
        op_range_free(&cr);
        return -1;
    }
    int status = 0;
    if (dp_bool(o->m, "reply_status", 0, &status, o->err) < 0) {
        op_range_free(&cr);
        return -1;
    }
    int rc = engine_lookup(o->e, op_owner(o), rid, &cr, model, (uint32_t)ws, (uint32_t)readers,
                           o->now, o->err->message, sizeof(o->err->message));
    op_range_free(&cr);
    if (rc != ENGINE_OK) return op_engine_fail(o, rc);
    if (status) { /* the session's first status, as query_prefetch_status would report it */
        uint32_t hits = 0;
        int ready = engine_lookup_status(o->e, op_owner(o), rid, &hits);
        dp_put_bool(o->r, "ready", ready);
        if (ready) dp_put_int(o->r, "hit_chunks", hits);
    }
    return 0;
}

static int op_query_prefetch(struct op_ctx *o) {
    char rid[ENGINE_REQUEST_ID_MAX + 1];
    if (dp_cstr(o->m, "request_id", 1, rid, sizeof(rid), o->err) < 0) return -1;
    uint32_t hits = 0;
    int ready = engine_lookup_status(o->e, op_owner(o), rid, &hits);
    dp_put_bool(o->r, "ready", ready);
    if (ready) dp_put_int(o->r, "hit_chunks", hits);
    return 0;
}

static int op_free_lookup_locks(struct op_ctx *o) {
    char rid[ENGINE_REQUEST_ID_MAX + 1];
    int64_t start = 0, end = INT64_MAX, worker = -1;
    if (dp_cstr(o->m, "request_id", 1, rid, sizeof(rid), o->err) < 0) return -1;
    if (dp_int(o->m, "start", 0, 0, INT64_MAX, &start, o->err) < 0) return -1;
    if (dp_int(o->m, "end", 0, 0, INT64_MAX, &end, o->err) < 0) return -1;
    if (dp_int(o->m, "worker_id", 0, 0, 254, &worker, o->err) < 0) return -1;
    if (session_too_big(o, rid)) return -1;
    uint64_t cs = (uint64_t)o->e->cfg->chunk_size;
    uint64_t from = (uint64_t)start / cs, to = ((uint64_t)end + cs - 1) / cs;
    uint64_t n = engine_lookup_release(o->e, op_owner(o), rid,
                                       from > UINT32_MAX ? UINT32_MAX : (uint32_t)from,
                                       to > UINT32_MAX ? UINT32_MAX : (uint32_t)to, worker);
    dp_put_int(o->r, "released", (int64_t)n);
    return 0;
}

static int op_end_session(struct op_ctx *o) {
    char rid[ENGINE_REQUEST_ID_MAX + 1];
    if (dp_cstr(o->m, "request_id", 1, rid, sizeof(rid), o->err) < 0) return -1;
    if (session_too_big(o, rid)) return -1;
    engine_end_session(o->e, op_owner(o), rid);
    return 0;
}

/* ---- small operations ---- */

static int op_clear(struct op_ctx *o) {
    dp_put_int(o->r, "cleared", (int64_t)engine_clear_l1(o->e));
    return 0;
}

static int op_get_chunk_size(struct op_ctx *o) {
    dp_put_int(o->r, "chunk_size", o->e->cfg->chunk_size);
    return 0;
}

static int op_ping(struct op_ctx *o) {
    int64_t id = -1;
    if (dp_int(o->m, "instance_id", 0, 0, INT64_MAX, &id, o->err) < 0) return -1;
    if (id >= 0) {
        int warm = KV_WARM_OFF;
        int known = engine_context_ping(o->e, id, o->peer ? op_owner(o) : NULL, o->now, &warm) == 0;
        dp_put_int(o->r, "instance_id", id);
        dp_put_bool(o->r, "registered", known);
        if (known) dp_put_bool(o->r, "warming", warm == KV_WARM_QUEUED);
    }
    dp_put_double(o->r, "server_time", clock_wall());
    return 0;
}

static int op_noop(struct op_ctx *o) {
    dp_put_str(o->r, "result", "OK");
    return 0;
}

/* small: the operation's work is bounded by a small payload, or by the objects of its range
 * (held to the caller's limit by op_parse_range), so the loop thread may run it (dataplane.c).
 * clear (all of L1), register (maps shared memory) and the copies never are. */
static const struct dp_op {
    const char *name;
    int (*fn)(struct op_ctx *o);
    int small;
} OPS[] = {
    {"register_kv_cache", dp_op_register, 0},
    {"unregister_kv_cache", dp_op_unregister, 0},
    {"lookup", op_lookup, 1},
    {"query_prefetch_status", op_query_prefetch, 1},
    {"retrieve", dp_op_retrieve, 0},
    {"store", dp_op_store, 0},
    {"store_bytes", dp_op_store_bytes, 0},
    {"retrieve_bytes", dp_op_retrieve_bytes, 0},
    {"free_lookup_locks", op_free_lookup_locks, 1},
    {"end_session", op_end_session, 1},
    {"clear", op_clear, 0},
    {"get_chunk_size", op_get_chunk_size, 1},
    {"ping", op_ping, 1},
    {"noop", op_noop, 1},
};

static const struct dp_op *find_op(const char *op, size_t oplen) {
    for (size_t i = 0; i < sizeof(OPS) / sizeof(OPS[0]); i++)
        if (strlen(OPS[i].name) == oplen && memcmp(OPS[i].name, op, oplen) == 0) return &OPS[i];
    return NULL;
}

static int handle(struct engine *e, const struct dp_peer *peer, const char *op, size_t oplen,
                  const void *payload, size_t len, const struct dp_blob *frames, uint32_t nframes,
                  uint32_t small_objects, struct dp_park *park, struct dp_reply *reply);

void dataplane_handle(struct engine *e, const char *op, size_t oplen, const void *payload,
                      size_t len, struct dp_reply *reply) {
    dataplane_handle_peer(e, NULL, op, oplen, payload, len, NULL, 0, reply);
}

void dataplane_handle_peer(struct engine *e, const struct dp_peer *peer, const char *op,
                           size_t oplen, const void *payload, size_t len,
                           const struct dp_blob *frames, uint32_t nframes, struct dp_reply *reply) {
    (void)handle(e, peer, op, oplen, payload, len, frames, nframes, 0, NULL, reply);
}

int dataplane_handle_parkable(struct engine *e, const struct dp_peer *peer, const char *op,
                              size_t oplen, const void *payload, size_t len,
                              const struct dp_blob *frames, uint32_t nframes, struct dp_park *park,
                              struct dp_reply *reply) {
    park->wait = NULL;
    handle(e, peer, op, oplen, payload, len, frames, nframes, 0, park, reply);
    return park->again ? DP_RUN_AGAIN : park->wait ? DP_WAIT_L2 : DP_DONE;
}

int dataplane_op_small(const char *op, size_t oplen) {
    const struct dp_op *d = find_op(op, oplen);
    return d && d->small;
}

int dataplane_handle_small(struct engine *e, const struct dp_peer *peer, const char *op,
                           size_t oplen, const void *payload, size_t len, uint32_t max_objects,
                           struct dp_reply *reply) {
    const struct dp_op *d = find_op(op, oplen);
    if (!d || !d->small || len > DP_SMALL_MAX_BYTES || max_objects == 0) return 0;
    return handle(e, peer, op, oplen, payload, len, NULL, 0, max_objects, NULL, reply);
}

/* The request's metrics, and the reply map closed. */
static void finish(struct engine *e, const char *name, int ok, const struct dp_err *err,
                   uint64_t t0, struct dp_reply *reply) {
    const char *labels[] = {name, ok ? "ok" : (err->code ? err->code : DP_INTERNAL)};
    metrics_add(e->dpm.requests, labels, 1);
    const char *dl[] = {name};
    metric_observe(metric_labels(e->dpm.duration, dl), (double)(clock_mono_ns() - t0) / 1e9);
    if (!ok) log_debug(e->lg_dp, "%s failed: %s: %s", name, err->code, err->message);
    size_t n;
    dp_finish(reply, ok, err, &n);
}

/* Runs one request; 0 (nothing done, the reply untouched) when small_objects is set and the
 * request's range holds more objects, else 1 with the reply complete (or, with park->wait set,
 * to be finished by dataplane_finish_parked). */
static int handle(struct engine *e, const struct dp_peer *peer, const char *op, size_t oplen,
                  const void *payload, size_t len, const struct dp_blob *frames, uint32_t nframes,
                  uint32_t small_objects, struct dp_park *park, struct dp_reply *reply) {
    struct dp_err err = {NULL, ""};
    const struct dp_op *d = find_op(op, oplen);
    uint64_t t0 = park && park->store ? park->t0 : clock_mono_ns();
    int ok = 0;
    if (park) park->again = 0;
    if (!d) {
        /* Echo the name printable-ASCII only: the reply's strings must stay valid UTF-8. */
        char shown[4 * 64 + 1];
        size_t k = 0;
        for (size_t i = 0; i < oplen && i < 64; i++) {
            unsigned char ch = (unsigned char)op[i];
            k += (size_t)snprintf(shown + k, sizeof(shown) - k,
                                  ch >= 0x20 && ch < 0x7f && ch != '\\' ? "%c" : "\\x%02x", ch);
        }
        dp_fail(&err, DP_UNKNOWN_OPERATION, "unknown operation '%s'", shown);
    } else {
        msgpack_unpacked up;
        msgpack_unpacked_init(&up);
        struct dp_map m = {0};
        int deferred = 0;
        if (nframes && d->fn != dp_op_store_bytes) {
            dp_fail(&err, DP_BAD_REQUEST,
                    "a %s request has 3 frames (request id, operation, payload), got %u; only "
                    "store_bytes with chunk_frames carries frames after the payload",
                    d->name, 3 + nframes);
        } else if (dp_decode(payload, len, &up, &m, &err) == 0) {
            struct op_ctx o = {e, &m,     reply,   &err, clock_mono_ns(), peer, small_objects,
                               0, frames, nframes, park};
            ok = d->fn(&o) == 0;
            deferred = o.deferred;
        }
        msgpack_unpacked_destroy(&up);
        dp_map_free(&m);
        if (deferred) return 0;    /* the handler failed before touching anything */
        if (park && park->again) { /* parked by the engine: to run again */
            park->t0 = t0;
            return 1;
        }
        if (park && park->store) { /* a resumed store that failed before the engine took it */
            engine_store_abandon(e, park->store);
            park->store = NULL;
        }
        if (park && park->wait) { /* finished by dataplane_finish_parked */
            park->ok = ok;
            park->err = err;
            park->op = d->name;
            park->t0 = t0;
            return 1;
        }
    }
    finish(e, d ? d->name : "unknown", ok, &err, t0, reply);
    return 1;
}

void dataplane_finish_parked(struct engine *e, struct dp_park *park, struct dp_reply *reply) {
    dp_put_int(reply, "l2_stored_chunks", engine_l2_wait_end(e, park->wait));
    park->wait = NULL;
    finish(e, park->op, park->ok, &park->err, park->t0, reply);
}
