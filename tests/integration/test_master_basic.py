"""`lmcache master`: process lifecycle, membership and the wire contract over grpcio."""

import os
import re
import signal

import grpc
import pytest

from master_util import Master, build_dir, use_python_package, backend, master, stub  # noqa: F401

use_python_package()
from umbp import UMBPMasterClient, UMBPTierType, pb, pb_grpc  # noqa: E402

GB = 1 << 30


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_clean_exit_on_signal(sig):
    m = Master(metrics=False)
    assert m.stop(sig) == 0
    assert "[Master] Resolved timing: heartbeat_ttl=10s reaper_interval=5s max_missed=3" in m.stdout


def test_resolved_timing_line_shows_env_whatever_the_log_level():
    m = Master(env={"UMBP_HEARTBEAT_TTL_SEC": "7", "UMBP_LEASE_DURATION_SEC": "+4",
                    "UMBP_REAPER_INTERVAL_SEC": "bogus", "MORI_UMBP_LOG_LEVEL": "error"},
               metrics=False)
    assert m.stop() == 0
    lines = [l for l in m.stdout.splitlines() if l.startswith("[Master] Resolved timing:")]
    assert len(lines) == 1
    assert "heartbeat_ttl=7s reaper_interval=5s" in lines[0]
    assert "lease_duration=4s" in lines[0]


def test_umbp_master_symlink_runs_the_master():
    link = os.path.join(build_dir(), "umbp_master")
    assert os.path.islink(link)
    m = Master(argv0=link, metrics=False)
    c = UMBPMasterClient(m.addr, node_id="n", node_address="n:1")
    c.register_self({UMBPTierType.DRAM: (GB, GB)})
    assert m.stop() == 0


def test_register_twice_is_already_exists(master):
    c = UMBPMasterClient(master.addr, node_id="dup", node_address="dup:1")
    c.register_self({UMBPTierType.DRAM: (GB, GB)})
    with pytest.raises(RuntimeError, match="node is already alive and cannot be re-registered"):
        UMBPMasterClient(master.addr, node_id="dup").register_self({})
    with pytest.raises(grpc.RpcError) as e:
        stub(master).RegisterClient(pb.RegisterClientRequest(node_id="dup"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    c.unregister_self()
    assert not c.is_registered()
    c.register_self({})  # re-register after unregister works
    c.unregister_self()


def test_register_response_and_heartbeat_sequence(master):
    s = stub(master)
    r = s.RegisterClient(pb.RegisterClientRequest(node_id="hb", node_address="hb:1"))
    assert r.heartbeat_interval_ms == 5000 and r.ack_seq == 0
    ev = pb.KvEvent(kind=pb.KvEvent.ADD, key="k1", tier=pb.TIER_DRAM, size=100)
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="hb", bundles=[pb.EventBundle(seq=1, events=[ev])]))
    assert h.status == pb.CLIENT_STATUS_ALIVE and h.acked_seq == 1 and not h.request_full_sync
    g = s.RouteGet(pb.RouteGetRequest(key="k1"))
    assert g.found and g.node_id == "hb" and g.size == 100 and g.tier == pb.TIER_DRAM
    # A gap asks for a full sync and acks the last applied sequence.
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="hb", bundles=[pb.EventBundle(seq=5, events=[])]))
    assert h.request_full_sync and h.acked_seq == 1
    # Keepalive: no bundles, liveness only.
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="hb"))
    assert h.status == pb.CLIENT_STATUS_ALIVE and h.acked_seq == 1 and not h.request_full_sync
    # A full sync replaces the node's blocks and acks the baseline.
    ev2 = pb.KvEvent(kind=pb.KvEvent.ADD, key="k2", tier=pb.TIER_HBM, size=7)
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="hb", is_full_sync=True, delta_seq_baseline=9,
                                        bundles=[pb.EventBundle(seq=0, events=[ev2])]))
    assert h.acked_seq == 9 and not h.request_full_sync
    assert list(s.BatchLookup(pb.BatchLookupRequest(keys=["k1", "k2", ""])).found) == [
        False, True, False]
    rm = pb.KvEvent(kind=pb.KvEvent.REMOVE, key="k2", tier=pb.TIER_HBM)
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="hb", bundles=[pb.EventBundle(seq=10, events=[rm])]))
    assert h.acked_seq == 10
    assert not s.RouteGet(pb.RouteGetRequest(key="k2")).found
    # Unknown nodes get OK with status UNKNOWN.
    h = s.Heartbeat(pb.HeartbeatRequest(node_id="nobody"))
    assert h.status == pb.CLIENT_STATUS_UNKNOWN
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="hb"))
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="never-registered"))


def test_route_put_and_batch_route(master):
    s = stub(master)
    caps = [pb.TierCapacity(tier=pb.TIER_HBM, total_capacity_bytes=1000, available_capacity_bytes=300),
            pb.TierCapacity(tier=pb.TIER_DRAM, total_capacity_bytes=10000, available_capacity_bytes=9000),
            pb.TierCapacity(tier=pb.TIER_SSD, total_capacity_bytes=10**9, available_capacity_bytes=10**9)]
    s.RegisterClient(pb.RegisterClientRequest(node_id="rp", peer_address="rp:9", tier_capacities=caps))
    with pytest.raises(grpc.RpcError) as e:
        s.RoutePut(pb.RoutePutRequest(key=""))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == "key cannot be empty"
    with pytest.raises(grpc.RpcError) as e:
        s.RouteGet(pb.RouteGetRequest(key=""))
    assert e.value.details() == "key cannot be empty"
    r = s.RoutePut(pb.RoutePutRequest(key="x", block_size=200))
    assert r.outcome == pb.ROUTE_PUT_OUTCOME_ROUTED and r.node_id == "rp" and r.tier == pb.TIER_HBM
    assert r.peer_address == "rp:9"
    r = s.BatchRoutePut(pb.BatchRoutePutRequest(keys=["a", "b", "c"], block_sizes=[200, 200, 10**6]))
    assert [x.tier for x in r.entries] == [pb.TIER_HBM, pb.TIER_DRAM, pb.TIER_UNKNOWN]
    assert r.entries[2].outcome == pb.ROUTE_PUT_OUTCOME_UNAVAILABLE
    with pytest.raises(grpc.RpcError) as e:
        s.BatchRoutePut(pb.BatchRoutePutRequest(keys=["a"], block_sizes=[]))
    assert e.value.details() == "keys and block_sizes must have the same length"
    ev = pb.KvEvent(kind=pb.KvEvent.ADD, key="have", tier=pb.TIER_SSD, size=5)
    s.Heartbeat(pb.HeartbeatRequest(node_id="rp", bundles=[pb.EventBundle(seq=1, events=[ev])],
                                    tier_capacities=caps))
    r = s.RoutePut(pb.RoutePutRequest(key="have", block_size=1))
    assert r.outcome == pb.ROUTE_PUT_OUTCOME_ALREADY_EXISTS
    r = s.RoutePut(pb.RoutePutRequest(key="y", block_size=1, exclude_nodes=["rp"]))
    assert r.outcome == pb.ROUTE_PUT_OUTCOME_UNAVAILABLE
    g = s.BatchRouteGet(pb.BatchRouteGetRequest(keys=["have", "missing", "have"]))
    assert list(g.node_ref) == [1, 0, 1] and len(g.nodes) == 1
    assert g.nodes[0].node_id == "rp" and g.nodes[0].peer_address == "rp:9"
    assert list(g.tier) == [pb.TIER_SSD, pb.TIER_UNKNOWN, pb.TIER_SSD] and list(g.size) == [5, 0, 5]
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="rp"))


def test_unknown_method_is_unimplemented(master):
    ch = grpc.insecure_channel(master.addr)
    call = ch.unary_unary("/umbp.UMBPMaster/NoSuchThing")
    with pytest.raises(grpc.RpcError) as e:
        call(b"")
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_garbage_request_is_invalid_argument(master):
    ch = grpc.insecure_channel(master.addr)
    call = ch.unary_unary("/umbp.UMBPMaster/MatchExternalKv")
    with pytest.raises(grpc.RpcError) as e:
        call(b"\xff\xff\xff\xff")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_endpoint(master):
    import urllib.error
    import urllib.request

    c = UMBPMasterClient(master.addr, node_id="met", node_address="met:1")
    c.register_self({UMBPTierType.DRAM: (GB, GB // 2)})
    c.report_external_kv_blocks("met", ["m1", "m2"], UMBPTierType.DRAM)
    c.match_external_kv(["m1", "zz"])
    text = master.metrics()
    assert re.search(r'^mori_umbp_external_kv_report_total\{node="met",tier="DRAM",result="ok"\} 1', text, re.M)
    assert re.search(r'^mori_umbp_external_kv_report_blocks_total\{node="met",tier="DRAM"\} 2', text, re.M)
    assert re.search(r"^mori_umbp_external_kv_match_total \d", text, re.M)
    assert "# TYPE mori_umbp_client_count gauge" in text
    assert re.search(r'^mori_umbp_client_capacity_utilization_ratio\{node="met",tier="DRAM"\} 0.5', text, re.M)
    for path in ("/", "/nope", "/metricsx"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen("http://127.0.0.1:%d%s" % (master.metrics_port, path))
        assert e.value.code == 404
    c.unregister_self()


def test_heartbeats_of_unknown_nodes_create_no_metric_series(master):
    # Heartbeats for made-up node ids (no registration needed) once filled the per-node
    # capacity families for good (4096 series each): a real node then got none.
    s = stub(master)
    caps = [pb.TierCapacity(tier=pb.TIER_DRAM, total_capacity_bytes=GB,
                            available_capacity_bytes=GB)]
    ev = pb.KvEvent(kind=pb.KvEvent.ADD, key="k", tier=pb.TIER_DRAM, size=1)
    for i in range(50):
        h = s.Heartbeat(pb.HeartbeatRequest(node_id="ghost-%d" % i, tier_capacities=caps,
                                            bundles=[pb.EventBundle(seq=1, events=[ev])]))
        assert h.status == pb.CLIENT_STATUS_UNKNOWN
    s.RegisterClient(pb.RegisterClientRequest(node_id="real", tier_capacities=caps))
    s.Heartbeat(pb.HeartbeatRequest(node_id="real", tier_capacities=caps))
    text = master.metrics()
    assert 'node="ghost-' not in text
    assert 'mori_umbp_client_capacity_total_bytes{node="real",tier="DRAM"}' in text
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="real"))


def test_report_metrics_relay_with_tags(master):
    s = stub(master)
    s.RegisterClient(pb.RegisterClientRequest(node_id="rel", tags=["sgl_role=prefill", "junk"]))
    hist = pb.HistogramAggregate(bounds=[0.001, 0.01], bucket_counts=[1, 3], count=4, sum=0.02)
    s.ReportMetrics(pb.ReportMetricsRequest(node_id="rel", metrics=[
        pb.MetricSample(name="mori_umbp_master_client_rpc_latency_seconds", help="lat",
                        labels=[pb.MetricLabel(name="rpc", value="Heartbeat"),
                                pb.MetricLabel(name="status", value="ok")],
                        histogram_aggregate=hist),
        pb.MetricSample(name="relayed_total", help="c", counter_delta=2.9),
        pb.MetricSample(name="relayed_gauge", help="g", gauge_value=1.5),
        pb.MetricSample(name="unset_value"),
    ]))
    s.Heartbeat(pb.HeartbeatRequest(node_id="rel", tier_kv_counts=[
        pb.TierKvCount(tier=pb.TIER_DRAM, count=3), pb.TierKvCount(tier=pb.TIER_SSD, count=4)]))
    text = master.metrics()
    assert 'relayed_total{node="rel",sgl_role="prefill"} 2' in text
    assert 'relayed_gauge{node="rel",sgl_role="prefill"} 1.5' in text
    assert ('mori_umbp_master_client_rpc_latency_seconds_bucket{node="rel",sgl_role="prefill",'
            'rpc="Heartbeat",status="ok",le="+Inf"} 4') in text
    assert 'mori_umbp_client_kv_live_count_total{node="rel",sgl_role="prefill"} 7' in text
    assert "unset_value" not in text
    s.UnregisterClient(pb.UnregisterClientRequest(node_id="rel"))


def listening_ports(pid):
    """TCP ports on which process pid has a listening socket: its socket inodes (from
    /proc/<pid>/fd) matched against the LISTEN rows of /proc/<pid>/net/tcp and tcp6."""
    inodes = set()
    fd_dir = "/proc/%d/fd" % pid
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        m = re.fullmatch(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    ports = set()
    for table in ("tcp", "tcp6"):
        with open("/proc/%d/net/%s" % (pid, table)) as f:
            next(f)  # header
            for row in f:
                cols = row.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                    ports.add(int(local.rsplit(":", 1)[1], 16))
    return ports


def test_metrics_port_zero_disables_endpoint():
    # The check itself: a master with metrics listens on exactly its two ports.
    with Master() as full:
        assert listening_ports(full.proc.pid) == {full.port, full.metrics_port}
    m = Master(metrics=False)
    c = UMBPMasterClient(m.addr)
    assert c.match_external_kv(["a"]) == []
    stub(m).ReportMetrics(pb.ReportMetricsRequest(node_id="x"))
    # Port 0 means no metrics endpoint at all (not one on a kernel-chosen port).
    assert listening_ports(m.proc.pid) == {m.port}
    assert m.stop() == 0


def test_bad_metrics_port_argument_fails():
    import subprocess
    from master_util import lmcache_bin

    r = subprocess.run([lmcache_bin(), "master", "127.0.0.1:0", "notaport"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "metrics_port" in r.stderr
    assert "ThreadSanitizer" not in r.stderr, r.stderr  # a report also exits non-zero


def test_python_client_raises_on_a_master_that_does_not_answer():
    # A master that accepted the connection but does not answer (SIGSTOP: a hung process, a
    # stuck VM): calls raise RuntimeError at the client's deadline instead of blocking.
    import threading
    import time

    m = Master(metrics=False)
    try:
        warm = UMBPMasterClient(m.addr, timeout=1)
        assert warm.match_external_kv(["warm"]) == []  # channel connected
        assert UMBPMasterClient(m.addr).timeout == 30.0  # the default
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            for c in (warm, UMBPMasterClient(m.addr, timeout=1)):  # connected, then fresh
                res = {}

                def call():
                    t0 = time.monotonic()
                    try:
                        res["r"] = c.match_external_kv(["h"])
                    except RuntimeError as e:
                        res["r"] = e
                    res["t"] = time.monotonic() - t0

                t = threading.Thread(target=call, daemon=True)
                t.start()
                t.join(60)
                assert "t" in res, "still blocked after 60 s"
                assert isinstance(res["r"], RuntimeError), res
                assert str(res["r"]).startswith("MatchExternalKv failed: ")
                assert res["t"] < 30
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        with pytest.raises(ValueError):
            UMBPMasterClient(m.addr, timeout=0)
    finally:
        assert m.stop() == 0
