/* Heap and memory-limit readings (heap.h). */
#include "base/heap.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

/* Present when AddressSanitizer, ThreadSanitizer or another sanitizer runtime replaces malloc:
 * glibc's figures then describe only what the runtime itself allocates. */
extern size_t __sanitizer_get_current_allocated_bytes(void) __attribute__((weak));

uint64_t heap_in_use(void) {
    if (__sanitizer_get_current_allocated_bytes)
        return (uint64_t)__sanitizer_get_current_allocated_bytes();
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
    struct mallinfo2 mi = mallinfo2();
    return (uint64_t)mi.uordblks + (uint64_t)mi.hblkhd;
#else
    return 0;
#endif
}

/* The number a memory.max file holds; UINT64_MAX for "max" or a file that cannot be read. */
static uint64_t read_max(const char *path) {
    FILE *f = fopen(path, "re");
    if (!f) return UINT64_MAX;
    char buf[64] = "";
    uint64_t v = UINT64_MAX;
    if (fgets(buf, sizeof(buf), f) && buf[0] >= '0' && buf[0] <= '9') {
        char *end = NULL;
        unsigned long long n = strtoull(buf, &end, 10);
        if (end != buf && (*end == '\n' || *end == '\0')) v = (uint64_t)n;
    }
    fclose(f);
    return v;
}

uint64_t heap_cgroup_limit(const char *root, const char *cgroup_path, const char *file) {
    char path[PATH_MAX];
    char dir[PATH_MAX];
    uint64_t best = UINT64_MAX;
    if (snprintf(dir, sizeof(dir), "%s", cgroup_path) >= (int)sizeof(dir)) return best;
    for (;;) { /* the cgroup itself, then each ancestor up to the root */
        size_t len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') dir[--len] = '\0';
        if (snprintf(path, sizeof(path), "%s%s/%s", root, len == 1 ? "" : dir, file) <
            (int)sizeof(path)) {
            uint64_t v = read_max(path);
            if (v < best) best = v;
        }
        char *slash = strrchr(dir, '/');
        if (!slash || len <= 1) break;
        if (slash == dir)
            dir[1] = '\0';
        else
            *slash = '\0';
    }
    return best;
}

uint64_t heap_memory_limit(void) {
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    uint64_t limit = pages > 0 && psize > 0 ? (uint64_t)pages * (uint64_t)psize : 0;
    FILE *f = fopen("/proc/self/cgroup", "re");
    if (!f) return limit;
    char line[PATH_MAX + 32];
    while (fgets(line, sizeof(line), f)) {
        line[strcspn(line, "\n")] = '\0';
        uint64_t cg = UINT64_MAX;
        if (!strncmp(line, "0::", 3)) /* cgroup v2 */
            cg = heap_cgroup_limit("/sys/fs/cgroup", line + 3, "memory.max");
        else if (strstr(line, ":memory:")) /* cgroup v1's memory controller */
            cg = heap_cgroup_limit("/sys/fs/cgroup/memory", strstr(line, ":memory:") + 8,
                                   "memory.limit_in_bytes");
        if (cg && cg != UINT64_MAX && (!limit || cg < limit)) limit = cg;
    }
    fclose(f);
    return limit;
}
