/* The engine's request path (engine.h): prompts turned into object keys, store and read with
 * their write-through waits, reply pins, lookup sessions with their L2 prefetches, KV contexts
 * and warm prefetch. engine.c holds the life cycle, metrics, status and administration. */
#include "server/engine.h"
#include "server/engine_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "base/errbuf.h"
#include "base/log.h"
#include "base/metrics.h"
#include "server/keys.h"
#include "server/l1/l1.h"
#include "server/l2/controller.h"

/* Releases what a lookup session still holds and frees it. touch: end_session marks its
 * objects as recently used. */
void engine_session_release(struct engine *e, struct session *s, int touch) {
    uint64_t now = clock_mono_ns();
    size_t n = (size_t)s->locked_chunks * s->world_size;
    for (size_t i = 0; i < n; i++) {
        if (touch) l1_touch(e->l1, &s->objs[i].key, now);
        if (s->objs[i].locks) l1_finish_read(e->l1, &s->objs[i].key, s->objs[i].locks, now);
    }
    session_free(s);
}

/* The session table hands locks back through this (after dropping its lock). */
static void release_locks(const struct l1_key *key, uint32_t locks, void *arg) {
    struct engine *e = arg;
    l1_finish_read(e->l1, key, locks, clock_mono_ns());
}

/* A store waiting for the write-through of the chunks it stored (engine_store, wait_l2_ns). */
struct engine_l2_wait {
    struct engine_l2_wait *next;
    struct l1_key *keys; /* owned by an asynchronous wait, else the caller's */
    uint8_t *state;      /* per key: 0 in flight, 1 stored by every adapter, 2 failed or dropped */
    size_t n, left;
    uint64_t deadline_ns;
    void (*notify)(void *arg); /* an asynchronous wait: called when left reaches 0 */
    void *notify_arg;
    bool notified;
};

static bool l1_key_same(const struct l1_key *a, const struct l1_key *b) {
    return a->hash_len == b->hash_len && !memcmp(a->hash, b->hash, a->hash_len) &&
           a->kv_rank == b->kv_rank && a->object_group_id == b->object_group_id &&
           a->model_id == b->model_id && a->salt_id == b->salt_id && a->model_gen == b->model_gen &&
           a->salt_gen == b->salt_gen;
}

/* The controller's store_done: marks the key in every waiting store that queued it. The scan
 * is over waiting stores only (one per worker, plus at most DP_MAX_PARKED parked on each), so
 * write-through nobody waits for costs a lock. */
void engine_l2_store_done(void *arg, const struct l1_key *key, int ok) {
    struct engine *e = arg;
    pthread_mutex_lock(&e->l2w_mu);
    bool wake = false;
    for (struct engine_l2_wait *w = e->l2w_head; w; w = w->next)
        for (size_t i = 0; i < w->n; i++)
            if (!w->state[i] && l1_key_same(&w->keys[i], key)) {
                w->state[i] = ok ? 1 : 2;
                if (--w->left == 0) {
                    if (!w->notify)
                        wake = true;
                    else if (!w->notified) {
                        w->notified = true;
                        w->notify(w->notify_arg);
                    }
                }
                break;
            }
    if (wake) pthread_cond_broadcast(&e->l2w_cv);
    pthread_mutex_unlock(&e->l2w_mu);
}

static void l2w_unlink(struct engine *e, struct engine_l2_wait *w) {
    for (struct engine_l2_wait **pp = &e->l2w_head; *pp; pp = &(*pp)->next)
        if (*pp == w) {
            *pp = w->next;
            break;
        }
}

static int64_t l2w_stored(const struct engine_l2_wait *w) {
    int64_t stored = 0;
    for (size_t i = 0; i < w->n; i++) stored += w->state[i] == 1;
    return stored;
}

/* Queues keys[0..n) for write-through and, with wait_ns, waits until every one of them is
 * stored in every adapter, failed, or wait_ns passed. Returns the number stored everywhere
 * (0 without wait_ns). With src->l2_notify the wait is handed to the caller instead (*async). */
static int64_t l2_store_and_wait(struct engine *e, const struct keys_object_key *okeys,
                                 const struct l1_key *keys, size_t n, uint64_t wait_ns,
                                 const struct engine_source *src, struct engine_l2_wait **async) {
    struct engine_l2_wait *w = NULL, local = {0};
    if (wait_ns && src->l2_notify) {
        w = calloc(1, sizeof(*w));
        if (w) {
            w->state = calloc(n, 1);
            w->keys = malloc(n * sizeof(*keys));
            if (!w->state || !w->keys) {
                free(w->state);
                free(w->keys);
                free(w);
                w = NULL;
            } else {
                memcpy(w->keys, keys, n * sizeof(*keys));
                w->notify = src->l2_notify;
                w->notify_arg = src->l2_notify_arg;
            }
        }
    } else if (wait_ns) {
        local.state = calloc(n, 1);
        local.keys = (struct l1_key *)keys;
        if (local.state) w = &local;
    }
    if (w) {
        w->n = w->left = n;
        w->deadline_ns = clock_mono_ns() + wait_ns;
        pthread_mutex_lock(&e->l2w_mu);
        w->next = e->l2w_head;
        e->l2w_head = w;
        pthread_mutex_unlock(&e->l2w_mu);
    }
    size_t took = l2ctl_store(e->l2ctl, okeys, keys, n);
    if (!w) return 0;
    pthread_mutex_lock(&e->l2w_mu);
    for (size_t i = took; i < n; i++) /* refused by a full queue: they will never be written */
        if (!w->state[i]) {
            w->state[i] = 2;
            w->left--;
        }
    if (w != &local) { /* the caller waits: told when the last one settles */
        if (w->left == 0 && !w->notified) {
            w->notified = true;
            w->notify(w->notify_arg);
        }
        pthread_mutex_unlock(&e->l2w_mu);
        *async = w;
        return 0;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + wait_ns;
    until.tv_sec += (time_t)(ns / 1000000000u);
    until.tv_nsec = (long)(ns % 1000000000u);
    while (w->left && pthread_cond_timedwait(&e->l2w_cv, &e->l2w_mu, &until) == 0) {
    }
    l2w_unlink(e, w);
    pthread_mutex_unlock(&e->l2w_mu);
    int64_t stored = l2w_stored(w);
    free(w->state);
    return stored;
}

uint64_t engine_l2_wait_deadline(const struct engine_l2_wait *w) { return w->deadline_ns; }

int64_t engine_l2_wait_end(struct engine *e, struct engine_l2_wait *w) {
    pthread_mutex_lock(&e->l2w_mu);
    l2w_unlink(e, w);
    pthread_mutex_unlock(&e->l2w_mu);
    int64_t stored = l2w_stored(w);
    free(w->state);
    free(w->keys);
    free(w);
    return stored;
}

/* ---- prompts: the one place that turns chunks into object keys ---- */

/* The key of chunk c of p for one rank. intern: a store's or a prefetch's key (prefetches
 * create objects), which adds the model and salt names; otherwise a read's key, which adds
 * nothing (an unknown name gives a key no object has, so the read misses). okey (may be NULL)
 * gets the ObjectKey. */
static int prompt_key(struct engine *e, const struct engine_prompt *p, uint32_t c,
                      const char *model, uint32_t world_size, uint32_t rank, bool intern,
                      struct keys_object_key *okey, struct l1_key *out, char *err, size_t errlen) {
    struct keys_object_key k;
    memset(&k, 0, sizeof(k));
    memcpy(k.hash, p->hashes[c], p->hash_len[c]);
    k.hash_len = p->hash_len[c];
    if (keys_kv_rank_pack(world_size, rank, &k.kv_rank, err, errlen) < 0) return ENGINE_ERR_INVAL;
    snprintf(k.model_name, sizeof(k.model_name), "%s", model);
    snprintf(k.cache_salt, sizeof(k.cache_salt), "%s", p->salt);
    if (!intern) {
        l1_key_lookup(e->l1, &k, out);
    } else if (l1_key_make(e->l1, &k, out) != L1_OK) {
        errbuf_set(err, errlen, "too many distinct model names or cache salts in use");
        return ENGINE_ERR_TOO_MANY_NAMES;
    }
    if (okey) *okey = k;
    return ENGINE_OK;
}

/* The per-rank expansion of chunks [from, to) of p: every rank of world_size for each chunk in
 * turn (chunk-major, the order lookups lock in), interned, into keys/l1keys
 * ((to - from) * world_size of each). What lookups and warm prefetches hand to L2. */
static int prompt_keys(struct engine *e, const struct engine_prompt *p, uint32_t from, uint32_t to,
                       const char *model, uint32_t world_size, struct keys_object_key *keys,
                       struct l1_key *l1keys, char *err, size_t errlen) {
    size_t n = 0;
    for (uint32_t c = from; c < to; c++)
        for (uint32_t r = 0; r < world_size; r++, n++) {
            int rc =
                prompt_key(e, p, c, model, world_size, r, true, &keys[n], &l1keys[n], err, errlen);
            if (rc != ENGINE_OK) return rc;
        }
    return ENGINE_OK;
}

/* ---- store / read ---- */

/* Whether a resident key holds an object of `size` bytes (true when it vanished meanwhile). */
static bool resident_size_is(struct engine *e, const struct l1_key *key, uint64_t size) {
    struct l1_ref r;
    uint64_t now = clock_mono_ns();
    if (l1_reserve_read(e->l1, key, 1, now, &r) != L1_OK) return true;
    bool same = r.size == size;
    l1_finish_read(e->l1, key, 1, now);
    return same;
}

/* Between two tries of a wait for another writer: 20 us, doubling up to 2 ms (a chunk copy takes
 * micro- to milliseconds; L1 has no wake-up for this). */
#define STORE_POLL_FIRST_NS (20ull * 1000)
#define STORE_POLL_MAX_NS   (2ull * 1000 * 1000)

/* Sets the wait's deadline at its first use: true while the store may still wait. */
static bool wait_left(uint64_t *deadline, uint64_t now) {
    if (!*deadline) *deadline = now + ENGINE_STORE_WAIT_NS;
    return now < *deadline;
}

/* l1_reserve_write that waits for a concurrent writer of the same key instead of answering
 * L1_ERR_BUSY at once: until that writer finished (L1_EXISTS), failed (L1_OK: this caller
 * writes it) or *deadline passed (L1_ERR_BUSY), polling with a growing sleep. With replace, a
 * resident object of another size is deleted (once no one reads it) and written again.
 * *deadline is 0 until the first wait of the store sets it, so one store waits
 * ENGINE_STORE_WAIT_NS at most. wait false: L1_ERR_BUSY at once instead of waiting. */
static int reserve_or_wait(struct engine *e, const struct l1_key *key, uint64_t size, bool replace,
                           bool wait, uint64_t *deadline, struct l1_ref *ref) {
    uint64_t sleep_ns = STORE_POLL_FIRST_NS;
    for (;;) {
        uint64_t now = clock_mono_ns();
        int w = l1_reserve_write(e->l1, key, size, false, now, ref);
        if (w == L1_EXISTS && replace && !resident_size_is(e, key, size)) {
            if (l1_delete(e->l1, key, false, now) == L1_OK) continue;
            w = L1_ERR_BUSY; /* read-locked: wait for its readers */
        }
        if (w != L1_ERR_BUSY || !wait || !wait_left(deadline, now)) return w;
        struct timespec ts = {0, (long)sleep_ns};
        nanosleep(&ts, NULL);
        if (sleep_ns < STORE_POLL_MAX_NS) sleep_ns *= 2;
    }
}

/* A store in progress: its counts, what it stored for the write-through, and where it goes on
 * (on the caller's stack, or kept between the calls of a resumable store). */
struct engine_store_state {
    uint32_t n;    /* chunks of the range */
    uint32_t next; /* the chunk (index in the range) a resumed call starts with */
    struct engine_store_result res;
    uint64_t deadline; /* of the wait for other writers (0: not waited yet) */
    uint64_t retry_at; /* a parked store: when to call again */
    uint64_t poll_ns;
    /* what was admitted, for the write-through (NULL: none) */
    struct keys_object_key *wt_keys;
    struct l1_key *wt_l1keys;
    size_t nwt;
};

/* The chunks a store reserved and has not filled yet. */
struct store_batch {
    uint32_t n;
    uint64_t bytes;
    uint32_t idx[ENGINE_STORE_BATCH];
    void *dst[ENGINE_STORE_BATCH];
    uint64_t size[ENGINE_STORE_BATCH];
    struct l1_key key[ENGINE_STORE_BATCH];
    struct l1_ref ref[ENGINE_STORE_BATCH];
    struct keys_object_key okey[ENGINE_STORE_BATCH];
};

/* Fills the batch (one fill_many, or chunk by chunk), then finishes the writes of the chunks
 * filled and aborts the others. ENGINE_OK, or ENGINE_ERR_SOURCE with err. */
static int store_flush(struct engine *e, const struct engine_prompt *p,
                       const struct engine_source *src, struct store_batch *b,
                       struct engine_store_state *st, char *err, size_t errlen) {
    uint32_t done = 0;
    int bad = 0;
    if (b->n == 0) return ENGINE_OK;
    if (src->fill_many && b->n > 1) {
        bad = src->fill_many(src->arg, b->idx, b->dst, b->n, &done) != 0;
        if (!bad) done = b->n;
        if (done >= b->n) done = bad ? b->n - 1 : b->n;
    } else {
        for (; done < b->n; done++)
            if (src->fill(src->arg, b->idx[done], b->dst[done]) < 0) {
                bad = 1;
                break;
            }
    }
    uint64_t now = clock_mono_ns();
    for (uint32_t j = 0; j < b->n; j++) {
        if (j >= done) {
            l1_abort_write(e->l1, &b->key[j], b->ref[j].token);
            continue;
        }
        if (l1_finish_write(e->l1, &b->key[j], b->ref[j].token, 0, now) == L1_OK) {
            st->res.stored++;
            st->res.bytes += b->size[j];
            if (st->wt_keys) {
                st->wt_keys[st->nwt] = b->okey[j];
                st->wt_l1keys[st->nwt++] = b->key[j];
            }
        }
    }
    b->n = 0;
    b->bytes = 0;
    if (!bad) return ENGINE_OK;
    errbuf_set(err, errlen, "chunk %u could not be read from its source",
               p->start_chunk + b->idx[done]);
    return ENGINE_ERR_SOURCE;
}

static void state_init(struct engine *e, struct engine_store_state *st, uint32_t n) {
    memset(st, 0, sizeof(*st));
    st->n = n;
    if (e->l2ctl && n) {
        st->wt_keys = malloc((size_t)n * sizeof(*st->wt_keys));
        st->wt_l1keys = malloc((size_t)n * sizeof(*st->wt_l1keys));
        if (!st->wt_keys || !st->wt_l1keys) { /* write-through is best effort; the store goes on */
            free(st->wt_keys);
            free(st->wt_l1keys);
            st->wt_keys = NULL;
            st->wt_l1keys = NULL;
        }
    }
}

/* Queues the write-through of what the store stored (waiting for it as src says) and frees what
 * the state holds; its counts go to *res. */
static void state_end(struct engine *e, struct engine_store_state *st,
                      const struct engine_source *src, struct engine_store_result *res) {
    if (st->nwt)
        st->res.l2_stored = l2_store_and_wait(e, st->wt_keys, st->wt_l1keys, st->nwt,
                                              src->wait_l2_ns, src, &st->res.l2_wait);
    free(st->wt_keys);
    free(st->wt_l1keys);
    st->wt_keys = NULL;
    st->wt_l1keys = NULL;
    st->nwt = 0;
    if (res) *res = st->res;
}

uint64_t engine_store_retry_at(const struct engine_store_state *st) { return st->retry_at; }

void engine_store_stop_waiting(struct engine_store_state *st) {
    st->deadline = 1; /* passed */
    st->retry_at = 0;
}

void engine_store_abandon(struct engine *e, struct engine_store_state *st) {
    const struct engine_source none = {0};
    if (!st) return;
    state_end(e, st, &none, NULL);
    free(st);
}

/* Parks a resumable store at chunk i (of the range): ENGINE_AGAIN, the counts so far in *res. */
static int store_park(struct engine_store_state *st, uint32_t i, uint64_t now,
                      struct engine_store_result *res) {
    st->next = i;
    st->poll_ns = st->poll_ns ? st->poll_ns * 2 : STORE_POLL_FIRST_NS;
    if (st->poll_ns > STORE_POLL_MAX_NS) st->poll_ns = STORE_POLL_MAX_NS;
    st->retry_at = now + st->poll_ns;
    if (st->retry_at > st->deadline) st->retry_at = st->deadline;
    *res = st->res;
    return ENGINE_AGAIN;
}

int engine_store(struct engine *e, const struct engine_prompt *p, const char *model,
                 uint32_t world_size, uint32_t rank, const struct engine_source *src,
                 uint64_t now_ns, struct engine_store_result *res, char *err, size_t errlen) {
    uint32_t n = p->end_chunk - p->start_chunk;
    int rc = ENGINE_OK;
    struct engine_store_state local, *st = src->resume ? *src->resume : NULL;
    bool park = src->resume != NULL; /* a wait for another writer parks instead */
    (void)now_ns;
    memset(res, 0, sizeof(*res));
    if (st && st->n != n) {
        errbuf_set(err, errlen, "a store resumed with %u chunks, started with %u", n, st->n);
        engine_store_abandon(e, st);
        *src->resume = NULL;
        return ENGINE_ERR_INVAL;
    }
    if (!st) {
        st = park ? malloc(sizeof(*st)) : &local;
        if (!st) {
            errbuf_set(err, errlen, "out of memory");
            return ENGINE_ERR_FULL;
        }
        state_init(e, st, n);
    }
    /* Reserved chunks are filled in batches (one copy job for several chunks). A batch is
     * filled before this call waits for another writer, parks, or retries a full L1, so it
     * never holds reservations while it waits, and L1 may evict what it stored before; a
     * failure fills the batch first, so the chunks before it stay stored as chunk by chunk. */
    uint64_t batch_bytes = (uint64_t)(e->cfg->l1_size_gb * (double)(1ull << 30)) / 8;
    if (batch_bytes > ENGINE_STORE_BATCH_BYTES) batch_bytes = ENGINE_STORE_BATCH_BYTES;
    struct store_batch *b = calloc(1, sizeof(*b));
    if (!b) {
        errbuf_set(err, errlen, "out of memory");
        rc = ENGINE_ERR_FULL;
        goto end;
    }
    for (uint32_t c = p->start_chunk + st->next; c < p->end_chunk; c++) {
        uint32_t i = c - p->start_chunk;
        struct l1_key key;
        struct l1_ref ref;
        struct keys_object_key okey;
        rc = prompt_key(e, p, c, model, world_size, rank, true, st->wt_keys ? &okey : NULL, &key,
                        err, errlen);
        if (rc != ENGINE_OK) break;
        uint64_t size = src->size(src->arg, i);
        if (b->n && (b->n == ENGINE_STORE_BATCH || b->bytes + size > batch_bytes)) {
            rc = store_flush(e, p, src, b, st, err, errlen);
            if (rc != ENGINE_OK) break;
        }
        int w =
            reserve_or_wait(e, &key, size, src->replace, !park && b->n == 0, &st->deadline, &ref);
        if (b->n && (w == L1_ERR_BUSY || w == L1_ERR_NOMEM)) {
            /* fill what is reserved, then wait (or let L1 evict it) */
            rc = store_flush(e, p, src, b, st, err, errlen);
            if (rc != ENGINE_OK) break;
            w = reserve_or_wait(e, &key, size, src->replace, !park, &st->deadline, &ref);
        }
        if (w == L1_ERR_BUSY && park) {
            uint64_t now = clock_mono_ns();
            if (wait_left(&st->deadline, now)) { /* nothing reserved: the batch is empty */
                free(b);
                *src->resume = st;
                return store_park(st, i, now, res);
            }
        }
        if (w == L1_EXISTS) { /* resident (written before, or by the writer we waited for) */
            st->res.skipped++;
            continue;
        }
        if (w == L1_ERR_BUSY) { /* still being written by another request */
            st->res.pending++;
            continue;
        }
        if (w != L1_OK) {
            errbuf_set(err, errlen, "L1: %s", l1_strerror(w));
            rc = w == L1_ERR_NOMEM            ? ENGINE_ERR_FULL
                 : w == L1_ERR_TOO_MANY_NAMES ? ENGINE_ERR_TOO_MANY_NAMES
                                              : ENGINE_ERR_INVAL;
            break;
        }
        b->idx[b->n] = i;
        b->dst[b->n] = ref.data;
        b->size[b->n] = size;
        b->key[b->n] = key;
        b->ref[b->n] = ref;
        if (st->wt_keys) b->okey[b->n] = okey;
        b->n++;
        b->bytes += size;
    }
    if (b->n) { /* the chunks before a failure are stored; a fill failure among them wins */
        char ferr[256];
        int frc = store_flush(e, p, src, b, st, ferr, sizeof(ferr));
        if (frc != ENGINE_OK) {
            rc = frc;
            errbuf_set(err, errlen, "%s", ferr);
        }
    }
    free(b);
end:
    state_end(e, st, src, res);
    if (st != &local) {
        free(st);
        *src->resume = NULL;
    }
    return rc;
}

int engine_read(struct engine *e, const struct engine_prompt *p, uint32_t c, const char *model,
                uint32_t world_size, uint32_t rank, const uint8_t *owner, const char *rid,
                uint64_t now_ns, struct engine_ref *ref, char *err, size_t errlen) {
    struct l1_ref r;
    int rc = prompt_key(e, p, c, model, world_size, rank, false, NULL, &ref->key, err, errlen);
    if (rc != ENGINE_OK) return rc;
    if (rid && *rid) {
        /* Only the very object the lookup locked: a retrieve naming another salt, model or
         * prompt must not read (or release) someone else's object. */
        if (!session_take_lock(&e->sessions, owner, rid, c, rank, &ref->key)) goto miss;
        if (l1_read_locked(e->l1, &ref->key, now_ns, &r) != L1_OK) {
            l1_finish_read(e->l1, &ref->key, 1, now_ns);
            goto miss;
        }
    } else if (l1_reserve_read(e->l1, &ref->key, 1, now_ns, &r) != L1_OK) {
        goto miss;
    }
    ref->data = r.data;
    ref->size = r.size;
    return ENGINE_OK;
miss:
    errbuf_set(err, errlen, "chunk %u is not in the cache", c);
    return ENGINE_ERR_NOT_FOUND;
}

void engine_read_done(struct engine *e, const struct engine_ref *ref, uint64_t now_ns) {
    l1_finish_read(e->l1, &ref->key, 1, now_ns);
}

struct engine_pin *engine_pin(struct engine *e, const struct engine_ref *ref, uint64_t now_ns) {
    struct l1_pin *pin;
    return l1_pin(e->l1, &ref->key, now_ns, &pin) == L1_OK ? (struct engine_pin *)pin : NULL;
}

void engine_unpin(struct engine_pin *pin, uint64_t now_ns) {
    l1_unpin((struct l1_pin *)pin, now_ns);
}

/* ---- lookup sessions ---- */

/* An L2 prefetch issued by a lookup: the keys of the missing chunks and where the result goes. */
struct prefetch_ticket {
    struct engine *e;
    char rid[SESSION_ID_MAX + 1];
    uint8_t owner[SESSION_OWNER];
    uint64_t gen;
    uint32_t readers;
    size_t n;
    struct keys_object_key *keys;
    struct l1_key *l1keys;
    char model[KEYS_MODEL_NAME_MAX + 1];
    char salt[KEYS_SALT_MAX + 1];
};

static void ticket_free(struct prefetch_ticket *tk) {
    if (!tk) return;
    free(tk->keys);
    free(tk->l1keys);
    free(tk);
}

/* The ticket for chunks [from, p->end_chunk) of session s; NULL when it cannot be made (the
 * lookup then answers with its L1 hits). */
static struct prefetch_ticket *ticket_new(struct engine *e, const struct engine_prompt *p,
                                          uint32_t from, const char *model, uint32_t world_size,
                                          uint32_t readers, const struct session *s) {
    char err[KEYS_ERR_MAX];
    struct prefetch_ticket *tk = calloc(1, sizeof(*tk));
    size_t n = (size_t)(p->end_chunk - from) * world_size;
    if (!tk) goto fail;
    tk->keys = malloc(n * sizeof(*tk->keys));
    tk->l1keys = malloc(n * sizeof(*tk->l1keys));
    if (!tk->keys || !tk->l1keys) goto fail;
    if (prompt_keys(e, p, from, p->end_chunk, model, world_size, tk->keys, tk->l1keys, err,
                    sizeof(err)) != ENGINE_OK)
        goto fail;
    tk->e = e;
    tk->n = n;
    snprintf(tk->rid, sizeof(tk->rid), "%s", s->id);
    memcpy(tk->owner, s->owner, SESSION_OWNER);
    snprintf(tk->model, sizeof(tk->model), "%s", model);
    snprintf(tk->salt, sizeof(tk->salt), "%s", p->salt);
    tk->gen = s->gen;
    tk->readers = readers;
    return tk;
fail:
    ticket_free(tk);
    return NULL;
}

/* Runs on the l2-controller thread when the prefetch ends. */
static void prefetch_done(void *arg, const struct l2ctl_prefetch_result *r) {
    struct prefetch_ticket *tk = arg;
    struct engine *e = tk->e;
    session_prefetch_done(&e->sessions, tk->owner, tk->rid, tk->gen, tk->l1keys, r->ready, r->total,
                          tk->readers, release_locks, e);
    const char *labels[] = {tk->model, tk->salt};
    /* Keys loaded from L2, in tokens (one key per rank and chunk). */
    double tokens = (double)r->found * (double)e->cfg->chunk_size;
    metrics_add(e->dpm.lookup_hit_l2, labels, tokens);
    metrics_add(e->dpm.lookup_hit, labels, tokens);
    ticket_free(tk);
}

/* Hands the ticket to L2 (which then owns it); -1 when L2 refuses (it is freed). */
static int ticket_submit(struct engine *e, struct prefetch_ticket *tk) {
    uint64_t id;
    int rc = l2ctl_prefetch_submit(e->l2ctl, tk->keys, tk->l1keys, tk->n, L2CTL_TRIM_PREFIX,
                                   tk->readers, strcmp(e->cfg->l2_prefetch_policy, "retain") != 0,
                                   prefetch_done, tk, &id);
    if (rc != L2_OK) {
        ticket_free(tk);
        return -1;
    }
    return 0;
}

int engine_lookup(struct engine *e, const uint8_t *owner, const char *rid,
                  const struct engine_prompt *p, const char *model, uint32_t world_size,
                  uint32_t readers, uint64_t now_ns, char *err, size_t errlen) {
    uint32_t nch = p->end_chunk - p->start_chunk;
    int rc = ENGINE_OK;
    struct session *s = calloc(1, sizeof(*s));
    if (!s) goto oom;
    /* Exactly what session_put charges: nothing for an empty range. */
    if (nch && !(s->objs = calloc((size_t)nch * world_size, sizeof(*s->objs)))) goto oom;
    snprintf(s->id, sizeof(s->id), "%s", rid);
    memcpy(s->owner, owner, SESSION_OWNER);
    s->start_chunk = p->start_chunk;
    s->nchunks = nch;
    s->world_size = world_size;
    s->created_ns = now_ns;
    /* Chunk-major: every rank of chunk c before chunk c+1; stop at the first chunk that is not
     * complete for every rank. */
    uint32_t c;
    for (c = 0; c < nch; c++) {
        struct session_obj *row = &s->objs[(size_t)c * world_size];
        uint32_t r;
        for (r = 0; r < world_size; r++) {
            rc = prompt_key(e, p, p->start_chunk + c, model, world_size, r, false, NULL,
                            &row[r].key, err, errlen);
            if (rc != ENGINE_OK) break;
            if (l1_reserve_read(e->l1, &row[r].key, readers, now_ns, NULL) != L1_OK) break;
            row[r].locks = readers;
        }
        if (r < world_size) {
            for (uint32_t q = 0; q < r; q++) {
                l1_finish_read(e->l1, &row[q].key, row[q].locks, now_ns);
                row[q].locks = 0;
            }
            break;
        }
    }
    s->locked_chunks = c;
    const char *labels[] = {model, p->salt};
    uint64_t cs = (uint64_t)e->cfg->chunk_size;
    metrics_add(e->dpm.lookups, labels, 1);
    metrics_add(e->dpm.lookup_requested, labels, (double)(nch * cs));
    metrics_add(e->dpm.lookup_hit, labels, (double)(c * cs));
    if (rc != ENGINE_OK) {
        engine_session_release(e, s, 0);
        return rc;
    }
    s->gen = atomic_fetch_add(&e->session_gen, 1) + 1;
    s->hit_chunks = c;
    /* Chunks c.. missing from L1 are prefetched from L2; the job turns ready when that ends. */
    struct prefetch_ticket *tk = NULL;
    if (c < nch && e->l2ctl)
        tk = ticket_new(e, p, p->start_chunk + c, model, world_size, readers, s);
    s->job_ready = tk == NULL;
    struct session *old;
    size_t mib = 1u << 20;
    if (session_put(&e->sessions, s, (size_t)e->cfg->session_mb_per_client * mib,
                    (size_t)e->cfg->session_mb * mib, &old) < 0) {
        if (old) engine_session_release(e, old, 0);
        ticket_free(tk);
        engine_session_release(e, s, 0);
        errbuf_set(err, errlen,
                   "lookup sessions would hold more than --session-mb-per-client (%ld MiB for "
                   "this connection) or --session-mb (%ld MiB in all): end sessions "
                   "(end_session, retrieve, free_lookup_locks) before starting more",
                   e->cfg->session_mb_per_client, e->cfg->session_mb);
        return ENGINE_ERR_LIMIT;
    }
    if (old) engine_session_release(e, old, 0);
    if (tk) {
        uint64_t gen = tk->gen;
        if (ticket_submit(e, tk) < 0) /* L2 is shutting down: answer with L1 hits */
            session_prefetch_done(&e->sessions, owner, rid, gen, NULL, NULL, 0, 0, release_locks,
                                  e);
    }
    return ENGINE_OK;
oom:
    session_free(s);
    errbuf_set(err, errlen, "out of memory");
    return ENGINE_ERR_INTERNAL;
}

int engine_lookup_status(struct engine *e, const uint8_t *owner, const char *rid, uint32_t *hits) {
    return session_query(&e->sessions, owner, rid, hits);
}

uint64_t engine_lookup_release(struct engine *e, const uint8_t *owner, const char *rid,
                               uint32_t from, uint32_t to, int64_t rank) {
    return session_release_range(&e->sessions, owner, rid, from, to, rank, release_locks, e);
}

void engine_end_session(struct engine *e, const uint8_t *owner, const char *rid) {
    struct session *s = session_remove(&e->sessions, owner, rid);
    if (s) engine_session_release(e, s, 1);
}

uint64_t engine_session_objects(struct engine *e, const uint8_t *owner, const char *rid) {
    return session_objects(&e->sessions, owner, rid);
}

/* ---- KV contexts ---- */

int engine_register_context(struct engine *e, const struct kv_context *c,
                            const struct kv_auth *auth, uint64_t now_ns,
                            unsigned char nonce[KV_PROOF_NONCE], uint64_t *proof_offset, char *err,
                            size_t errlen) {
    return kvreg_register(&e->contexts, c, auth, now_ns, nonce, proof_offset, err, errlen);
}

int engine_unregister_context(struct engine *e, int64_t instance_id, const uint8_t *owner) {
    return kvreg_unregister(&e->contexts, instance_id, owner);
}

struct kv_context *engine_context_get(struct engine *e, int64_t instance_id, const uint8_t *owner,
                                      uint64_t now_ns) {
    return owner ? kvreg_get_for(&e->contexts, instance_id, owner, now_ns)
                 : kvreg_get(&e->contexts, instance_id, now_ns);
}

void engine_context_put(struct kv_context *c) { kvreg_put(c); }

int engine_context_layout(struct engine *e, const char *model, uint32_t world_size,
                          struct kv_layout *out) {
    return kvreg_find_layout(&e->contexts, model, world_size, out);
}

int engine_context_ping(struct engine *e, int64_t instance_id, const uint8_t *owner,
                        uint64_t now_ns, int *warm_state) {
    return kvreg_ping(&e->contexts, instance_id, owner, now_ns, warm_state);
}

struct block_read {
    const struct kv_context *c;
    const uint32_t *ids;
    size_t n;
    uint32_t l0, l1;
    int (*fn)(void *arg, const void *bytes, size_t len);
    void *arg;
    int rc;
};

/* Reads engine memory: runs under the SIGBUS guard. */
static void read_blocks_guarded(void *arg) {
    struct block_read *b = arg;
    const struct kv_layout *l = &b->c->layout;
    size_t len = (size_t)l->tokens_per_block * l->bytes_per_token;
    for (uint32_t layer = b->l0; layer < b->l1; layer++)
        for (uint32_t k = 0; k < l->kv_count; k++)
            for (size_t i = 0; i < b->n; i++) {
                b->rc = b->fn(b->arg, kv_block_ptr(b->c, layer, k, b->ids[i]), len);
                if (b->rc) return;
            }
}

int engine_context_read_blocks(struct engine *e, const struct kv_context *c, const uint32_t *ids,
                               size_t n, uint32_t l0, uint32_t l1,
                               int (*fn)(void *arg, const void *bytes, size_t len), void *arg) {
    (void)e;
    struct block_read b = {c, ids, n, l0, l1, fn, arg, 0};
    if (kv_guarded(read_blocks_guarded, &b) < 0) return -1; /* the mapping shrank */
    return b.rc;
}

/* ---- warm prefetch ---- */

int engine_warm_prefetch(struct engine *e, const char *model, uint32_t world_size, const char *salt,
                         const uint32_t *tokens, size_t ntokens, uint64_t *id, size_t *nchunks,
                         char *err, size_t errlen) {
    struct engine_prompt p;
    struct keys_object_key *keys = NULL;
    struct l1_key *l1keys = NULL;
    struct kv_layout layout;
    int rc = ENGINE_OK;
    memset(&p, 0, sizeof(p));
    *nchunks = 0;
    /* The layout check comes first: it tells the operator that the model name or world size
     * is wrong, which a short sequence must not hide behind a no-op. */
    if (kvreg_find_layout(&e->contexts, model, world_size, &layout) < 0) {
        errbuf_set(err, errlen,
                   "no KV layout registered for model_name '%.256s' with world_size %u", model,
                   world_size);
        return ENGINE_ERR_NO_LAYOUT;
    }
    size_t cs = (size_t)e->cfg->chunk_size, nch = ntokens / cs;
    if (nch == 0) return ENGINE_OK;
    if (!e->l2ctl) {
        errbuf_set(err, errlen, "no L2 adapters configured");
        return ENGINE_ERR_NO_L2;
    }
    if (nch > UINT32_MAX) {
        errbuf_set(err, errlen, "too many chunks");
        return ENGINE_ERR_INVAL;
    }
    size_t nkeys = nch * world_size;
    p.hashes = malloc(nch * sizeof(*p.hashes));
    p.hash_len = malloc(nch);
    keys = calloc(nkeys, sizeof(*keys));
    l1keys = calloc(nkeys, sizeof(*l1keys));
    if (!p.hashes || !p.hash_len || !keys || !l1keys ||
        keys_prefix_hashes(e->seed, tokens, ntokens, cs, p.hashes, nch) != (long)nch) {
        errbuf_set(err, errlen, "out of memory");
        rc = ENGINE_ERR_INTERNAL;
        goto out;
    }
    memset(p.hash_len, KEYS_HASH_LEN, nch);
    p.end_chunk = (uint32_t)nch;
    snprintf(p.salt, sizeof(p.salt), "%s", salt);
    rc = prompt_keys(e, &p, 0, p.end_chunk, model, world_size, keys, l1keys, err, errlen);
    if (rc != ENGINE_OK) goto out;
    int l2rc = l2ctl_prefetch_submit(e->l2ctl, keys, l1keys, nkeys, L2CTL_TRIM_SPARSE, 0, false,
                                     NULL, NULL, id);
    if (l2rc == L2_ERR_BUSY) {
        errbuf_set(err, errlen,
                   "the L2 prefetches queued and running would name more than "
                   "--l2-prefetch-max-keys (%ld) objects: retry later",
                   e->cfg->l2_prefetch_max_keys);
        rc = ENGINE_ERR_UNAVAILABLE;
        goto out;
    }
    if (l2rc != L2_OK) {
        errbuf_set(err, errlen, "%s", l2_strerror(l2rc));
        rc = ENGINE_ERR_UNAVAILABLE;
        goto out;
    }
    *nchunks = nch;
out:
    free(p.hashes);
    free(p.hash_len);
    free(keys);
    free(l1keys);
    return rc;
}

int engine_warm_prefetch_poll(struct engine *e, uint64_t id, uint64_t *found, uint64_t *total) {
    struct l2ctl_prefetch_result r;
    if (!e->l2ctl) return ENGINE_ERR_NOT_FOUND;
    int rc = l2ctl_prefetch_poll(e->l2ctl, id, &r);
    if (rc == L2_ERR_BUSY) return ENGINE_ERR_BUSY;
    if (rc != L2_OK) return ENGINE_ERR_NOT_FOUND;
    *found = r.found;
    *total = r.total;
    return ENGINE_OK;
}
