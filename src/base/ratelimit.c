/* Log rate limit (see ratelimit.h). */
#include "base/ratelimit.h"

int ratelimit_allow(struct ratelimit *rl, double now, unsigned long *dropped) {
    int ok;
    *dropped = 0;
    pthread_mutex_lock(&rl->mu);
    if (now - rl->window_start >= rl->window_s) {
        *dropped = rl->suppressed;
        rl->suppressed = 0;
        rl->window_start = now;
        rl->count = 0;
    }
    ok = rl->count < rl->burst;
    if (ok)
        rl->count++;
    else
        rl->suppressed++;
    pthread_mutex_unlock(&rl->mu);
    if (!ok) *dropped = 0;
    return ok;
}
