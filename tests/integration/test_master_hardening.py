"""`lmcache master` against hostile requests over grpcio: strings that are not text, bad
heartbeat events, relayed metrics that would break /metrics, oversized registrations and
the memory of reaped nodes."""

import re
import shutil
import subprocess
import time

import grpc
import pytest

from master_util import Master, use_python_package, backend, master, stub  # noqa: F401

use_python_package()
from umbp import pb, pb_grpc  # noqa: E402

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def raw(m, method):
    """A call that sends and receives bytes, to put what protobuf libraries refuse on the wire."""
    return grpc.insecure_channel(m.addr).unary_unary("/umbp.UMBPMaster/" + method)


def rejected(fn, *args, match=None):
    with pytest.raises(grpc.RpcError) as e:
        fn(*args)
    assert e.value.code() == INVALID, (e.value.code(), e.value.details())
    if match:
        assert re.search(match, e.value.details()), e.value.details()
    return e.value.details()


# ---- strings from the wire: no NUL, valid UTF-8 ----

NUL_ID = "victim\x00x"


def test_node_id_with_nul_is_rejected_everywhere(master):
    s = stub(master)
    s.RegisterClient(pb.RegisterClientRequest(node_id="victim", peer_address="v:1"))
    s.ReportExternalKvBlocks(pb.ReportExternalKvBlocksRequest(
        node_id="victim", hashes=["vh"], tier=pb.TIER_DRAM))
    calls = [
        (s.RegisterClient, pb.RegisterClientRequest(node_id=NUL_ID)),
        (s.UnregisterClient, pb.UnregisterClientRequest(node_id=NUL_ID)),
        (s.Heartbeat, pb.HeartbeatRequest(node_id=NUL_ID, is_full_sync=True)),
        (s.ReportExternalKvBlocks, pb.ReportExternalKvBlocksRequest(
            node_id=NUL_ID, hashes=["x"], tier=pb.TIER_DRAM)),
        (s.RevokeExternalKvBlocks, pb.RevokeExternalKvBlocksRequest(
            node_id=NUL_ID, hashes=["vh"], tier=pb.TIER_DRAM)),
        (s.RevokeAllExternalKvBlocksAtTier, pb.RevokeAllExternalKvBlocksAtTierRequest(
            node_id=NUL_ID, tier=pb.TIER_DRAM)),
        (s.RevokeAllExternalKvBlocksForNode, pb.RevokeAllExternalKvBlocksForNodeRequest(
            node_id=NUL_ID)),
        (s.RouteGet, pb.RouteGetRequest(key="k", node_id=NUL_ID)),
        (s.BatchRouteGet, pb.BatchRouteGetRequest(keys=["k"], exclude_nodes=[NUL_ID])),
        (s.BatchLookup, pb.BatchLookupRequest(keys=["k\x00x"])),
        (s.ReportMetrics, pb.ReportMetricsRequest(node_id=NUL_ID)),
        (s.GetExternalKvHitCounts, pb.GetExternalKvHitCountsRequest(hashes=["vh\x00"])),
        (s.MatchExternalKv, pb.MatchExternalKvRequest(hashes=["vh\x00x"])),
    ]
    for fn, req in calls:
        d = rejected(fn, req, match="must not contain NUL bytes")
        assert d.split()[0] in ("node_id", "key", "keys", "exclude_nodes", "hashes"), d
    # "victim" was not touched by any of them: still registered, its placement still there.
    with pytest.raises(grpc.RpcError) as e:
        s.RegisterClient(pb.RegisterClientRequest(node_id="victim"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    m = s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=["vh"]))
    assert [x.node_id for x in m.matches] == ["victim"]
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="victim"))


def test_strings_that_are_not_utf8_are_rejected(master):
    # grpcio's protobuf refuses to build these, so the bytes are patched after packing.
    req = pb.RegisterClientRequest(node_id="AAAA", node_address="n:1").SerializeToString()
    bad = req.replace(b"AAAA", b"\xff\xfeAB")
    rejected(raw(master, "RegisterClient"), bad, match="^node_id must be valid UTF-8$")
    req = pb.ReportMetricsRequest(node_id="u8", metrics=[pb.MetricSample(
        name="u8_gauge_x", gauge_value=1,
        labels=[pb.MetricLabel(name="k", value="VVVV")])]).SerializeToString()
    rejected(raw(master, "ReportMetrics"), req.replace(b"VVVV", b"\xc0\xafAB"),
             match="^value must be valid UTF-8$")
    req = pb.MatchExternalKvRequest(hashes=["HHHH"]).SerializeToString()
    rejected(raw(master, "MatchExternalKv"), req.replace(b"HHHH", b"\xed\xa0\x80A"),
             match="^hashes must be valid UTF-8$")
    # engine_desc is bytes, not text: anything goes.
    s = stub(master)
    s.RegisterClient(pb.RegisterClientRequest(node_id="u8", engine_desc=b"\x00\xff\xfe"))
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="u8"))


# ---- heartbeat events: tiers in the enum, keys not empty ----

def test_heartbeat_events_with_bad_tier_or_empty_key_are_rejected(master):
    s = stub(master)
    s.RegisterClient(pb.RegisterClientRequest(node_id="hbv"))
    good = pb.KvEvent(kind=pb.KvEvent.ADD, key="hk", tier=pb.TIER_DRAM, size=10)
    for ev, msg in ((pb.KvEvent(key="hx", tier=7), "^tier must be TIER_UNKNOWN"),
                    (pb.KvEvent(key="hx", tier=-1), "^tier must be TIER_UNKNOWN"),
                    (pb.KvEvent(key="", tier=pb.TIER_HBM), "^event key cannot be empty$")):
        for full in (False, True):
            # The bad event comes second: nothing of the heartbeat applies, not even the first.
            rejected(s.Heartbeat, pb.HeartbeatRequest(
                node_id="hbv", is_full_sync=full, delta_seq_baseline=1,
                bundles=[pb.EventBundle(seq=1, events=[good, ev])]), match=msg)
    assert list(s.BatchLookup(pb.BatchLookupRequest(keys=["hk", "hx", ""])).found) == [
        False, False, False]
    # The sequence was not consumed either: seq 1 still applies.
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="hbv", bundles=[pb.EventBundle(seq=1, events=[good])]))
    assert h.acked_seq == 1 and not h.request_full_sync
    assert list(s.BatchLookup(pb.BatchLookupRequest(keys=["hk"])).found) == [True]
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="hbv"))


# ---- ReportMetrics: /metrics stays parseable whatever the clients send ----

def assert_promtool_clean(text):
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    out = (p.stdout + p.stderr).strip()
    # 0: clean; 3: lint findings only (the reference's own names have some, e.g. a gauge named
    # mori_umbp_client_count); 1 with "error while linting": the text does not parse.
    assert p.returncode in (0, 3) and "error" not in out, out


def sample(name, labels=(), **kw):
    return pb.MetricSample(name=name, labels=[pb.MetricLabel(name=k, value=v) for k, v in labels],
                           **kw)


def hist(bounds, buckets, count, total=1.0):
    return pb.HistogramAggregate(bounds=bounds, bucket_counts=buckets, count=count, sum=total)


BAD_SAMPLES = [
    (sample("hard_bad", [("a:b", "x")], gauge_value=1), r'label name "a:b" is not valid'),
    (sample("hard_bad", [("node", "spoofed")], gauge_value=1), r'label name "node" is reserved'),
    (sample("hard_bad", [("__name__", "other")], gauge_value=1), r'"__name__" is not valid'),
    (sample("hard_bad", [("__meta", "x")], counter_delta=1), r'"__meta" is not valid'),
    (sample("hard_bad", [("", "x")], gauge_value=1), r'label name "" is not valid'),
    (sample("hard_bad", [("k", "1"), ("k", "2")], gauge_value=1), r'"k" is repeated'),
    (sample("hard-bad", gauge_value=1), "not a valid metric name"),
    (sample("1hard", gauge_value=1), "not a valid metric name"),
    (sample("", gauge_value=1), "not a valid metric name"),
    (sample("hard_h", [("le", "1")], histogram_aggregate=hist([1.0], [1], 1)), '"le" is reserved'),
    (sample("hard_h", histogram_aggregate=hist([2.0, 1.0], [1, 2], 2)), "strictly increasing"),
    (sample("hard_h", histogram_aggregate=hist([1.0, 1.0], [1, 2], 2)), "strictly increasing"),
    (sample("hard_h", histogram_aggregate=hist([1.0, 2.0], [3, 2], 3)), "cumulative"),
    (sample("hard_h", histogram_aggregate=hist([1.0, float("inf")], [1, 2], 2)), "finite"),
    (sample("hard_h", histogram_aggregate=hist([1.0, float("nan")], [1, 2], 2)), "finite"),
    (sample("hard_h", histogram_aggregate=hist([1.0, 2.0], [1], 2)), "bucket count differs"),
    (sample("hard_h", histogram_aggregate=hist([1.0, 2.0], [1, 5], 4)), r"exceed count"),
]


@pytest.mark.parametrize("bad,msg", BAD_SAMPLES, ids=[str(i) for i in range(len(BAD_SAMPLES))])
def test_report_metrics_rejects_bad_samples_and_metrics_stay_parseable(master, bad, msg):
    s = stub(master)
    good = sample("hard_good_bytes", [("k", "v")], gauge_value=7)
    # The bad sample comes second: the whole call is refused, the good one is not relayed.
    rejected(s.ReportMetrics, pb.ReportMetricsRequest(
        node_id="relay_bad", metrics=[sample("hard_not_applied", gauge_value=1), bad]),
        match=r"^metrics\[1\]: .*" + msg)
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="relay_bad", metrics=[good]))
    text = master.metrics()
    assert_promtool_clean(text)
    assert 'hard_good_bytes{node="relay_bad",k="v"} 7\n' in text
    assert "hard_not_applied" not in text and "spoofed" not in text


def test_report_metrics_escapes_help_and_label_values(master):
    s = stub(master)
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="esc\"node\\\n", metrics=[
        sample("hard_escaped_bytes", [("path", 'a"b\\c\nd')], help="line1\nline2 back\\slash \"q\"",
               gauge_value=3),
        sample("hard_escaped_hist_seconds", [("rpc", "x\ny")], help="h\\\n",
               histogram_aggregate=hist([0.1, 2.5], [1, 2], 3, 0.3)),
    ]))
    text = master.metrics()
    assert_promtool_clean(text)
    assert '# HELP hard_escaped_bytes line1\\nline2 back\\\\slash "q"\n' in text
    assert ('hard_escaped_bytes{node="esc\\"node\\\\\\n",path="a\\"b\\\\c\\nd"} 3\n') in text
    assert ('hard_escaped_hist_seconds_bucket{node="esc\\"node\\\\\\n",rpc="x\\ny",le="0.1"} 1\n'
            in text)
    assert 'hard_escaped_hist_seconds_sum{node="esc\\"node\\\\\\n",rpc="x\\ny"} 0.3\n' in text


def test_report_metrics_gauges_print_exactly(master):
    s = stub(master)
    values = {"hard_int_bytes": (123456789, "123456789"), "hard_big_bytes": (2**53, "9007199254740992"),
              "hard_tenth_ratio": (0.1, "0.1"), "hard_third_ratio": (1 / 3, "0.3333333333333333"),
              "hard_neg_ratio": (-2.5, "-2.5"), "hard_huge_ratio": (1e300, "1e+300"),
              "hard_nan_ratio": (float("nan"), "NaN"), "hard_inf_ratio": (float("inf"), "+Inf")}
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="exact", metrics=[
        sample(n, gauge_value=v) for n, (v, _) in values.items()]))
    text = master.metrics()
    assert_promtool_clean(text)
    for n, (v, shown) in values.items():
        line = re.search(r'^%s\{node="exact"\} (\S+)$' % n, text, re.M)
        assert line and line.group(1) == shown, (n, line and line.group(1))
        if v == v:
            assert float(line.group(1)) == v  # reads back exactly


def test_report_metrics_name_collisions_are_dropped(master):
    s = stub(master)
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="coll", metrics=[
        sample("mori_umbp_client_count", gauge_value=99),  # the master's own family
        sample("mori_umbp_client", histogram_aggregate=hist([1.0], [0], 0)),  # ..._count
        sample("hard_coll_seconds", histogram_aggregate=hist([1.0], [1], 1)),
        sample("hard_coll_seconds_count", gauge_value=5),  # a line of the histogram above
        sample("hard_coll_seconds_bucket", counter_delta=5),
        sample("hard_coll_ok_bytes", gauge_value=5),
    ]))
    text = master.metrics()
    assert_promtool_clean(text)
    assert 'mori_umbp_client_count{' not in text
    assert "mori_umbp_client_bucket" not in text
    assert 'hard_coll_seconds_count{node="coll"} 1\n' in text
    assert "hard_coll_seconds_count{node=\"coll\"} 5" not in text
    assert 'hard_coll_ok_bytes{node="coll"} 5\n' in text


def test_report_metrics_bad_tags_do_not_become_labels(master):
    s = stub(master)
    s.RegisterClient(pb.RegisterClientRequest(node_id="tagged", tags=[
        "a:b=1", "node=evil", "__name__=x", "__x=y", "le=2", "tier=t", "=v", "ok_tag=v",
        "ok_tag=w", "quote=\"\n\\"]))
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="tagged", metrics=[
        sample("hard_tagged_bytes", [("ok_tag", "from_sample"), ("x", "1")], gauge_value=1),
        sample("hard_tagged_seconds", histogram_aggregate=hist([1.0], [1], 1))]))
    s.Heartbeat(pb.HeartbeatRequest(node_id="tagged", tier_kv_counts=[
        pb.TierKvCount(tier=pb.TIER_DRAM, count=3)]))
    text = master.metrics()
    assert_promtool_clean(text)
    labels = '{node="tagged",ok_tag="v",quote="\\"\\n\\\\"'
    assert "hard_tagged_bytes" + labels + ',x="1"} 1\n' in text
    assert "hard_tagged_seconds_bucket" + labels + ',le="1"} 1\n' in text
    assert "mori_umbp_client_kv_live_count" + labels + ',tier="DRAM"} 3\n' in text
    assert "evil" not in text
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="tagged"))


def test_report_metrics_histogram_bounds_must_match_the_first(master):
    s = stub(master)
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="hb", metrics=[
        sample("hard_merge_seconds", histogram_aggregate=hist([1.0, 2.0], [1, 2], 3, 1.5))]))
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="hb", metrics=[  # same count, other bounds
        sample("hard_merge_seconds", histogram_aggregate=hist([1.0, 3.0], [5, 5], 5, 1.5))]))
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="hb", metrics=[
        sample("hard_merge_seconds", histogram_aggregate=hist([1.0, 2.0], [1, 1], 1, 0.5))]))
    text = master.metrics()
    assert_promtool_clean(text)
    assert 'hard_merge_seconds_bucket{node="hb",le="2"} 3\n' in text
    assert 'hard_merge_seconds_count{node="hb"} 4\n' in text
    assert 'hard_merge_seconds_sum{node="hb"} 2\n' in text


# ---- registrations are bounded; reaped nodes give their memory back ----

MIB = 1 << 20


def test_engine_desc_is_capped(master):
    s = stub(master)
    rejected(s.RegisterClient, pb.RegisterClientRequest(node_id="fat", engine_desc=b"x" * (MIB + 1)),
             match=r"^engine_desc exceeds LMCACHE_MASTER_MAX_ENGINE_DESC_BYTES=1048576$")
    # Nothing was registered: the same id registers fine with the largest allowed desc.
    s.RegisterClient(pb.RegisterClientRequest(node_id="fat", engine_desc=b"x" * MIB))
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="fat"))


def test_engine_desc_cap_is_a_knob():
    m = Master(env={"LMCACHE_MASTER_MAX_ENGINE_DESC_BYTES": "100"}, metrics=False)
    try:
        s = stub(m)
        rejected(s.RegisterClient, pb.RegisterClientRequest(node_id="n", engine_desc=b"x" * 101),
                 match="LMCACHE_MASTER_MAX_ENGINE_DESC_BYTES=100$")
        s.RegisterClient(pb.RegisterClientRequest(node_id="n", engine_desc=b"x" * 100))
    finally:
        assert m.stop() == 0


def test_registration_strings_and_tags_are_bounded(master):
    s = stub(master)
    long_id = "i" * 1025
    for fn, req in ((s.RegisterClient, pb.RegisterClientRequest(node_id=long_id)),
                    (s.Heartbeat, pb.HeartbeatRequest(node_id=long_id)),
                    (s.BatchLookup, pb.BatchLookupRequest(node_id=long_id, keys=["k"])),
                    (s.ReportMetrics, pb.ReportMetricsRequest(node_id=long_id)),
                    (s.RouteGet, pb.RouteGetRequest(node_id=long_id, key="k"))):
        rejected(fn, req, match="^node_id exceeds 1024 bytes$")
    rejected(s.RegisterClient, pb.RegisterClientRequest(node_id="b", peer_address="p" * 4097),
             match="^peer_address exceeds 4096 bytes$")
    rejected(s.RegisterClient, pb.RegisterClientRequest(node_id="b", tags=["t=%d" % i for i in range(65)]),
             match="^tags: more than 64$")
    rejected(s.RegisterClient, pb.RegisterClientRequest(node_id="b", tags=["t=" + "v" * 4095]),
             match="^tags entry exceeds 4096 bytes$")
    s.RegisterClient(pb.RegisterClientRequest(node_id="i" * 1024, peer_address="p" * 4096,
                                              tags=["t%d=%s" % (i, "v" * 4000) for i in range(64)]))
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="i" * 1024))


FAST_EXPIRY = {"UMBP_HEARTBEAT_TTL_SEC": "1", "UMBP_MAX_MISSED_HEARTBEATS": "1",
               "UMBP_REAPER_INTERVAL_SEC": "1"}


def start_silent_node(s, node):
    """Registers node with a 1 MiB engine_desc, one block and one external-KV placement."""
    s.RegisterClient(pb.RegisterClientRequest(node_id=node, peer_address=node + ":1",
                                              engine_desc=b"d" * MIB))
    ev = pb.KvEvent(kind=pb.KvEvent.ADD, key=node + "-blk", tier=pb.TIER_DRAM, size=1)
    assert s.Heartbeat(pb.HeartbeatRequest(
        node_id=node, bundles=[pb.EventBundle(seq=1, events=[ev])])).acked_seq == 1
    s.ReportExternalKvBlocks(pb.ReportExternalKvBlocksRequest(
        node_id=node, hashes=[node + "-h"], tier=pb.TIER_DRAM))
    assert len(s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[node + "-h"])).matches) == 1


def wait_reaped(s, node, alive="stay"):
    """Polls (bounded) until the reaper wiped node's entries; alive keeps heartbeating."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s.Heartbeat(pb.HeartbeatRequest(node_id=alive))
        gone = not s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[node + "-h"])).matches
        if gone and not s.BatchLookup(pb.BatchLookupRequest(keys=[node + "-blk"])).found[0]:
            return
        time.sleep(0.1)
    raise AssertionError("node %s was not reaped" % node)


def test_reaped_node_record_is_deleted_after_the_retention():
    m = Master(env=dict(FAST_EXPIRY, LMCACHE_MASTER_EXPIRED_RETENTION_SEC="0"), metrics=False)
    try:
        s = stub(m)
        s.RegisterClient(pb.RegisterClientRequest(node_id="stay"))
        start_silent_node(s, "gone")
        wait_reaped(s, "gone")
        # The record went with the entries: the node is unknown, not revived by a heartbeat.
        h = s.Heartbeat(pb.HeartbeatRequest(node_id="gone"))
        assert h.status == pb.CLIENT_STATUS_UNKNOWN
        assert s.Heartbeat(pb.HeartbeatRequest(node_id="stay")).status == pb.CLIENT_STATUS_ALIVE
        s.RegisterClient(pb.RegisterClientRequest(node_id="gone"))  # registers from scratch
        assert s.Heartbeat(pb.HeartbeatRequest(node_id="gone")).status == pb.CLIENT_STATUS_ALIVE
    finally:
        assert m.stop() == 0


def test_expired_node_is_revived_by_a_heartbeat_within_the_retention():
    m = Master(env=FAST_EXPIRY, metrics=False)  # default retention: 300 s
    try:
        s = stub(m)
        s.RegisterClient(pb.RegisterClientRequest(node_id="stay"))
        start_silent_node(s, "nap")
        wait_reaped(s, "nap")
        h = s.Heartbeat(pb.HeartbeatRequest(node_id="nap"))
        assert h.status == pb.CLIENT_STATUS_ALIVE and h.acked_seq == 1  # the record was kept
        # Its placements went at expiry: the revived node is asked to send them again.
        assert h.request_full_sync
    finally:
        assert m.stop() == 0


def test_departed_nodes_leave_the_metrics():
    # A node's per-node series (capacities, heartbeats, reports...) stayed on /metrics after it
    # unregistered or expired, and with node ids that change at every restart the families
    # filled up (4096 series each) and newer nodes got none. They now go with the node.
    m = Master(env=FAST_EXPIRY)
    try:
        s = stub(m)
        caps = [pb.TierCapacity(tier=pb.TIER_DRAM, total_capacity_bytes=MIB,
                                available_capacity_bytes=MIB)]
        s.RegisterClient(pb.RegisterClientRequest(node_id="stay", tier_capacities=caps))
        s.RegisterClient(pb.RegisterClientRequest(node_id="leaves", tier_capacities=caps))
        start_silent_node(s, "nap")
        s.Heartbeat(pb.HeartbeatRequest(node_id="nap", tier_capacities=caps))
        s.ReportExternalKvBlocks(pb.ReportExternalKvBlocksRequest(
            node_id="leaves", hashes=["x"], tier=pb.TIER_DRAM))
        text = m.metrics()
        for node in ("stay", "leaves", "nap"):
            assert 'mori_umbp_client_capacity_total_bytes{node="%s",tier="DRAM"}' % node in text
        assert 'mori_umbp_external_kv_report_total{node="leaves"' in text
        s.UnregisterClient(pb.UnregisterClientRequest(node_id="leaves"))
        text = m.metrics()
        assert 'node="leaves"' not in text
        wait_reaped(s, "nap")
        text = m.metrics()
        assert 'node="nap"' not in text
        assert 'mori_umbp_client_capacity_total_bytes{node="stay",tier="DRAM"}' in text
        # Back again: its series come back with it.
        s.RegisterClient(pb.RegisterClientRequest(node_id="leaves", tier_capacities=caps))
        assert 'mori_umbp_client_capacity_total_bytes{node="leaves",tier="DRAM"}' in m.metrics()
    finally:
        assert m.stop() == 0


# ---- the metrics port: one thread, so one deadline per connection ----


def test_trickling_client_cannot_hold_the_metrics_port(backend):
    """A client sending a byte a second and never a full request line held the port's one
    thread for as long as it kept trickling (each byte reset a 2 s timeout): /metrics and
    /route waited behind it. Every connection now has 5 s from its accept."""
    import socket
    import threading
    import urllib.request

    if backend != "inmemory":
        pytest.skip("the HTTP port does not depend on the store")
    m = Master()
    cut = []
    stop = threading.Event()

    def trickle():
        s = socket.create_connection(("127.0.0.1", m.metrics_port))
        s.settimeout(1.0)
        t0 = time.monotonic()
        s.sendall(b"G")
        try:
            while not stop.is_set() and time.monotonic() - t0 < 60:
                try:
                    s.recv(4096)  # the master answered or closed: cut off
                    cut.append(time.monotonic() - t0)
                    return
                except socket.timeout:
                    s.sendall(b"E")  # would keep it alive for 4095 bytes x 2 s
        except OSError:
            cut.append(time.monotonic() - t0)
        finally:
            s.close()

    t = threading.Thread(target=trickle, daemon=True)
    try:
        t.start()
        time.sleep(1.0)  # the trickler holds the connection being served
        t0 = time.monotonic()
        url = "http://127.0.0.1:%d/metrics" % m.metrics_port
        with urllib.request.urlopen(url, timeout=30) as r:
            assert r.status == 200
            assert "mori_umbp_client_count" in r.read().decode()
        assert time.monotonic() - t0 < 15
        t.join(timeout=30)
        assert cut and cut[0] < 15, cut
    finally:
        stop.set()
        t.join(timeout=5)
        assert m.stop() == 0
