/* The Redis store's command batches (struct batch, mstore_redis_internal.h) as the
 * operations build them: arguments copied into one buffer, key names of the schema, reply
 * helpers, and the per-operation latency timing. Private to mstore_redis*.c. */
#ifndef LMCACHE_MASTER_MSTORE_REDIS_BATCH_H
#define LMCACHE_MASTER_MSTORE_REDIS_BATCH_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/hash.h"
#include "base/metrics.h"
#include "master/mstore_redis_internal.h"

/* The timed store operations (mori_umbp_store_op_latency_seconds); OP_NAMES in
 * mstore_redis.c names them in this order. */
enum {
    OP_REGISTER,
    OP_UNREGISTER,
    OP_HEARTBEAT,
    OP_EXPIRE,
    OP_ALIVE_COUNT,
    OP_STATUS,
    OP_TAGS,
    OP_LIST_ALIVE,
    OP_XREPORT,
    OP_XREVOKE,
    OP_XREVOKE_TIER,
    OP_XREVOKE_NODE,
    OP_MATCH,
    OP_HITS,
    OP_HIT_GC,
    OP_XCOUNT,
    OP_ROUTE_GET,
    OP_EXISTS,
    OP_COUNT
};
_Static_assert(OP_COUNT <= sizeof(((struct rstore *)0)->m_lat) / sizeof(struct metric *),
               "m_lat holds every operation");

/* ---- command batches: every argument copied into one buffer, sent as one pipeline ---- */

static inline void b_free(struct batch *b) {
    rs_arena_free(&b->arena);
    free(b->buf);
    free(b->aoff);
    free(b->alen);
    free(b->c);
    memset(b, 0, sizeof(*b));
}

static inline void b_put(struct batch *b, const void *p, size_t n) {
    if (b->oom) return;
    if (b->blen + n > b->bcap) {
        size_t nc = b->bcap ? b->bcap : 4096;
        while (nc < b->blen + n) nc *= 2;
        char *nb = realloc(b->buf, nc);
        if (!nb) {
            b->oom = true;
            return;
        }
        b->buf = nb;
        b->bcap = nc;
    }
    if (n) memcpy(b->buf + b->blen, p, n);
    b->blen += n;
}

static inline void b_puts(struct batch *b, const char *s) { b_put(b, s, strlen(s)); }

static inline void b_end(struct batch *b) {
    if (b->oom) return;
    if (b->na == b->acap) {
        size_t nc = b->acap ? b->acap * 2 : 64;
        size_t *o = realloc(b->aoff, nc * sizeof(*o));
        if (o) b->aoff = o;
        size_t *l = realloc(b->alen, nc * sizeof(*l));
        if (l) b->alen = l;
        if (!o || !l) {
            b->oom = true;
            return;
        }
        b->acap = nc;
    }
    b->aoff[b->na] = b->astart;
    b->alen[b->na] = b->blen - b->astart;
    b->na++;
    b->c[b->nc - 1].argc++;
    b->astart = b->blen;
}

static inline void b_arg(struct batch *b, const void *p, size_t n) {
    b_put(b, p, n);
    b_end(b);
}

static inline void b_str(struct batch *b, const char *s) { b_arg(b, s, strlen(s)); }

static inline void b_u64(struct batch *b, uint64_t v) {
    char t[24];
    int n = snprintf(t, sizeof(t), "%llu", (unsigned long long)v);
    b_arg(b, t, (size_t)n);
}

static inline void b_i64(struct batch *b, int64_t v) {
    char t[24];
    int n = snprintf(t, sizeof(t), "%lld", (long long)v);
    b_arg(b, t, (size_t)n);
}

/* Room for ncmd commands, nargs arguments and bytes of them, so that a large batch does
 * not grow by doubling (false on no memory: the batch is then marked so). */
static inline void b_reserve(struct batch *b, size_t ncmd, size_t nargs, size_t bytes) {
    if (b->oom) return;
    if (ncmd > b->ccap) {
        struct bcmd *c = realloc(b->c, ncmd * sizeof(*c));
        if (c) {
            b->c = c;
            b->ccap = ncmd;
        }
    }
    if (nargs > b->acap) {
        size_t *o = realloc(b->aoff, nargs * sizeof(*o));
        if (o) b->aoff = o;
        size_t *l = o ? realloc(b->alen, nargs * sizeof(*l)) : NULL;
        if (l) {
            b->alen = l;
            b->acap = nargs;
        }
    }
    if (bytes > b->bcap) {
        char *nb = realloc(b->buf, bytes);
        if (nb) {
            b->buf = nb;
            b->bcap = bytes;
        }
    }
}

/* Starts a command: a plain one (name) or a script call with numkeys keys to follow, for
 * the endpoint of route (a shard, or ROUTE_CTL for the control keys). */
static inline void b_cmd(struct batch *b, uint32_t route, const char *name, int script,
                         size_t numkeys) {
    if (b->oom) return;
    if (b->nc == b->ccap) {
        size_t nc = b->ccap ? b->ccap * 2 : 8;
        struct bcmd *c = realloc(b->c, nc * sizeof(*c));
        if (!c) {
            b->oom = true;
            return;
        }
        b->c = c;
        b->ccap = nc;
    }
    b->c[b->nc++] = (struct bcmd){.a0 = b->na, .script = script, .route = route};
    b->astart = b->blen;
    if (script >= 0) {
        b_str(b, "EVALSHA");
        b_str(b, ""); /* the SHA, filled in at send time */
        b_u64(b, numkeys);
    } else {
        b_str(b, name);
    }
}

static inline int run(struct rstore *r, struct batch *b) { return rs_run(r, b, NULL); }

/* ---- key names ---- */

static inline uint32_t shard_of(const struct rstore *r, const void *p, size_t n) {
    return r->nshards == 1 ? 0 : fnv1a32(p, n) % r->nshards;
}

static inline void b_node_key(struct batch *b, const struct rstore *r, const char *id) {
    b_puts(b, r->ctl);
    b_puts(b, ":node:");
    b_puts(b, id);
    b_end(b);
}

static inline void b_shard_key(struct batch *b, const struct rstore *r, uint32_t s, const char *mid,
                               const void *p, size_t n, const char *tail) {
    b_puts(b, r->tag[s]);
    b_puts(b, mid);
    b_put(b, p, n);
    if (tail) b_puts(b, tail);
    b_end(b);
}

static inline void b_control_keys(struct batch *b, const struct rstore *r, const char *id) {
    b_node_key(b, r, id);
    b_str(b, r->k_alive);
    b_str(b, r->k_peers);
    b_str(b, r->k_expired);
}

/* ---- timing ---- */

#define OP_BEGIN(r) uint64_t op_t0_ = (r)->m_lat[0] ? clock_mono_ns() : 0
#define OP_END(r, op)                                                                              \
    do {                                                                                           \
        if ((r)->m_lat[op])                                                                        \
            metric_observe((r)->m_lat[op], (double)(clock_mono_ns() - op_t0_) / 1e9);              \
    } while (0)

static inline long long rep_int(const redisReply *rep) {
    if (!rep) return 0;
    if (rep->type == REDIS_REPLY_INTEGER) return rep->integer;
    if (rep->type == REDIS_REPLY_STRING) return strtoll(rep->str, NULL, 10);
    return 0;
}

#endif
