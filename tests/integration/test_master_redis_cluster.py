"""The Redis store of `lmcache master` on a real Redis Cluster (three redis-servers with
--cluster-enabled yes on loopback): the shard tags spread over the masters, slot migrations
answered through ASK and MOVED, the redirection bound, a lost master read as misses, and
NOSCRIPT after a script cache loss. The master's semantic tests also run on a cluster (the
"redis-cluster" leg of master_util.backend)."""

import os
import re
import subprocess

import grpc
import pytest

from master_util import (Master, RedisCluster, fnv1a32 as fnv, free_port, lmcache_bin,
                         needs_redis, redis_cluster_env, use_python_package)

use_python_package()
from umbp import UMBPMasterClient, UMBPTierType, pb, pb_grpc  # noqa: E402

pytestmark = needs_redis


@pytest.fixture
def cluster():
    c = RedisCluster()
    yield c
    c.close()


def dram(c, keys):
    return sorted(h for x in c.match_external_kv(keys)
                  for h in x.hashes_by_tier.get(UMBPTierType.DRAM, []))


def metric(m, name, **labels):
    sel = ",".join('%s="%s"' % kv for kv in sorted(labels.items()))
    found = re.search(r"^%s\{%s\} (\d+)" % (re.escape(name), re.escape(sel)), m.metrics(), re.M)
    return int(found.group(1)) if found else 0


def populate(m, cl, ns, keys):
    """A node with keys reported and as blocks; returns (client, stub, shard tags)."""
    c = UMBPMasterClient(m.addr, node_id="cn", node_address="cn:1")
    c.register_self({UMBPTierType.DRAM: (1 << 30, 1 << 30)})
    c.report_external_kv_blocks("cn", keys, UMBPTierType.DRAM)
    s = pb_grpc.UMBPMasterStub(grpc.insecure_channel(m.addr))
    ev = [pb.KvEvent(kind=pb.KvEvent.ADD, key=k, tier=pb.TIER_DRAM, size=10) for k in keys]
    assert s.Heartbeat(pb.HeartbeatRequest(node_id="cn", bundles=[
        pb.EventBundle(seq=1, events=ev)])).acked_seq == 1
    c.match_external_kv(keys, count_as_hit=True)
    nums = cl.nodes[0].cli("-c", "GET", "{umbp:%s}:shard_tags" % ns)
    tags = ["{umbp:%s:b%s}" % (ns, k) for k in nums.split(",")]
    return c, s, tags


def slot_of(cl, tag):
    return int(cl.nodes[0].cli("CLUSTER", "KEYSLOT", tag))


def apart(cl, ns, tags):
    """A shard tag whose master does not hold the control keys: (tag, its slot, its node)."""
    ctl = cl.owner(slot_of(cl, "{umbp:%s}" % ns)).port
    tag = next(t for t in tags if cl.owner(slot_of(cl, t)).port != ctl)
    return tag, slot_of(cl, tag), cl.owner(slot_of(cl, tag))


def test_cluster_and_shard_uris_together_exit_with_one_line():
    env = dict(os.environ, UMBP_METADATA_BACKEND="redis", UMBP_REDIS_CLUSTER="1",
               UMBP_REDIS_SHARD_URIS="tcp://127.0.0.1:1,tcp://127.0.0.1:2")
    p = subprocess.run([lmcache_bin(), "master", "127.0.0.1:%d" % free_port(), "0"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "umbp_master: cannot create the metadata store: UMBP_REDIS_CLUSTER=1 and "
        "UMBP_REDIS_SHARD_URIS cannot be combined")


def test_one_tag_per_master_and_keys_on_every_master(cluster):
    env = redis_cluster_env("spread", cluster)
    with Master(env=env) as m:
        keys = ["k%d" % i for i in range(90)]
        c, s, tags = populate(m, cluster, "spread", keys)
        # One tag per master, each served by a different master.
        assert len(tags) == 3
        owners = {cluster.owner(slot_of(cluster, t)).port for t in tags}
        assert len(owners) == 3
        # Key i lives under tag FNV-1a(i) mod 3, on that tag's master.
        for k in keys[:10]:
            t = tags[fnv(k) % 3]
            n = cluster.owner(slot_of(cluster, t))
            assert n.cli("HGET", "%s:extkv:%s" % (t, k), "cn") == "4"
            assert n.cli("HGET", "%s:hit:%s" % (t, k), "c") == "1"
            assert n.cli("HGET", "%s:block:%s" % (t, k), "l|cn|2") == "10"
        assert dram(c, keys) == sorted(keys)
        assert list(s.BatchLookup(pb.BatchLookupRequest(keys=keys[:5] + ["nope"])).found) == \
            [True] * 5 + [False]
    # A second master on the same namespace reads the recorded tags back.
    with Master(env=env) as m2:
        assert dram(UMBPMasterClient(m2.addr), keys) == sorted(keys)


def test_slot_migration_ask_then_moved(cluster):
    # No read cache: its watch thread reads the slot map again every second and, on a slow
    # run, would put the map right before a command is answered MOVED.
    env = dict(redis_cluster_env("mig", cluster), MORI_UMBP_LOG_LEVEL="info",
               LMCACHE_MASTER_REDIS_CACHE_MB="0")
    with Master(env=env) as m:
        keys = ["m%d" % i for i in range(60)]
        c, s, tags = populate(m, cluster, "mig", keys)
        tag, slot, src = apart(cluster, "mig", tags)
        ctl = cluster.owner(slot_of(cluster, "{umbp:mig}")).port
        dst = next(n for n in cluster.nodes if n.port not in (src.port, ctl))
        src_id, dst_id = src.cli("CLUSTER", "MYID"), dst.cli("CLUSTER", "MYID")
        mine = sorted(k for k in keys if tags[fnv(k) % 3] == tag)
        assert mine
        # Half-way through a migration: every key of the slot moved, the slot still the
        # source's. The source answers ASK; the master follows it without updating its map.
        assert dst.cli("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id) == "OK"
        assert src.cli("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id) == "OK"
        names = src.cli("CLUSTER", "GETKEYSINSLOT", slot, 10000).split()
        assert len(names) >= len(mine)
        assert src.cli("MIGRATE", "127.0.0.1", dst.port, "", 0, 5000, "KEYS", *names) == "OK"
        assert dram(c, keys) == sorted(keys)
        assert metric(m, "lmcache_master_redis_cluster_redirects_total",
                      backend="redis", kind="ask") >= 1
        # A write during the migration lands on the target too.
        extra = next("x%d" % i for i in range(1000) if tags[fnv("x%d" % i) % 3] == tag)
        c.report_external_kv_blocks("cn", [extra], UMBPTierType.DRAM)
        # The migration ends: the master's map is stale, MOVED puts it right.
        for n in cluster.nodes:
            assert n.cli("CLUSTER", "SETSLOT", slot, "NODE", dst_id) == "OK"
        assert dst.cli("HGET", "%s:extkv:%s" % (tag, extra), "cn") == "4"
        assert src.cli("CLUSTER", "COUNTKEYSINSLOT", slot) == "0"
        moved0 = metric(m, "lmcache_master_redis_cluster_redirects_total",
                        backend="redis", kind="moved")
        assert dram(c, keys + [extra]) == sorted(keys + [extra])
        assert metric(m, "lmcache_master_redis_cluster_redirects_total",
                      backend="redis", kind="moved") > moved0
        assert metric(m, "lmcache_master_redis_cluster_slot_map_reads_total", backend="redis") >= 1
        # Hits and blocks of the moved slot still count and route.
        c.match_external_kv(mine, count_as_hit=True)
        assert {e.hash: e.hit_count_total for e in c.get_external_kv_hit_counts(mine)} == \
            {k: 2 for k in mine}
        assert s.RouteGet(pb.RouteGetRequest(key=mine[0])).node_id == "cn"
        c.revoke_external_kv_blocks("cn", mine, UMBPTierType.DRAM)
        assert dram(c, keys) == sorted(set(keys) - set(mine))
        # The map now names the target: no further redirection.
        moved1 = metric(m, "lmcache_master_redis_cluster_redirects_total",
                        backend="redis", kind="moved")
        dram(c, keys)
        assert metric(m, "lmcache_master_redis_cluster_redirects_total",
                      backend="redis", kind="moved") == moved1


def test_redirection_loop_is_bounded(cluster):
    env = redis_cluster_env("loop", cluster)
    with Master(env=env) as m:
        keys = ["l%d" % i for i in range(30)]
        c, s, tags = populate(m, cluster, "loop", keys)
        tag, slot, src = apart(cluster, "loop", tags)
        dst = next(n for n in cluster.nodes if n.port != src.port)
        # MIGRATING without IMPORTING: the source sends missing keys to the target with ASK,
        # the target sends them back with MOVED, for ever.
        assert src.cli("CLUSTER", "SETSLOT", slot, "MIGRATING", dst.cli("CLUSTER", "MYID")) == "OK"
        absent = next("z%d" % i for i in range(1000) if tags[fnv("z%d" % i) % 3] == tag)
        with pytest.raises(grpc.RpcError) as e:
            s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=[absent]), timeout=20)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "still redirected after 5 tries" in e.value.details()
        assert src.cli("CLUSTER", "SETSLOT", slot, "STABLE") == "OK"
        assert dram(c, keys) == sorted(keys)


def test_lost_master_reads_as_misses_and_noscript_reloads(cluster):
    env = dict(redis_cluster_env("lost", cluster), MORI_UMBP_LOG_LEVEL="warn")
    with Master(env=env) as m:
        keys = ["q%d" % i for i in range(60)]
        c, s, tags = populate(m, cluster, "lost", keys)
        # Scripts gone from every node (a failover to a fresh replica): reloaded, retried.
        for n in cluster.nodes:
            assert n.cli("SCRIPT", "FLUSH") == "OK"
        c.match_external_kv(keys, count_as_hit=True)
        assert metric(m, "mori_umbp_redis_noscript_reload_total", backend="redis") >= 1
        assert {e.hash: e.hit_count_total for e in c.get_external_kv_hit_counts(keys[:2])} == \
            {keys[0]: 2, keys[1]: 2}
        gone, _, node = apart(cluster, "lost", tags)
        node.stop()
        live = sorted(k for k in keys if tags[fnv(k) % 3] != gone)
        assert dram(c, keys) == live
        found = list(s.BatchLookup(pb.BatchLookupRequest(keys=keys)).found)
        assert found == [k in live for k in keys]
        assert metric(m, "mori_umbp_redis_degraded_shard_total", backend="redis",
                      method="MatchExternalKv") >= 1
        m.stop()
        assert "redis shard degraded (MatchExternalKv)" in m.stderr


def test_redis_cli_reshard_while_matching(cluster):
    """Every slot of one master moved to another by `redis-cli --cluster reshard` while a
    client keeps matching (with hits): every answer complete and right."""
    import threading
    env = redis_cluster_env("live", cluster)
    with Master(env=env) as m:
        keys = ["r%d" % i for i in range(90)]
        c, s, tags = populate(m, cluster, "live", keys)
        tag, slot, src = apart(cluster, "live", tags)
        dst = next(n for n in cluster.nodes if n.port != src.port)
        me = src.cli("CLUSTER", "MYID")
        ranges = next(line.split()[8:] for line in src.cli("CLUSTER", "NODES").splitlines()
                      if line.split()[0] == me)
        nslots = sum(int(r.partition("-")[2] or r) - int(r.partition("-")[0]) + 1
                     for r in ranges)
        stop, bad, done = threading.Event(), [], [0]

        def load():
            cl = UMBPMasterClient(m.addr)
            while not stop.is_set():
                try:
                    got = sorted(h for x in cl.match_external_kv(keys, count_as_hit=True)
                                 for h in x.hashes_by_tier.get(UMBPTierType.DRAM, []))
                    if got != sorted(keys):
                        bad.append(len(got))
                    done[0] += 1
                except grpc.RpcError as e:
                    bad.append(e.details())

        t = threading.Thread(target=load)
        t.start()
        try:
            r = subprocess.run(["redis-cli", "--cluster", "reshard", "127.0.0.1:%d" % src.port,
                                "--cluster-from", me, "--cluster-to", dst.cli("CLUSTER", "MYID"),
                                "--cluster-slots", str(nslots), "--cluster-yes"],
                               capture_output=True, text=True, timeout=300)
        finally:
            stop.set()
            t.join()
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert cluster.owner(slot).port == dst.port
        assert done[0] > 0 and bad == []
        assert dram(c, keys) == sorted(keys)
        n = {e.hash: e.hit_count_total for e in c.get_external_kv_hit_counts(keys)}
        assert n == {k: done[0] + 1 for k in keys}
        assert metric(m, "lmcache_master_redis_cluster_redirects_total",
                      backend="redis", kind="moved") >= 1
