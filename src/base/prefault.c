#include "base/prefault.h"

#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define PREFAULT_PAGE 4096u

/* One byte inside the range on each of its pages: its first byte, then each page start. The
 * reads run while other threads may write those bytes (a store into L1, a retrieve into a
 * registered region): the values are thrown away, only the page's mapping matters, so
 * ThreadSanitizer is told not to record them. */
#if defined(__SANITIZE_THREAD__)
#define NOT_FOR_TSAN __attribute__((no_sanitize("thread")))
#else
#define NOT_FOR_TSAN
#endif
NOT_FOR_TSAN static void touch_pages(const void *p, size_t len, uintptr_t lo) {
    const volatile unsigned char *b = p;
    unsigned char sink = b[0];
    for (uintptr_t a = lo + PREFAULT_PAGE; a < (uintptr_t)p + len; a += PREFAULT_PAGE)
        sink ^= *(const volatile unsigned char *)a;
    (void)sink;
}

int prefault_range(void *p, size_t len, int touch) {
    if (len == 0) return 0;
    /* madvise wants whole pages: the pages that hold the range (mapped, as the range is). */
    uintptr_t lo = (uintptr_t)p & ~(uintptr_t)(PREFAULT_PAGE - 1);
    uintptr_t hi = ((uintptr_t)p + len + PREFAULT_PAGE - 1) & ~(uintptr_t)(PREFAULT_PAGE - 1);
    if (madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) != 0) {
        int e = errno;
        /* EINVAL: a kernel without it (or a mapping it does not apply to): read-populate. */
        if (e != EINVAL || madvise((void *)lo, hi - lo, MADV_POPULATE_READ) != 0) {
            if (e != EINVAL) errno = e;
            return -1;
        }
    }
    if (!touch) return 0;
    touch_pages(p, len, lo);
    return 0;
}
