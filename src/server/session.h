/* Lookup sessions: the read locks a lookup took (per object, for its request id), its prefetch
 * job (reported exactly once), and their release by retrieve, free_lookup_locks, end_session or
 * expiry. The table never calls into L1: functions hand back what the caller must release. */
#ifndef LMCACHE_SERVER_SESSION_H
#define LMCACHE_SERVER_SESSION_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "base/htab.h"
#include "server/l1/l1.h"

#define SESSION_ID_MAX  256
#define SESSION_BUCKETS 1024 /* owner buckets; the session table starts with as many, grows */
#define SESSION_OWNER   32   /* bytes of the key of the connection that opened a session */

/* One looked-up object and the read locks this session still holds on it. */
struct session_obj {
    struct l1_key key;
    uint32_t locks;
};

/* A session belongs to the connection that opened it: every call below names the session by
 * (owner, id), so another connection that knows or guesses the id finds nothing, and two
 * connections may use the same request id without meeting. */
struct session {
    char id[SESSION_ID_MAX + 1];
    uint8_t owner[SESSION_OWNER];
    uint32_t start_chunk; /* absolute index of the first chunk of the lookup range */
    uint32_t nchunks;     /* chunks in the lookup range */
    uint32_t world_size;
    uint32_t locked_chunks;   /* leading chunks whose objects (all ranks) were locked */
    struct session_obj *objs; /* locked_chunks * world_size, chunk-major (chunk, then rank) */
    int job_reported;         /* query_prefetch_status answered "ready" already */
    int job_ready;
    uint32_t hit_chunks;
    uint64_t created_ns;
    uint64_t gen;  /* unique per lookup: a late L2 result finds out whether its session is gone */
    size_t bytes;  /* what it holds in memory, counted against its owner's and the table's limit */
    uint64_t hash; /* of (owner, id) under the table's seed */
    struct htab_node hn;  /* in the table */
    struct session *next; /* in the lists drain and expire hand back */
};

/* What one connection's sessions hold. */
struct session_owner {
    uint8_t owner[SESSION_OWNER];
    size_t bytes;
    size_t sessions;
    struct session_owner *next;
};

struct session_table {
    pthread_mutex_t lock;
    struct htab tab;  /* sessions by (owner, id); doubles as it fills */
    uint64_t seed[2]; /* random per table: request ids are the client's, chains must not be */
    struct session_owner *owners[SESSION_BUCKETS];
    size_t count; /* sessions */
    size_t jobs;  /* prefetch jobs not yet reported */
    size_t bytes; /* held by all sessions */
};

/* 0, or -1 when out of memory. */
int session_table_init(struct session_table *t);
/* Frees every session, returning them chained through ->next for the caller to release. */
struct session *session_table_drain(struct session_table *t);
void session_table_destroy(struct session_table *t);

/* Inserts s (owned by the table from now on); *old is the session it replaces (same owner and
 * id), which the caller must release and free, or NULL. A session's memory (s->bytes, set
 * here) counts against its owner (max_owner_bytes) and against the table (max_bytes; 0: no
 * limit): when it would take either past its limit, -1 and nothing changed (s stays the
 * caller's). Else 0. */
int session_put(struct session_table *t, struct session *s, size_t max_owner_bytes,
                size_t max_bytes, struct session **old);
/* Removes and returns the session (the caller releases its locks and frees it), or NULL. */
struct session *session_remove(struct session_table *t, const uint8_t *owner, const char *id);
void session_free(struct session *s);

/* Objects the session's range spans (chunks x world_size: the most locks it can hold, and so
 * the work of releasing them), or 0 for an unknown session. */
uint64_t session_objects(struct session_table *t, const uint8_t *owner, const char *id);
/* query_prefetch_status: 1 = ready (*hits set; the job is consumed), 0 = pending, and an unknown
 * id or an already reported job counts as ready with 0 hits. */
int session_query(struct session_table *t, const uint8_t *owner, const char *id, uint32_t *hits);
/* Marks the lookup's prefetch job complete with `hits` leading chunks. */
void session_job_done(struct session_table *t, const uint8_t *owner, const char *id, uint32_t hits);

/* Applies a finished L2 prefetch to session id if it is still generation gen. keys/ready cover
 * the chunks from the session's first unlocked chunk on, chunk-major (every rank of a chunk in
 * turn); a ready key holds `locks` read locks. The leading chunks ready for every rank become the
 * session's (locked_chunks and hit_chunks grow, the job turns ready); every other ready key's
 * locks, or all of them when the session is gone, are handed to release() after the table lock
 * is dropped. */
void session_prefetch_done(struct session_table *t, const uint8_t *owner, const char *id,
                           uint64_t gen, const struct l1_key *keys, const uint8_t *ready,
                           size_t nkeys, uint32_t locks,
                           void (*release)(const struct l1_key *key, uint32_t locks, void *arg),
                           void *arg);

/* Takes one of the session's locks on (absolute chunk, rank) if the object the lookup locked
 * there is `key`: 1 when it held one (the caller now owns that lock and releases it after its
 * copy), 0 otherwise (no such lock, or the request names another object: another salt, model or
 * prompt than its lookup). */
int session_take_lock(struct session_table *t, const uint8_t *owner, const char *id, uint32_t chunk,
                      uint32_t rank, const struct l1_key *key);
/* Hands back every lock the session holds on chunks [from, to) (absolute) for one rank, or all
 * ranks when rank < 0: fn is called per object with its lock count after the table lock is
 * dropped. Returns the number of locks released. */
uint64_t session_release_range(struct session_table *t, const uint8_t *owner, const char *id,
                               uint32_t from, uint32_t to, int64_t rank,
                               void (*fn)(const struct l1_key *key, uint32_t locks, void *arg),
                               void *arg);
/* Removes sessions created before `before_ns`, chained through ->next. */
struct session *session_expire(struct session_table *t, uint64_t before_ns);
void session_counts(struct session_table *t, size_t *sessions, size_t *jobs);

#endif
