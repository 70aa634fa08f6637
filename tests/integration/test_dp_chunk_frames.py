"""retrieve_bytes with chunk_frames (docs/protocol.md): the chunks as frames after the reply map,
sent from L1 under reply pins. The bytes a client reads are the bytes stored even when the
objects are cleared and their memory wanted by new stores while the reply waits; a client that
never reads or goes away releases its pins; the pin cap falls back to copies; SIGTERM with
pinned replies queued exits cleanly."""
import hashlib
import itertools
import re
import struct
import time

import msgpack
import pytest
import zmq

CHUNK = 16
MODEL = "frames-model"
MIB = 1 << 20


def hashes(n, tag):
    return [hashlib.sha256(tag + struct.pack(">I", i)).digest() for i in range(n)]


def blobs(n, size, seed):
    return [hashlib.sha256(b"%d:%d" % (seed, i)).digest() * (size // 32) for i in range(n)]


class Client:
    def __init__(self, port, rcvhwm=None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 30000)
        self.sock.setsockopt(zmq.LINGER, 0)
        if rcvhwm is not None:  # a client that stops reading: libzmq then stops reading too
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self.sock.setsockopt(zmq.RCVBUF, 65536)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ids = itertools.count(1)

    def send(self, op, **payload):
        rid = str(next(self.ids)).encode()
        self.sock.send_multipart([rid, op.encode(), msgpack.packb(payload)])
        return rid

    def recv(self, rid, op):
        frames = self.sock.recv_multipart()
        assert frames[0] == rid and frames[1] == op.encode()
        return msgpack.unpackb(frames[2]), frames[3:]

    def call(self, op, **payload):
        reply, extra = self.recv(self.send(op, **payload), op)
        assert reply["ok"], reply
        return reply, extra

    def close(self):
        self.sock.close(0)


@pytest.fixture
def srv(make_server):
    def make(*args):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args))
        return s, Client(s.zmq_port)
    return make


def l1(s):
    return s.get("/status").json()["storage_manager"]["l1"]


def wait_l1(s, pred, what, timeout=30):
    deadline = time.time() + timeout
    while True:
        st = l1(s)
        if pred(st):
            return st
        if time.time() > deadline:
            raise AssertionError(f"{what}: {st}")
        time.sleep(0.02)


def retrieves_done(s):
    m = re.search(r'^lmcache_mp_dataplane_requests_total\{operation="retrieve_bytes",result="ok"\} '
                  r'(\S+)$', s.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def send_unread(s, hs, n=12):
    """n chunk-frame retrieves of hs from a client that does not read; returns once the server has
    run them all (their replies are then queued, pinning the objects)."""
    slow = Client(s.zmq_port, rcvhwm=1)
    before = retrieves_done(s)
    rids = [slow.send("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, chunk_frames=True)
            for _ in range(n)]
    deadline = time.time() + 30
    while retrieves_done(s) < before + n:
        assert time.time() < deadline, "the retrieves did not run"
        time.sleep(0.02)
    wait_l1(s, lambda st: st["pins"] > 0 and st["read_locked_objects"] == 0,
            "replies pinned while the client does not read")
    return slow, rids


def store(c, hs, data):
    r, _ = c.call("store_bytes", model_name=MODEL, chunk_hashes=hs, chunks=data)
    assert r["stored_chunks"] == len(hs)


def test_chunk_frames_reply_is_the_stored_bytes_and_the_old_reply_is_unchanged(srv):
    s, c = srv()
    hs, data = hashes(3, b"a"), blobs(3, 256 << 10, 1)
    store(c, hs, data)
    r, frames = c.call("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, chunk_frames=True)
    assert r == {"ok": True, "chunk_frames": 3, "copied_chunks": 0}
    assert frames == data
    # a range: the leading present chunks only
    r, frames = c.call("retrieve_bytes", model_name=MODEL, chunk_hashes=hs + hashes(1, b"x"),
                       start=CHUNK, chunk_frames=True)
    assert r["chunk_frames"] == 2 and frames == data[1:]
    r, frames = c.call("retrieve_bytes", model_name=MODEL, chunk_hashes=hashes(2, b"x"),
                       chunk_frames=True)
    assert r["chunk_frames"] == 0 and frames == []
    # Absent or false: the 3-frame reply with the chunks in the map, byte for byte.
    want = (b"\xdf\x00\x00\x00\x02" + msgpack.packb("chunks") + msgpack.packb(data) +
            msgpack.packb("ok") + msgpack.packb(True))
    for extra in ({}, {"chunk_frames": False}):
        rid = c.send("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, **extra)
        got = c.sock.recv_multipart()
        assert len(got) == 3 and got[0] == rid
        assert got[2] == want
    rid = c.send("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, chunk_frames=1)
    reply, extra = c.recv(rid, "retrieve_bytes")
    assert reply["code"] == "bad_request" and "chunk_frames" in reply["message"] and not extra
    st = wait_l1(s, lambda st: st["pins"] == 0, "pins released once sent")
    assert st["pinned_bytes"] == 0 and st["read_locked_objects"] == 0


def test_cleared_objects_stay_intact_for_a_reply_that_waits(srv):
    # Regression for a reply sent from L1: its objects are cleared while the client does not
    # read, and new stores want the memory; the reply must still carry the bytes it was built
    # from, and the memory is freed when the last reply has left.
    s, c = srv("--l1-pinned-reply-ratio", "1")
    hs, data = hashes(4, b"p"), blobs(4, 4 * MIB, 2)
    store(c, hs, data)
    slow, rids = send_unread(s, hs)
    assert s.post("/cache/clear", json={"force": True}).status_code == 200
    st = l1(s)
    assert st["objects"] == 0 and st["doomed_objects"] == 4
    # New objects fill L1 several times over (eviction); none may land in pinned memory.
    for round_ in range(4):
        for k in range(14):
            store(c, hashes(1, b"n%d-%d" % (round_, k)), blobs(1, 4 * MIB, 100 + k))
    # The same key cannot be stored while its doomed entry is in use.
    r, _ = c.call("store_bytes", model_name=MODEL, chunk_hashes=hs[:1], chunks=data[:1])
    assert r["stored_chunks"] == 0, r
    for rid in rids:
        reply, frames = slow.recv(rid, "retrieve_bytes")
        assert reply["chunk_frames"] == 4 and reply["copied_chunks"] == 0
        assert frames == data
    slow.close()
    st = wait_l1(s, lambda st: st["pins"] == 0 and st["doomed_objects"] == 0,
                 "last reply sent: pins released, doomed objects freed")
    assert st["pinned_bytes"] == 0
    assert st["bytes_used"] == st["objects"] * 4 * MIB


@pytest.mark.parametrize("how", ["clear", "delete_by_eviction", "none"])
def test_client_that_goes_away_releases_its_pins(srv, how):
    s, c = srv("--l1-pinned-reply-ratio", "1")
    hs, data = hashes(4, b"g"), blobs(4, 4 * MIB, 3)
    store(c, hs, data)
    slow, _ = send_unread(s, hs)
    if how == "clear":
        c.call("clear")
        assert l1(s)["doomed_objects"] == 4
    elif how == "delete_by_eviction":
        for k in range(70):
            store(c, hashes(1, b"e%d" % k), blobs(1, 4 * MIB, 200 + k))
        assert l1(s)["objects"] < 74  # evicted around the pinned objects
    slow.close()  # never read: libzmq drops the replies when the connection goes
    st = wait_l1(s, lambda st: st["pins"] == 0 and st["doomed_objects"] == 0,
                 "pins released by the dropped replies")
    assert st["pinned_bytes"] == 0
    assert st["bytes_used"] == st["objects"] * 4 * MIB
    if how == "none":
        assert st["objects"] == 4
        _, frames = c.call("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, chunk_frames=True)
        assert frames == data


def test_pin_cap_falls_back_to_copies(srv):
    # 0.25 GiB L1 x 0.006 = 1.5 MiB: the first 1 MiB chunk is pinned, the second copied.
    s, c = srv("--l1-pinned-reply-ratio", "0.006")
    hs, data = hashes(2, b"c"), blobs(2, MIB, 4)
    store(c, hs, data)
    r, frames = c.call("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, chunk_frames=True)
    assert r["chunk_frames"] == 2 and r["copied_chunks"] == 1 and frames == data
    wait_l1(s, lambda st: st["pins"] == 0, "pins released")
    s2, c2 = srv("--l1-pinned-reply-ratio", "0")
    store(c2, hs, data)
    r, frames = c2.call("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, chunk_frames=True)
    assert r["chunk_frames"] == 2 and r["copied_chunks"] == 2 and frames == data
    assert l1(s2)["pins_refused"] == 2
    assert "lmcache_mp_l1_pin_refused_total 2" in s2.get("/metrics").text


def test_sigterm_with_pinned_replies_queued_exits_cleanly(srv):
    s, c = srv("--l1-pinned-reply-ratio", "1")
    hs, data = hashes(4, b"t"), blobs(4, 4 * MIB, 5)
    store(c, hs, data)
    slow, _ = send_unread(s, hs)
    c.call("clear")
    assert s.stop() == 0
    assert "reply pins held" not in s.output()
    slow.close()
    c.close()
