"""Documented corners of the data-plane contract (docs/protocol.md): nesting depth, layout
bounds, ping of an unknown instance, how skipped tokens count in retrieved_chunks."""
import random

import msgpack
import pytest

from dp_util import DPClient, ShmKV

CHUNK = 64


@pytest.fixture
def dp(make_server):
    s = make_server(args=["--chunk-size", str(CHUNK)])
    c = DPClient(s.zmq_port)
    yield s, c
    c.close()


def raw_payload(c, op, body):
    c.sock.send_multipart([b"r", op.encode(), body])
    return msgpack.unpackb(c.sock.recv_multipart()[2])


def test_payload_nesting_depth_is_32_containers(dp):
    _, c = dp
    # {"x": [[...[1]...]]}: the payload map plus `arrays` nested arrays.
    ok = raw_payload(c, "noop", b"\x81\xa1x" + b"\x91" * 31 + b"\x01")
    assert ok["ok"] is True
    r = raw_payload(c, "noop", b"\x81\xa1x" + b"\x91" * 32 + b"\x01")
    assert r["ok"] is False and r["code"] == "bad_request"
    r = raw_payload(c, "noop", b"\x81\xa1x" + b"\x91" * 100000 + b"\x01")
    assert r["ok"] is False and r["code"] == "bad_request"
    assert c.call("noop")["result"] == "OK"


def test_ping_says_whether_the_instance_is_registered(dp):
    _, c = dp
    r = c.call("ping", instance_id=77)
    assert r["instance_id"] == 77 and r["registered"] is False
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=77, model_name="m", **kv.layout())
        assert c.call("ping", instance_id=77)["registered"] is True
        assert "registered" not in c.call("ping")
    finally:
        kv.close()


def test_layout_whose_chunk_object_exceeds_4_gib_is_refused(dp):
    _, c = dp
    r = c.raw("register_kv_cache", {
        "instance_id": 1, "model_name": "m", "shm_name": "/lmc-none", "num_layers": 1024,
        "num_blocks": 4, "tokens_per_block": 16, "bytes_per_token": 1 << 16})
    assert r["ok"] is False and r["code"] == "bad_request", r
    assert "objects of" in r["message"]
    for field, bad in (("num_layers", 100001), ("tokens_per_block", (1 << 20) + 1),
                       ("bytes_per_token", (1 << 30) + 1), ("kv_count", 3),
                       ("num_blocks", 1 << 32)):
        payload = {"instance_id": 1, "model_name": "m", "shm_name": "/lmc-none", "num_layers": 1,
                   "num_blocks": 4, "tokens_per_block": 16, "bytes_per_token": 64, field: bad}
        r = c.raw("register_kv_cache", payload)
        assert r["ok"] is False and r["code"] == "bad_request" and field in r["message"], r


def test_chunks_wholly_before_skip_first_n_tokens_count_as_retrieved(dp):
    _, c = dp
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=3, model_name="m", **kv.layout())
        per = CHUNK // kv.tpb
        toks = [random.Random(9).randrange(1 << 31) for _ in range(2 * CHUNK)]
        kv.fill_blocks(range(2 * per), "s")
        assert c.call("store", instance_id=3, token_ids=toks,
                      block_ids=list(range(2 * per)))["stored_chunks"] == 2
        kv.zero()
        r = c.call("retrieve", instance_id=3, token_ids=toks, block_ids=list(range(2 * per)),
                   skip_first_n_tokens=CHUNK + kv.tpb)
        assert r["retrieved_chunks"] == 2
        blocks = kv.read_blocks(range(2 * per))
        per_block = kv.layers * kv.kv
        # Chunk 0 and the first block of chunk 1 are not written; the rest is.
        assert all(b == b"\0" * kv.block_bytes for b in blocks[:(per + 1) * per_block])
        assert all(b != b"\0" * kv.block_bytes for b in blocks[(per + 1) * per_block:])
    finally:
        kv.close()
