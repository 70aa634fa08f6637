"""The Redis store's read cache of MatchExternalKv (CLIENT TRACKING, BCAST): replicas that
see each other's writes at once (the fence), writes made behind the masters' backs with
redis-cli, the listener killed, Redis restarted, a cache far smaller than the data, and the
metrics and settings line that show it."""

import random
import re
import time

import grpc
import pytest

from master_util import (Master, RedisCluster, RedisServer, _port_free, fnv1a32, free_port,
                         needs_redis, redis_cluster_env, redis_env, shared_cluster,
                         use_python_package)

use_python_package()
from umbp import UMBPMasterClient, UMBPTierType, pb, pb_grpc  # noqa: E402

pytestmark = needs_redis

GB = 1 << 30
DRAM, HBM = int(UMBPTierType.DRAM), int(UMBPTierType.HBM)


@pytest.fixture
def redis():
    r = RedisServer()
    yield r
    r.close()


@pytest.fixture
def redis2():
    r = RedisServer()
    yield r
    r.close()


def metric(m, name):
    found = re.search(r'^%s(?:\{backend="redis"\})? ([0-9.e+]+)$' % name, m.metrics(), re.M)
    return float(found.group(1)) if found else None


def wait_serving(m, want=1.0, timeout=20):
    deadline = time.monotonic() + timeout
    while metric(m, "lmcache_master_redis_cache_serving") != want:
        assert time.monotonic() < deadline, "cache serving never became %s" % want
        time.sleep(0.02)


def triples(client, hashes):
    """(node, peer, tier, hash) of a plain match."""
    out = set()
    for x in client.match_external_kv(hashes):
        for t, hs in x.hashes_by_tier.items():
            out |= {(x.node_id, x.peer_address, int(t), h) for h in hs}
    return out


def expected(model, peers, hashes):
    return {(n, peers.get(n, ""), t, h) for h in set(hashes) for (n, t) in model.get(h, ())}


def register(addr, node, peer):
    s = pb_grpc.UMBPMasterStub(grpc.insecure_channel(addr))
    s.RegisterClient(pb.RegisterClientRequest(node_id=node, node_address=node + ":1",
                                              peer_address=peer))


def test_cache_serves_counts_and_prints_its_setting(redis):
    with Master(env=redis_env("c1", redis)) as m:
        wait_serving(m)
        register(m.addr, "n1", "n1:9")
        c = UMBPMasterClient(m.addr, node_id="n1")
        c.report_external_kv_blocks("n1", ["a", "b"], UMBPTierType.DRAM)
        want = {("n1", "n1:9", DRAM, "a"), ("n1", "n1:9", DRAM, "b")}
        assert triples(c, ["a", "b", "zz"]) == want
        assert triples(c, ["a", "b", "zz"]) == want  # from the cache
        assert metric(m, "lmcache_master_redis_cache_hits_total") >= 3
        assert metric(m, "lmcache_master_redis_cache_misses_total") >= 3
        assert metric(m, "lmcache_master_redis_cache_entries") >= 4  # a, b, zz, the peers
        assert metric(m, "lmcache_master_redis_cache_bytes") > 0
        # count_as_hit keeps its script (hit counts written through Redis).
        assert len(c.match_external_kv(["a"], count_as_hit=True)) == 1
        assert {e.hash: e.hit_count_total
                for e in c.get_external_kv_hit_counts(["a"])} == {"a": 1}
    assert "cache_mb=256" in m.stdout + m.stderr
    assert m.proc.returncode == 0


def test_cache_off_is_the_direct_path(redis):
    with Master(env=dict(redis_env("c0", redis), LMCACHE_MASTER_REDIS_CACHE_MB="0")) as m:
        register(m.addr, "n1", "n1:9")
        c = UMBPMasterClient(m.addr, node_id="n1")
        c.report_external_kv_blocks("n1", ["a"], UMBPTierType.DRAM)
        assert triples(c, ["a"]) == {("n1", "n1:9", DRAM, "a")}
        assert metric(m, "lmcache_master_redis_cache_serving") is None
    assert "cache_mb=0" in m.stdout + m.stderr


@pytest.mark.parametrize("mode", ["single", "multi", "cluster"])
def test_replica_writes_are_seen_by_the_next_match_on_another(mode, redis, redis2):
    env = redis_env("lin-" + mode, redis)
    if mode == "multi":
        env["UMBP_REDIS_SHARD_URIS"] = redis.uri + "," + redis2.uri
    if mode == "cluster":
        env = redis_cluster_env("lin-cluster")
    rng = random.Random(7)
    with Master(env=env) as a, Master(env=env) as b:
        wait_serving(a)
        wait_serving(b)
        peers = {"n1": "n1:9", "n2": "n2:9"}
        for n, p in peers.items():
            register(a.addr, n, p)
        ca, cb = UMBPMasterClient(a.addr), UMBPMasterClient(b.addr)
        pool = ["h%02d" % i for i in range(40)]
        model = {}
        for rnd in range(300):
            writer = ca if rnd % 3 else cb
            node = rng.choice(["n1", "n2"])
            tier = rng.choice([UMBPTierType.DRAM, UMBPTierType.HBM])
            hs = rng.sample(pool, rng.randint(1, 8))
            if rng.random() < 0.5:
                writer.report_external_kv_blocks(node, hs, tier)
                for h in hs:
                    model.setdefault(h, set()).add((node, int(tier)))
            else:
                writer.revoke_external_kv_blocks(node, hs, tier)
                for h in hs:
                    model.get(h, set()).discard((node, int(tier)))
            if rnd % 50 == 49:  # a node wiped, back with another peer address
                pb_grpc.UMBPMasterStub(grpc.insecure_channel(b.addr)).UnregisterClient(
                    pb.UnregisterClientRequest(node_id="n2"))
                for h in model:
                    model[h] = {x for x in model[h] if x[0] != "n2"}
                peers["n2"] = "n2:%d" % rnd
                register(a.addr, "n2", peers["n2"])
            q = rng.sample(pool, 24)
            reader = cb if writer is ca else ca
            assert triples(reader, q) == expected(model, peers, q), "round %d" % rnd
        assert metric(b, "lmcache_master_redis_cache_hits_total") > 0
        assert metric(b, "lmcache_master_redis_cache_invalidations_total") > 0


def test_writes_by_redis_cli_are_seen_by_the_next_match(redis):
    with Master(env=redis_env("cli", redis)) as m:
        wait_serving(m)
        c = UMBPMasterClient(m.addr)
        key = "{umbp:cli}:extkv:h"
        assert triples(c, ["h"]) == set()
        assert triples(c, ["h"]) == set()  # a cached miss
        for rnd in range(50):
            redis.cli("HSET", key, "ghost", str(1 << DRAM))
            assert triples(c, ["h"]) == {("ghost", "", DRAM, "h")}, rnd
            redis.cli("HSET", key, "ghost", str(1 << HBM))
            assert triples(c, ["h"]) == {("ghost", "", HBM, "h")}, rnd
            redis.cli("DEL", key)
            assert triples(c, ["h"]) == set(), rnd
        redis.cli("HSET", "{umbp:cli}:alive_peers", "ghost", "g:1")
        redis.cli("HSET", key, "ghost", str(1 << DRAM))
        assert triples(c, ["h"]) == {("ghost", "g:1", DRAM, "h")}
        redis.cli("HSET", "{umbp:cli}:alive_peers", "ghost", "g:2")
        assert triples(c, ["h"]) == {("ghost", "g:2", DRAM, "h")}
        # FLUSHALL: a nil invalidation, the whole cache goes.
        flushes = metric(m, "lmcache_master_redis_cache_flushes_total")
        redis.cli("FLUSHALL")
        assert triples(c, ["h"]) == set()
        assert metric(m, "lmcache_master_redis_cache_flushes_total") > flushes


def test_listener_killed_flushes_and_answers_stay_correct(redis):
    with Master(env=redis_env("kill", redis)) as m:
        wait_serving(m)
        c = UMBPMasterClient(m.addr)
        key = "{umbp:kill}:extkv:h"
        redis.cli("HSET", key, "ghost", str(1 << DRAM))
        assert triples(c, ["h"]) == {("ghost", "", DRAM, "h")}
        assert triples(c, ["h"]) == {("ghost", "", DRAM, "h")}
        for rnd in range(20):
            tier = DRAM if rnd % 2 else HBM
            assert int(redis.cli("CLIENT", "KILL", "TYPE", "pubsub")) >= 1
            # Written while the master has no listener: no invalidation will ever come.
            redis.cli("HSET", key, "ghost", str(1 << tier))
            assert triples(c, ["h"]) == {("ghost", "", tier, "h")}, rnd
            wait_serving(m)
            assert triples(c, ["h"]) == {("ghost", "", tier, "h")}, rnd
        assert metric(m, "lmcache_master_redis_cache_flushes_total") >= 20
    assert m.proc.returncode == 0  # listeners joined, nothing leaked (sanitizer builds)


def test_redis_restart_flushes_then_tracks_again(redis):
    with Master(env=redis_env("rst", redis)) as m:
        wait_serving(m)
        register(m.addr, "n1", "n1:9")
        c = UMBPMasterClient(m.addr, node_id="n1")
        c.report_external_kv_blocks("n1", ["a"], UMBPTierType.DRAM)
        assert triples(c, ["a"]) == {("n1", "n1:9", DRAM, "a")}
        assert triples(c, ["a"]) == {("n1", "n1:9", DRAM, "a")}
        redis.stop()
        redis.start()  # empty: no persistence in these tests
        deadline = time.monotonic() + 20
        while True:
            try:
                assert triples(c, ["a"]) == set()  # never the cached answer
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                assert time.monotonic() < deadline
                time.sleep(0.05)
        wait_serving(m)
        assert metric(m, "lmcache_master_redis_cache_flushes_total") >= 1
        register(m.addr, "n1", "n1:8")
        c.report_external_kv_blocks("n1", ["a"], UMBPTierType.HBM)
        assert triples(c, ["a"]) == {("n1", "n1:8", HBM, "a")}
        assert triples(c, ["a"]) == {("n1", "n1:8", HBM, "a")}
    assert m.proc.returncode == 0


def test_tiny_cache_evicts_and_stays_correct(redis):
    with Master(env=dict(redis_env("tiny", redis), LMCACHE_MASTER_REDIS_CACHE_MB="1")) as m:
        wait_serving(m)
        register(m.addr, "n1", "n1:9")
        c = UMBPMasterClient(m.addr, node_id="n1")
        hs = ["%064x" % i for i in range(12000)]
        for i in range(0, len(hs), 2000):
            c.report_external_kv_blocks("n1", hs[i:i + 2000:2], UMBPTierType.DRAM)
        rng = random.Random(3)
        for rnd in range(60):
            q = rng.sample(hs, 256)
            want = {("n1", "n1:9", DRAM, h) for h in q if int(h, 16) % 2 == 0}
            assert triples(c, q) == want, rnd
        assert metric(m, "lmcache_master_redis_cache_bytes") <= 1 << 20
        assert metric(m, "lmcache_master_redis_cache_entries") < 12000
        assert metric(m, "lmcache_master_redis_cache_hits_total") > 0


def test_multi_mode_one_listener_lost_turns_the_whole_cache_off(redis, redis2):
    env = dict(redis_env("mk", redis), UMBP_REDIS_SHARD_URIS=redis.uri + "," + redis2.uri)
    with Master(env=env) as m:
        wait_serving(m)
        register(m.addr, "n1", "n1:9")
        c = UMBPMasterClient(m.addr, node_id="n1")
        hs = ["m%03d" % i for i in range(64)]
        c.report_external_kv_blocks("n1", hs, UMBPTierType.DRAM)
        want = {("n1", "n1:9", DRAM, h) for h in hs}
        assert triples(c, hs) == want
        assert triples(c, hs) == want
        for rnd in range(10):
            flushes = metric(m, "lmcache_master_redis_cache_flushes_total")
            assert int(redis2.cli("CLIENT", "KILL", "TYPE", "pubsub")) == 1
            # Written on the second shard's Redis while nothing listens there.
            tier = HBM if rnd % 2 == 0 else DRAM
            c.report_external_kv_blocks("n1", hs, tier)
            c.revoke_external_kv_blocks("n1", hs, DRAM if tier == HBM else HBM)
            want = {("n1", "n1:9", tier, h) for h in hs}
            assert triples(c, hs) == want, rnd
            wait_serving(m)
            assert metric(m, "lmcache_master_redis_cache_flushes_total") > flushes
            assert triples(c, hs) == want, rnd
    assert m.proc.returncode == 0


# ---- Redis Cluster ----


def cluster_key(cl, ns, h):
    """The extkv key of hash h in namespace ns (its shard's tag, as the master chose them)."""
    nums = cl.nodes[0].cli("-c", "GET", "{umbp:%s}:shard_tags" % ns).split(",")
    return "{umbp:%s:b%s}:extkv:%s" % (ns, nums[fnv1a32(h) % len(nums)], h)


def test_cluster_writes_by_redis_cli_are_seen_by_the_next_match():
    cl = shared_cluster()
    with Master(env=redis_cluster_env("ccli", cl)) as m:
        wait_serving(m)
        c = UMBPMasterClient(m.addr)
        key = cluster_key(cl, "ccli", "h")
        node = cl.owner(int(cl.nodes[0].cli("CLUSTER", "KEYSLOT", key)))
        assert triples(c, ["h"]) == set()
        assert triples(c, ["h"]) == set()  # a cached miss
        for rnd in range(30):
            node.cli("HSET", key, "ghost", str(1 << DRAM))
            assert triples(c, ["h"]) == {("ghost", "", DRAM, "h")}, rnd
            node.cli("HSET", key, "ghost", str(1 << HBM))
            assert triples(c, ["h"]) == {("ghost", "", HBM, "h")}, rnd
            node.cli("DEL", key)
            assert triples(c, ["h"]) == set(), rnd
        # The peer map lives on the control tag's master, maybe another one.
        cl.nodes[0].cli("-c", "HSET", "{umbp:ccli}:alive_peers", "ghost", "g:1")
        node.cli("HSET", key, "ghost", str(1 << DRAM))
        assert triples(c, ["h"]) == {("ghost", "g:1", DRAM, "h")}
        cl.nodes[0].cli("-c", "HSET", "{umbp:ccli}:alive_peers", "ghost", "g:2")
        assert triples(c, ["h"]) == {("ghost", "g:2", DRAM, "h")}
        assert metric(m, "lmcache_master_redis_cache_hits_total") > 0
        assert metric(m, "lmcache_master_redis_cache_serving") == 1
    assert "cluster: not cached" not in m.stdout + m.stderr
    assert m.proc.returncode == 0


def test_cluster_listener_killed_on_one_master_flushes_and_recovers():
    cl = shared_cluster()
    with Master(env=redis_cluster_env("ckill", cl)) as m:
        wait_serving(m)
        register(m.addr, "n1", "n1:9")
        c = UMBPMasterClient(m.addr, node_id="n1")
        hs = ["k%03d" % i for i in range(48)]
        c.report_external_kv_blocks("n1", hs, UMBPTierType.DRAM)
        want = {("n1", "n1:9", DRAM, h) for h in hs}
        assert triples(c, hs) == want
        assert triples(c, hs) == want
        key = cluster_key(cl, "ckill", hs[0])
        node = cl.owner(int(cl.nodes[0].cli("CLUSTER", "KEYSLOT", key)))
        for rnd in range(8):
            flushes = metric(m, "lmcache_master_redis_cache_flushes_total")
            assert int(node.cli("CLIENT", "KILL", "TYPE", "pubsub")) >= 1
            # Written on that master while nothing of this master listens there.
            tier = HBM if rnd % 2 == 0 else DRAM
            node.cli("HSET", key, "n1", str(1 << tier))
            want0 = {("n1", "n1:9", tier, hs[0])} | (want - {("n1", "n1:9", DRAM, hs[0])})
            assert triples(c, hs) == want0, rnd
            wait_serving(m)
            assert metric(m, "lmcache_master_redis_cache_flushes_total") > flushes
            assert triples(c, hs) == want0, rnd
    assert m.proc.returncode == 0


def test_cluster_reshard_while_writing_and_matching_stays_linearizable():
    """Every slot of one master moved to another by `redis-cli --cluster reshard` while one
    replica writes and another matches right after (with the cache on): every answer is
    the model's."""
    import subprocess
    import tempfile
    cl = RedisCluster()
    try:
        # The nodes never heartbeat: no expiry while the reshard runs.
        env = dict(redis_cluster_env("rsh", cl), UMBP_HEARTBEAT_TTL_SEC="86400")
        with Master(env=env) as a, Master(env=env) as b:
            wait_serving(a)
            wait_serving(b)
            peers = {"n1": "n1:9", "n2": "n2:9"}
            for n, p in peers.items():
                register(a.addr, n, p)
            ca, cb = UMBPMasterClient(a.addr), UMBPMasterClient(b.addr)
            pool = ["s%02d" % i for i in range(60)]
            model = {}
            ca.report_external_kv_blocks("n1", pool, UMBPTierType.DRAM)
            for h in pool:
                model[h] = {("n1", DRAM)}
            src = cl.nodes[0]
            dst = cl.nodes[1]
            me = src.cli("CLUSTER", "MYID")
            ranges = next(line.split()[8:] for line in src.cli("CLUSTER", "NODES").splitlines()
                          if line.split()[0] == me)
            nslots = sum(int(r.partition("-")[2] or r) - int(r.partition("-")[0]) + 1
                         for r in ranges)
            log = tempfile.TemporaryFile(mode="w+")  # a line per slot: not a pipe
            proc = subprocess.Popen(
                ["redis-cli", "--cluster", "reshard", "127.0.0.1:%d" % src.port,
                 "--cluster-from", me, "--cluster-to", dst.cli("CLUSTER", "MYID"),
                 "--cluster-slots", str(nslots), "--cluster-yes"],
                stdout=log, stderr=subprocess.STDOUT, text=True)
            rng = random.Random(11)
            rounds, tail = 0, 40

            def write(w, report, node, hs, tier):
                for attempt in range(50):  # idempotent: again after a failed try
                    try:
                        if report:
                            w.report_external_kv_blocks(node, hs, tier)
                        else:
                            w.revoke_external_kv_blocks(node, hs, tier)
                        return
                    except (grpc.RpcError, RuntimeError):  # a script during a migration
                        assert attempt < 49
                        time.sleep(0.05)

            while tail:
                if proc.poll() is not None:
                    tail -= 1
                writer, reader = (ca, cb) if rounds % 2 else (cb, ca)
                node = rng.choice(["n1", "n2"])
                tier = rng.choice([UMBPTierType.DRAM, UMBPTierType.HBM])
                hs = rng.sample(pool, rng.randint(1, 6))
                report = rng.random() < 0.5
                write(writer, report, node, hs, tier)
                for h in hs:
                    if report:
                        model.setdefault(h, set()).add((node, int(tier)))
                    else:
                        model.get(h, set()).discard((node, int(tier)))
                q = rng.sample(pool, 24)
                for attempt in range(50):
                    try:
                        got = triples(reader, q)
                        break
                    except (grpc.RpcError, RuntimeError):  # a script during a migration
                        assert attempt < 49
                        time.sleep(0.05)
                assert got == expected(model, peers, q), "round %d" % rounds
                rounds += 1
            proc.wait()
            log.seek(0)
            assert proc.returncode == 0, log.read()[-2000:]
            assert rounds > 40
            assert next(line.split()[8:] for line in src.cli("CLUSTER", "NODES").splitlines()
                        if line.split()[0] == me) == []  # the source serves no slot now
            for m in (a, b):
                wait_serving(m)
                assert metric(m, "lmcache_master_redis_cache_hits_total") > 0
                assert metric(m, "lmcache_master_redis_cache_flushes_total") > 0
            assert triples(cb, pool) == expected(model, peers, pool)
        assert a.proc.returncode == 0 and b.proc.returncode == 0
    finally:
        cl.close()


def test_cluster_master_added_is_tracked_before_a_slot_migrates_to_it():
    """A master joins the cluster: both masters' listeners reach it before it serves a slot,
    so a write another replica makes there during a migration is seen by a match whose
    answer was cached (a cached miss) before."""
    import subprocess
    cl = RedisCluster()
    new = None
    try:
        env = redis_cluster_env("add", cl)
        with Master(env=env) as a, Master(env=env) as b:
            wait_serving(a)
            wait_serving(b)
            register(a.addr, "n1", "n1:9")
            ca, cb = UMBPMasterClient(a.addr), UMBPMasterClient(b.addr)
            nums = cl.nodes[0].cli("-c", "GET", "{umbp:add}:shard_tags").split(",")
            tag = "{umbp:add:b%s}" % nums[0]
            x, y = [h for h in ("a%d" % i for i in range(4000))
                    if fnv1a32(h) % len(nums) == 0][:2]
            ca.report_external_kv_blocks("n1", [y], UMBPTierType.DRAM)
            slot = int(cl.nodes[0].cli("CLUSTER", "KEYSLOT", tag))
            src = cl.owner(slot)
            while True:
                port = free_port()
                if port + 10000 <= 65535 and _port_free(port + 10000):
                    break
            new = RedisServer(port=port, extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes-%d.conf" % port,
                "--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "no"])
            r = subprocess.run(["redis-cli", "--cluster", "add-node", "127.0.0.1:%d" % port,
                                "127.0.0.1:%d" % src.port], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0, r.stdout + r.stderr
            deadline = time.monotonic() + 30
            while "cluster_state:ok" not in new.cli("CLUSTER", "INFO"):
                assert time.monotonic() < deadline, "the added master never saw the cluster ok"
                time.sleep(0.05)
            # Each master's listener reaches the new master, which serves no slot yet.
            deadline = time.monotonic() + 30
            while len(new.cli("CLIENT", "LIST", "TYPE", "pubsub").splitlines()) < 2:
                assert time.monotonic() < deadline, "no listener on the added master"
                time.sleep(0.05)
            wait_serving(a)
            wait_serving(b)
            want_y = {("n1", "n1:9", DRAM, y)}
            assert triples(cb, [x, y]) == want_y
            assert triples(cb, [x, y]) == want_y  # x a cached miss
            hits = metric(b, "lmcache_master_redis_cache_hits_total")
            assert triples(cb, [x, y]) == want_y
            assert metric(b, "lmcache_master_redis_cache_hits_total") > hits
            # The slot half-way to the new master: its keys there, x written there by a.
            src_id, new_id = src.cli("CLUSTER", "MYID"), new.cli("CLUSTER", "MYID")
            assert new.cli("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id) == "OK"
            assert src.cli("CLUSTER", "SETSLOT", slot, "MIGRATING", new_id) == "OK"
            names = src.cli("CLUSTER", "GETKEYSINSLOT", slot, 10000).split()
            assert names
            assert src.cli("MIGRATE", "127.0.0.1", port, "", 0, 5000, "KEYS", *names) == "OK"
            ca.report_external_kv_blocks("n1", [x], UMBPTierType.DRAM)
            want = {("n1", "n1:9", DRAM, x), ("n1", "n1:9", DRAM, y)}
            assert triples(cb, [x, y]) == want
            for n in cl.nodes + [new]:
                # Gossip spreads the new node: every master must know it before SETSLOT NODE.
                deadline = time.monotonic() + 30
                while new_id not in n.cli("CLUSTER", "NODES"):
                    assert time.monotonic() < deadline, "a master never learnt the new node"
                    time.sleep(0.05)
                assert n.cli("CLUSTER", "SETSLOT", slot, "NODE", new_id) == "OK"
            assert new.cli("HGET", "%s:extkv:%s" % (tag, x), "n1") == str(1 << DRAM)
            assert triples(cb, [x, y]) == want
            ca.revoke_external_kv_blocks("n1", [x], UMBPTierType.DRAM)
            assert triples(cb, [x, y]) == want_y
            wait_serving(b)
            assert triples(cb, [x, y]) == want_y
            assert triples(cb, [x, y]) == want_y
        assert a.proc.returncode == 0 and b.proc.returncode == 0, a.stderr + b.stderr
    finally:
        if new:
            new.close()
        cl.close()
