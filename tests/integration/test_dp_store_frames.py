"""store_bytes with chunk_frames (docs/protocol.md): the chunks as frames after the payload map
instead of bins inside it. The bytes stored are the bytes sent; every malformed shape (counts
that disagree, frames on other operations, empty frames, both shapes at once) is bad_request;
too many frames or too many bytes are too_large; the server keeps answering, in order; the
Python client sends frames from its callers' buffers."""
import hashlib
import itertools
import struct

import msgpack
import numpy as np
import pytest
import zmq

from py_client_util import BUILD  # noqa: F401 (puts <build>/python on sys.path)
from lmcache_client import Client

CHUNK = 16
MODEL = "sf-model"


def hashes(n, tag):
    return [hashlib.sha256(tag + struct.pack(">I", i)).digest() for i in range(n)]


def blobs(n, size, seed):
    return [hashlib.sha256(b"%d:%d" % (seed, i)).digest() * (size // 32) for i in range(n)]


class Raw:
    def __init__(self, port):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 30000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ids = itertools.count(1)

    def send(self, op, payload, frames=()):
        rid = str(next(self.ids)).encode()
        self.sock.send_multipart([rid, op.encode(), msgpack.packb(payload), *frames])
        return rid

    def recv(self, rid, op):
        got = self.sock.recv_multipart()
        assert got[0] == rid and got[1] == op.encode(), got[:2]
        assert len(got) == 3, "a store_bytes reply has three frames"
        return msgpack.unpackb(got[2])

    def call(self, op, payload, frames=()):
        return self.recv(self.send(op, payload, frames), op)

    def close(self):
        self.sock.close(0)


@pytest.fixture
def raw(make_server):
    socks = []

    def make(*args):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args))
        r = Raw(s.zmq_port)
        socks.append(r)
        return s, r

    yield make
    for r in socks:
        r.close()


def store_frames(r, hs, data, **extra):
    p = {"model_name": MODEL, "chunk_hashes": hs, "chunk_frames": len(data), **extra}
    return r.call("store_bytes", p, data)


def retrieve(r, hs):
    rep = r.call("retrieve_bytes", {"model_name": MODEL, "chunk_hashes": hs})
    assert rep["ok"], rep
    return rep["chunks"]


def test_frames_store_the_bytes_sent_and_match_the_bins_shape(raw):
    s, r = raw()
    hs, data = hashes(5, b"a"), blobs(5, 64 << 10, 1)
    rep = store_frames(r, hs, data)
    assert rep == {"ok": True, "stored_chunks": 5, "skipped_chunks": 0, "pending_chunks": 0}
    assert retrieve(r, hs) == data
    # The same chunks through the bins shape are the same objects: all skipped.
    rep = r.call("store_bytes", {"model_name": MODEL, "chunk_hashes": hs, "chunks": data})
    assert rep["ok"] and rep["stored_chunks"] == 0 and rep["skipped_chunks"] == 5
    # And the other way round: bins first, then frames.
    hs2, data2 = hashes(3, b"b"), blobs(3, 4096, 2)
    assert r.call("store_bytes", {"model_name": MODEL, "chunk_hashes": hs2,
                                  "chunks": data2})["stored_chunks"] == 3
    rep = store_frames(r, hs2, data2)
    assert rep["ok"] and rep["skipped_chunks"] == 3
    assert retrieve(r, hs2) == data2
    # wait_l2 works with frames too (no L2 tier: nothing to wait for).
    rep = store_frames(r, hashes(1, b"c"), blobs(1, 4096, 3), wait_l2=True)
    assert rep["ok"] and rep["stored_chunks"] == 1 and rep["l2_stored_chunks"] == 0


BAD = [
    # (payload changes, frames, message part)
    ({"chunk_frames": 2}, 3, "chunk_frames is 2 but 3 frames follow the payload"),
    ({"chunk_frames": 4}, 3, "chunk_frames is 4 but 3 frames follow the payload"),
    ({"chunk_frames": None, "chunks": "bins"}, 3,
     "3 frames follow the payload of a request without chunk_frames"),
    ({"chunks": "bins"}, 3, "a request with chunk_frames carries no chunks field"),
    ({"chunk_frames": -1}, 3, "field 'chunk_frames' is out of range"),
    ({"chunk_frames": "3"}, 3, "field 'chunk_frames' must be an integer"),
    ({"chunk_frames": 2, "hashes": 3}, 2, "2 chunks sent for a range of 3 chunks"),
    ({"empty": 1}, 3, "chunk frame 1 is empty"),
]


@pytest.mark.parametrize("change,nframes,why", BAD)
def test_malformed_frames_are_bad_request_and_nothing_is_stored(raw, change, nframes, why):
    s, r = raw()
    hs = hashes(change.get("hashes", nframes), b"bad")
    data = blobs(nframes, 4096, 7)
    if change.get("empty"):
        data[1] = b""
    p = {"model_name": MODEL, "chunk_hashes": hs, "chunk_frames": nframes}
    for k, v in change.items():
        if k in ("hashes", "empty"):
            continue
        if v is None:
            p.pop(k)
        else:
            p[k] = data if v == "bins" else v
    rep = r.call("store_bytes", p, data)
    assert rep["ok"] is False and rep["code"] == "bad_request", rep
    assert why in rep["message"], rep
    assert retrieve(r, hs) == []  # nothing stored
    assert r.call("noop", {})["ok"]


@pytest.mark.parametrize("op", ["noop", "lookup", "retrieve_bytes", "store"])
def test_frames_after_the_payload_of_other_operations_are_refused(raw, op):
    s, r = raw()
    rep = r.call(op, {"model_name": MODEL, "request_id": "x", "chunk_hashes": hashes(1, b"o"),
                      "chunk_frames": 1, "instance_id": 1, "block_ids": [0]}, [b"x" * 100])
    assert rep["ok"] is False and rep["code"] == "bad_request", rep
    assert "only store_bytes with chunk_frames carries frames after the payload" in \
        rep["message"], rep
    assert r.call("noop", {})["ok"]


def test_too_many_frames_or_bytes_are_too_large_and_replies_stay_in_order(raw):
    s, r = raw("--max-request-objects", "4", "--max-message-mb", "1")
    # Five frames: more than any range may hold.
    rid1 = r.send("store_bytes", {"model_name": MODEL, "chunk_hashes": hashes(5, b"t"),
                                  "chunk_frames": 5}, blobs(5, 1024, 1))
    # Two frames of 600 KiB: the message is over --max-message-mb though each frame is not.
    rid2 = r.send("store_bytes", {"model_name": MODEL, "chunk_hashes": hashes(2, b"u"),
                                  "chunk_frames": 2}, blobs(2, 600 << 10, 2))
    rid3 = r.send("noop", {})
    rep = r.recv(rid1, "store_bytes")
    assert rep["code"] == "too_large" and "more than --max-request-objects (4)" in \
        rep["message"], rep
    rep = r.recv(rid2, "store_bytes")
    assert rep["code"] == "too_large" and "exceeds --max-message-mb" in rep["message"], rep
    assert r.recv(rid3, "noop")["ok"]
    # Within both limits the same shape works.
    rep = store_frames(r, hashes(4, b"v"), blobs(4, 200 << 10, 3))
    assert rep["ok"] and rep["stored_chunks"] == 4


def test_layout_mismatch_with_frames_is_refused(raw):
    """An object of another size than a registered layout's is refused, as with bins."""
    from lmcache_client import KVCache, KVLayout
    s, r = raw()
    c = Client(s.zmq_port, timeout=20)
    try:
        kv = KVCache(c, 1, MODEL, KVLayout(num_layers=1, num_blocks=8, tokens_per_block=16,
                                            bytes_per_token=32))
        want = 2 * 1 * CHUNK * 32
        rep = store_frames(r, hashes(1, b"l"), [b"z" * (want + 1)])
        assert rep["code"] == "bad_request" and f"makes objects of {want} bytes" in \
            rep["message"], rep
        rep = store_frames(r, hashes(1, b"l"), [b"z" * want])
        assert rep["ok"] and rep["stored_chunks"] == 1
        kv.close()
    finally:
        c.close()


def test_python_client_sends_frames_from_its_callers_buffers(raw):
    s, r = raw()
    c = Client(s.zmq_port, timeout=20)
    try:
        arr = np.arange(4096, dtype=np.uint16)  # 8 KiB
        data = [b"b" * 8192, bytearray(b"y" * 8192), memoryview(b"m" * 8192), arr,
                arr[::2].copy(), arr.reshape(64, 64)[:, :32]]  # the last is not contiguous
        hs = hashes(len(data), b"py")
        got = c.store_bytes(MODEL, data, chunk_hashes=hs, chunk_frames=True)
        assert got.stored_chunks == len(data)
        want = [bytes(d) if not isinstance(d, np.ndarray) else d.tobytes() for d in data]
        assert c.retrieve_bytes(MODEL, chunk_hashes=hs).chunks == want
        # Pipelined handles with frames resolve like any other.
        hs2 = hashes(8, b"pipe")
        hs_ = [c.send_store_bytes(MODEL, [b"%d" % i * 100], chunk_hashes=[hs2[i]],
                                  chunk_frames=True) for i in range(8)]
        assert [h.result().stored_chunks for h in hs_] == [1] * 8
    finally:
        c.close()
