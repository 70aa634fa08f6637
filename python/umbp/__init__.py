"""Python control-plane client of the UMBP master (`lmcache master` / `umbp_master`).

API of the UMBP master client: ``UMBPMasterClient``, ``UMBPTierType``,
``UMBPExternalKvNodeMatch`` and ``UMBPExternalKvHitCountEntry``. Every failure raises
``RuntimeError("<Rpc> failed: <status message>")``. See docs/master.md.
"""

import enum
import os
import sys
import threading

import grpc


def _load_stubs():
    """Imports the protoc-generated modules: from the package's _proto directory (a build
    tree copy), else from $LMCACHE_BUILD_DIR/python/umbp/_proto, else ./build."""
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.join(here, "_proto")]
    bd = os.environ.get("LMCACHE_BUILD_DIR")
    if bd:
        candidates.append(os.path.join(bd, "python", "umbp", "_proto"))
    candidates.append(os.path.join(here, "..", "..", "build", "python", "umbp", "_proto"))
    for d in candidates:
        if os.path.exists(os.path.join(d, "umbp_pb2_grpc.py")):
            if d not in sys.path:
                sys.path.insert(0, d)
            import umbp_pb2  # noqa: E402
            import umbp_pb2_grpc  # noqa: E402

            return umbp_pb2, umbp_pb2_grpc
    raise ImportError("umbp stubs not found: build the tree (cmake) or set LMCACHE_BUILD_DIR")


pb, pb_grpc = _load_stubs()

__all__ = [
    "UMBPMasterClient",
    "UMBPTierType",
    "UMBPExternalKvNodeMatch",
    "UMBPExternalKvMatch",
    "UMBPExternalKvHitCountEntry",
]


class UMBPTierType(enum.IntEnum):
    """Storage tier; ordered so that sorting puts the fastest tier first."""

    Unknown = 0
    HBM = 1
    DRAM = 2
    SSD = 3


class UMBPExternalKvNodeMatch:
    """One node holding some of the queried hashes, grouped by every tier they live on."""

    __slots__ = ("node_id", "peer_address", "hashes_by_tier")

    def __init__(self, node_id="", peer_address="", hashes_by_tier=None):
        self.node_id = node_id
        self.peer_address = peer_address
        self.hashes_by_tier = dict(hashes_by_tier or {})

    def matched_hash_count(self):
        """Number of distinct matched hashes (a hash on HBM and DRAM counts once)."""
        seen = set()
        for hs in self.hashes_by_tier.values():
            seen.update(hs)
        return len(seen)

    def __repr__(self):
        return "<UMBPExternalKvNodeMatch node_id=%r matched=%d>" % (
            self.node_id,
            self.matched_hash_count(),
        )


UMBPExternalKvMatch = UMBPExternalKvNodeMatch


class UMBPExternalKvHitCountEntry:
    """Cumulative routing-hit counter of one hash."""

    __slots__ = ("hash", "hit_count_total")

    def __init__(self, hash="", hit_count_total=0):  # noqa: A002 - the documented name
        self.hash = hash
        self.hit_count_total = hit_count_total

    def __repr__(self):
        return "<UMBPExternalKvHitCountEntry hash=%r hit_count_total=%d>" % (
            self.hash,
            self.hit_count_total,
        )


def _tier(t):
    try:
        return UMBPTierType(int(t))
    except ValueError:
        return int(t)


# Long enough for a report of a million hashes to a Redis-backed master (about 125k hashes a
# second), short enough that a hung master cannot hold a routing path for good.
DEFAULT_TIMEOUT = 30.0


class UMBPMasterClient:
    """Control-plane client of the master. Construction never blocks and never raises
    for an unreachable master: the channel connects on first use. No heartbeat thread.

    timeout: the deadline of every call in seconds (None: none). A master that does not
    answer in time (hung, stopped, unreachable) makes the call raise RuntimeError."""

    def __init__(self, master_address, node_id="", node_address="", timeout=DEFAULT_TIMEOUT):
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be a positive number of seconds or None")
        self.master_address = master_address
        self.node_id = node_id
        self.node_address = node_address
        self.timeout = timeout
        self.auto_heartbeat = False
        self._lock = threading.Lock()
        self._channel = None
        self._stub = None
        self._registered = False

    # -- plumbing --
    def _get_stub(self):
        with self._lock:
            if self._stub is None:
                opts = [
                    ("grpc.max_receive_message_length", 64 << 20),
                    ("grpc.max_send_message_length", 64 << 20),
                ]
                self._channel = grpc.insecure_channel(self.master_address, options=opts)
                self._stub = pb_grpc.UMBPMasterStub(self._channel)
            return self._stub

    def _call(self, rpc, request):
        try:
            return getattr(self._get_stub(), rpc)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            details = e.details() if hasattr(e, "details") else str(e)
            raise RuntimeError("%s failed: %s" % (rpc, details)) from None

    def close(self):
        """Closes the channel (a later call reopens it)."""
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None
            self._stub = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # -- membership --
    def register_self(self, tier_capacities=None):
        """Registers node_id with {tier: (total_bytes, available_bytes)}."""
        caps = []
        for tier, (total, avail) in (tier_capacities or {}).items():
            caps.append(
                pb.TierCapacity(
                    tier=int(tier),
                    total_capacity_bytes=int(total),
                    available_capacity_bytes=int(avail),
                )
            )
        req = pb.RegisterClientRequest(
            node_id=self.node_id,
            node_address=self.node_address,
            tier_capacities=caps,
            peer_address="",
            engine_desc=b"",
        )
        self._call("RegisterClient", req)
        self._registered = True

    def unregister_self(self):
        """Unregisters node_id; does nothing when this client has not registered."""
        if not self._registered:
            return
        self._call("UnregisterClient", pb.UnregisterClientRequest(node_id=self.node_id))
        self._registered = False

    def is_registered(self):
        return self._registered

    # -- external KV --
    def report_external_kv_blocks(self, node_id, hashes, tier):
        req = pb.ReportExternalKvBlocksRequest(node_id=node_id, hashes=list(hashes), tier=int(tier))
        self._call("ReportExternalKvBlocks", req)

    def revoke_external_kv_blocks(self, node_id, hashes, tier):
        req = pb.RevokeExternalKvBlocksRequest(node_id=node_id, hashes=list(hashes), tier=int(tier))
        self._call("RevokeExternalKvBlocks", req)

    def revoke_all_external_kv_blocks_at_tier(self, node_id, tier):
        req = pb.RevokeAllExternalKvBlocksAtTierRequest(node_id=node_id, tier=int(tier))
        self._call("RevokeAllExternalKvBlocksAtTier", req)

    def revoke_all_external_kv_blocks_for_node(self, node_id):
        req = pb.RevokeAllExternalKvBlocksForNodeRequest(node_id=node_id)
        self._call("RevokeAllExternalKvBlocksForNode", req)

    def match_external_kv(self, hashes, count_as_hit=False):
        hashes = list(hashes)
        if not hashes:
            return []
        req = pb.MatchExternalKvRequest(hashes=hashes, count_as_hit=bool(count_as_hit))
        resp = self._call("MatchExternalKv", req)
        out = []
        for m in resp.matches:
            buckets = {}
            for th in m.hashes_by_tier:
                buckets[_tier(th.tier)] = list(th.hashes)
            ordered = {t: buckets[t] for t in sorted(buckets)}
            out.append(UMBPExternalKvNodeMatch(m.node_id, m.peer_address, ordered))
        return out

    def get_external_kv_hit_counts(self, hashes):
        req = pb.GetExternalKvHitCountsRequest(hashes=list(hashes))
        resp = self._call("GetExternalKvHitCounts", req)
        return [UMBPExternalKvHitCountEntry(e.hash, e.hit_count_total) for e in resp.entries]
