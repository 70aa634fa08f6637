/* Faulting memory in ahead of use, so that no copy in a timed path pays for a page's first
 * touch. */
#ifndef LMCACHE_BASE_PREFAULT_H
#define LMCACHE_BASE_PREFAULT_H

#include <stddef.h>

/* Faults [p, p + len) in writable without changing its contents (MADV_POPULATE_WRITE, Linux
 * 5.14; MADV_POPULATE_READ where that is refused). A page faulted in only readable (what
 * MAP_POPULATE does for a shared mapping) is clean, and its first write still updates the dirty
 * bit: on a shadow-paged VM, a hypervisor exit per page that no guest fault counter shows.
 * touch: then also read one byte of every 4 KiB page through this mapping. A shadow-paged VM's
 * hypervisor builds a process's mapping of a page on that process's first access, not when the
 * guest kernel faults the page in (measured on such a machine: 0.83 GB/s for the first copy into
 * 1 GiB that MADV_POPULATE_WRITE had faulted in, 11 GB/s after the reads; the reads cost 6-10 us
 * a page there, well under 0.1 us on a bare-metal kernel). Safe while other threads write the
 * range (it writes nothing). Returns 0, or -1 with errno when the range cannot be faulted in
 * (e.g. a shared object shrunk below it); the read pass then does not run. */
int prefault_range(void *p, size_t len, int touch);

#endif
