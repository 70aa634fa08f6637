"""The KV-event stream (`--kv-events-endpoint`) and its replay ROUTER
(`--kv-events-replay-endpoint`), over the real binary with pyzmq: both event forms
(maps tagged "type", legacy positional arrays), both hash forms (32-byte digests, int64),
AllBlocksCleared at start and after a clear that empties the node, a subscriber that joins late
detecting the sequence gap and recovering the missing batches through the replay endpoint, and
hostile input on the replay socket."""
import json
import os
import socket
import sys

import msgpack
import pytest
import zmq

from conftest import free_port
from dp_util import DPClient
from master_util import ROOT, use_python_package
from test_fleet import CHUNK, Master, fleet_server, matches, prompt, store, wait_for

use_python_package()
sys.path.insert(0, os.path.join(ROOT, "python"))

END = b"\xff" * 8  # the replay's end marker: sequence -1


def metric(s, name):
    for ln in s.get("/metrics").text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[1])
    return 0.0


def norm(h):
    return h.hex() if isinstance(h, bytes) else h


def decode_event(ev):
    """(type, hashes, medium, block_size) of an event in either form."""
    if isinstance(ev, dict):  # the current vLLM form: a map tagged "type"
        return (ev["type"], [norm(h) for h in ev.get("block_hashes", [])], ev.get("medium"),
                ev.get("block_size"))
    tag = ev[0]  # the legacy form: a tagged positional array
    if tag == "BlockStored":  # tag, hashes, parent, token_ids, block_size, lora_id, medium
        assert len(ev) == 7 and ev[2] is None and ev[3] == [] and ev[5] is None
        return tag, [norm(h) for h in ev[1]], ev[6], ev[4]
    if tag == "BlockRemoved":  # tag, hashes, medium
        assert len(ev) == 3
        return tag, [norm(h) for h in ev[1]], ev[2], None
    assert ev == ["AllBlocksCleared"]
    return tag, [], None, None


def decode_batch(payload):
    ts, evs, dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and dp_rank == 0
    return [decode_event(e) for e in evs]


def apply(state, events):
    for typ, hashes, medium, _ in events:
        if typ == "AllBlocksCleared":
            state.clear()
        elif typ == "BlockStored":
            state.setdefault(medium, set()).update(hashes)
        else:
            state.setdefault(medium, set()).difference_update(hashes)
    return {m: hs for m, hs in state.items() if hs}


class Sub:
    """A subscriber that binds (the server's endpoint has no '*': it connects)."""

    def __init__(self, ctx, port):
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:%d" % port)
        self.batches = {}

    def drain(self):
        try:
            while True:
                topic, seq, payload = self.sock.recv_multipart()
                assert topic == b"" and len(seq) == 8
                self.batches[int.from_bytes(seq, "big")] = payload
        except zmq.Again:
            pass
        return self.batches


def replay(ctx, ep, start, timeout_ms=10000):
    """[(seq, payload)] the replay endpoint sends for start, up to its end marker."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            empty, seq, payload = s.recv_multipart()
            assert empty == b""
            if seq == END:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        s.close(0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)  # closes the sockets a failed test left open


def kv_server(make_server, *extra):
    pub, rep = free_port(), free_port()
    s = make_server(args=["--chunk-size", str(CHUNK), "--kv-events-endpoint",
                          "tcp://127.0.0.1:%d" % pub, "--kv-events-replay-endpoint",
                          "tcp://127.0.0.1:%d" % rep] + list(extra))
    return s, DPClient(s.zmq_port), pub, "tcp://127.0.0.1:%d" % rep


def test_late_subscriber_recovers_the_gap_through_replay(make_server, ctx):
    s, c, pub, rep = kv_server(make_server)
    # Batch 0 is the AllBlocksCleared of the start: subscribers forget an earlier life.
    first = wait_for(lambda: replay(ctx, rep, 0))
    assert first[0][0] == 0
    assert decode_batch(first[0][1]) == [("AllBlocksCleared", [], None, None)]
    # Batches published before anyone subscribes are lost to PUB/SUB.
    want = set()
    for i in range(3):
        before = metric(s, "lmcache_mp_kv_events_batches_total")
        want |= set(store(c, 10 + i))
        assert wait_for(lambda: metric(s, "lmcache_mp_kv_events_batches_total") > before)
    sub = Sub(ctx, pub)
    for i in range(100):
        want |= set(store(c, 100 + i, chunks=1))
        if wait_for(lambda: sub.drain(), timeout=0.5):
            break
    seen = sub.drain()
    assert seen
    # The subscriber joined late: it sees the gap from the sequence numbers.
    lo = min(seen)
    missing = [q for q in range(0, max(seen)) if q not in seen]
    assert lo >= 4 and missing[:4] == [0, 1, 2, 3]
    got = dict(replay(ctx, rep, missing[0]))
    assert set(missing) <= set(got)
    # Replayed batches are the very batches that were published.
    assert all(got[q] == seen[q] for q in seen if q in got)
    merged = dict(seen)
    merged.update(got)
    seqs = sorted(merged)
    assert seqs == list(range(0, seqs[-1] + 1))
    state = {}
    for q in seqs:
        apply(state, decode_batch(merged[q]))
    assert apply(state, []) == {"CPU": want}
    # A clear that empties the node is one AllBlocksCleared (no L2 tier keeps copies).
    assert s.post("/cache/clear").status_code == 200

    def cleared():
        evs = [e for q in sorted(sub.drain()) if q > seqs[-1] for e in decode_batch(sub.batches[q])]
        return ("AllBlocksCleared", [], None, None) in evs and evs
    evs = wait_for(cleared)
    assert evs and evs[-1][0] == "AllBlocksCleared"
    assert apply(state, evs) == {}
    assert metric(s, "lmcache_mp_kv_events_replay_requests_total") >= 2
    assert metric(s, "lmcache_mp_kv_events_replayed_batches_total") >= 5


def test_legacy_arrays_int64_hashes_and_the_rescan_after_a_restart(make_server, ctx, tmp_path):
    l2 = ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path)})]
    fmt = ["--kv-events-format", "legacy", "--kv-events-hash-format", "int64"]
    s, c, pub, rep = kv_server(make_server, *(fmt + l2))
    hashes = store(c, 1, chunks=3)
    ints = {int.from_bytes(bytes.fromhex(h)[24:], "big") for h in hashes}

    def state_now():
        st = {}
        for _, p in replay(ctx, rep, 0):
            raw = msgpack.unpackb(p, raw=False)[1]
            assert all(isinstance(e, list) for e in raw)  # positional arrays, not maps
            evs = decode_batch(p)
            for typ, hs, medium, bs in evs:
                assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hs)
                if typ == "BlockStored":
                    assert bs == CHUNK
            apply(st, evs)
        return apply(st, [])
    # The integer form is the digest's last 8 bytes, big-endian.
    assert wait_for(lambda: state_now() == {"CPU": ints, "FS": ints})
    # A clear leaves the fs copies: the L1 blocks are removed one by one, no AllBlocksCleared.
    assert s.post("/cache/clear").status_code == 200
    assert wait_for(lambda: state_now() == {"FS": ints})
    batches = replay(ctx, rep, 0)
    types = [e[0] for _, p in batches for e in decode_batch(p)]
    assert types.count("AllBlocksCleared") == 1 and types[0] == "AllBlocksCleared"
    assert s.stop() == 0
    # A restart over the same directory: AllBlocksCleared first, then the rescan report.
    s2, c2, pub2, rep2 = kv_server(make_server, *(fmt + l2))
    got = wait_for(lambda: [e for _, p in replay(ctx, rep2, 0) for e in decode_batch(p)]
                   if len(replay(ctx, rep2, 0)) else None)
    assert got[0][0] == "AllBlocksCleared"
    assert wait_for(lambda: apply({}, [e for _, p in replay(ctx, rep2, 0)
                                       for e in decode_batch(p)]) == {"FS": ints})


def test_replay_socket_survives_hostile_input(make_server, ctx):
    s, c, pub, rep = kv_server(make_server)
    want = set(store(c, 1))

    def stored():
        return apply({}, [e for _, p in replay(ctx, rep, 0) for e in decode_batch(p)])
    assert wait_for(lambda: stored() == {"CPU": want})
    port = int(rep.rsplit(":", 1)[1])
    rejected0 = metric(s, "lmcache_mp_kv_events_replay_rejected_total")
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.RCVTIMEO, 10000)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(rep)
    # Malformed requests are ignored: short or long sequence, no delimiter, extra frames.
    bad = [[b"", b"123"], [b"", b"\0" * 9], [b"x", b"\0" * 8], [b"\0" * 8],
           [b"", b"\0" * 8, b"more"], [b""], [b"", b"", b""]]
    for m in bad:
        d.send_multipart(m)
    # The next well-formed request is the first answered: a start beyond the newest batch gets
    # the end marker only, so does the largest sequence.
    d.send_multipart([b"", (1 << 63).to_bytes(8, "big")])
    assert d.recv_multipart() == [b"", END, b""]
    d.send_multipart([b"", END])
    assert d.recv_multipart() == [b"", END, b""]
    assert wait_for(lambda: metric(s, "lmcache_mp_kv_events_replay_rejected_total") >=
                    rejected0 + len(bad))
    # A frame larger than any request disconnects that peer (ZMQ_MAXMSGSIZE); others go on.
    big = ctx.socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    big.connect(rep)
    big.send_multipart([b"", b"\0" * (1 << 20)])
    # Bytes that are not ZMTP at all.
    for junk in (b"\xff" * 4096, b"GET / HTTP/1.1\r\n\r\n", os.urandom(65536)):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sk:
            try:
                sk.sendall(junk)
            except OSError:
                pass
    # Many requests at once, from many peers: each is answered in full or ignored (at most 16
    # replays run at once), never half-way, and the server keeps serving.
    peers = []
    for _ in range(40):
        p = ctx.socket(zmq.DEALER)
        p.setsockopt(zmq.LINGER, 0)
        p.setsockopt(zmq.RCVTIMEO, 3000)
        p.connect(rep)
        peers.append(p)
    for p in peers:
        p.send_multipart([b"", (0).to_bytes(8, "big")])
        for _ in range(50):  # the same peer asking again starts over
            p.send_multipart([b"", (0).to_bytes(8, "big")])
    answered = 0
    for p in peers:
        try:
            while True:
                empty, seq, payload = p.recv_multipart()
                assert empty == b""
                if seq == END:
                    answered += 1
                    break
                decode_batch(payload)
        except zmq.Again:
            pass
        p.close(0)
    assert answered >= 16
    big.close(0)
    d.close(0)
    assert s.get("/healthcheck").status_code == 200
    full = replay(ctx, rep, 0)
    assert [q for q, _ in full] == list(range(len(full)))
    assert stored() == {"CPU": want}
    assert metric(s, "lmcache_mp_kv_events_replay_buffer_bytes") > 0


def test_replay_needs_the_event_endpoint(tmp_path):
    import subprocess
    from conftest import BIN
    r = subprocess.run([BIN, "server", "--l1-size-gb", "0.01", "--eviction-policy", "LRU",
                        "--port", str(free_port()), "--http-port",
                        str(free_port()), "--kv-events-replay-endpoint",
                        "tcp://127.0.0.1:%d" % free_port()], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--kv-events-endpoint" in r.stderr


@pytest.fixture(scope="module")
def s3():
    import s3_harness
    env = s3_harness.S3Env()
    try:
        env.start()
    except RuntimeError as e:
        if str(e).startswith("skip:"):
            pytest.skip(str(e))
        raise
    yield env
    env.stop()


def test_s3_objects_are_medium_obj_in_events_but_not_placements(make_server, ctx, s3):
    import s3_harness
    m = Master()
    try:
        cfg = {"type": "s3", "endpoint": s3.endpoint, "bucket": s3.bucket,
               "region": "us-east-1", "access_key_id": s3_harness.AKID,
               "secret_access_key": s3_harness.SECRET, "prefix": "kvev/"}
        pub, rep = free_port(), free_port()
        s, c = fleet_server(make_server, m.addr, "node-s3", "--kv-events-endpoint",
                            "tcp://127.0.0.1:%d" % pub, "--kv-events-replay-endpoint",
                            "tcp://127.0.0.1:%d" % rep, "--l2-adapter", json.dumps(cfg))
        rep = "tcp://127.0.0.1:%d" % rep
        hashes = set(store(c, 77, chunks=2))

        def state():
            return apply({}, [e for _, p in replay(ctx, rep, 0) for e in decode_batch(p)])
        assert wait_for(lambda: state() == {"CPU": hashes, "OBJ": hashes}, timeout=30)
        # The master is told of the DRAM copies only: S3 is shared by the fleet.
        from umbp import UMBPTierType
        assert wait_for(lambda: matches(m.addr, sorted(hashes)) == {
            "node-s3": {UMBPTierType.DRAM: hashes}})
        # A clear keeps the S3 copies (block by block, no AllBlocksCleared); deleting them
        # removes them from the stream.
        assert s.post("/cache/clear").status_code == 200
        assert wait_for(lambda: state() == {"OBJ": hashes}, timeout=30)
        keys = [e["key"] for e in s.get("/cache/objects").json()["entries"]]
        assert len(keys) == 2
        r = s.delete("/cache/objects", json={"keys": keys, "adapter": "S3L2Adapter"})
        assert r.status_code == 200, r.text
        assert wait_for(lambda: state() == {}, timeout=30)
        assert matches(m.addr, sorted(hashes)) == {}
    finally:
        m.stop()
