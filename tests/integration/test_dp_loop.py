"""Small requests run by the data socket's loop thread (docs/protocol.md, Concurrency and
ordering): a client's replies keep the order of its requests whichever thread ran them, and
only bounded work runs on the loop (few objects, small payloads, small sessions)."""

import msgpack
import pytest

from dp_util import hashes, wire_maker
from test_protocol import Wire

CHUNK = 32
MODEL = "loop-model"


@pytest.fixture
def srv(make_server):
    return wire_maker(make_server, CHUNK)


def metric(s, name, labels=""):
    """The value of one series of /metrics (0 when absent)."""
    want = name + labels + " "
    for line in s.get("/metrics").text.splitlines():
        if line.startswith(want):
            return float(line.split()[-1])
    return 0.0


def loop_count(s):
    return metric(s, "lmcache_mp_dataplane_loop_requests_total")


def pipeline(w, reqs):
    """Sends every (op, payload) without waiting, then reads the replies: they must come back
    in the order sent."""
    rids = []
    for op, payload in reqs:
        rid = str(next(w.ids)).encode()
        rids.append((rid, op.encode()))
        w.send([rid, op.encode(), msgpack.packb(payload)])
    replies = []
    for rid, op in rids:
        r_id, r_op, reply = w.recv()
        assert (r_id, r_op) == (rid, op), (r_id, r_op, rid, op)
        replies.append(reply)
    return replies


def test_a_lone_small_request_runs_on_the_loop(srv):
    s, w = srv()
    before = loop_count(s)
    assert w.ok("noop")["result"] == "OK"
    assert loop_count(s) == before + 1
    h = hashes(2, b"lone")
    w.ok("store_bytes", model_name=MODEL, chunk_hashes=h, chunks=[b"a" * 64, b"b" * 64])
    mid = loop_count(s)
    assert mid == before + 1  # stores never run on the loop
    w.ok("lookup", request_id="r", model_name=MODEL, chunk_hashes=h)
    q = w.ok("query_prefetch_status", request_id="r")
    assert q["ready"] and q["hit_chunks"] == 2
    w.ok("end_session", request_id="r")
    assert loop_count(s) == mid + 3
    assert metric(s, "lmcache_mp_active_sessions") == 0


def test_lookup_pipelined_behind_a_big_store_sees_the_store(srv):
    # The lookup reaches the loop while the store may still run on the client's worker: it must
    # then wait behind it (or run after it), never answer from before the store.
    s, w = srv("--max-workers", "1", "--max-message-mb", "64")
    big = b"\x5a" * (8 << 20)
    for i in range(6):
        h = hashes(3, b"big%d" % i)
        rid = "p%d" % i
        replies = pipeline(w, [
            ("store_bytes", {"model_name": MODEL, "chunk_hashes": h, "chunks": [big] * 3}),
            ("lookup", {"request_id": rid, "model_name": MODEL, "chunk_hashes": h}),
            ("query_prefetch_status", {"request_id": rid}),
            ("end_session", {"request_id": rid}),
            ("noop", {}),
        ])
        assert all(r["ok"] for r in replies), replies
        assert replies[0]["stored_chunks"] == 3
        assert replies[2]["ready"] and replies[2]["hit_chunks"] == 3, replies[2]
        assert replies[4]["result"] == "OK"
    assert metric(s, "lmcache_mp_active_sessions") == 0


def test_replies_keep_request_order_across_loop_and_worker(srv):
    # Two clients on one worker: one keeps it busy with stores, the other pipelines small and
    # big requests; each client's replies come back in its own order.
    s, a = srv("--max-workers", "1", "--max-message-mb", "64")
    b = Wire(s.zmq_port)
    big = b"\x33" * (4 << 20)
    reqs_a, reqs_b = [], []
    for i in range(8):
        ha, hb = hashes(1, b"a%d" % i), hashes(1, b"b%d" % i)
        reqs_a += [("store_bytes", {"model_name": MODEL, "chunk_hashes": ha, "chunks": [big]}),
                   ("noop", {})]
        reqs_b += [("noop", {}),
                   ("store_bytes", {"model_name": MODEL, "chunk_hashes": hb, "chunks": [big]}),
                   ("lookup", {"request_id": "b%d" % i, "model_name": MODEL,
                               "chunk_hashes": hb}),
                   ("query_prefetch_status", {"request_id": "b%d" % i}),
                   ("end_session", {"request_id": "b%d" % i})]
    rids = {}
    for w, reqs in ((a, reqs_a), (b, reqs_b)):
        rids[w] = []
        for op, payload in reqs:
            rid = str(next(w.ids)).encode()
            rids[w].append(rid)
            w.send([rid, op.encode(), msgpack.packb(payload)])
    for w, reqs in ((a, reqs_a), (b, reqs_b)):
        got = []
        for (op, _), rid in zip(reqs, rids[w]):
            r_id, r_op, reply = w.recv()
            assert (r_id, r_op) == (rid, op.encode())
            assert reply["ok"], reply
            got.append((op, reply))
        for op, reply in got:
            if op == "query_prefetch_status":
                assert reply["ready"] and reply["hit_chunks"] == 1, reply
    # Whether any of those small requests found the worker idle depends on timing (a loaded
    # machine may keep the worker busy from a's first store to b's last request). Once every
    # reply is in, the worker is idle: b's next pipeline starts with a noop the loop must run,
    # followed by requests the worker runs and small ones either thread may run.
    before = loop_count(s)
    hb = hashes(1, b"b-idle")
    replies = pipeline(b, [
        ("noop", {}),
        ("store_bytes", {"model_name": MODEL, "chunk_hashes": hb, "chunks": [big]}),
        ("noop", {}),
        ("lookup", {"request_id": "b-idle", "model_name": MODEL, "chunk_hashes": hb}),
        ("query_prefetch_status", {"request_id": "b-idle"}),
        ("end_session", {"request_id": "b-idle"}),
    ])
    assert all(r["ok"] for r in replies), replies
    assert replies[4]["ready"] and replies[4]["hit_chunks"] == 1, replies[4]
    b.sock.close(0)
    assert loop_count(s) >= before + 1


def test_big_lookups_and_sessions_go_to_the_worker(srv):
    # Bounded work on the loop: more than 128 objects (chunks x world_size), a payload over
    # 8 KiB, a session spanning more than 128 objects, and operations of unbounded work never
    # run there; each still gets its normal answer, counted once.
    s, w = srv("--max-request-objects", "4096")
    before = loop_count(s)
    h = hashes(129, b"many")
    w.ok("lookup", request_id="many", model_name=MODEL, chunk_hashes=h)  # 129 objects
    w.ok("lookup", request_id="ranks", model_name=MODEL, world_size=200,
         chunk_hashes=h[:1])  # 200 objects
    big_tokens = [(1 << 20) + i for i in range(64 * CHUNK)]  # 64 chunks, ~10 KB payload
    assert len(msgpack.packb({"token_ids": big_tokens})) > 8192
    w.ok("lookup", request_id="bytes", model_name=MODEL, token_ids=big_tokens)
    assert metric(s, "lmcache_mp_active_sessions") == 3
    for rid in ("many", "ranks", "bytes"):  # sessions of 129, 200 and 64 objects
        w.ok("end_session", request_id=rid)
    w.ok("clear")
    assert metric(s, "lmcache_mp_active_sessions") == 0
    # only the end_session of the 64-object session ran on the loop
    assert loop_count(s) == before + 1
    ok = '{operation="lookup",result="ok"}'
    assert metric(s, "lmcache_mp_dataplane_requests_total", ok) == 3
    ok = '{operation="end_session",result="ok"}'
    assert metric(s, "lmcache_mp_dataplane_requests_total", ok) == 3


def test_a_session_too_big_for_the_loop_is_released_by_the_worker(srv):
    # A lookup that replaces a session of the same id releases the old one's locks: with more
    # than 128 objects that is the worker's job too.
    s, w = srv("--max-request-objects", "4096")
    h = hashes(1000, b"locks")
    w.ok("store_bytes", model_name=MODEL, chunk_hashes=h, chunks=[b"x" * 16] * 1000)
    w.ok("lookup", request_id="r", model_name=MODEL, chunk_hashes=h)
    assert w.ok("query_prefetch_status", request_id="r")["hit_chunks"] == 1000
    before = loop_count(s)
    w.ok("lookup", request_id="r", model_name=MODEL, chunk_hashes=h[:1])  # replaces it
    assert loop_count(s) == before
    assert w.ok("query_prefetch_status", request_id="r")["hit_chunks"] == 1
    released = w.ok("free_lookup_locks", request_id="r")["released"]
    assert released == 1
    assert loop_count(s) == before + 2  # the small session's query and release
    # every lock of the replaced session was released: clear frees every object
    assert w.ok("clear")["cleared"] == 1000
    w.ok("end_session", request_id="r")


def test_a_rejected_request_is_answered_after_the_clients_earlier_ones(srv):
    # Regression: a malformed request was answered by the loop at once, ahead of the replies of
    # the client's requests still running on its worker.
    s, w = srv("--max-workers", "1", "--max-message-mb", "64")
    big = b"\x5a" * (8 << 20)
    for i in range(3):
        h = hashes(3, b"rej%d" % i)
        w.send([b"s%d" % i, b"store_bytes",
                msgpack.packb({"model_name": MODEL, "chunk_hashes": h, "chunks": [big] * 3})])
        w.send([b"bad%d" % i, b"noop"])  # no payload frame
        w.send([b"n%d" % i, b"noop", msgpack.packb({})])
        got = [w.recv() for _ in range(3)]
        assert [g[0] for g in got] == [b"s%d" % i, b"bad%d" % i, b"n%d" % i], got
        assert got[0][2]["ok"] and got[0][2]["stored_chunks"] == 3
        assert got[1][2]["ok"] is False and got[1][2]["code"] == "bad_request", got[1]
        assert got[2][2]["ok"]
