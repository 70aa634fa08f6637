/* Quota table: a sorted array of (salt, limit) under one mutex. Few entries, rare writes. */
#include "server/l1/quota.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "server/keys.h"

struct quota_entry {
    char *salt;
    uint64_t limit;
};

struct quota {
    pthread_mutex_t mu;
    struct quota_entry *v; /* sorted by salt */
    size_t n, cap;
};

struct quota *quota_create(void) {
    struct quota *q = calloc(1, sizeof(*q));
    if (!q) return NULL;
    if (pthread_mutex_init(&q->mu, NULL) != 0) {
        free(q);
        return NULL;
    }
    return q;
}

void quota_destroy(struct quota *q) {
    if (!q) return;
    for (size_t i = 0; i < q->n; i++) free(q->v[i].salt);
    free(q->v);
    pthread_mutex_destroy(&q->mu);
    free(q);
}

/* Caller holds q->mu. Index of salt, or the insertion point with *found = false. */
static size_t do_quota_find(struct quota *q, const char *salt, bool *found) {
    size_t lo = 0, hi = q->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(q->v[mid].salt, salt);
        if (c == 0) {
            *found = true;
            return mid;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = false;
    return lo;
}

int quota_set(struct quota *q, const char *salt, uint64_t limit_bytes, char *err, size_t errlen) {
    if (keys_check_cache_salt(salt, strlen(salt), err, errlen) != 0) return -1;
    int rc = 0;
    bool found;
    pthread_mutex_lock(&q->mu);
    size_t i = do_quota_find(q, salt, &found);
    if (found) {
        q->v[i].limit = limit_bytes;
        goto out;
    }
    if (q->n == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 8;
        struct quota_entry *v = realloc(q->v, cap * sizeof(*v));
        if (!v) goto oom;
        q->v = v;
        q->cap = cap;
    }
    char *copy = strdup(salt);
    if (!copy) goto oom;
    memmove(&q->v[i + 1], &q->v[i], (q->n - i) * sizeof(*q->v));
    q->v[i] = (struct quota_entry){copy, limit_bytes};
    q->n++;
    goto out;
oom:
    if (err && errlen) strncpy(err, "out of memory", errlen - 1), err[errlen - 1] = '\0';
    rc = -1;
out:
    pthread_mutex_unlock(&q->mu);
    return rc;
}

bool quota_get(struct quota *q, const char *salt, uint64_t *limit_bytes) {
    bool found;
    pthread_mutex_lock(&q->mu);
    size_t i = do_quota_find(q, salt, &found);
    *limit_bytes = found ? q->v[i].limit : 0;
    pthread_mutex_unlock(&q->mu);
    return found;
}

bool quota_remove(struct quota *q, const char *salt) {
    bool found;
    pthread_mutex_lock(&q->mu);
    size_t i = do_quota_find(q, salt, &found);
    if (found) {
        free(q->v[i].salt);
        memmove(&q->v[i], &q->v[i + 1], (q->n - i - 1) * sizeof(*q->v));
        q->n--;
    }
    pthread_mutex_unlock(&q->mu);
    return found;
}

void quota_foreach(struct quota *q, void (*fn)(const char *salt, uint64_t limit_bytes, void *arg),
                   void *arg) {
    pthread_mutex_lock(&q->mu);
    for (size_t i = 0; i < q->n; i++) fn(q->v[i].salt, q->v[i].limit, arg);
    pthread_mutex_unlock(&q->mu);
}

size_t quota_count(struct quota *q) {
    pthread_mutex_lock(&q->mu);
    size_t n = q->n;
    pthread_mutex_unlock(&q->mu);
    return n;
}
