/* Clocks. Logic that depends on time takes `now` as an argument; these are the sources. */
#ifndef LMCACHE_BASE_CLOCK_H
#define LMCACHE_BASE_CLOCK_H

#include <stdint.h>

/* Monotonic time in nanoseconds / seconds. */
uint64_t clock_mono_ns(void);
double clock_mono(void);
/* Wall-clock seconds since the epoch. */
double clock_wall(void);

#endif
