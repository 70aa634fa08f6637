/* A log rate limit for messages whose rate a remote peer chooses (refused connections, failed
 * handshakes): at most `burst` per window, and the count of the ones dropped is handed to the
 * next one allowed, so the log says how many were suppressed. Thread-safe. */
#ifndef LMCACHE_BASE_RATELIMIT_H
#define LMCACHE_BASE_RATELIMIT_H

#include <pthread.h>

struct ratelimit {
    pthread_mutex_t mu;
    double window_s;
    unsigned burst;
    double window_start;
    unsigned count;
    unsigned long suppressed;
};

#define RATELIMIT_INIT(window, n)                                                                  \
    { PTHREAD_MUTEX_INITIALIZER, (window), (n), -1e300, 0, 0 }

/* 1 when a message may be logged at time now (seconds, monotonic); then *dropped is the number
 * suppressed since the last one allowed. 0 when it is to be dropped. */
int ratelimit_allow(struct ratelimit *rl, double now, unsigned long *dropped);

#endif
