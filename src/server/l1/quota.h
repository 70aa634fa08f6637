/* Quota table: per-cache_salt byte limits for IsolatedLRU (soft: enforced by eviction, never by
 * refusing writes). A salt without an entry has limit 0 (allowlist). The empty salt "" is an
 * ordinary salt here; the HTTP layer maps its `_default` path segment to "".
 *
 * Thread-safety: one mutex, a leaf lock -- no other lock is taken while it is held, and L1
 * calls into the table without holding any of its own locks. */
#ifndef LMCACHE_SERVER_L1_QUOTA_H
#define LMCACHE_SERVER_L1_QUOTA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct quota;

struct quota *quota_create(void);
void quota_destroy(struct quota *q);

/* Sets or replaces the limit of salt (validated like ObjectKey.cache_salt). Returns 0, or -1
 * with a message (bad salt, out of memory). */
int quota_set(struct quota *q, const char *salt, uint64_t limit_bytes, char *err, size_t errlen);
/* Returns true and the limit when salt has an entry; false and *limit_bytes = 0 otherwise. */
bool quota_get(struct quota *q, const char *salt, uint64_t *limit_bytes);
/* Returns true when an entry was removed, false when there was none. */
bool quota_remove(struct quota *q, const char *salt);
/* Calls fn for every entry in salt order, under the table's mutex: fn must not call back into
 * the quota table. */
void quota_foreach(struct quota *q, void (*fn)(const char *salt, uint64_t limit_bytes, void *arg),
                   void *arg);
size_t quota_count(struct quota *q);

#endif
