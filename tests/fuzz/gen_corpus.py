#!/usr/bin/python3
"""Writes the seed corpora of fuzz_master_rpc, fuzz_client_reply and fuzz_dp_decode into
tests/fuzz/corpus/:
valid messages, so the fuzzers start from inputs that reach the handlers and decoders.

    LMCACHE_BUILD_DIR=build /usr/bin/python3 tests/fuzz/gen_corpus.py

fuzz_master_rpc input: one byte (the method's index in umbp.proto's service, the order of the
master's method table) and the protobuf request. fuzz_client_reply input: a msgpack reply map
as the server sends it. fuzz_dp_decode input: a request payload with integer arrays long
enough to be read in place. The committed files are this script's output; rerun it when a message
changes."""
import os
import re
import sys

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(os.environ.get("LMCACHE_BUILD_DIR", os.path.join(ROOT, "build")),
                                "python"))
from umbp import pb  # noqa: E402


def methods():
    with open(os.path.join(ROOT, "src", "master", "umbp.proto")) as f:
        return re.findall(r"^\s*rpc (\w+)\(", f.read(), re.M)


def write(name, files):
    d = os.path.join(HERE, "corpus", name)
    os.makedirs(d, exist_ok=True)
    for fname, data in files.items():
        with open(os.path.join(d, fname), "wb") as f:
            f.write(data)


def master_rpc():
    idx = {m: i for i, m in enumerate(methods())}
    ev = [pb.KvEvent(kind=pb.KvEvent.ADD, key="k1", tier=pb.TIER_DRAM, size=4096),
          pb.KvEvent(kind=pb.KvEvent.REMOVE, key="k0", tier=pb.TIER_SSD)]
    reqs = {
        "register": ("RegisterClient", pb.RegisterClientRequest(
            node_id="n1", node_address="10.0.0.1:50051", peer_address="10.0.0.1:6000")),
        "heartbeat": ("Heartbeat", pb.HeartbeatRequest(
            node_id="n1", bundles=[pb.EventBundle(seq=1, events=ev)])),
        "route_get": ("RouteGet", pb.RouteGetRequest(key="k1")),
        "batch_route_get": ("BatchRouteGet", pb.BatchRouteGetRequest(keys=["k1", "k2"])),
        "report_xkv": ("ReportExternalKvBlocks", pb.ReportExternalKvBlocksRequest(
            node_id="n1", hashes=["h0", "h1", "h2"], tier=pb.TIER_DRAM)),
        "match_xkv": ("MatchExternalKv", pb.MatchExternalKvRequest(
            hashes=["h0", "h1", "h9"], count_as_hit=True)),
        "hit_counts": ("GetExternalKvHitCounts",
                       pb.GetExternalKvHitCountsRequest(hashes=["h0", "h1"])),
        "revoke_tier": ("RevokeAllExternalKvBlocksAtTier",
                        pb.RevokeAllExternalKvBlocksAtTierRequest(node_id="n1",
                                                                  tier=pb.TIER_DRAM)),
        "unregister": ("UnregisterClient", pb.UnregisterClientRequest(node_id="n1")),
    }
    write("fuzz_master_rpc",
          {f: bytes([idx[m]]) + msg.SerializeToString() for f, (m, msg) in reqs.items()})


def client_reply():
    replies = {
        "ok": {"ok": True, "result": "OK"},
        "chunk_size": {"ok": True, "chunk_size": 256},
        "lookup_ready": {"ok": True, "ready": True, "hit_chunks": 2},
        "retrieve": {"ok": True, "retrieved_chunks": 2, "chunks": [b"\x00" * 16, b"\x01" * 16]},
        "error": {"ok": False, "code": "not_found", "message": "no such object"},
        "proof": {"ok": False, "code": "proof_required", "message": "prove", "nonce": b"n" * 32},
    }
    write("fuzz_client_reply", {f: msgpack.packb(r) for f, r in replies.items()})


def dp_decode():
    mixed = [5, 200, 70000, 4000000000, 127, 128, 65535, 65536] * 12  # every plain form
    payloads = {
        "lookup": {"request_id": "r", "model_name": "m", "token_ids": list(range(512))},
        "store": {"instance_id": 1, "token_ids": mixed, "block_ids": list(range(96)),
                  "cache_salt": "s"},
        "short": {"token_ids": list(range(63)), "block_ids": [1, 2]},
        "uint64": {"token_ids": [2 ** 40] + list(range(80))},
        "negative": {"block_ids": [-1] + list(range(80))},
        "twice": [("token_ids", list(range(70))), ("token_ids", [1])],
    }
    out = {}
    for f, p in payloads.items():
        if isinstance(p, list):  # a map with a repeated key, packed by hand
            body = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in p)
            out[f] = bytes([0x80 | len(p)]) + body
        else:
            out[f] = msgpack.packb(p)
    write("fuzz_dp_decode", out)


if __name__ == "__main__":
    master_rpc()
    client_reply()
    dp_decode()
