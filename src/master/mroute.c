/* Replica choice for RouteGet and placement advice for RoutePut. */
#include "master/mroute.h"

#include <stdlib.h>
#include <string.h>

int mroute_get_rank(int tier) {
    switch (tier) {
    case 1:
        return 0; /* HBM */
    case 2:
        return 1; /* DRAM */
    case 3:
        return 2; /* SSD */
    default:
        return 3;
    }
}

size_t mroute_get_pick(const struct mstore_loc *locs, size_t n, const char *requester,
                       uint64_t (*rnd)(void)) {
    int best = 4;
    size_t nbest = 0;
    for (size_t i = 0; i < n; i++) {
        int r = mroute_get_rank(locs[i].tier);
        if (r < best) {
            best = r;
            nbest = 0;
        }
        if (r == best) nbest++;
    }
    if (requester && *requester)
        for (size_t i = 0; i < n; i++)
            if (mroute_get_rank(locs[i].tier) == best && strcmp(locs[i].node_id, requester) == 0)
                return i;
    size_t k = nbest > 1 ? (size_t)(rnd() % nbest) : 0;
    for (size_t i = 0; i < n; i++)
        if (mroute_get_rank(locs[i].tier) == best && k-- == 0) return i;
    return 0;
}

static const int PUT_TIERS[] = {1, 2}; /* HBM, then DRAM; SSD is never a put target */
#define NPUT_TIERS 2

struct cstate {
    bool excluded;
    uint64_t avail[MSTORE_NTIERS];
    uint8_t mask;
};

static bool fits(const struct cstate *c, int tier, uint64_t size) {
    return !c->excluded && (c->mask & (1u << tier)) && c->avail[tier] >= size;
}

/* The base algorithm on one tier; -1 when no candidate fits. */
static int pick_on_tier(const struct cstate *cs, size_t n, int tier, uint64_t size,
                        enum mroute_algo algo, uint64_t (*rnd)(void)) {
    if (algo == MROUTE_RANDOM) {
        /* Weighted by available bytes; sums in long double to avoid overflow. */
        long double total = 0;
        for (size_t i = 0; i < n; i++)
            if (fits(&cs[i], tier, size)) total += (long double)cs[i].avail[tier] + 1;
        if (total <= 0) return -1;
        long double x = (long double)(rnd() >> 11) / (long double)(1ull << 53) * total;
        int last = -1;
        for (size_t i = 0; i < n; i++) {
            if (!fits(&cs[i], tier, size)) continue;
            last = (int)i;
            x -= (long double)cs[i].avail[tier] + 1;
            if (x < 0) return (int)i;
        }
        return last;
    }
    int best = -1;
    for (size_t i = 0; i < n; i++)
        if (fits(&cs[i], tier, size) && (best < 0 || cs[i].avail[tier] > cs[best].avail[tier]))
            best = (int)i;
    return best;
}

static bool pick_global(const struct cstate *cs, size_t n, uint64_t size, enum mroute_algo algo,
                        uint64_t (*rnd)(void), struct mroute_pick *p) {
    for (int t = 0; t < NPUT_TIERS; t++) {
        int c = pick_on_tier(cs, n, PUT_TIERS[t], size, algo, rnd);
        if (c >= 0) {
            *p = (struct mroute_pick){c, PUT_TIERS[t]};
            return true;
        }
    }
    return false;
}

int mroute_put_plan(const struct mstore_alive *cands, size_t ncands, const uint64_t *sizes,
                    const bool *exists, size_t n, char *const *excl, size_t nexcl,
                    const char *requester, enum mroute_algo algo, enum mroute_affinity aff,
                    uint64_t (*rnd)(void), struct mroute_pick *out) {
    struct cstate *cs = calloc(ncands ? ncands : 1, sizeof(*cs));
    if (!cs) return -1;
    int self = -1;
    for (size_t i = 0; i < ncands; i++) {
        cs[i].mask = cands[i].caps.mask;
        memcpy(cs[i].avail, cands[i].caps.avail, sizeof(cs[i].avail));
        for (size_t e = 0; e < nexcl; e++)
            if (strcmp(excl[e], cands[i].node_id) == 0) cs[i].excluded = true;
        if (requester && strcmp(requester, cands[i].node_id) == 0) self = (int)i;
    }
    struct mroute_pick sticky = {-1, 0};
    if (aff == MROUTE_AFF_SAME) {
        /* Pin the whole batch to one (node, tier) when one can hold all of it. */
        uint64_t sum = 0;
        for (size_t i = 0; i < n; i++)
            if (!exists[i]) sum += sizes[i];
        pick_global(cs, ncands, sum, MROUTE_MOST_AVAILABLE, rnd, &sticky);
    }
    bool pinned = sticky.cand >= 0;
    for (size_t i = 0; i < n; i++) {
        struct mroute_pick p = {-1, 0};
        bool ok = false;
        if (exists[i]) {
            out[i] = p;
            continue;
        }
        if (aff == MROUTE_AFF_LOCAL && self >= 0) {
            for (int t = 0; t < NPUT_TIERS && !ok; t++)
                if (fits(&cs[self], PUT_TIERS[t], sizes[i])) {
                    p = (struct mroute_pick){self, PUT_TIERS[t]};
                    ok = true;
                }
        }
        if (!ok && pinned && fits(&cs[sticky.cand], sticky.tier, sizes[i])) {
            p = sticky;
            ok = true;
        }
        if (!ok && aff == MROUTE_AFF_SAME && sticky.cand >= 0) {
            /* Tier first; the sticky node is preferred only within each tier. */
            for (int t = 0; t < NPUT_TIERS && !ok; t++) {
                int tier = PUT_TIERS[t];
                if (fits(&cs[sticky.cand], tier, sizes[i])) {
                    p = (struct mroute_pick){sticky.cand, tier};
                    ok = true;
                } else {
                    int c = pick_on_tier(cs, ncands, tier, sizes[i], algo, rnd);
                    if (c >= 0) {
                        p = (struct mroute_pick){c, tier};
                        ok = true;
                    }
                }
            }
        }
        if (!ok) ok = pick_global(cs, ncands, sizes[i], algo, rnd, &p);
        if (ok) {
            cs[p.cand].avail[p.tier] -= sizes[i];
            if (aff == MROUTE_AFF_SAME) sticky = p;
        }
        out[i] = ok ? p : (struct mroute_pick){-1, 0};
    }
    free(cs);
    return 0;
}
