"""A store reply is true when the client reads it: chunks counted as stored or skipped are in the
cache, also when another request was writing the same chunks at the same moment, and when that
other writer failed half-way."""
import os
import signal
import threading
import time

import pytest

from dp_util import DPClient, ShmKV, random_prompt

CHUNK = 64  # tokens per chunk (--chunk-size)
LAYERS, BPT, TPB = 8, 4096, 16  # 2 * 8 * 64 * 4096 = 4 MiB per chunk: a wide write window
NCHUNKS = 6


@pytest.fixture
def dp(make_server):
    def make(*args):
        s = make_server(args=["--chunk-size", str(CHUNK), "--l1-size-gb", "0.25",
                              "--max-workers", "4"] + list(args))
        return s, DPClient(s.zmq_port)
    return make


def prompt(seed, chunks=NCHUNKS):
    return random_prompt(seed, chunks, CHUNK)


def engine(blocks=NCHUNKS * CHUNK // TPB):
    """An engine's KV cache; each writer registers it from its own connection."""
    kv = ShmKV(layers=LAYERS, blocks=blocks, tokens_per_block=TPB, bytes_per_token=BPT)
    kv.fill_blocks(range(blocks), seed=7)  # every engine holds the same KV bytes
    return kv


def check_truthful(r, present):
    assert r["stored_chunks"] + r["skipped_chunks"] + r.get("pending_chunks", 0) == NCHUNKS, r
    if r["ok"] and r.get("pending_chunks", 0) == 0:
        assert present == NCHUNKS, (r, present)


def test_concurrent_writers_of_the_same_chunks_reply_the_truth(dp):
    s, c = dp()
    kvs = [engine() for _ in range(3)]
    try:
        for rnd in range(12):
            toks = prompt(rnd)
            out = [None] * 3
            barrier = threading.Barrier(3)
            ts = []
            for i in range(3):
                def run(i=i):
                    cc = DPClient(s.zmq_port)
                    try:
                        cc.call("register_kv_cache", instance_id=10 + i, model_name="m",
                                **kvs[i].layout())
                        barrier.wait()
                        r = cc.raw("store", {"instance_id": 10 + i, "token_ids": toks,
                                             "block_ids": list(range(NCHUNKS * CHUNK // TPB))})
                        got = cc.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"]
                        out[i] = (r, len(got))
                    except Exception as e:  # noqa: BLE001
                        out[i] = e
                    finally:
                        cc.close()
                ts.append(threading.Thread(target=run))
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            for o in out:
                assert not isinstance(o, Exception), o
                r, present = o
                assert r["ok"], r
                check_truthful(r, present)
            # Exactly one writer wrote each chunk.
            assert sum(o[0]["stored_chunks"] for o in out) == NCHUNKS, out
            c.call("clear")
    finally:
        for kv in kvs:
            kv.close()


def test_a_writer_that_fails_mid_store_leaves_no_false_skip(dp):
    s, c = dp()
    for rnd in range(12):
        victim, other = engine(), engine()
        try:
            toks = prompt(100 + rnd)
            out = [None] * 2
            barrier = threading.Barrier(3)

            def victim_store():
                cc = DPClient(s.zmq_port)
                try:
                    cc.call("register_kv_cache", instance_id=20, model_name="m", **victim.layout())
                    barrier.wait()
                    out[0] = cc.raw("store", {"instance_id": 20, "token_ids": toks,
                                              "block_ids": list(range(NCHUNKS * CHUNK // TPB))})
                except Exception as e:  # noqa: BLE001
                    out[0] = e
                finally:
                    cc.close()

            def other_store():
                cc = DPClient(s.zmq_port)
                try:
                    cc.call("register_kv_cache", instance_id=21, model_name="m", **other.layout())
                    barrier.wait()
                    r = cc.raw("store", {"instance_id": 21, "token_ids": toks,
                                         "block_ids": list(range(NCHUNKS * CHUNK // TPB))})
                    got = cc.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"]
                    out[1] = (r, len(got))
                except Exception as e:  # noqa: BLE001
                    out[1] = e
                finally:
                    cc.close()

            ts = [threading.Thread(target=victim_store), threading.Thread(target=other_store)]
            for t in ts:
                t.start()
            barrier.wait()
            # The victim engine dies: its shared memory goes away under its store.
            os.ftruncate(victim.fd, 0)
            for t in ts:
                t.join()
            assert not isinstance(out[0], Exception), out[0]
            assert not isinstance(out[1], Exception), out[1]
            r, present = out[1]
            assert r["ok"], r
            check_truthful(r, present)
            assert out[0]["stored_chunks"] + r["stored_chunks"] == NCHUNKS, (out, r)
            c.call("clear")
        finally:
            victim.close()
            other.close()


def test_store_bytes_of_another_size_than_the_registered_layout_is_refused(dp):
    s, c = dp()
    kv = ShmKV(layers=2, blocks=8, tokens_per_block=TPB, bytes_per_token=64)
    try:
        toks = prompt(1, 1)
        # Before any registration, any size is accepted...
        c.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"x" * 100])
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        obj = 2 * 2 * CHUNK * 64
        # ...after it, only the layout's object size.
        r = c.raw("store_bytes", {"model_name": "m", "token_ids": prompt(2, 1),
                                  "chunks": [b"y" * 100]})
        assert r["ok"] is False and r["code"] == "bad_request", r
        assert "registered" in r["message"]
        c.call("store_bytes", model_name="m", token_ids=prompt(2, 1), chunks=[b"y" * obj])
        # The object stored before the registration is replaced by the engine's own store, so
        # the key is usable again.
        kv.fill_blocks(range(4), seed=3)
        r = c.call("store", instance_id=1, token_ids=toks, block_ids=list(range(4)))
        assert r["stored_chunks"] == 1 and r["skipped_chunks"] == 0, r
        want = kv.read_blocks(range(4))
        kv.zero()
        assert c.call("retrieve", instance_id=1, token_ids=toks,
                      block_ids=list(range(4)))["retrieved_chunks"] == 1
        assert kv.read_blocks(range(4)) == want
        assert len(c.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"][0]) == obj
    finally:
        c.close()
        kv.close()


def fs_files(base):
    return sorted(p.name for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_wait_l2_replies_once_the_write_through_finished(make_server, tmp_path):
    import json
    base = tmp_path / "l2"
    base.mkdir()
    s = make_server(args=["--chunk-size", str(CHUNK), "--l2-adapter",
                          json.dumps({"type": "fs", "base_path": str(base)})])
    c = DPClient(s.zmq_port)
    try:
        toks = prompt(5, 3)
        chunks = [bytes([i]) * 5000 for i in range(3)]
        r = c.call("store_bytes", model_name="m", token_ids=toks, chunks=chunks, wait_l2=True)
        assert r["stored_chunks"] == 3 and r["l2_stored_chunks"] == 3, r
        # No polling: the files are there when the reply is.
        assert len(fs_files(base)) == 3
        ad = s.get("/status").json()["storage_manager"]["adapters"]
        assert sum(a["usage"]["objects"] for a in ad) == 3
        # A chunk already resident is not stored again: nothing to wait for.
        r = c.call("store_bytes", model_name="m", token_ids=toks, chunks=chunks, wait_l2=True)
        assert r["skipped_chunks"] == 3 and r["l2_stored_chunks"] == 0, r
        # Without the flag the reply does not carry the field.
        r = c.call("store_bytes", model_name="m", token_ids=prompt(6, 1), chunks=[b"z" * 100])
        assert "l2_stored_chunks" not in r
        r = c.raw("store_bytes", {"model_name": "m", "token_ids": toks, "chunks": chunks,
                                  "wait_l2": 1})
        assert r["ok"] is False and r["code"] == "bad_request"
    finally:
        c.close()


def test_wait_l2_without_l2_tiers_reports_none_written(dp):
    s, c = dp()
    try:
        r = c.call("store_bytes", model_name="m", token_ids=prompt(5, 1), chunks=[b"q" * 64],
                   wait_l2=True)
        assert r["stored_chunks"] == 1 and r["l2_stored_chunks"] == 0, r
    finally:
        c.close()


def test_python_client_reports_pending_l2_and_registration(make_server, tmp_path):
    import json
    import py_client_util  # noqa: F401 - puts <build>/python on sys.path
    from lmcache_client import Client
    base = tmp_path / "l2"
    base.mkdir()
    s = make_server(args=["--chunk-size", str(CHUNK), "--l2-adapter",
                          json.dumps({"type": "fs", "base_path": str(base)})])
    with Client(f"tcp://127.0.0.1:{s.zmq_port}") as c:
        r = c.store_bytes("m", [b"a" * 300, b"b" * 300], token_ids=prompt(8, 2), wait_l2=True)
        assert (r.stored_chunks, r.skipped_chunks, r.pending_chunks, r.l2_stored_chunks) == \
            (2, 0, 0, 2)
        assert len(fs_files(base)) == 2
        r = c.store_bytes("m", [b"c" * 300], token_ids=prompt(9, 1))
        assert r.l2_stored_chunks is None and r.pending_chunks == 0
        assert c.ping(5).registered is False


def test_a_store_waiting_for_its_write_through_holds_up_no_other_client(make_server):
    """One worker (the default). Client A stores with wait_l2 into an L2 tier that never answers
    (a TCP listener that accepts and says nothing; the S3 request times out after 10 s), then
    pipelines a noop. A's store reply waits for the write-through, but the worker serves client
    B meanwhile (before, every client of the worker waited up to 30 s behind A); A's replies come
    after that, in the order sent, with l2_stored_chunks 0."""
    import json
    import socket

    import msgpack
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    cfg = {"type": "s3", "endpoint": f"http://127.0.0.1:{hole.getsockname()[1]}",
           "bucket": "b", "region": "us-east-1", "access_key_id": "a",
           "secret_access_key": "s", "request_timeout_ms": 10000}
    s = make_server(args=["--chunk-size", str(CHUNK), "--l2-adapter", json.dumps(cfg)])
    a, b = DPClient(s.zmq_port), DPClient(s.zmq_port)
    try:
        toks = prompt(31, 1)
        a.sock.send_multipart([b"1", b"store_bytes", msgpack.packb(
            {"model_name": "m", "token_ids": toks, "chunks": [b"a" * 4096], "wait_l2": True})])
        a.sock.send_multipart([b"2", b"noop", msgpack.packb({})])
        # B's requests go to the same worker (there is one) and are answered now.
        r = b.call("store_bytes", model_name="m", token_ids=prompt(32, 1), chunks=[b"b" * 4096])
        assert r["stored_chunks"] == 1
        assert b.call("get_chunk_size")["chunk_size"] == CHUNK
        assert b.call("lookup", request_id="x", model_name="m", token_ids=toks,
                      reply_status=True)["hit_chunks"] == 1  # A's chunk is in L1 already
        assert a.sock.poll(0) == 0, "A's reply came before its write-through settled"
        rid, op, body = a.sock.recv_multipart()  # within RCVTIMEO (30 s)
        r = msgpack.unpackb(body)
        assert (rid, op) == (b"1", b"store_bytes") and r["ok"], r
        assert r["stored_chunks"] == 1 and r["l2_stored_chunks"] == 0, r
        rid, op, body = a.sock.recv_multipart()
        assert (rid, op) == (b"2", b"noop")
        body = s.get("/metrics").text
        assert 'lmcache_mp_dataplane_requests_total{operation="store_bytes",result="ok"} 2.0' in \
            body, [line for line in body.splitlines() if "requests_total" in line]
    finally:
        a.close()
        b.close()
        hole.close()


def test_a_store_waiting_for_another_writer_holds_up_no_other_client(make_server):
    """One worker (the default). B's chunks are read-locked by B's lookup and cleared, so A's
    store of them must wait until the lock is released (at most 2 s). That wait no longer holds
    the worker: B is served meanwhile, A's reply comes once B ends the lookup's session, with the
    chunks stored, and A's pipelined noop after it."""
    import msgpack
    s = make_server(args=["--chunk-size", str(CHUNK)])
    a, b = DPClient(s.zmq_port), DPClient(s.zmq_port)
    try:
        toks = prompt(41, 2)
        b.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"o" * 5000] * 2)
        b.call("lookup", request_id="held", model_name="m", token_ids=toks, num_kv_readers=1)
        assert b.call("clear")["cleared"] == 2  # doomed, still read by the lookup
        a.sock.send_multipart([b"1", b"store_bytes", msgpack.packb(
            {"model_name": "m", "token_ids": toks, "chunks": [b"n" * 5000] * 2})])
        a.sock.send_multipart([b"2", b"noop", msgpack.packb({})])
        # B's requests go to the same worker and are answered while A's store waits.
        r = b.call("store_bytes", model_name="m", token_ids=prompt(42, 1), chunks=[b"b" * 300])
        assert r["stored_chunks"] == 1
        assert b.call("get_chunk_size")["chunk_size"] == CHUNK
        assert a.sock.poll(0) == 0, "A's store replied before the chunks it waits for were free"
        b.call("end_session", request_id="held")
        rid, op, body = a.sock.recv_multipart()
        r = msgpack.unpackb(body)
        assert (rid, op) == (b"1", b"store_bytes") and r["ok"], r
        assert (r["stored_chunks"], r["skipped_chunks"], r["pending_chunks"]) == (2, 0, 0), r
        rid, op, body = a.sock.recv_multipart()
        assert (rid, op) == (b"2", b"noop")
        got = b.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"]
        assert got == [b"n" * 5000] * 2
        body = s.get("/metrics").text
        assert 'lmcache_mp_dataplane_requests_total{operation="store_bytes",result="ok"} 3.0' in \
            body, [line for line in body.splitlines() if "requests_total" in line]
    finally:
        a.close()
        b.close()


def test_a_store_parked_for_another_writer_is_answered_at_stop(make_server):
    """SIGTERM while A's store waits for a chunk B's lookup still reads: the stopping server
    waits no more, answers A with the chunk pending (not stored), then its pipelined noop, and
    exits 0."""
    import msgpack
    s = make_server(args=["--chunk-size", str(CHUNK)])
    a, b = DPClient(s.zmq_port), DPClient(s.zmq_port)
    try:
        toks = prompt(43, 1)
        b.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"o" * 700])
        b.call("lookup", request_id="held", model_name="m", token_ids=toks, num_kv_readers=1)
        assert b.call("clear")["cleared"] == 1
        a.sock.send_multipart([b"1", b"store_bytes", msgpack.packb(
            {"model_name": "m", "token_ids": toks, "chunks": [b"n" * 700]})])
        a.sock.send_multipart([b"2", b"noop", msgpack.packb({})])
        for _ in range(500):  # until the worker took A's store (it counts as submitted)
            if "lmcache_mp_num_submitted_stores_total 2.0" in s.get("/metrics").text:
                break
            time.sleep(0.01)
        else:
            raise AssertionError("A's store never reached the worker")
        assert a.sock.poll(0) == 0
        s.proc.send_signal(signal.SIGTERM)
        rid, op, body = a.sock.recv_multipart()
        r = msgpack.unpackb(body)
        assert (rid, op) == (b"1", b"store_bytes") and r["ok"], r
        assert (r["stored_chunks"], r["skipped_chunks"], r["pending_chunks"]) == (0, 0, 1), r
        rid, op, body = a.sock.recv_multipart()
        assert (rid, op) == (b"2", b"noop")
        assert s.stop() == 0
    finally:
        a.close()
        b.close()
