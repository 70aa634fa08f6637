"""The Redis metadata store of `lmcache master` with real processes on loopback: state that
outlives a master, replicas behind one Redis, Redis lost and back, start-up faults, the key
schema an operator reads, and bounded scripts for large full syncs."""

import re
import subprocess
import time

import grpc
import pytest

from master_util import (Master, RedisServer, fnv1a32, free_port, lmcache_bin, needs_redis,
                         redis_env, use_python_package)

use_python_package()
from umbp import UMBPMasterClient, UMBPTierType, pb, pb_grpc  # noqa: E402

pytestmark = needs_redis

GB = 1 << 30


@pytest.fixture
def redis():
    r = RedisServer()
    yield r
    r.close()


def stub(m):
    return pb_grpc.UMBPMasterStub(grpc.insecure_channel(m.addr))


def heartbeat(s, node, seq, adds=(), full=False, baseline=0):
    ev = [pb.KvEvent(kind=pb.KvEvent.ADD, key=k, tier=pb.TIER_DRAM, size=10) for k in adds]
    return s.Heartbeat(pb.HeartbeatRequest(
        node_id=node, is_full_sync=full, delta_seq_baseline=baseline,
        bundles=[pb.EventBundle(seq=seq, events=ev)]))


def matches(m, hashes, hit=False):
    c = UMBPMasterClient(m.addr)
    return sorted((x.node_id, x.peer_address,
                   tuple((int(t), tuple(h)) for t, h in sorted(x.hashes_by_tier.items())))
                  for x in c.match_external_kv(hashes, count_as_hit=hit))


def counts(m, hashes):
    return {e.hash: e.hit_count_total for e in UMBPMasterClient(m.addr).get_external_kv_hit_counts(hashes)}


def test_restart_keeps_placements_hit_counts_and_blocks(redis):
    env = redis_env("restart", redis)
    with Master(env=env) as m:
        c = UMBPMasterClient(m.addr, node_id="keep", node_address="keep:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        c.report_external_kv_blocks("keep", ["a", "b"], UMBPTierType.DRAM)
        c.report_external_kv_blocks("keep", ["b"], UMBPTierType.SSD)
        matches(m, ["a", "b"], hit=True)
        matches(m, ["a"], hit=True)
        assert heartbeat(stub(m), "keep", 1, adds=["blk"]).acked_seq == 1
        before = matches(m, ["a", "b", "zz"])
    with Master(env=env) as m2:
        assert matches(m2, ["a", "b", "zz"]) == before
        assert counts(m2, ["a", "b", "zz"]) == {"a": 2, "b": 1}
        s = stub(m2)
        g = s.RouteGet(pb.RouteGetRequest(key="blk"))
        assert g.found and g.node_id == "keep" and g.size == 10
        # The sequence survived too: the next delta applies.
        assert heartbeat(s, "keep", 2).acked_seq == 2


def test_two_replicas_answer_identically(redis):
    env = redis_env("replicas", redis)
    with Master(env=env) as m1, Master(env=env) as m2:
        c = UMBPMasterClient(m1.addr, node_id="r1", node_address="r1:1")
        c.register_self({UMBPTierType.HBM: (GB, GB)})
        s1, s2 = stub(m1), stub(m2)
        s1.RegisterClient(pb.RegisterClientRequest(node_id="r2", node_address="r2:1",
                                                   peer_address="r2:9"))
        UMBPMasterClient(m2.addr, node_id="r2").report_external_kv_blocks(
            "r2", ["x", "y"], UMBPTierType.DRAM)
        c.report_external_kv_blocks("r1", ["x"], UMBPTierType.HBM)
        # Registered through one, matched through the other, the same answer from both.
        assert matches(m1, ["x", "y", "q"]) == matches(m2, ["x", "y", "q"])
        assert ("r2", "r2:9", ((int(UMBPTierType.DRAM), ("x", "y")),)) in matches(m2, ["x", "y"])
        with pytest.raises(grpc.RpcError) as e:
            s2.RegisterClient(pb.RegisterClientRequest(node_id="r2"))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # Hits counted through either replica add up.
        matches(m1, ["x"], hit=True)
        matches(m2, ["x", "x"], hit=True)
        assert counts(m1, ["x"]) == counts(m2, ["x"]) == {"x": 2}
        # The heartbeat sequence is one CAS: a delta through m2 continues m1's.
        assert heartbeat(s1, "r2", 1, adds=["k"]).acked_seq == 1
        assert heartbeat(s2, "r2", 2).acked_seq == 2
        h = heartbeat(s1, "r2", 2)
        assert h.request_full_sync and h.acked_seq == 2
        assert s2.RouteGet(pb.RouteGetRequest(key="k")).node_id == "r2"
        assert list(s1.BatchLookup(pb.BatchLookupRequest(keys=["k", "n"])).found) == [True, False]
        # Unregister through one: gone for both.
        s2.UnregisterClient(pb.UnregisterClientRequest(node_id="r2"))
        assert matches(m1, ["x", "y"]) == matches(m2, ["x", "y"])
        assert not s1.RouteGet(pb.RouteGetRequest(key="k")).found


def test_reaper_on_every_replica_expires_once(redis):
    env = dict(redis_env("reap", redis), UMBP_HEARTBEAT_TTL_SEC="1",
               UMBP_MAX_MISSED_HEARTBEATS="1", UMBP_REAPER_INTERVAL_SEC="1",
               MORI_UMBP_LOG_LEVEL="warn")
    m1, m2 = Master(env=env), Master(env=env)
    try:
        c = UMBPMasterClient(m1.addr, node_id="gone", node_address="g:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        c.report_external_kv_blocks("gone", ["h"], UMBPTierType.DRAM)
        deadline = time.monotonic() + 30
        while matches(m2, ["h"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert matches(m1, ["h"]) == matches(m2, ["h"]) == []
    finally:
        m1.stop()
        m2.stop()
    logs = m1.stderr + m2.stderr
    assert logs.count("[Reaper] Expired client: gone") == 1


def test_redis_lost_and_back_without_restarting_the_master(redis):
    env = redis_env("outage", redis)
    with Master(env=env) as m:
        c = UMBPMasterClient(m.addr, node_id="o", node_address="o:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        c.report_external_kv_blocks("o", ["h"], UMBPTierType.DRAM)
        s = stub(m)
        redis.stop()
        with pytest.raises(grpc.RpcError) as e:
            s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=["h"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details().startswith("MatchExternalKv: metadata store unavailable: ")
        for call, req, name in [
            (s.Heartbeat, pb.HeartbeatRequest(node_id="o"), "Heartbeat"),
            (s.BatchLookup, pb.BatchLookupRequest(keys=["k"]), "BatchLookup"),
            (s.RegisterClient, pb.RegisterClientRequest(node_id="p"), "RegisterClient"),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                call(req, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details().startswith(name + ": metadata store unavailable: ")
        # Back (empty: no persistence in this test), with its script cache gone.
        redis.start()
        deadline = time.monotonic() + 20
        while True:
            try:
                s.RegisterClient(pb.RegisterClientRequest(node_id="o", node_address="o:1"))
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() < deadline
                time.sleep(0.1)
        c.report_external_kv_blocks("o", ["h"], UMBPTierType.DRAM)
        assert [x.node_id for x in c.match_external_kv(["h"])] == ["o"]
        text = m.metrics()
        assert re.search(r'mori_umbp_redis_noscript_reload_total\{backend="redis"\} [1-9]', text)
        assert re.search(r'mori_umbp_redis_transport_errors_total\{backend="redis"\} [1-9]', text)
        assert 'mori_umbp_store_op_latency_seconds_bucket{op="MatchExternalKv",backend="redis"' in text


def run_master(env, timeout=20):
    port = free_port()
    e = dict(env)
    return subprocess.run([lmcache_bin(), "master", "127.0.0.1:%d" % port, "0"], env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_required_redis_down_exits_with_one_line():
    import os

    env = dict(os.environ, UMBP_METADATA_BACKEND="redis",
               UMBP_REDIS_URI="tcp://127.0.0.1:%d" % free_port(), UMBP_REDIS_PASSWORD="s3cret")
    r = run_master(env)
    assert r.returncode != 0
    assert "ThreadSanitizer" not in r.stderr, r.stderr  # a report also exits non-zero
    lines = [l for l in r.stderr.splitlines() if l.startswith("umbp_master:")]
    assert len(lines) == 1 and "redis unavailable" in lines[0], r.stderr
    assert "s3cret" not in r.stdout + r.stderr
    assert "password=<redacted>" in r.stdout


def test_not_required_starts_degraded_and_recovers():
    port = free_port()
    env = {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": "tcp://127.0.0.1:%d" % port,
           "UMBP_REDIS_REQUIRED": "0", "UMBP_REDIS_NAMESPACE": "degraded"}
    with Master(env=env) as m:
        s = stub(m)
        with pytest.raises(grpc.RpcError) as e:
            s.BatchLookup(pb.BatchLookupRequest(keys=["k"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        r = RedisServer(port=port)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    s.RegisterClient(pb.RegisterClientRequest(node_id="d"))
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.UNAVAILABLE
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
            assert heartbeat(s, "d", 1, adds=["k"]).acked_seq == 1
            assert list(s.BatchLookup(pb.BatchLookupRequest(keys=["k"])).found) == [True]
        finally:
            r.close()


def test_password_auth_and_redaction():
    r = RedisServer(password="pw-xyz")
    try:
        env = dict(redis_env("auth", r), UMBP_REDIS_PASSWORD="pw-xyz")
        m = Master(env=env)
        c = UMBPMasterClient(m.addr, node_id="a", node_address="a:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        assert m.stop() == 0
        assert "password=<redacted>" in m.stdout and "pw-xyz" not in m.stdout + m.stderr
    finally:
        r.close()


def test_key_schema_is_the_reference_layout(redis):
    env = dict(redis_env("schema", redis))
    with Master(env=env) as m:
        c = UMBPMasterClient(m.addr, node_id="n1", node_address="n1:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB // 2)})
        caps = redis.cli("HGET", "{umbp:schema}:node:n1", "caps")
        c.report_external_kv_blocks("n1", ["h"], UMBPTierType.DRAM)
        c.report_external_kv_blocks("n1", ["h"], UMBPTierType.SSD)
        c.match_external_kv(["h"], count_as_hit=True)
        heartbeat(stub(m), "n1", 1, adds=["blk"])
    t = "{umbp:schema}"
    assert redis.cli("HGET", t + ":node:n1", "status") == "1"
    assert caps == "2:%d:%d" % (GB, GB // 2)
    assert redis.cli("SMEMBERS", t + ":nodes:alive") == "n1"
    assert redis.cli("HGET", t + ":extkv:h", "n1") == str(4 + 8)
    assert redis.cli("HGET", t + ":hit:h", "c") == "1"
    assert redis.cli("SMEMBERS", t + ":hit:index") == t + ":hit:h"
    assert redis.cli("HGET", t + ":block:blk", "l|n1|2") == "10"
    assert redis.cli("SMEMBERS", t + ":node:n1:blocks") == t + ":block:blk"


def test_block_shards_use_fnv_tags(redis):
    env = dict(redis_env("sh", redis), UMBP_REDIS_BLOCK_SHARDS="4")
    with Master(env=env) as m:
        c = UMBPMasterClient(m.addr, node_id="n", node_address="n:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        keys = ["h%d" % i for i in range(40)]
        c.report_external_kv_blocks("n", keys, UMBPTierType.DRAM)
        assert [len(x.hashes_by_tier[UMBPTierType.DRAM]) for x in c.match_external_kv(keys)] == [40]

    def fnv(s):
        h = 2166136261
        for b in s.encode():
            h = ((h ^ b) * 16777619) & 0xFFFFFFFF
        return h

    for k in keys:
        assert redis.cli("HGET", "{umbp:sh:b%d}:extkv:%s" % (fnv(k) % 4, k), "n") == "4"


def test_large_full_sync_runs_in_bounded_scripts(redis):
    env = redis_env("bulk", redis)
    n = 20000
    with Master(env=env) as m:
        s = stub(m)
        s.RegisterClient(pb.RegisterClientRequest(node_id="big"))
        before = redis.cli("INFO", "commandstats")
        keys = ["k%d" % i for i in range(n)]
        h = heartbeat(s, "big", 0, adds=keys, full=True, baseline=7)
        assert h.acked_seq == 7 and not h.request_full_sync
        after = redis.cli("INFO", "commandstats")
        calls = [int(re.search(r"cmdstat_evalsha:calls=(\d+)", x).group(1)) if "evalsha" in x
                 else 0 for x in (before, after)]
        assert calls[1] - calls[0] >= n // 2048  # one script per chunk of events
        found = s.BatchLookup(pb.BatchLookupRequest(keys=keys[:100] + keys[-100:] + ["no"])).found
        assert list(found) == [True] * 200 + [False]
        # A second full sync replaces everything.
        heartbeat(s, "big", 0, adds=["only"], full=True, baseline=8)
        found = s.BatchLookup(pb.BatchLookupRequest(keys=["k0", "k19999", "only"])).found
        assert list(found) == [False, False, True]
        assert redis.cli("SCARD", "{umbp:bulk}:node:big:blocks") == "1"


def test_redis_that_never_answers_gives_unavailable_not_a_hang():
    """A Redis that accepts and then says nothing (a hung host): each RPC ends with
    UNAVAILABLE after about the socket timeout, well inside the call's deadline."""
    import socket
    import threading

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(64)
    held = []
    stop = threading.Event()

    def accept():
        lst.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(lst.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    env = {"UMBP_METADATA_BACKEND": "redis",
           "UMBP_REDIS_URI": "tcp://127.0.0.1:%d" % lst.getsockname()[1],
           "UMBP_REDIS_REQUIRED": "0", "UMBP_REDIS_SOCKET_TIMEOUT_MS": "300",
           "UMBP_REDIS_CONNECT_TIMEOUT_MS": "300"}
    try:
        with Master(env=env) as m:
            s = stub(m)
            for call, req, name in [
                (s.MatchExternalKv, pb.MatchExternalKvRequest(hashes=["h"]), "MatchExternalKv"),
                (s.BatchRoutePut, pb.BatchRoutePutRequest(keys=["k"], block_sizes=[1]),
                 "BatchRoutePut"),
                (s.Heartbeat, pb.HeartbeatRequest(node_id="n"), "Heartbeat"),
            ]:
                with pytest.raises(grpc.RpcError) as e:
                    call(req, timeout=15)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
                assert e.value.details().startswith(name + ": metadata store unavailable: ")
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        lst.close()


def test_sigterm_while_a_call_waits_on_a_paused_redis_exits_cleanly(redis):
    """SIGTERM while a call waits on a stalled Redis for longer than the grace period: the
    master waits for that handler (bounded by the socket timeout) before it shuts gRPC's
    queue down, and exits 0; it used to abort in gRPC (SIGABRT) when the late handler sent
    its reply."""
    import os
    import signal
    import threading

    env = dict(redis_env(redis=redis), UMBP_REDIS_SOCKET_TIMEOUT_MS="3000",
               UMBP_GRPC_SHUTDOWN_DEADLINE_SEC="1", LMCACHE_MASTER_REDIS_CACHE_MB="0",
               MORI_UMBP_LOG_LEVEL="warn")
    m = Master(env=env, metrics=False)
    paused = False
    try:
        s = stub(m)
        s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=["warm"]))  # a pooled connection
        os.kill(redis.proc.pid, signal.SIGSTOP)  # stalled, its socket still open
        paused = True
        errs = []

        def call():
            try:
                s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=["x"]), timeout=60)
            except grpc.RpcError as e:
                errs.append(e.code())

        t = threading.Thread(target=call, daemon=True)
        t.start()
        time.sleep(1.0)  # the call is in its handler, waiting on Redis
        t0 = time.monotonic()
        rc = m.stop(timeout=60)
        took = time.monotonic() - t0
        assert rc == 0, (rc, m.stderr[-3000:])
        assert "waiting for 1 running call(s) to return" in m.stderr  # past the grace period
        # Two socket timeouts at most (one retry on a new connection), plus slack.
        assert took < 30, took
        t.join(timeout=30)
        assert errs and errs[0] in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), errs
    finally:
        if paused:
            os.kill(redis.proc.pid, signal.SIGCONT)
        if m.proc.poll() is None:
            m.stop()


def test_multi_mode_two_endpoints_and_a_failed_shard():
    from master_util import redis_multi_env

    a, b = RedisServer(), RedisServer()
    try:
        env = dict(redis_multi_env("multi", (a, b)), MORI_UMBP_LOG_LEVEL="warn")
        with Master(env=env) as m:
            assert "shard_uris=%s,%s" % (a.uri, b.uri) in m.proc.stdout.readline() + \
                m.proc.stdout.readline()
            c = UMBPMasterClient(m.addr, node_id="mm", node_address="mm:1")
            c.register_self({UMBPTierType.DRAM: (GB, GB)})
            keys = ["h%d" % i for i in range(64)]
            c.report_external_kv_blocks("mm", keys, UMBPTierType.DRAM)
            s = stub(m)
            assert heartbeat(s, "mm", 1, adds=keys).acked_seq == 1
            matches(m, keys, hit=True)
            on = {0: [k for k in keys if fnv1a32(k) % 2 == 0],
                  1: [k for k in keys if fnv1a32(k) % 2]}
            assert on[0] and on[1]
            # Control keys and shard 0 on the first endpoint, shard 1 on the second.
            assert a.cli("HGET", "{umbp:multi}:node:mm", "status") == "1"
            assert b.cli("EXISTS", "{umbp:multi}:node:mm") == "0"
            for sh, r in ((0, a), (1, b)):
                k = on[sh][0]
                assert r.cli("HGET", "{umbp:multi:b%d}:extkv:%s" % (sh, k), "mm") == "4"
                assert r.cli("HGET", "{umbp:multi:b%d}:hit:%s" % (sh, k), "c") == "1"
                assert r.cli("HGET", "{umbp:multi:b%d}:block:%s" % (sh, k), "l|mm|2") == "10"
            full = c.match_external_kv(keys)
            assert [sorted(x.hashes_by_tier[UMBPTierType.DRAM]) for x in full] == [sorted(keys)]
            assert full[0].peer_address == ""
            # Shard 1 lost: its keys read as misses, the rest still answers.
            b.stop()
            part = c.match_external_kv(keys)
            assert [sorted(x.hashes_by_tier[UMBPTierType.DRAM]) for x in part] == [sorted(on[0])]
            found = list(s.BatchLookup(pb.BatchLookupRequest(keys=keys)).found)
            assert found == [k in on[0] for k in keys]
            assert re.search(r'mori_umbp_redis_degraded_shard_total\{backend="redis",'
                             r'method="MatchExternalKv"\} [1-9]', m.metrics())
            # A heartbeat whose events cannot reach their shard asks for a full sync.
            assert heartbeat(s, "mm", 2, adds=on[1][:2]).request_full_sync
            # Back (empty: no persistence here): reports reach it again.
            b.start()
            deadline = time.monotonic() + 20
            while True:
                c.report_external_kv_blocks("mm", on[1], UMBPTierType.DRAM)
                got = c.match_external_kv(keys)[0].hashes_by_tier[UMBPTierType.DRAM]
                if len(got) == 64:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        a.close()
        b.close()


def test_hit_gc_on_every_replica(redis):
    env = dict(redis_env("hitgc", redis), UMBP_HIT_INDEX_TTL_SEC="1",
               UMBP_HIT_INDEX_GC_INTERVAL_SEC="1")
    with Master(env=env) as m1, Master(env=env) as m2:
        c = UMBPMasterClient(m1.addr, node_id="g", node_address="g:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        c.report_external_kv_blocks("g", ["a", "b"], UMBPTierType.DRAM)
        matches(m1, ["a", "b"], hit=True)
        matches(m2, ["a"], hit=True)
        assert counts(m2, ["a", "b"]) == {"a": 2, "b": 1}
        deadline = time.monotonic() + 30
        while counts(m1, ["a", "b"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert counts(m1, ["a", "b"]) == counts(m2, ["a", "b"]) == {}
        assert redis.cli("SCARD", "{umbp:hitgc}:hit:index") == "0"
        # Placements are not hit counters: still there.
        assert [x.node_id for x in c.match_external_kv(["a", "b"])] == ["g"]


@pytest.mark.parametrize("store", ["inmemory", "redis"])
def test_hashes_longer_than_64k_match_and_count(store, redis):
    """Report hashes the whole key; match and the hit query must find it the same way."""
    env = redis_env("long", redis) if store == "redis" else {}
    with Master(env=env) as m:
        c = UMBPMasterClient(m.addr, node_id="ln", node_address="ln:1")
        c.register_self({UMBPTierType.DRAM: (GB, GB)})
        big = "x" * 70000
        c.report_external_kv_blocks("ln", [big, "small"], UMBPTierType.DRAM)
        got = c.match_external_kv([big, big, "small"], count_as_hit=True)
        assert [(x.node_id, sorted(len(h) for h in x.hashes_by_tier[UMBPTierType.DRAM]))
                for x in got] == [("ln", [5, 70000])]
        assert {len(e.hash): e.hit_count_total
                for e in c.get_external_kv_hit_counts([big, "small"])} == {70000: 1, 5: 1}
