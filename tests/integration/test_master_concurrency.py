"""Many clients at once against one master: every RPC, `GET /metrics` and `POST /route`, the
reaper and the hit GC, all running together on every store. The other master tests send one
call at a time; this one is what the ThreadSanitizer run (scripts/test-extra.sh) needs to see
the store's locks, the relay, the metrics and the Redis pools and read cache under contention."""

import hashlib
import json
import random
import threading
import time
import urllib.request

import grpc

from master_util import Master, backend, stub, use_python_package  # noqa: F401

use_python_package()
from umbp import pb  # noqa: E402

# Four gRPC workers, a reaper and a hit GC that run every second, nodes expired after a second
# of silence and deleted a second later, two pooled connections per Redis endpoint.
ENV = {"LMCACHE_MASTER_THREADS": "4", "UMBP_HEARTBEAT_TTL_SEC": "1",
       "UMBP_MAX_MISSED_HEARTBEATS": "1", "UMBP_REAPER_INTERVAL_SEC": "1",
       "UMBP_HIT_INDEX_TTL_SEC": "1", "UMBP_HIT_INDEX_GC_INTERVAL_SEC": "1",
       "LMCACHE_MASTER_EXPIRED_RETENTION_SEC": "1", "UMBP_REDIS_POOL_SIZE": "2"}
POOL = [hashlib.sha256(b"%d" % i).hexdigest() for i in range(64)]
TIERS = [pb.TIER_HBM, pb.TIER_DRAM, pb.TIER_SSD]
SECONDS = 3.0
WORKERS = 4


def client(m, i, deadline, errors, counts):
    """One node: registers, heartbeats with events and runs every RPC on shared hashes."""
    s = stub(m)
    rng = random.Random(i)
    node = "w%d" % i
    caps = [pb.TierCapacity(tier=pb.TIER_DRAM, total_capacity_bytes=1 << 30,
                            available_capacity_bytes=1 << 29)]
    seq = 0
    try:
        while time.monotonic() < deadline:
            try:
                s.RegisterClient(pb.RegisterClientRequest(
                    node_id=node, node_address=node + ":1", peer_address=node + ":2",
                    tier_capacities=caps, tags=["rack=%d" % (i % 2)]))
                seq = 0
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
            hs = rng.sample(POOL, 8)
            tier = rng.choice(TIERS)
            seq += 1
            ev = [pb.KvEvent(kind=rng.choice([pb.KvEvent.ADD, pb.KvEvent.REMOVE]),
                             key="%s-%d" % (node, k), tier=pb.TIER_DRAM, size=4096)
                  for k in rng.sample(range(16), 4)]
            h = s.Heartbeat(pb.HeartbeatRequest(node_id=node, tier_capacities=caps,
                                                bundles=[pb.EventBundle(seq=seq, events=ev)]))
            seq = h.acked_seq
            s.ReportExternalKvBlocks(pb.ReportExternalKvBlocksRequest(node_id=node, hashes=hs,
                                                                      tier=tier))
            s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=rng.sample(POOL, 16),
                                                        count_as_hit=rng.random() < 0.5))
            s.GetExternalKvHitCounts(pb.GetExternalKvHitCountsRequest(hashes=hs))
            s.RevokeExternalKvBlocks(pb.RevokeExternalKvBlocksRequest(node_id=node,
                                                                      hashes=hs[:3], tier=tier))
            keys = ["w%d-%d" % (rng.randrange(WORKERS), k) for k in range(4)]
            s.BatchLookup(pb.BatchLookupRequest(node_id=node, keys=keys))
            s.RouteGet(pb.RouteGetRequest(node_id=node, key=keys[0]))
            s.BatchRouteGet(pb.BatchRouteGetRequest(node_id=node, keys=keys))
            s.RoutePut(pb.RoutePutRequest(node_id=node, key="p-%d" % rng.randrange(32),
                                          block_size=4096))
            s.BatchRoutePut(pb.BatchRoutePutRequest(node_id=node, keys=keys,
                                                    block_sizes=[4096] * len(keys)))
            s.ReportMetrics(pb.ReportMetricsRequest(node_id=node, metrics=[pb.MetricSample(
                name="conc_ops_total", help="ops", counter_delta=1.0)]))
            r = rng.random()
            if r < 0.05:
                s.RevokeAllExternalKvBlocksForNode(
                    pb.RevokeAllExternalKvBlocksForNodeRequest(node_id=node))
            elif r < 0.1:
                s.RevokeAllExternalKvBlocksAtTier(
                    pb.RevokeAllExternalKvBlocksAtTierRequest(node_id=node, tier=tier))
            elif r < 0.15:
                s.UnregisterClient(pb.UnregisterClientRequest(node_id=node))
            counts[i] += 1
    except Exception as e:  # reported by the test, with the node it happened on
        errors.append("%s: %r" % (node, e))


def silent_nodes(m, deadline, errors):
    """Nodes that register, report and go quiet, so the reaper expires and deletes them while
    the others run."""
    s = stub(m)
    k = 0
    try:
        while time.monotonic() < deadline:
            node = "silent%d" % k
            k += 1
            s.RegisterClient(pb.RegisterClientRequest(node_id=node, peer_address=node + ":1"))
            s.ReportExternalKvBlocks(pb.ReportExternalKvBlocksRequest(
                node_id=node, hashes=POOL[:16], tier=pb.TIER_DRAM))
            time.sleep(0.3)
    except Exception as e:
        errors.append("silent: %r" % e)


def http_reader(m, deadline, errors):
    """Scrapes /metrics and asks /route while the RPCs run."""
    body = json.dumps({"hashes": POOL[:8], "chunk_size": 256}).encode()
    try:
        while time.monotonic() < deadline:
            assert "mori_umbp_client_count" in m.metrics()
            req = urllib.request.Request("http://127.0.0.1:%d/route" % m.metrics_port, data=body)
            with urllib.request.urlopen(req, timeout=30) as r:
                assert "nodes" in json.loads(r.read())
    except Exception as e:
        errors.append("http: %r" % e)


def test_every_path_at_once_then_a_consistent_index():
    m = Master(env=ENV)
    try:
        deadline = time.monotonic() + SECONDS
        errors, counts = [], [0] * WORKERS
        threads = [threading.Thread(target=client, args=(m, i, deadline, errors, counts))
                   for i in range(WORKERS)]
        threads += [threading.Thread(target=silent_nodes, args=(m, deadline, errors)),
                    threading.Thread(target=http_reader, args=(m, deadline, errors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert all(counts), counts
        # Afterwards the index answers as if the calls had come one by one.
        s = stub(m)
        s.UnregisterClient(pb.UnregisterClientRequest(node_id="final"))
        s.RegisterClient(pb.RegisterClientRequest(node_id="final", peer_address="final:1"))
        s.ReportExternalKvBlocks(pb.ReportExternalKvBlocksRequest(
            node_id="final", hashes=POOL[:4], tier=pb.TIER_HBM))
        got = s.MatchExternalKv(pb.MatchExternalKvRequest(hashes=POOL[:4])).matches
        assert any(x.node_id == "final" for x in got), got
    finally:
        assert m.stop() == 0, m.stderr
