/* In-memory master store and routing policies: clock and randomness injected. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "master/mroute.h"
#include "master/mstore.h"

static struct mstore *mk(void) {
    struct mstore_mem_cfg c = {.shards = 4};
    return mstore_mem_create(&c);
}

static void reg(struct mstore *s, const char *id, int64_t now) {
    struct mstore_reg r = {.node_id = id, .node_address = "a", .peer_address = "p"};
    assert_int_equal(s->ops->register_client(s, &r, now, 30000), 0);
}

static void test_register_rules(void **st) {
    (void)st;
    struct mstore *s = mk();
    reg(s, "n", 0);
    struct mstore_reg r = {.node_id = "n"};
    assert_int_equal(s->ops->register_client(s, &r, 5000, 30000), 1);  /* alive, not stale */
    assert_int_equal(s->ops->register_client(s, &r, 31000, 30000), 0); /* stale: replaced */
    assert_int_equal(s->ops->alive_count(s), 1);
    assert_int_equal(s->ops->expire_stale(s, 40000, 0, NULL, NULL), 1);
    assert_int_equal(s->ops->expire_stale(s, 40000, 0, NULL, NULL), 0); /* idempotent */
    assert_int_equal(s->ops->client_status(s, "n"), MSTORE_STATUS_EXPIRED);
    assert_int_equal(s->ops->alive_count(s), 0);
    assert_int_equal(s->ops->register_client(s, &r, 41000, 30000), 0); /* expired: allowed */
    assert_true(s->ops->unregister_client(s, "n"));
    assert_false(s->ops->unregister_client(s, "n"));
    s->ops->destroy(s);
}

/* A reaped node loses its engine_desc and index entries at expiry, its whole record once
 * the retention has passed; a heartbeat in between revives it (as in the reference). */
static void test_reaper_releases_memory(void **st) {
    (void)st;
    struct mstore *s = mk();
    size_t elen = 1 << 20;
    uint8_t *desc = calloc(1, elen);
    char *tags[] = {"role=prefill"};
    struct mstore_reg r = {.node_id = "big",
                           .node_address = "a:1",
                           .peer_address = "p:1",
                           .engine_desc = desc,
                           .engine_desc_len = elen,
                           .tags = tags,
                           .ntags = 1};
    assert_int_equal(s->ops->register_client(s, &r, 0, 30000), 0);
    reg(s, "small", 0);
    size_t small = mstore_mem_record_bytes(s);
    reg(s, "other", 0);
    size_t per_small = mstore_mem_record_bytes(s) - small;
    assert_true(small > elen && small < elen + 256);
    uint64_t acked;
    struct mstore_event add = {MSTORE_EV_ADD, "blk", 2, 10};
    assert_int_equal(s->ops->apply_heartbeat(s, "big", 1, 0, NULL, &add, 1, false, &acked),
                     MSTORE_HB_APPLIED);
    char *h = "hash";
    assert_int_equal(s->ops->ext_report(s, "big", &h, 1, 2), 1);
    size_t idx_bytes = mstore_mem_bytes(s);
    /* "small" and "other" keep heartbeating; "big" stops at 0. */
    for (int64_t t = 10000; t <= 40000; t += 10000) {
        assert_int_equal(s->ops->apply_heartbeat(s, "small", 0, t, NULL, NULL, 0, false, &acked),
                         MSTORE_HB_SEQ_GAP);
        assert_int_equal(s->ops->apply_heartbeat(s, "other", 0, t, NULL, NULL, 0, false, &acked),
                         MSTORE_HB_SEQ_GAP);
    }
    /* Expired at 40 s (cutoff 10 s), kept for 60 s more. */
    assert_int_equal(s->ops->expire_stale(s, 10000, 10000 - 60000, NULL, NULL), 1);
    assert_int_equal(s->ops->client_status(s, "big"), MSTORE_STATUS_EXPIRED);
    assert_int_equal(mstore_mem_record_bytes(s), small + per_small - elen); /* desc freed */
    assert_true(mstore_mem_bytes(s) < idx_bytes);                           /* entries freed */
    bool found;
    char *k = "blk";
    s->ops->block_exists(s, &k, 1, &found);
    assert_false(found);
    assert_int_equal(s->ops->ext_count(s), 0);
    /* Within the retention a heartbeat revives the record (REVIVED: its placements are gone,
     * the node must send them again; a later heartbeat is plain); expire it again. */
    assert_int_equal(s->ops->apply_heartbeat(s, "big", 0, 41000, NULL, NULL, 0, false, &acked),
                     MSTORE_HB_REVIVED);
    assert_int_equal(s->ops->client_status(s, "big"), MSTORE_STATUS_ALIVE);
    assert_int_equal(s->ops->apply_heartbeat(s, "big", 0, 41000, NULL, NULL, 0, false, &acked),
                     MSTORE_HB_SEQ_GAP);
    assert_int_equal(s->ops->apply_heartbeat(s, "small", 0, 45000, NULL, NULL, 0, false, &acked),
                     MSTORE_HB_SEQ_GAP);
    assert_int_equal(s->ops->apply_heartbeat(s, "other", 0, 45000, NULL, NULL, 0, false, &acked),
                     MSTORE_HB_SEQ_GAP);
    assert_int_equal(s->ops->expire_stale(s, 42000, 42000 - 60000, NULL, NULL), 1);
    assert_int_equal(s->ops->expire_stale(s, 42000, 42000 - 60000, NULL, NULL), 0);
    assert_int_equal(s->ops->client_status(s, "big"), MSTORE_STATUS_EXPIRED);
    /* Past the retention the record goes: status UNKNOWN, a heartbeat is UNKNOWN. The
     * others expire in the same tick but are still within theirs. */
    assert_int_equal(s->ops->expire_stale(s, 110000, 43000, NULL, NULL), 2);
    assert_int_equal(s->ops->client_status(s, "big"), MSTORE_STATUS_UNKNOWN);
    assert_int_equal(s->ops->apply_heartbeat(s, "big", 0, 111000, NULL, NULL, 0, false, &acked),
                     MSTORE_HB_UNKNOWN);
    assert_false(s->ops->unregister_client(s, "big"));
    /* Retention 0 (forget_before == cutoff): expired and deleted in one tick. */
    assert_int_equal(s->ops->client_status(s, "small"), MSTORE_STATUS_EXPIRED);
    assert_int_equal(s->ops->expire_stale(s, 200000, 200000, NULL, NULL), 0);
    assert_int_equal(s->ops->client_status(s, "small"), MSTORE_STATUS_UNKNOWN);
    assert_int_equal(mstore_mem_record_bytes(s), 0);
    /* A record replaced by a new registration is counted once. */
    reg(s, "small", 300000);
    assert_int_equal(mstore_mem_record_bytes(s), per_small);
    struct mstore_reg again = {.node_id = "small", .node_address = "a", .peer_address = "p"};
    assert_int_equal(s->ops->register_client(s, &again, 400000, 30000), 0); /* stale */
    assert_int_equal(mstore_mem_record_bytes(s), per_small);
    assert_true(s->ops->unregister_client(s, "small"));
    assert_int_equal(mstore_mem_record_bytes(s), 0);
    free(desc);
    s->ops->destroy(s);
}

static void test_heartbeat_cas(void **st) {
    (void)st;
    struct mstore *s = mk();
    uint64_t acked;
    assert_int_equal(s->ops->apply_heartbeat(s, "x", 1, 0, NULL, NULL, 0, false, &acked),
                     MSTORE_HB_UNKNOWN);
    reg(s, "n", 0);
    struct mstore_event add = {MSTORE_EV_ADD, "k", 2, 100}, rm = {MSTORE_EV_REMOVE, "k", 2, 0};
    assert_int_equal(s->ops->apply_heartbeat(s, "n", 1, 1, NULL, &add, 1, false, &acked),
                     MSTORE_HB_APPLIED);
    assert_int_equal(acked, 1);
    assert_int_equal(s->ops->apply_heartbeat(s, "n", 3, 2, NULL, &rm, 1, false, &acked),
                     MSTORE_HB_SEQ_GAP);
    assert_int_equal(acked, 1);
    char *k = "k";
    bool found;
    s->ops->block_exists(s, &k, 1, &found);
    assert_true(found); /* the gapped REMOVE was not applied */
    assert_int_equal(s->ops->apply_heartbeat(s, "n", 2, 3, NULL, &rm, 1, false, &acked),
                     MSTORE_HB_APPLIED);
    s->ops->block_exists(s, &k, 1, &found);
    assert_false(found);
    struct mstore_event fs = {MSTORE_EV_ADD, "f", 1, 7};
    assert_int_equal(s->ops->apply_heartbeat(s, "n", 9, 4, NULL, &fs, 1, true, &acked),
                     MSTORE_HB_APPLIED);
    assert_int_equal(acked, 9);
    struct mstore_loc *locs[1];
    size_t nl[1];
    char *f = "f";
    assert_int_equal(s->ops->block_route_get(s, &f, 1, NULL, 0, 5, 100, locs, nl), 0);
    assert_int_equal(nl[0], 1);
    assert_string_equal(locs[0][0].node_id, "n");
    free(locs[0]);
    char *ex = "n";
    assert_int_equal(s->ops->block_route_get(s, &f, 1, &ex, 1, 5, 100, locs, nl), 0);
    assert_int_equal(nl[0], 0);
    s->ops->destroy(s);
}

static char *H[] = {"h0", "h1", "h2", "h3", "h4", "h5"};

static void test_ext_index_and_hits(void **st) {
    (void)st;
    struct mstore *s = mk();
    assert_int_equal(s->ops->ext_report(s, "ghost", H, 2, 2), 0); /* not alive: ignored */
    reg(s, "a", 0);
    reg(s, "b", 0);
    assert_int_equal(s->ops->ext_report(s, "a", H, 4, 2), 1);
    assert_int_equal(s->ops->ext_report(s, "a", H, 2, 1), 1);
    assert_int_equal(s->ops->ext_report(s, "b", H, 1, 3), 1);
    assert_int_equal(s->ops->ext_count(s), 7);
    char *q[] = {"h0", "h0", "h1", "zz"};
    struct mstore_key qk[] = {{"h0", 2}, {"h0", 2}, {"h1", 2}, {"zz", 2}};
    struct mstore_match mt;
    assert_int_equal(s->ops->ext_match(s, qk, 4, true, 10, &mt), 0);
    assert_int_equal(mt.nnodes, 2);
    for (uint32_t i = 0; i < mt.nnodes; i++) {
        if (strcmp(mt.nodes[i].node_id, "a") == 0) {
            assert_int_equal(mt.nodes[i].ntiers, 2);
            assert_int_equal(mt.nodes[i].tiers[0].tier, 1); /* ascending */
            assert_int_equal(mt.nodes[i].tiers[1].n, 2);    /* deduplicated */
            assert_int_equal(mt.nodes[i].distinct, 2);
        }
    }
    mstore_match_free(&mt);
    struct mstore_hit *h;
    size_t nh;
    assert_int_equal(s->ops->hit_counts(s, q, 4, &h, &nh), 0);
    assert_int_equal(nh, 2); /* h0 once, h1 once, zz absent */
    assert_int_equal(h[0].count, 1);
    free(h);
    /* Revoke-all-at-tier drops only that tier; counters survive. */
    s->ops->ext_revoke_tier(s, "a", 2);
    s->ops->ext_revoke_tier(s, "a", 1);
    s->ops->ext_revoke_node(s, "b");
    assert_int_equal(s->ops->ext_count(s), 0);
    assert_int_equal(s->ops->hit_counts(s, q, 4, &h, &nh), 0);
    assert_int_equal(nh, 2);
    free(h);
    assert_int_equal(s->ops->hit_gc(s, 5), 0);  /* last seen at 10 */
    assert_int_equal(s->ops->hit_gc(s, 11), 2); /* older than the cutoff */
    assert_int_equal(s->ops->hit_counts(s, q, 4, &h, &nh), 0);
    assert_int_equal(nh, 0);
    free(h);
    s->ops->destroy(s);
}

static void test_reverse_index_consistency(void **st) {
    (void)st;
    struct mstore *s = mk();
    reg(s, "a", 0);
    enum { N = 2000 };
    char **hs = calloc(N, sizeof(char *));
    for (int i = 0; i < N; i++) {
        hs[i] = malloc(16);
        snprintf(hs[i], 16, "k%d", i);
    }
    assert_int_equal(s->ops->ext_report(s, "a", hs, N, 2), 1);
    assert_int_equal(s->ops->ext_report(s, "a", hs, N / 2, 3), 1);
    /* Revoke every third one individually, then the whole DRAM tier. */
    for (int i = 0; i < N; i += 3) s->ops->ext_revoke(s, "a", &hs[i], 1, 2);
    assert_int_equal(s->ops->ext_count(s), N - (N + 2) / 3 + N / 2);
    s->ops->ext_revoke_tier(s, "a", 2);
    assert_int_equal(s->ops->ext_count(s), N / 2);
    s->ops->ext_revoke_tier(s, "a", 3);
    assert_int_equal(s->ops->ext_count(s), 0);
    for (int i = 0; i < N; i++) free(hs[i]);
    free(hs);
    s->ops->destroy(s);
}

/* One shard's table grows from 16 buckets to hold 3000 entries: every one is still found by
 * the batched match (which indexes the buckets itself) and by the hit counters, and the
 * bucket array shows up in the byte count. */
static void test_ext_table_grows_and_keeps_every_entry(void **st) {
    (void)st;
    struct mstore_mem_cfg c = {.shards = 1};
    struct mstore *s = mstore_mem_create(&c);
    assert_non_null(s);
    size_t empty = mstore_mem_bytes(s);
    reg(s, "a", 0);
    enum { N = 3000 };
    char **hs = calloc(N, sizeof(char *));
    struct mstore_key *qk = calloc(N, sizeof(*qk));
    assert_non_null(hs);
    assert_non_null(qk);
    for (int i = 0; i < N; i++) {
        hs[i] = malloc(16);
        snprintf(hs[i], 16, "g%d", i);
        qk[i] = (struct mstore_key){hs[i], strlen(hs[i])};
    }
    assert_int_equal(s->ops->ext_report(s, "a", hs, N, 2), 1);
    assert_int_equal(s->ops->ext_count(s), N);
    assert_true(mstore_mem_bytes(s) >= empty + (N - 16) * sizeof(void *));
    struct mstore_match mt;
    assert_int_equal(s->ops->ext_match(s, qk, N, true, 5, &mt), 0);
    assert_int_equal(mt.nnodes, 1);
    assert_int_equal(mt.nodes[0].distinct, N);
    mstore_match_free(&mt);
    struct mstore_hit *h;
    size_t nh;
    assert_int_equal(s->ops->hit_counts(s, hs, N, &h, &nh), 0);
    assert_int_equal(nh, N);
    free(h);
    s->ops->ext_revoke_node(s, "a");
    assert_int_equal(s->ops->hit_gc(s, 6), N);
    assert_int_equal(s->ops->hit_counts(s, hs, N, &h, &nh), 0);
    assert_int_equal(nh, 0);
    free(h);
    for (int i = 0; i < N; i++) free(hs[i]);
    free(hs);
    free(qk);
    s->ops->destroy(s);
}

/* One hash held by more nodes than a 16-bit count holds: the placement array grew by
 * doubling a uint16_t capacity, which wrapped to 0 at the 32769th node (realloc to 0 bytes
 * freed the array the entry kept). Every placement must be reported, matched and revoked. */
static void test_ext_placements_past_65536_nodes(void **st) {
    (void)st;
    struct mstore *s = mk();
    enum { N = 65536 + 64 };
    char id[32], *h = "the-hash";
    for (uint32_t i = 0; i < N; i++) {
        snprintf(id, sizeof(id), "n%u", i);
        reg(s, id, 0);
        assert_int_equal(s->ops->ext_report(s, id, &h, 1, 2), 1);
    }
    assert_int_equal(s->ops->ext_count(s), N);
    struct mstore_key qk = {h, strlen(h)};
    struct mstore_match mt;
    assert_int_equal(s->ops->ext_match(s, &qk, 1, false, 0, &mt), 0);
    assert_int_equal(mt.nnodes, N);
    for (uint32_t i = 0; i < mt.nnodes; i++) {
        assert_int_equal(mt.nodes[i].distinct, 1);
        assert_int_equal(mt.nodes[i].tiers[0].tier, 2);
    }
    mstore_match_free(&mt);
    /* Revoked in the order that finds each at the array's head (a removal moves the last
     * placement into the hole), so the test stays linear. */
    for (uint32_t k = 0; k < N; k++) {
        snprintf(id, sizeof(id), "n%u", k == 0 ? 0 : N - k);
        s->ops->ext_revoke(s, id, &h, 1, 2);
    }
    assert_int_equal(s->ops->ext_count(s), 0);
    assert_int_equal(s->ops->ext_match(s, &qk, 1, false, 0, &mt), 0);
    assert_int_equal(mt.nnodes, 0);
    mstore_match_free(&mt);
    s->ops->destroy(s);
}

static uint64_t zero_rand(void) { return 0; }

static void test_route_policies(void **st) {
    (void)st;
    struct mstore_loc locs[] = {{"a", 0, 3, 1}, {"b", 1, 2, 1}, {"c", 2, 2, 1}};
    assert_int_equal(mroute_get_pick(locs, 3, NULL, zero_rand), 1);
    assert_int_equal(mroute_get_pick(locs, 3, "c", zero_rand), 2); /* own replica in best rank */
    assert_int_equal(mroute_get_pick(locs, 3, "a", zero_rand), 1); /* SSD never beats DRAM */
    struct mstore_alive c[2] = {{.node = 0, .node_id = "x"}, {.node = 1, .node_id = "y"}};
    c[0].caps.mask = c[1].caps.mask = (1u << 1) | (1u << 2) | (1u << 3);
    c[0].caps.avail[1] = 100;
    c[1].caps.avail[1] = 300;
    c[0].caps.avail[2] = c[1].caps.avail[2] = 1000;
    c[0].caps.avail[3] = 1u << 30;
    uint64_t sizes[] = {250, 250, 50, 5000};
    bool exists[] = {false, false, false, false};
    struct mroute_pick p[4];
    assert_int_equal(mroute_put_plan(c, 2, sizes, exists, 4, NULL, 0, NULL, MROUTE_MOST_AVAILABLE,
                                     MROUTE_AFF_NONE, zero_rand, p),
                     0);
    assert_int_equal(p[0].cand, 1);
    assert_int_equal(p[0].tier, 1);
    assert_int_equal(p[1].tier, 2); /* HBM used up by the first pick */
    assert_int_equal(p[2].cand, 0);
    assert_int_equal(p[2].tier, 1);
    assert_int_equal(p[3].cand, -1); /* SSD is never a put target */
    assert_int_equal(mroute_put_plan(c, 2, sizes, exists, 3, NULL, 0, "x", MROUTE_MOST_AVAILABLE,
                                     MROUTE_AFF_LOCAL, zero_rand, p),
                     0);
    assert_int_equal(p[0].cand, 0);
    assert_int_equal(p[0].tier, 2); /* local DRAM before global HBM */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_register_rules),
        cmocka_unit_test(test_reaper_releases_memory),
        cmocka_unit_test(test_heartbeat_cas),
        cmocka_unit_test(test_ext_index_and_hits),
        cmocka_unit_test(test_reverse_index_consistency),
        cmocka_unit_test(test_ext_table_grows_and_keeps_every_entry),
        cmocka_unit_test(test_ext_placements_past_65536_nodes),
        cmocka_unit_test(test_route_policies),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
