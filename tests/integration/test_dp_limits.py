"""Bounded work and memory per data-plane request (docs/protocol.md, Limits): objects per request
(chunks of the range x ranks), repeated chunk hashes, reply size, backpressure on pipelined
clients, and wire strings that must be UTF-8 text before they reach metric labels and logs."""
import json
import os
import shutil
import struct
import subprocess

import msgpack
import pytest
import zmq

from dp_util import hashes, wire_maker, proc_status
from test_protocol import Wire

CHUNK = 32
MODEL = "limits-model"


@pytest.fixture
def srv(make_server):
    return wire_maker(make_server, CHUNK)


def raw_map(fields):
    """A msgpack map whose values are packed normally, or taken verbatim when bytes wrapped in
    a 1-tuple (to send strings that are not valid UTF-8)."""
    assert len(fields) < 16
    out = bytes([0x80 | len(fields)])
    for k, v in fields.items():
        out += msgpack.packb(k) + (v[0] if isinstance(v, tuple) else msgpack.packb(v))
    return out


def promtool_clean(body):
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian package prometheus) is required"
    p = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
    assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr


# ---- objects per request -------------------------------------------------------------------

def test_lookup_of_many_chunks_times_ranks_is_too_large(srv):
    # Regression: 10,000 chunk hashes x world_size 8 made the server lock and allocate 80,000
    # objects (with 1,000,000 hashes and an L2 tier: 7.8 GB and a worker blocked for 27 s).
    _, w = srv()
    r = w.err("lookup", "too_large", request_id="r", model_name=MODEL, world_size=8,
              chunk_hashes=hashes(10000))
    assert "--max-request-objects" in r["message"]
    assert w.ok("noop")


def test_huge_lookup_with_l2_is_rejected_without_allocating(srv, tmp_path):
    s, w = srv("--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path / "l2")}),
               "--l1-prefault=false")
    before = proc_status(s.proc.pid, "VmRSS")
    # 1,000,000 one-byte hashes (3 MB on the wire) x 8 ranks
    body = raw_map({"request_id": "r", "model_name": MODEL, "world_size": 8,
                    "chunk_hashes": (b"\xdd" + struct.pack(">I", 1000000) +
                                     b"".join(b"\xc4\x01" + bytes([i % 251 + 1])
                                              for i in range(1000000)),)})
    r = w.raw("lookup", body)
    assert r["ok"] is False and r["code"] == "too_large", r
    assert proc_status(s.proc.pid, "VmHWM") - before < 256 << 20


def test_request_objects_limit_is_exact_and_counts_ranks(srv):
    _, w = srv("--max-request-objects", "64")
    h = hashes(65)
    w.ok("lookup", request_id="a", model_name=MODEL, world_size=8, chunk_hashes=h[:8])
    w.err("lookup", "too_large", request_id="a", model_name=MODEL, world_size=8,
          chunk_hashes=h[:9])
    w.ok("lookup", request_id="b", model_name=MODEL, chunk_hashes=h[:64])
    w.err("lookup", "too_large", request_id="b", model_name=MODEL, chunk_hashes=h)
    # only the range counts: the prompt may be longer
    w.ok("lookup", request_id="c", model_name=MODEL, chunk_hashes=h, start=CHUNK)
    w.err("retrieve_bytes", "too_large", model_name=MODEL, chunk_hashes=h)
    w.err("store_bytes", "too_large", model_name=MODEL, chunk_hashes=h, chunks=[b"x"] * 65)
    w.err("lookup", "too_large", request_id="d", model_name=MODEL,
          token_ids=list(range(65 * CHUNK)))


def test_prompt_over_the_chunk_limit_is_too_large(srv):
    _, w = srv()
    body = raw_map({"request_id": "r", "model_name": MODEL, "end": CHUNK,
                    "chunk_hashes": (b"\xdd" + struct.pack(">I", (1 << 20) + 1) +
                                     b"\xc4\x01\x07" * ((1 << 20) + 1),)})
    assert w.raw("lookup", body)["code"] == "too_large"


# ---- repeated chunks and reply size ----------------------------------------------------------

def test_retrieve_bytes_with_a_repeated_chunk_is_bad_request(srv):
    # Regression: one resident chunk named 70,000 times built a 1 GB reply.
    _, w = srv()
    h = hashes(1)[0]
    assert w.ok("store_bytes", model_name=MODEL, chunk_hashes=[h],
                chunks=[b"k" * 16384])["stored_chunks"] == 1
    r = w.err("retrieve_bytes", "bad_request", model_name=MODEL, chunk_hashes=[h] * 1000)
    assert "repeats" in r["message"]
    # a shorter hash with the same leading bytes is another chunk
    w.ok("retrieve_bytes", model_name=MODEL, chunk_hashes=[h, h[:16]])
    w.err("store_bytes", "bad_request", model_name=MODEL, chunk_hashes=[h, h],
          chunks=[b"a", b"b"])
    w.err("lookup", "bad_request", request_id="r", model_name=MODEL, chunk_hashes=[h, h])
    # a repeat outside the range does not matter
    got = w.ok("retrieve_bytes", model_name=MODEL, chunk_hashes=[h, h], end=CHUNK)
    assert got["chunks"] == [b"k" * 16384]


def test_retrieve_bytes_reply_is_held_to_max_reply_mb(srv):
    s, w = srv("--max-reply-mb", "1")
    hs = hashes(3, b"big")
    w.ok("store_bytes", model_name=MODEL, chunk_hashes=hs, chunks=[bytes([i]) * (400 << 10)
                                                                   for i in range(3)])
    got = w.ok("retrieve_bytes", model_name=MODEL, chunk_hashes=hs, end=2 * CHUNK)
    assert got["chunks"] == [bytes([i]) * (400 << 10) for i in range(2)]
    r = w.err("retrieve_bytes", "too_large", model_name=MODEL, chunk_hashes=hs)
    assert "--max-reply-mb" in r["message"]
    # the chunks examined were unlocked again
    assert s.get("/status").json()["storage_manager"]["l1"]["read_locked_objects"] == 0


def test_retrieve_bytes_reply_defaults_to_max_message_mb(srv):
    _, w = srv("--max-message-mb", "1")
    hs = hashes(3, b"def")
    for i, h in enumerate(hs):
        w.ok("store_bytes", model_name=MODEL, chunk_hashes=[h], chunks=[bytes([i]) * (400 << 10)])
    w.err("retrieve_bytes", "too_large", model_name=MODEL, chunk_hashes=hs)
    assert len(w.ok("retrieve_bytes", model_name=MODEL, chunk_hashes=hs[:2])["chunks"]) == 2


# ---- backpressure --------------------------------------------------------------------------

def test_pipelined_large_requests_are_pushed_back(srv):
    # Regression: pipelined large requests to a busy worker were drained from the socket into an
    # unbounded queue (300 x 10 MiB grew the server to 2.6 GB). Each request here carries a
    # 1M-token prompt (5 MB) and a 4 MiB chunk; the worker decodes and hashes it more slowly than
    # the socket delivers it.
    budget_mb, hwm, n = 8, 2, 120
    # (under AddressSanitizer, freed memory waits in a quarantine of 256 MiB unless told)
    asan = ":".join(filter(None, [os.environ.get("ASAN_OPTIONS"), "quarantine_size_mb=16"]))
    s, _ = srv("--max-workers", "1", "--worker-queue-mb", str(budget_mb), "--zmq-rcvhwm",
               str(hwm), "--max-message-mb", "16", "--l1-prefault=false", l1_size_gb="0.05",
               env={"ASAN_OPTIONS": asan})
    ntok = 1 << 20
    be = struct.pack(">%dI" % ntok, *range(1 << 20, (1 << 20) + ntok))
    tok = bytearray(5 * ntok)
    tok[0::5] = b"\xce" * ntok
    for lane in range(4):
        tok[1 + lane::5] = be[lane::4]
    tok = bytes(tok)
    chunk = b"\x5a" * (4 << 20)
    head = bytes([0x84]) + msgpack.packb("model_name") + msgpack.packb(MODEL) + \
        msgpack.packb("end") + msgpack.packb(CHUNK) + msgpack.packb("chunks") + b"\x91" + \
        b"\xc6" + struct.pack(">I", len(chunk))
    tail = msgpack.packb("token_ids") + b"\xdd" + struct.pack(">I", ntok)
    msg_bytes = len(head) + len(chunk) + len(tail) + len(tok)

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 1)
    sock.setsockopt(zmq.RCVTIMEO, 60000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{s.zmq_port}")
    try:
        before = proc_status(s.proc.pid, "VmRSS")
        for i in range(n):  # every prompt differs in its first token: n distinct chunks
            first = b"\xce" + struct.pack(">I", i)
            sock.send_multipart([b"%d" % i, b"store_bytes",
                                 head + chunk + tail + first + tok[5:]])
        replies = {}
        for _ in range(n):
            rid, op, body = sock.recv_multipart()
            replies[int(rid)] = msgpack.unpackb(body)
        peak = proc_status(s.proc.pid, "VmHWM")
    finally:
        sock.close(0)
    assert sorted(replies) == list(range(n))
    for i, r in replies.items():
        assert r["ok"] and r["stored_chunks"] == 1, (i, r)
    # budget + what libzmq buffers (hwm requests and one being read) + the request in hand
    # (decoded: ~24 B per token) + L1 (50 MiB) + slack; without backpressure the server held
    # most of the n x 9 MiB in its queue.
    bound = (budget_mb << 20) + (hwm + 2) * msg_bytes + 24 * ntok + (50 << 20) + (200 << 20)
    assert peak - before < bound, (peak - before, bound)
    assert bound < n * msg_bytes // 2  # the bound is meaningful
    # each request is over the budget on its own: the socket paused behind it
    pauses = [l for l in s.get("/metrics").text.splitlines()
              if l.startswith("lmcache_mp_dataplane_read_pauses_total ")]
    assert len(pauses) == 1 and float(pauses[0].split()[1]) >= 1, pauses


# ---- strings from the wire -----------------------------------------------------------------

BAD_TEXT = [b"\xff\xfe", b"a\nb", b"\x1b[31m", b"\xc0\xaf", b"\xed\xa0\x80", b"\xc2\x85"]


def raw_str(b):
    assert len(b) < 32
    return (bytes([0xa0 | len(b)]) + b,)


def test_salt_and_model_must_be_utf8_text(srv):
    # Regression: one store with a cache_salt of b"\xff\xfe" made /metrics unparseable.
    s, w = srv()
    for bad in BAD_TEXT:
        r = w.raw("store_bytes", raw_map({"model_name": MODEL, "cache_salt": raw_str(bad),
                                          "chunk_hashes": [b"\x01"], "chunks": [b"x"]}))
        assert r["ok"] is False and r["code"] == "bad_request", (bad, r)
        assert "cache_salt" in r["message"]
        r = w.raw("lookup", raw_map({"request_id": "r", "model_name": raw_str(bad),
                                     "chunk_hashes": [b"\x01"]}))
        assert r["ok"] is False and r["code"] == "bad_request", (bad, r)
        assert "model_name" in r["message"]
        r = w.raw("lookup", raw_map({"request_id": raw_str(bad), "model_name": MODEL,
                                     "chunk_hashes": [b"\x01"]}))
        assert r["code"] == "bad_request", (bad, r)
    # UTF-8 text beyond ASCII is fine
    w.ok("store_bytes", model_name="modèle", cache_salt="café-租户", chunk_hashes=[b"\x01"],
         chunks=[b"x"])
    w.ok("lookup", request_id="r", model_name="modèle", cache_salt="café-租户",
         chunk_hashes=[b"\x01"])
    body = s.get("/metrics").text
    assert 'cache_salt="café-租户"' in body
    promtool_clean(body)


def test_open_lookup_sessions_are_held_to_a_memory_budget(srv):
    # Regression: every lookup kept its session (about 52 bytes per object of its range) until
    # ended or expired (600 s), without any cap: 200 lookups of 16,384 hashes grew the server by
    # 165 MB, and nothing stopped more.
    s, w = srv("--session-mb-per-client", "4", "--session-mb", "5")
    h = hashes(16384)  # ~850 KB of session each
    for i in range(4):
        w.ok("lookup", request_id=f"r{i}", model_name=MODEL, chunk_hashes=h)
    r = w.err("lookup", "too_large", request_id="r4", model_name=MODEL, chunk_hashes=h)
    assert "--session-mb-per-client" in r["message"]
    # replacing a session of the same id is within the budget; ending one makes room
    w.ok("lookup", request_id="r0", model_name=MODEL, chunk_hashes=h)
    w.ok("end_session", request_id="r1")
    w.ok("lookup", request_id="r4", model_name=MODEL, chunk_hashes=h)
    # another connection has its own budget, up to the table's (5 MiB in all)
    other = Wire(s.zmq_port)
    other.ok("lookup", request_id="x0", model_name=MODEL, chunk_hashes=h)
    other.ok("lookup", request_id="x1", model_name=MODEL, chunk_hashes=h)
    r = other.err("lookup", "too_large", request_id="x2", model_name=MODEL, chunk_hashes=h)
    assert "--session-mb" in r["message"]
    assert s.get("/status").json()["active_sessions"] == 6


def heap_bytes(s):
    for line in s.get("/metrics").text.splitlines():
        if line.startswith("lmcache_mp_heap_bytes "):
            return float(line.split()[1])
    raise AssertionError("lmcache_mp_heap_bytes is not on /metrics")


def test_empty_range_lookups_are_charged_what_they_hold(srv):
    # Regression: a lookup of an empty range with world_size 255 allocated room for 255 objects
    # while its session was charged for none: 22,795 such lookups (50 bytes each) fit in 8 MiB
    # of budget and grew the server by 293 MiB. Each session is now charged what it holds, and
    # the session table grows with its sessions (chains stay short however many there are).
    # Growth is what malloc holds (lmcache_mp_heap_bytes: live allocations, also under the
    # sanitizers, whose quarantine would make RSS grow with any churn).
    s, w = srv("--session-mb-per-client", "4", "--session-mb", "4", "--l1-prefault=false")
    heap0 = heap_bytes(s)
    sent = accepted = 0
    refused = None
    while refused is None and sent < 200000:
        for i in range(500):
            body = msgpack.packb({"request_id": f"e{sent + i}", "model_name": MODEL,
                                  "world_size": 255, "token_ids": []})
            w.send([str(sent + i).encode(), b"lookup", body])
        for i in range(500):
            reply = w.recv()[2]
            if reply["ok"]:
                accepted += 1
            elif refused is None:
                refused = reply
        sent += 500
    assert refused is not None and refused["code"] == "too_large", refused
    assert "--session-mb-per-client" in refused["message"]
    grown = heap_bytes(s) - heap0
    assert accepted > 1000
    assert grown < 48 << 20, (accepted, grown)
    # Every accepted session is still there and answers.
    assert s.get("/status").json()["active_sessions"] == accepted
    w.ok("end_session", request_id="e0")
    w.ok("query_prefetch_status", request_id=f"e{accepted - 1}")
