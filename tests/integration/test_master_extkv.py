"""External-KV placement index and hit counters of `lmcache master`, through python/umbp,
including the seed document's examples with only their import line changed."""

import contextlib
import os
import subprocess
import sys
import time

import pytest

from master_util import ROOT, Master, build_dir, use_python_package, backend, master  # noqa: F401

use_python_package()
from umbp import (  # noqa: E402
    UMBPExternalKvHitCountEntry,
    UMBPExternalKvNodeMatch,
    UMBPMasterClient,
    UMBPTierType,
)

_1GB = 1 << 30


_seq = [0]


def node(master, prefix="n", tiers=(UMBPTierType.DRAM,)):
    _seq[0] += 1
    nid = "%s-%d" % (prefix, _seq[0])
    c = UMBPMasterClient(master.addr, node_id=nid, node_address=nid + ":8080")
    c.register_self({t: (_1GB, _1GB) for t in tiers})
    return nid, c


def test_tier_type_and_result_types():
    assert [t.name for t in sorted(UMBPTierType)] == ["Unknown", "HBM", "DRAM", "SSD"]
    assert UMBPTierType.HBM < UMBPTierType.DRAM < UMBPTierType.SSD
    m = UMBPExternalKvNodeMatch("x", "", {UMBPTierType.HBM: ["a"], UMBPTierType.DRAM: ["a", "b"]})
    assert m.matched_hash_count() == 2
    assert repr(m) == "<UMBPExternalKvNodeMatch node_id='x' matched=2>"
    e = UMBPExternalKvHitCountEntry("h", 3)
    assert repr(e) == "<UMBPExternalKvHitCountEntry hash='h' hit_count_total=3>"


def test_construction_is_lazy_and_failures_raise():
    c = UMBPMasterClient("127.0.0.1:1", node_id="x")  # nothing listens there
    assert not c.is_registered()
    with pytest.raises(RuntimeError, match="RegisterClient failed"):
        c.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})
    with pytest.raises(RuntimeError, match="MatchExternalKv failed"):
        c.match_external_kv(["a"])
    c.unregister_self()  # not registered: no RPC, no error


def test_validation_messages(master):
    nid, c = node(master)
    with pytest.raises(RuntimeError, match="node_id"):
        c.report_external_kv_blocks("", ["a"], UMBPTierType.DRAM)
    with pytest.raises(RuntimeError, match="hashes"):
        c.report_external_kv_blocks(nid, [], UMBPTierType.DRAM)
    with pytest.raises(RuntimeError, match="node_id must not be empty"):
        c.revoke_external_kv_blocks("", [], UMBPTierType.DRAM)
    with pytest.raises(RuntimeError, match="hashes must not be empty"):
        c.revoke_external_kv_blocks(nid, [], UMBPTierType.DRAM)
    with pytest.raises(RuntimeError, match="node_id"):
        c.revoke_all_external_kv_blocks_at_tier("", UMBPTierType.SSD)
    assert c.match_external_kv([]) == []
    assert c.get_external_kv_hit_counts(["never-seen"]) == []


def test_report_is_additive_and_tiers_ordered(master):
    nid, c = node(master)
    hs = ["add-%d" % i for i in range(3)]
    c.report_external_kv_blocks(nid, hs, UMBPTierType.SSD)
    c.report_external_kv_blocks(nid, hs[:2], UMBPTierType.HBM)
    c.report_external_kv_blocks(nid, hs[:2], UMBPTierType.HBM)  # re-report: no-op
    (m,) = c.match_external_kv(hs + ["missing"])
    assert m.node_id == nid and m.peer_address == ""
    assert list(m.hashes_by_tier) == [UMBPTierType.HBM, UMBPTierType.SSD]
    assert m.hashes_by_tier[UMBPTierType.HBM] == hs[:2]
    assert m.hashes_by_tier[UMBPTierType.SSD] == hs
    assert m.matched_hash_count() == 3
    c.revoke_external_kv_blocks(nid, hs[:1], UMBPTierType.HBM)
    (m,) = c.match_external_kv(hs)
    assert m.hashes_by_tier[UMBPTierType.HBM] == hs[1:2]
    c.revoke_all_external_kv_blocks_at_tier(nid, UMBPTierType.SSD)
    (m,) = c.match_external_kv(hs)
    assert dict(m.hashes_by_tier) == {UMBPTierType.HBM: hs[1:2]}
    c.revoke_external_kv_blocks(nid, ["never-reported"], UMBPTierType.DRAM)
    c.revoke_external_kv_blocks("unknown-node", hs, UMBPTierType.HBM)  # no liveness check


def test_report_for_unknown_or_unregistered_node_is_ignored(master):
    c = UMBPMasterClient(master.addr)
    c.report_external_kv_blocks("ghost", ["g1"], UMBPTierType.DRAM)
    assert c.match_external_kv(["g1"]) == []
    nid, n = node(master)
    n.unregister_self()
    c.report_external_kv_blocks(nid, ["g2"], UMBPTierType.DRAM)
    assert c.match_external_kv(["g2"]) == []
    assert 'result="rejected_not_alive"' in master.metrics()


def test_unregister_drops_placements_and_revoke_all_for_node(master):
    nid, c = node(master)
    c.report_external_kv_blocks(nid, ["u1", "u2"], UMBPTierType.DRAM)
    c.report_external_kv_blocks(nid, ["u1"], UMBPTierType.HBM)
    c.revoke_all_external_kv_blocks_for_node(nid)
    assert c.match_external_kv(["u1", "u2"]) == []
    c.report_external_kv_blocks(nid, ["u3"], UMBPTierType.DRAM)
    c.unregister_self()
    assert c.match_external_kv(["u3"]) == []


def test_one_match_per_node_and_shared_hashes(master):
    a, ca = node(master)
    b, cb = node(master)
    hs = ["shared-0", "shared-1"]
    ca.report_external_kv_blocks(a, hs, UMBPTierType.DRAM)
    cb.report_external_kv_blocks(b, hs, UMBPTierType.HBM)
    got = {m.node_id: list(m.hashes_by_tier.keys()) for m in ca.match_external_kv(hs)}
    assert got == {a: [UMBPTierType.DRAM], b: [UMBPTierType.HBM]}


def test_count_as_hit_rules(master):
    a, ca = node(master)
    b, cb = node(master)
    ca.report_external_kv_blocks(a, ["hot", "warm"], UMBPTierType.HBM)
    ca.report_external_kv_blocks(a, ["hot"], UMBPTierType.DRAM)
    cb.report_external_kv_blocks(b, ["hot"], UMBPTierType.SSD)
    q = UMBPMasterClient(master.addr)
    q.match_external_kv(["hot", "warm"])  # count_as_hit=False records nothing
    assert q.get_external_kv_hit_counts(["hot", "warm"]) == []
    q.match_external_kv(["hot", "hot", "hot", "missing"], count_as_hit=True)
    counts = {e.hash: e.hit_count_total for e in q.get_external_kv_hit_counts(["hot", "missing"])}
    assert counts == {"hot": 1}
    for _ in range(3):
        q.match_external_kv(["hot", "warm"], count_as_hit=True)
    entries = q.get_external_kv_hit_counts(["warm", "hot", "hot", "nope"])
    assert sorted((e.hash, e.hit_count_total) for e in entries) == [("hot", 4), ("warm", 3)]
    # Counters survive revokes.
    ca.revoke_external_kv_blocks(a, ["hot"], UMBPTierType.HBM)
    ca.revoke_all_external_kv_blocks_at_tier(a, UMBPTierType.DRAM)
    cb.revoke_all_external_kv_blocks_at_tier(b, UMBPTierType.SSD)
    assert q.match_external_kv(["hot"], count_as_hit=True) == []
    counts = {e.hash: e.hit_count_total for e in q.get_external_kv_hit_counts(["hot"])}
    assert counts == {"hot": 4}


def test_hit_query_batch_cap():
    m = Master(env={"UMBP_HIT_QUERY_MAX_BATCH": "8"}, metrics=False)
    try:
        c = UMBPMasterClient(m.addr)
        assert c.get_external_kv_hit_counts(["h"] * 8) == []
        with pytest.raises(RuntimeError, match="UMBP_HIT_QUERY_MAX_BATCH"):
            c.get_external_kv_hit_counts(["h%d" % i for i in range(9)])
        with pytest.raises(RuntimeError, match="hashes size exceeds UMBP_HIT_QUERY_MAX_BATCH=8"):
            c.get_external_kv_hit_counts(["h"] * 9)  # duplicates count toward the cap
    finally:
        assert m.stop() == 0


def test_default_batch_cap_is_4096(master):
    c = UMBPMasterClient(master.addr)
    c.get_external_kv_hit_counts(["x%d" % i for i in range(4096)])
    with pytest.raises(RuntimeError, match="UMBP_HIT_QUERY_MAX_BATCH=4096"):
        c.get_external_kv_hit_counts(["x%d" % i for i in range(4097)])


def test_short_ttls_expire_nodes_and_hit_counters():
    env = {"UMBP_HEARTBEAT_TTL_SEC": "1", "UMBP_MAX_MISSED_HEARTBEATS": "1",
           "UMBP_REAPER_INTERVAL_SEC": "1", "UMBP_HIT_INDEX_TTL_SEC": "1",
           "UMBP_HIT_INDEX_GC_INTERVAL_SEC": "1"}
    m = Master(env=env, metrics=False)
    try:
        c = UMBPMasterClient(m.addr, node_id="short", node_address="short:1")
        c.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})
        c.report_external_kv_blocks("short", ["t1"], UMBPTierType.DRAM)
        assert len(c.match_external_kv(["t1"], count_as_hit=True)) == 1
        assert len(c.get_external_kv_hit_counts(["t1"])) == 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not c.match_external_kv(["t1"]) and not c.get_external_kv_hit_counts(["t1"]):
                break
            time.sleep(0.2)
        assert c.match_external_kv(["t1"]) == []  # the reaper expired the node
        assert c.get_external_kv_hit_counts(["t1"]) == []  # the GC dropped the counter
        c.report_external_kv_blocks("short", ["t2"], UMBPTierType.DRAM)  # expired: ignored
        assert c.match_external_kv(["t2"]) == []
        # An expired node may register again.
        UMBPMasterClient(m.addr, node_id="short").register_self({})
    finally:
        assert m.stop() == 0


def test_restart_loses_placements_and_hit_counts():
    m = Master(metrics=False)
    c = UMBPMasterClient(m.addr, node_id="r", node_address="r:1")
    c.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})
    c.report_external_kv_blocks("r", ["p"], UMBPTierType.DRAM)
    c.match_external_kv(["p"], count_as_hit=True)
    assert len(c.get_external_kv_hit_counts(["p"])) == 1
    assert m.stop() == 0
    m2 = Master(metrics=False)
    try:
        c2 = UMBPMasterClient(m2.addr)
        assert c2.match_external_kv(["p"]) == []
        assert c2.get_external_kv_hit_counts(["p"]) == []
    finally:
        assert m2.stop() == 0


def test_large_batch_report_and_match(master):
    nid, c = node(master)
    hs = ["big-%04d" % i for i in range(500)]
    c.report_external_kv_blocks(nid, hs, UMBPTierType.DRAM)
    (m,) = c.match_external_kv(hs[::-1])
    assert m.matched_hash_count() == 500
    assert m.hashes_by_tier[UMBPTierType.DRAM] == hs[::-1]  # request order


# ---- the seed document's examples, verbatim apart from the import line and the address ----

SEED_EXAMPLES = {
    "basic_registration": '''
from umbp import UMBPMasterClient, UMBPTierType

_1GB = 1 * 1024 * 1024 * 1024

client = UMBPMasterClient(
    "127.0.0.1:15558",
    node_id="worker-0",
    node_address="worker-0:8080",
)

# Register with available DRAM capacity
client.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})
assert client.is_registered()

# ... do work ...

client.unregister_self()
''',
    "report_and_match": '''
from umbp import UMBPMasterClient, UMBPTierType

_1GB = 1 * 1024 * 1024 * 1024
master = "127.0.0.1:15558"

# Node A reports that it holds some KV blocks in DRAM
node_a = UMBPMasterClient(master, node_id="node-a", node_address="node-a:8080")
node_a.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})

hashes = ["sha256-abc", "sha256-def", "sha256-ghi"]
node_a.report_external_kv_blocks("node-a", hashes, UMBPTierType.DRAM)

# Node B queries which nodes hold these blocks
node_b = UMBPMasterClient(master)
matches = node_b.match_external_kv(hashes)
for m in matches:
    per_tier = {t.name: len(hs) for t, hs in m.hashes_by_tier.items()}
    peer = m.peer_address or ""
    print(f"node {m.node_id} @ {peer} has {m.matched_hash_count()} blocks: {per_tier}")
# -> "node node-a @ has 3 blocks: {'DRAM': 3}"

# GPU was evicted but the host (DRAM) mirror is still alive - drop only
# the HBM bucket; node-a stays in the index with its DRAM bucket intact.
evicted = ["sha256-abc", "sha256-def"]
node_a.revoke_external_kv_blocks("node-a", evicted, UMBPTierType.HBM)

# Storage backend was cleared - drop every SSD bucket this node has in
# one RPC. HBM and DRAM buckets are untouched.
node_a.revoke_all_external_kv_blocks_at_tier("node-a", UMBPTierType.SSD)

# write_through created a CPU mirror while the GPU copy is still alive
# - report both tiers; the master keeps both buckets.
hashes = ["sha256-prefix-0", "sha256-prefix-1"]
node_a.report_external_kv_blocks("node-a", hashes, UMBPTierType.HBM)
node_a.report_external_kv_blocks("node-a", hashes, UMBPTierType.DRAM)

matches = node_a.match_external_kv(hashes)
m = matches[0]
# m.hashes_by_tier == {UMBPTierType.HBM: [...], UMBPTierType.DRAM: [...]}
# m.matched_hash_count() == 2  (distinct, NOT 4 - same hash on two tiers)
assert list(m.hashes_by_tier) == [UMBPTierType.HBM, UMBPTierType.DRAM]
assert m.matched_hash_count() == 2
''',
    "multiple_nodes": '''
from umbp import UMBPMasterClient, UMBPTierType
master = "127.0.0.1:15558"

_1GB = 1 * 1024 * 1024 * 1024
hashes = ["sha256-shared-0", "sha256-shared-1"]

node_a = UMBPMasterClient(master, node_id="node-a", node_address="node-a:8080")
node_a.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})
node_a.report_external_kv_blocks("node-a", hashes, UMBPTierType.DRAM)

node_b = UMBPMasterClient(master, node_id="node-b", node_address="node-b:8080")
node_b.register_self({UMBPTierType.HBM: (_1GB, _1GB)})
node_b.report_external_kv_blocks("node-b", hashes, UMBPTierType.HBM)

# match_external_kv returns one entry per node; each entry breaks the
# matched hashes down by every tier they live on for that node.
matches = node_a.match_external_kv(hashes)
matched_nodes = {m.node_id: list(m.hashes_by_tier.keys()) for m in matches}
# -> {"node-a": [UMBPTierType.DRAM], "node-b": [UMBPTierType.HBM]}
assert matched_nodes == {"node-a": [UMBPTierType.DRAM], "node-b": [UMBPTierType.HBM]}
''',
    "scheduling": '''
from collections import defaultdict
from umbp import UMBPMasterClient, UMBPTierType

master = "127.0.0.1:15558"
query_client = UMBPMasterClient(master)

query_hashes = [
    "sha256-prefix-0",
    "sha256-prefix-1",
    "sha256-prefix-2",
    "sha256-prefix-3",
]
matches = query_client.match_external_kv(query_hashes)

locations_by_hash = defaultdict(list)
for m in matches:
    for tier, hashes in m.hashes_by_tier.items():
        for h in hashes:
            locations_by_hash[h].append(
                {
                    "node_id": m.node_id,
                    "peer_address": m.peer_address,
                    "tier": tier,
                }
            )

summaries = []
for m in matches:
    best_tier_by_hash = {}
    for tier in sorted(m.hashes_by_tier):
        for h in m.hashes_by_tier[tier]:
            best_tier_by_hash.setdefault(h, tier)
    summaries.append(
        {
            "node_id": m.node_id,
            "matched_blocks": len(best_tier_by_hash),
            "per_tier_blocks": {
                tier.name: len(set(hashes)) for tier, hashes in m.hashes_by_tier.items()
            },
            "best_tier_by_hash": best_tier_by_hash,
        }
    )

not_found = set(query_hashes) - set(locations_by_hash)
best_node = max(summaries, key=lambda s: s["matched_blocks"], default=None)

tier_cost = {
    UMBPTierType.HBM: 0,
    UMBPTierType.DRAM: 1,
    UMBPTierType.SSD: 3,
}


def estimated_fetch_cost(summary):
    return sum(
        tier_cost[tier] for tier in summary["best_tier_by_hash"].values()
    )


cost_aware_node = min(summaries, key=estimated_fetch_cost, default=None)
''',
    "hot_blocks": '''
import time
from umbp import UMBPMasterClient

router = UMBPMasterClient("127.0.0.1:15558")


def pick_worker_from_matches(matches):
    return matches[0].node_id


def route_request(prefix_hashes):
    matches = router.match_external_kv(prefix_hashes, count_as_hit=True)
    if not matches:
        return None
    return pick_worker_from_matches(matches)


route_request(["sha256-prefix-0", "sha256-prefix-1"])
monitor = UMBPMasterClient("127.0.0.1:15558")


def load_tracked_prefix_hashes():
    return ["sha256-prefix-0", "sha256-prefix-1", "sha256-prefix-9"]


tracked_hashes: list[str] = load_tracked_prefix_hashes()


def fetch_counts(client, hashes, batch=4096):
    counts: dict[str, int] = {}
    for i in range(0, len(hashes), batch):
        for entry in client.get_external_kv_hit_counts(hashes[i : i + batch]):
            counts[entry.hash] = entry.hit_count_total
    return counts


counts = fetch_counts(monitor, tracked_hashes)
hottest = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:32]
assert hottest and all(h != "sha256-prefix-9" for h, _ in hottest)


def snapshot_counts(client, hashes, batch=4096):
    counts = {}
    for i in range(0, len(hashes), batch):
        for entry in client.get_external_kv_hit_counts(hashes[i : i + batch]):
            counts[entry.hash] = entry.hit_count_total
    return counts


before = snapshot_counts(monitor, tracked_hashes)
time.sleep(0.1)
route_request(["sha256-prefix-0"])
after = snapshot_counts(monitor, tracked_hashes)
delta = {
    h: after[h] - before.get(h, 0)
    for h in after
    if after[h] - before.get(h, 0) > 0
}
recent_hottest = sorted(delta.items(), key=lambda kv: kv[1], reverse=True)[:32]
assert recent_hottest == [("sha256-prefix-0", 1)]
''',
    "context_manager": '''
import contextlib
from umbp import UMBPMasterClient, UMBPTierType


@contextlib.contextmanager
def registered_client(master_address, node_id, tier_caps):
    client = UMBPMasterClient(master_address, node_id=node_id, node_address=node_id)
    client.register_self(tier_caps)
    try:
        yield client
    finally:
        with contextlib.suppress(Exception):
            client.unregister_self()


_1GB = 1 * 1024 * 1024 * 1024
with registered_client("127.0.0.1:15558", "worker-0", {UMBPTierType.DRAM: (_1GB, _1GB)}) as c:
    c.report_external_kv_blocks("worker-0", ["sha256-abc"], UMBPTierType.DRAM)
    matches = c.match_external_kv(["sha256-abc"])
    assert len(matches) == 1
''',
}


@pytest.mark.parametrize("name", list(SEED_EXAMPLES))
def test_seed_example_runs_unchanged(name):
    m = Master(metrics=False)
    try:
        if name in ("scheduling", "hot_blocks"):  # give the queries something to find
            c = UMBPMasterClient(m.addr, node_id="seed", node_address="seed:1")
            c.register_self({UMBPTierType.DRAM: (_1GB, _1GB)})
            c.report_external_kv_blocks("seed", ["sha256-prefix-%d" % i for i in range(4)],
                                        UMBPTierType.DRAM)
        env = dict(os.environ, PYTHONPATH=os.path.join(build_dir(), "python"))
        code = SEED_EXAMPLES[name].replace("127.0.0.1:15558", m.addr)
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        if name == "report_and_match":
            assert "node node-a @  has 3 blocks: {'DRAM': 3}" in r.stdout
    finally:
        assert m.stop() == 0


def test_demo_script():
    env = dict(os.environ, PYTHONPATH=os.path.join(build_dir(), "python"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "umbp_master_client_demo.py")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all scenarios passed" in r.stdout


