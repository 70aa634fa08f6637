"""`lmcache master` against hostile requests over grpcio: strings that are not text, bad
heartbeat events, relayed metrics that would break /metrics, oversized registrations and
the memory of reaped nodes."""

import re
import shutil
import subprocess
import time

import grpc
import pytest

from master_util import Master, use_python_package

use_python_package()
from umbp import pb, pb_grpc  # noqa: E402

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def master():
    m = Master()
    yield m
    assert m.stop() == 0


def stub(m):
    return pb_grpc.UMBPMasterStub(grpc.insecure_channel(m.addr))


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
