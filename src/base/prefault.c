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
    /* One byte inside the range on each of its pages: its first byte, then each page start. */
    const volatile unsigned char *b = p;
    unsigned char sink = b[0];
    for (uintptr_t a = lo + PREFAULT_PAGE; a < (uintptr_t)p + len; a += PREFAULT_PAGE)
        sink ^= *(const volatile unsigned char *)a;
    (void)sink;
    return 0;
}
