/* MatchExternalKv wire code against protobuf-c: the master's in-place request decoder and
 * direct reply encoder (src/master/mwire.c), and the C client's reply decoder. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../src/client/umbp_client.c" /* decode_match is static */
#include "master/mstore.h"
#include "master/mwire.h"

/* The two decoders agree on acceptance and, when accepted, on every hash and the flag. */
static void same_as_protobuf_c(const uint8_t *d, size_t n) {
    struct mstore_key *k;
    size_t nk;
    bool hit;
    int rc = mwire_match_request(d, n, &k, &nk, &hit);
    Umbp__MatchExternalKvRequest *q = umbp__match_external_kv_request__unpack(NULL, n, d);
    if ((rc == MWIRE_OK) != (q != NULL)) {
        fprintf(stderr, "mismatch rc=%d pbc=%d n=%zu:", rc, q != NULL, n);
        for (size_t i = 0; i < n; i++) fprintf(stderr, " %02x", d[i]);
        fprintf(stderr, "\n");
    }
    assert_int_equal(rc == MWIRE_OK, q != NULL);
    if (q) {
        assert_int_equal(nk, q->n_hashes);
        assert_int_equal(hit, q->count_as_hit);
        for (size_t i = 0; i < nk; i++) { /* protobuf-c's C string ends at a NUL */
            const char *z = memchr(k[i].p, 0, k[i].n);
            size_t cn = z ? (size_t)(z - k[i].p) : k[i].n;
            assert_int_equal(cn, strlen(q->hashes[i]));
            assert_memory_equal(k[i].p, q->hashes[i], cn);
        }
        umbp__match_external_kv_request__free_unpacked(q, NULL);
    }
    free(k);
}

static void test_request_decoder(void **st) {
    (void)st;
    char *hs[] = {"h0", "", "a-longer-hash-0123456789abcdef0123456789abcdef0123456789abcdef"};
    Umbp__MatchExternalKvRequest q = UMBP__MATCH_EXTERNAL_KV_REQUEST__INIT;
    q.n_hashes = 3;
    q.hashes = hs;
    q.count_as_hit = true;
    uint8_t buf[512];
    size_t n = umbp__match_external_kv_request__pack(&q, buf);
    same_as_protobuf_c(buf, n);
    for (size_t cut = 0; cut < n; cut++) same_as_protobuf_c(buf, cut); /* truncations */
    /* Unknown fields of every wire type protobuf-c skips, then the flag reset to 0. */
    uint8_t extra[] = {0x38, 0x96, 0x01,                     /* field 7 varint */
                       0x45, 1,    2,    3,   4,             /* field 8 fixed32 */
                       0x49, 1,    2,    3,   4, 5, 6, 7, 8, /* field 9 fixed64 */
                       0x52, 2,    'x',  'y',                /* field 10 bytes */
                       0x10, 0x00};
    memcpy(buf + n, extra, sizeof(extra));
    same_as_protobuf_c(buf, n + sizeof(extra));
    const uint8_t bad[][4] = {
        {0x08, 0x01},            /* hashes as a varint */
        {0x12, 0x01, 0x01},      /* count_as_hit length-delimited */
        {0x0b, 0x0c},            /* a group */
        {0x0a, 0x05, 'a'},       /* length past the end */
        {0x00, 0x00},            /* field 0 */
        {0x0a, 0x03, 'a', 0x00}, /* length past the end */
    };
    const size_t bad_len[] = {2, 3, 2, 3, 2, 4};
    for (size_t i = 0; i < sizeof(bad_len) / sizeof(bad_len[0]); i++)
        same_as_protobuf_c(bad[i], bad_len[i]);
    same_as_protobuf_c(NULL, 0);
}

/* A hash with an embedded NUL keeps its wire length (the handler then rejects it). */
static void test_request_keeps_embedded_nul(void **st) {
    (void)st;
    const uint8_t d[] = {0x0a, 0x08, 'v', 'i', 'c', 't', 'i', 'm', 0x00, 'x'};
    same_as_protobuf_c(d, sizeof(d));
    struct mstore_key *k;
    size_t nk;
    bool hit;
    assert_int_equal(mwire_match_request(d, sizeof(d), &k, &nk, &hit), MWIRE_OK);
    assert_int_equal(nk, 1);
    assert_int_equal(k[0].n, 8);
    assert_int_equal(mwire_text_check(k[0].p, k[0].n), MWIRE_TEXT_NUL);
    free(k);
}

static void test_text_check(void **st) {
    (void)st;
    static const struct {
        const char *s;
        size_t n;
        int want;
    } cases[] = {
        {"", 0, MWIRE_TEXT_OK},
        {"plain ascii", 11, MWIRE_TEXT_OK},
        {"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 14, MWIRE_TEXT_OK},
        {"victim\0x", 8, MWIRE_TEXT_NUL},
        {"\xff", 1, MWIRE_TEXT_UTF8},
        {"\xc0\xaf", 2, MWIRE_TEXT_UTF8},         /* overlong '/' */
        {"\xe0\x80\xaf", 3, MWIRE_TEXT_UTF8},     /* overlong */
        {"\xed\xa0\x80", 3, MWIRE_TEXT_UTF8},     /* surrogate */
        {"\xf4\x90\x80\x80", 4, MWIRE_TEXT_UTF8}, /* > U+10FFFF */
        {"\xe2\x82", 2, MWIRE_TEXT_UTF8},         /* truncated */
        {"\xe2\x28\xa1", 3, MWIRE_TEXT_UTF8},     /* bad continuation */
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        assert_int_equal(mwire_text_check(cases[i].s, cases[i].n), cases[i].want);
}

/* Every string field of a request, nested messages included, is checked with its wire
 * length: an id with an embedded NUL or a label that is not UTF-8 is named. */
static void test_check_strings(void **st) {
    (void)st;
    uint8_t buf[256];
    const char *field;
    Umbp__RegisterClientRequest q = UMBP__REGISTER_CLIENT_REQUEST__INIT;
    q.node_id = "ok";
    q.node_address = "addr";
    size_t n = umbp__register_client_request__pack(&q, buf);
    assert_int_equal(
        mwire_check_strings(&umbp__register_client_request__descriptor, buf, n, &field),
        MWIRE_TEXT_OK);
    /* node_id "victim\0x" spliced in by hand: protobuf-c would stop at the NUL. */
    const uint8_t nul[] = {0x0a, 0x08, 'v', 'i', 'c', 't', 'i', 'm', 0x00, 'x'};
    assert_int_equal(
        mwire_check_strings(&umbp__register_client_request__descriptor, nul, sizeof(nul), &field),
        MWIRE_TEXT_NUL);
    assert_string_equal(field, "node_id");
    Umbp__MetricLabel lab = UMBP__METRIC_LABEL__INIT;
    lab.name = "k";
    lab.value = "\xff\xfe";
    Umbp__MetricLabel *plab = &lab;
    Umbp__MetricSample smp = UMBP__METRIC_SAMPLE__INIT;
    smp.name = "m";
    smp.n_labels = 1;
    smp.labels = &plab;
    Umbp__MetricSample *psmp = &smp;
    Umbp__ReportMetricsRequest rq = UMBP__REPORT_METRICS_REQUEST__INIT;
    rq.node_id = "n";
    rq.n_metrics = 1;
    rq.metrics = &psmp;
    n = umbp__report_metrics_request__pack(&rq, buf);
    assert_int_equal(mwire_check_strings(&umbp__report_metrics_request__descriptor, buf, n, &field),
                     MWIRE_TEXT_UTF8);
    assert_string_equal(field, "value");
    /* A node_id may be 1024 bytes long, not more; other strings have no such limit here. */
    static char id[1100];
    memset(id, 'i', 1025);
    Umbp__HeartbeatRequest hb = UMBP__HEARTBEAT_REQUEST__INIT;
    hb.node_id = id;
    uint8_t big[1200];
    n = umbp__heartbeat_request__pack(&hb, big);
    assert_int_equal(mwire_check_strings(&umbp__heartbeat_request__descriptor, big, n, &field),
                     MWIRE_TEXT_LONG);
    assert_string_equal(field, "node_id");
    id[1024] = 0;
    n = umbp__heartbeat_request__pack(&hb, big);
    assert_int_equal(mwire_check_strings(&umbp__heartbeat_request__descriptor, big, n, &field),
                     MWIRE_TEXT_OK);
    Umbp__RouteGetRequest rg = UMBP__ROUTE_GET_REQUEST__INIT;
    memset(id, 'k', 1099);
    rg.key = id;
    rg.node_id = "n";
    n = umbp__route_get_request__pack(&rg, big);
    assert_int_equal(mwire_check_strings(&umbp__route_get_request__descriptor, big, n, &field),
                     MWIRE_TEXT_OK);
    /* bytes fields are not text: engine_desc may hold anything. */
    Umbp__RegisterClientRequest e = UMBP__REGISTER_CLIENT_REQUEST__INIT;
    e.node_id = "n";
    e.engine_desc.data = (uint8_t *)"\0\xff";
    e.engine_desc.len = 2;
    n = umbp__register_client_request__pack(&e, buf);
    assert_int_equal(
        mwire_check_strings(&umbp__register_client_request__descriptor, buf, n, &field),
        MWIRE_TEXT_OK);
}

static void reg(struct mstore *s, const char *id, const char *peer) {
    struct mstore_reg r = {.node_id = id, .node_address = id, .peer_address = peer};
    assert_int_equal(s->ops->register_client(s, &r, 0, 30000), 0);
}

/* The encoded reply unpacks with protobuf-c to the store's result, and the client's decoder
 * reads the same thing (tiers ascending, hashes in request order). */
static void test_reply_roundtrip(void **st) {
    (void)st;
    struct mstore_mem_cfg c = {.shards = 4};
    struct mstore *s = mstore_mem_create(&c);
    reg(s, "node-a", "peer-a:1");
    reg(s, "node-b", "");
    char *ha[] = {"h0", "h1", "h2"}, *hb[] = {"h2", "h3"};
    assert_int_equal(s->ops->ext_report(s, "node-a", ha, 3, 2), 1); /* DRAM */
    assert_int_equal(s->ops->ext_report(s, "node-a", ha, 1, 1), 1); /* h0 also HBM */
    assert_int_equal(s->ops->ext_report(s, "node-b", hb, 2, 0), 1); /* UNKNOWN tier */
    struct mstore_key keys[] = {{"h3", 2}, {"h2", 2}, {"zz", 2}, {"h0", 2}, {"h2", 2}};
    struct mstore_match mt;
    assert_int_equal(s->ops->ext_match(s, keys, 5, false, 1, &mt), 0);
    uint8_t *buf;
    size_t len;
    assert_int_equal(mwire_match_reply(&mt, keys, &buf, &len), MWIRE_OK);
    Umbp__MatchExternalKvResponse *r = umbp__match_external_kv_response__unpack(NULL, len, buf);
    assert_non_null(r);
    assert_int_equal(r->n_matches, 2);
    for (size_t i = 0; i < r->n_matches; i++) {
        Umbp__ExternalKvNodeMatch *m = r->matches[i];
        if (strcmp(m->node_id, "node-b") == 0) {
            assert_string_equal(m->peer_address, "");
            assert_int_equal(m->n_hashes_by_tier, 1);
            assert_int_equal(m->hashes_by_tier[0]->tier, 0);
            assert_int_equal(m->hashes_by_tier[0]->n_hashes, 2);
            assert_string_equal(m->hashes_by_tier[0]->hashes[0], "h3");
            assert_string_equal(m->hashes_by_tier[0]->hashes[1], "h2");
        } else {
            assert_string_equal(m->node_id, "node-a");
            assert_string_equal(m->peer_address, "peer-a:1");
            assert_int_equal(m->n_hashes_by_tier, 2);
            assert_int_equal(m->hashes_by_tier[0]->tier, 1);
            assert_int_equal(m->hashes_by_tier[0]->n_hashes, 1);
            assert_string_equal(m->hashes_by_tier[0]->hashes[0], "h0");
            assert_int_equal(m->hashes_by_tier[1]->tier, 2);
            assert_int_equal(m->hashes_by_tier[1]->n_hashes, 2); /* duplicate h2 once */
            assert_string_equal(m->hashes_by_tier[1]->hashes[0], "h2");
            assert_string_equal(m->hashes_by_tier[1]->hashes[1], "h0");
        }
    }
    /* protobuf-c's own encoding of the same message is byte-identical. */
    size_t n2 = umbp__match_external_kv_response__get_packed_size(r);
    uint8_t *b2 = malloc(n2);
    assert_non_null(b2);
    assert_int_equal(umbp__match_external_kv_response__pack(r, b2), len);
    assert_memory_equal(b2, buf, len);
    free(b2);

    struct umbp_match_result res;
    assert_int_equal(decode_match(buf, len, &res), 0);
    assert_int_equal(res.n, r->n_matches);
    for (size_t i = 0; i < res.n; i++) {
        Umbp__ExternalKvNodeMatch *m = r->matches[i];
        assert_string_equal(res.nodes[i].node_id, m->node_id);
        assert_string_equal(res.nodes[i].peer_address, m->peer_address);
        assert_int_equal(res.nodes[i].ntiers, m->n_hashes_by_tier);
        for (size_t t = 0; t < res.nodes[i].ntiers; t++) {
            assert_int_equal(res.nodes[i].tiers[t].tier, m->hashes_by_tier[t]->tier);
            assert_int_equal(res.nodes[i].tiers[t].n, m->hashes_by_tier[t]->n_hashes);
            for (size_t k = 0; k < res.nodes[i].tiers[t].n; k++)
                assert_string_equal(res.nodes[i].tiers[t].hashes[k],
                                    m->hashes_by_tier[t]->hashes[k]);
        }
    }
    assert_int_equal(umbp_node_match_count(&res.nodes[0]) + umbp_node_match_count(&res.nodes[1]),
                     4); /* a: h2 h0; b: h3 h2 */
    umbp_match_result_free(&res);
    for (size_t cut = 0; cut < len; cut++) { /* truncated replies are refused or shorter */
        if (decode_match(buf, cut, &res) == 0) umbp_match_result_free(&res);
    }
    umbp__match_external_kv_response__free_unpacked(r, NULL);
    free(buf);
    mstore_match_free(&mt);
    s->ops->destroy(s);
}

/* The client's decoder orders tiers and accepts fields in any order. */
static void test_client_decoder_order(void **st) {
    (void)st;
    /* node { tiers {tier 3, "x"}, tiers {tier 1, "y"}, node_id "n" } */
    const uint8_t msg[] = {0x0a, 0x11, 0x1a, 0x05, 0x08, 0x03, 0x12, 0x01, 'x', 0x1a,
                           0x05, 0x08, 0x01, 0x12, 0x01, 'y',  0x0a, 0x01, 'n'};
    struct umbp_match_result res;
    assert_int_equal(decode_match(msg, sizeof(msg), &res), 0);
    assert_int_equal(res.n, 1);
    assert_string_equal(res.nodes[0].node_id, "n");
    assert_string_equal(res.nodes[0].peer_address, "");
    assert_int_equal(res.nodes[0].ntiers, 2);
    assert_int_equal(res.nodes[0].tiers[0].tier, UMBP_TIER_HBM);
    assert_string_equal(res.nodes[0].tiers[0].hashes[0], "y");
    assert_int_equal(res.nodes[0].tiers[1].tier, UMBP_TIER_SSD);
    umbp_match_result_free(&res);
    const uint8_t bad[] = {0x0a, 0x03, 0x1a, 0x01, 0x08}; /* tier truncated */
    assert_int_equal(decode_match(bad, sizeof(bad), &res), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_request_decoder), cmocka_unit_test(test_request_keeps_embedded_nul),
        cmocka_unit_test(test_text_check),      cmocka_unit_test(test_check_strings),
        cmocka_unit_test(test_reply_roundtrip), cmocka_unit_test(test_client_decoder_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
