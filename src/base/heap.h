/* What the process's malloc holds, and how much memory the process may use at all: the inputs
 * of a memory bound that counts bytes really allocated, not bytes received. */
#ifndef LMCACHE_BASE_HEAP_H
#define LMCACHE_BASE_HEAP_H

#include <stdint.h>

/* Bytes malloc has handed out and not taken back: glibc's mallinfo2 (in use in every arena
 * plus mmapped chunks), or the sanitizer's allocator when one replaces malloc. 0 when neither
 * can tell (another libc). Walks the heap's free lists under the arena lock: call it at a
 * bounded rate. Thread-safe. */
uint64_t heap_in_use(void);

/* The memory this process may use: physical memory, or a cgroup limit on the path from the
 * process's cgroup to the root (v2 memory.max, v1 memory.limit_in_bytes), whichever is lowest.
 * 0 when unknown. */
uint64_t heap_memory_limit(void);

/* The lowest number in `file` (memory.max, memory.limit_in_bytes) of `cgroup_path` (as
 * /proc/self/cgroup gives it: "/a/b") and of its ancestors under `root` (the controller's
 * mount, e.g. /sys/fs/cgroup); UINT64_MAX when none sets one ("max", or no such file). Exposed
 * for tests. */
uint64_t heap_cgroup_limit(const char *root, const char *cgroup_path, const char *file);

#endif
