"""The data-plane wire contract of docs/protocol.md, spoken directly with pyzmq + msgpack:
framing and every error path (malformed msgpack, unknown operation, missing and mistyped fields,
block ids out of range or too few with nothing committed, oversized payloads, unregistered
instances, bad shared memory) and the session semantics (num_kv_readers locks,
query_prefetch_status answered once, free_lookup_locks, end_session, skip_first_n_tokens,
existing keys skipped, store_bytes/retrieve_bytes byte-identical, chunk_hashes)."""
import hashlib
import itertools
import mmap
import os
import random
import struct
import time
import uuid

import msgpack
import pytest
import zmq

from dp_util import PROOF_PAGE, register

CHUNK = 32  # --chunk-size of these servers
TPB = 16    # tokens per engine block
BPC = CHUNK // TPB
LAYERS, BLOCKS, BPT = 2, 32, 32
MODEL = "proto-model"


class Wire:
    """One DEALER socket; `send` takes raw frames, `call` a payload dict."""

    def __init__(self, port):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, 20000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.ids = itertools.count(1)

    def send(self, frames):
        self.sock.send_multipart(frames)

    def recv(self):
        frames = self.sock.recv_multipart()
        assert len(frames) == 3, frames
        reply = msgpack.unpackb(frames[2])
        assert isinstance(reply["ok"], bool)
        if not reply["ok"]:
            assert isinstance(reply["code"], str) and isinstance(reply["message"], str)
        return frames[0], frames[1], reply

    def raw(self, op, body):
        rid = str(next(self.ids)).encode()
        self.send([rid, op.encode(), body])
        r_id, r_op, reply = self.recv()
        assert r_id == rid and r_op == op.encode()
        return reply

    def call(self, op, **payload):
        return self.raw(op, msgpack.packb(payload))

    def ok(self, op, **payload):
        reply = self.call(op, **payload)
        assert reply["ok"], reply
        return reply

    def reg(self, **payload):
        """register_kv_cache, answering the proof-of-access challenge."""
        reply = register(lambda op, p: self.raw(op, msgpack.packb(p)), payload)
        assert reply["ok"], reply
        return reply

    def err(self, op, code, **payload):
        reply = self.call(op, **payload)
        assert reply["ok"] is False and reply["code"] == code, reply
        return reply


class Engine:
    """A layer-major paged KV cache in POSIX shared memory, registered as `instance`."""

    def __init__(self, wire, instance=0, blocks=BLOCKS):
        self.blocks = blocks
        self.bb = TPB * BPT
        self.size = LAYERS * 2 * blocks * self.bb
        self.name = "/lmc-proto-" + uuid.uuid4().hex[:12]
        self.fd = os.open("/dev/shm" + self.name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, self.size + PROOF_PAGE)
        self.mem = mmap.mmap(self.fd, self.size)
        self.instance = instance
        wire.reg(instance_id=instance, model_name=MODEL, shm_name=self.name,
                 num_layers=LAYERS, num_blocks=blocks, tokens_per_block=TPB, bytes_per_token=BPT)

    def off(self, layer, k, block, token=0):
        return ((layer * 2 + k) * self.blocks + block) * self.bb + token * BPT

    def fill(self, seed):
        self.mem[:] = random.Random(seed).randbytes(self.size)

    def snapshot(self):
        return bytes(self.mem)

    def zero(self):
        self.mem[:] = bytes(self.size)

    def tokens(self, block, t0, t1):
        """Bytes of tokens [t0, t1) of `block` for every layer and K/V."""
        return [bytes(self.mem[self.off(l, k, block, t0):self.off(l, k, block, t1)])
                for l in range(LAYERS) for k in range(2)]

    def close(self):
        self.mem.close()
        os.close(self.fd)
        os.unlink("/dev/shm" + self.name)


@pytest.fixture
def srv(make_server):
    def make(*args):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args))
        return s, Wire(s.zmq_port)
    return make


@pytest.fixture
def eng(srv):
    engines = []

    def make(*args, **kw):
        s, w = srv(*args)
        e = Engine(w, **kw)
        engines.append(e)
        return s, w, e
    yield make
    for e in engines:
        e.close()


def prompt(seed, chunks):
    rnd = random.Random(seed)
    return [rnd.randrange(1 << 32) for _ in range(chunks * CHUNK)]


def hits(w, rid, tokens, wait_s=30, **kw):
    w.ok("lookup", request_id=rid, model_name=MODEL, token_ids=tokens, **kw)
    deadline = time.monotonic() + wait_s
    while True:
        st = w.ok("query_prefetch_status", request_id=rid)
        if st["ready"]:
            return st["hit_chunks"]
        assert time.monotonic() < deadline, "lookup %s not ready after %d s" % (rid, wait_s)
        time.sleep(0.01)


# ---- framing -------------------------------------------------------------------------------

def test_noop_empty_payload_and_chunk_size(srv):
    _, w = srv()
    assert w.raw("noop", b"") == {"ok": True, "result": "OK"}
    assert w.ok("noop")["result"] == "OK"
    assert w.ok("get_chunk_size")["chunk_size"] == CHUNK


def test_malformed_msgpack_is_bad_request(srv):
    _, w = srv()
    for body in (b"\xc1", b"\x92\x01", b"\x81\xa2ok", b"\x81\xa1a\x01trailing"):
        r = w.raw("lookup", body)
        assert r["code"] == "bad_request", (body, r)
    assert w.ok("noop")  # the connection is still served


def test_payload_not_a_map_is_bad_request(srv):
    _, w = srv()
    for body in (msgpack.packb([1, 2]), msgpack.packb("x"), msgpack.packb(7)):
        assert w.raw("noop", body)["code"] == "bad_request"


def test_wrong_frame_counts_get_a_reply(srv):
    _, w = srv()
    for frames in ([b"r2", b"noop", b"", b"extra"], [b"r3"]):
        w.send(frames)
        r_id, _, reply = w.recv()
        assert reply["code"] == "bad_request", (frames, reply)
        assert r_id in (frames[0], b"")
    assert w.ok("noop")


def test_two_frames_is_bad_request(srv):
    _, w = srv()
    w.send([b"r1", b"noop"])
    assert w.recv()[2].get("code") == "bad_request"


def test_request_id_too_long_gets_empty_id(srv):
    _, w = srv()
    w.send([b"x" * 65, b"noop", b""])
    r_id, _, reply = w.recv()
    assert reply["code"] == "bad_request" and r_id == b""
    w.send([b"y" * 64, b"noop", b""])  # 64 is allowed
    r_id, _, reply = w.recv()
    assert reply["ok"] and r_id == b"y" * 64


def test_unknown_operation(srv):
    _, w = srv()
    r = w.err("no_such_op", "unknown_operation")
    assert r["message"]


def test_missing_and_mistyped_fields_name_the_field(eng):
    _, w, _ = eng()  # instance 0 registered: the field errors are the only ones
    r = w.err("lookup", "bad_request", model_name=MODEL, token_ids=[1, 2])
    assert "request_id" in r["message"]
    r = w.err("lookup", "bad_request", request_id=7, model_name=MODEL, token_ids=[1])
    assert "request_id" in r["message"]
    r = w.err("store", "bad_request", instance_id="zero", token_ids=[1], block_ids=[0])
    assert "instance_id" in r["message"]
    r = w.err("lookup", "bad_request", request_id="r", model_name=MODEL, token_ids=["a"])
    assert "token_ids" in r["message"]
    # neither of token_ids / chunk_hashes
    w.err("lookup", "bad_request", request_id="r", model_name=MODEL)
    # unknown fields are ignored
    assert w.ok("noop", whatever=1, nested={"a": [1]})


def test_block_ids_of_wrong_type_is_bad_request(eng):
    _, w, _ = eng()
    r = w.err("retrieve", "bad_request", instance_id=0, token_ids=[1], block_ids="0,1")
    assert "block_ids" in r["message"]


def test_token_ids_and_chunk_hashes_together_is_bad_request(srv):
    _, w = srv()
    w.err("lookup", "bad_request", request_id="r", model_name=MODEL, token_ids=[1],
          chunk_hashes=[b"\x01" * 32])


def test_any_integer_width_is_accepted(srv):
    _, w = srv()
    # {"instance_id": uint64(3)} written with the 9-byte encoding
    body = b"\x81\xabinstance_id\xcf" + struct.pack(">Q", 3)
    r = w.raw("ping", body)
    assert r["ok"] and r["instance_id"] == 3


def test_invalid_keys_are_bad_request(srv):
    _, w = srv()
    w.err("lookup", "bad_request", request_id="r", model_name="a@b", token_ids=[1] * CHUNK)
    for salt in ("a@b", "a/b", "a\\b", "x" * 129):
        w.err("lookup", "bad_request", request_id="r", model_name=MODEL, token_ids=[1] * CHUNK,
              cache_salt=salt)
    w.ok("lookup", request_id="r", model_name=MODEL, token_ids=[1] * CHUNK, cache_salt="x" * 128)


def test_oversized_payload_is_too_large(srv):
    _, w = srv("--max-message-mb", "1")
    r = w.err("store_bytes", "too_large", model_name=MODEL, token_ids=list(range(CHUNK)),
              chunks=[b"\0" * (1 << 20)])
    assert r["message"]
    assert w.ok("noop")


def test_pipelined_requests_all_answered(srv):
    _, w = srv()
    ids = [f"p{i}".encode() for i in range(200)]
    for rid in ids:
        w.send([rid, b"noop", b""])
    got = {w.recv()[0] for _ in ids}
    assert got == set(ids)


# ---- registrations -------------------------------------------------------------------------

def test_unregistered_instance(srv):
    _, w = srv()
    toks = prompt(1, 1)
    w.err("store", "not_registered", instance_id=42, token_ids=toks, block_ids=[0, 1])
    w.err("retrieve", "not_registered", instance_id=42, token_ids=toks, block_ids=[0, 1])
    w.err("unregister_kv_cache", "not_registered", instance_id=42)


def test_unregister_then_not_registered(eng):
    _, w, e = eng()
    w.ok("unregister_kv_cache", instance_id=e.instance)
    w.err("store", "not_registered", instance_id=e.instance, token_ids=prompt(2, 1),
          block_ids=[0, 1])


def test_shm_errors(srv):
    _, w = srv()
    layout = dict(num_layers=LAYERS, num_blocks=BLOCKS, tokens_per_block=TPB, bytes_per_token=BPT)
    w.err("register_kv_cache", "shm_error", instance_id=1, model_name=MODEL,
          shm_name="/lmc-proto-does-not-exist-" + uuid.uuid4().hex, **layout)
    name = "/lmc-proto-small-" + uuid.uuid4().hex[:8]
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        w.err("register_kv_cache", "shm_error", instance_id=1, model_name=MODEL, shm_name=name,
              **layout)
    finally:
        os.close(fd)
        os.unlink("/dev/shm" + name)
    w.err("register_kv_cache", "bad_request", instance_id=1, model_name=MODEL, shm_name=name,
          **dict(layout, num_layers=0))


def test_chunk_size_must_be_a_multiple_of_tokens_per_block(srv):
    _, w = srv()
    w.err("register_kv_cache", "bad_request", instance_id=1, model_name=MODEL, shm_name="/x",
          num_layers=1, num_blocks=1, tokens_per_block=CHUNK * 2 // 3 or 1, bytes_per_token=1)


# ---- block ids: fail closed ----------------------------------------------------------------

def test_block_ids_out_of_range_commit_nothing(eng):
    _, w, e = eng()
    e.fill(3)
    toks = prompt(3, 2)
    w.err("store", "invalid_blocks", instance_id=0, token_ids=toks,
          block_ids=[0, 1, 2, BLOCKS])
    w.err("store", "invalid_blocks", instance_id=0, token_ids=toks, block_ids=[0, 1, 2, -1])
    assert hits(w, "r", toks) == 0
    w.ok("end_session", request_id="r")


def test_too_few_block_ids_commit_nothing(eng):
    _, w, e = eng()
    e.fill(4)
    toks = prompt(4, 2)
    w.err("store", "invalid_blocks", instance_id=0, token_ids=toks, block_ids=[0, 1, 2])
    assert hits(w, "r", toks) == 0
    w.ok("end_session", request_id="r")
    r = w.ok("store", instance_id=0, token_ids=toks, block_ids=[0, 1, 2, 3])
    assert r["stored_chunks"] == 2
    before = [e.tokens(b, 0, TPB) for b in range(4)]
    e.zero()
    r = w.err("retrieve", "invalid_blocks", instance_id=0, token_ids=toks, block_ids=[0, 1, 2])
    assert e.snapshot() == bytes(e.size)  # nothing was copied
    w.err("retrieve", "invalid_blocks", instance_id=0, token_ids=toks,
          block_ids=[0, 1, 2, BLOCKS + 5])
    assert e.snapshot() == bytes(e.size)
    assert w.ok("retrieve", instance_id=0, token_ids=toks,
                block_ids=[0, 1, 2, 3])["retrieved_chunks"] == 2
    assert [e.tokens(b, 0, TPB) for b in range(4)] == before


# ---- store / retrieve semantics ------------------------------------------------------------

def test_store_existing_keys_skipped(eng):
    _, w, e = eng()
    e.fill(5)
    toks = prompt(5, 2)
    r = w.ok("store", instance_id=0, token_ids=toks, block_ids=[0, 1, 2, 3])
    assert (r["stored_chunks"], r["skipped_chunks"]) == (2, 0)
    r = w.ok("store", instance_id=0, token_ids=toks, block_ids=[4, 5, 6, 7])
    assert (r["stored_chunks"], r["skipped_chunks"]) == (0, 2)
    longer = toks + prompt(6, 1)
    r = w.ok("store", instance_id=0, token_ids=longer, block_ids=[0, 1, 2, 3, 4, 5])
    assert (r["stored_chunks"], r["skipped_chunks"]) == (1, 2)


def test_start_end_ranges(eng):
    _, w, e = eng()
    e.fill(6)
    toks = prompt(6, 3)
    # chunk 0 only, then chunk 2 only: the lookup stops at the missing chunk 1
    assert w.ok("store", instance_id=0, token_ids=toks, end=CHUNK,
                block_ids=[0, 1])["stored_chunks"] == 1
    assert w.ok("store", instance_id=0, token_ids=toks, start=2 * CHUNK,
                block_ids=[4, 5])["stored_chunks"] == 1
    assert hits(w, "a", toks) == 1
    assert hits(w, "b", toks, start=2 * CHUNK) == 1
    # a prompt length that is not a chunk multiple is rounded down
    assert hits(w, "c", toks[:CHUNK + 5]) == 1
    for rid in "abc":
        w.ok("end_session", request_id=rid)
    # retrieve stops at the missing chunk with the count copied before it
    r = w.err("retrieve", "not_found", instance_id=0, token_ids=toks, block_ids=list(range(6)))
    assert r["retrieved_chunks"] == 1


def test_retrieve_skip_first_n_tokens(eng):
    _, w, e = eng()
    e.fill(7)
    toks = prompt(7, 2)
    blocks = [0, 1, 2, 3]
    w.ok("store", instance_id=0, token_ids=toks, block_ids=blocks)
    ref = [e.tokens(b, 0, TPB) for b in blocks]
    for skip in (0, 5, TPB, CHUNK + 3, 2 * CHUNK):
        e.zero()
        r = w.ok("retrieve", instance_id=0, token_ids=toks, block_ids=blocks,
                 skip_first_n_tokens=skip)
        assert r["retrieved_chunks"] == 2
        for i, b in enumerate(blocks):
            lo = min(max(skip - i * TPB, 0), TPB)  # tokens of this block not written
            got = e.tokens(b, 0, TPB)
            for part_got, part_ref in zip(got, ref[i]):
                assert part_got[:lo * BPT] == bytes(lo * BPT), (skip, b)
                assert part_got[lo * BPT:] == part_ref[lo * BPT:], (skip, b)


def test_store_bytes_retrieve_bytes_round_trip(srv):
    _, w = srv()
    toks = prompt(8, 3)
    objs = [os.urandom(LAYERS * 2 * CHUNK * BPT) for _ in range(3)]
    r = w.ok("store_bytes", model_name=MODEL, token_ids=toks, chunks=objs)
    assert (r["stored_chunks"], r["skipped_chunks"]) == (3, 0)
    assert w.ok("retrieve_bytes", model_name=MODEL, token_ids=toks)["chunks"] == objs
    assert w.ok("store_bytes", model_name=MODEL, token_ids=toks,
                chunks=objs)["skipped_chunks"] == 3
    # another rank, another salt: other keys
    assert w.ok("retrieve_bytes", model_name=MODEL, worker_id=1, world_size=2,
                token_ids=toks)["chunks"] == []
    assert w.ok("retrieve_bytes", model_name=MODEL, token_ids=toks,
                cache_salt="other")["chunks"] == []
    # only the leading present chunks
    longer = toks + prompt(9, 1)
    assert w.ok("retrieve_bytes", model_name=MODEL, token_ids=longer)["chunks"] == objs
    assert w.ok("retrieve_bytes", model_name=MODEL, token_ids=toks,
                start=CHUNK)["chunks"] == objs[1:]


def test_shm_and_bytes_paths_share_the_object_layout(eng):
    _, w, e = eng()
    e.fill(10)
    toks = prompt(10, 1)
    w.ok("store", instance_id=0, token_ids=toks, block_ids=[0, 1])
    obj = w.ok("retrieve_bytes", model_name=MODEL, token_ids=toks)["chunks"][0]
    # [K|V][layer][token][bytes]
    want = b"".join(e.tokens(0, 0, TPB)[l * 2 + k] + e.tokens(1, 0, TPB)[l * 2 + k]
                    for k in range(2) for l in range(LAYERS))
    assert obj == want


def test_chunk_hashes_match_the_documented_chain(srv):
    _, w = srv()
    toks = prompt(11, 2)
    seed = hashlib.sha256(b"lmcache-chunk-hash-v1").digest()
    h, chain = seed, []
    for i in range(2):
        h = hashlib.sha256(h + struct.pack(f">{CHUNK}I", *toks[i * CHUNK:(i + 1) * CHUNK])).digest()
        chain.append(h)
    objs = [os.urandom(64), os.urandom(64)]
    assert w.ok("store_bytes", model_name=MODEL, chunk_hashes=chain,
                chunks=objs)["stored_chunks"] == 2
    assert w.ok("retrieve_bytes", model_name=MODEL, token_ids=toks)["chunks"] == objs
    assert hits(w, "h", toks) == 2
    w.ok("end_session", request_id="h")


def test_lookup_covers_every_rank(srv):
    _, w = srv()
    toks = prompt(12, 1)
    w.ok("store_bytes", model_name=MODEL, world_size=2, worker_id=0, token_ids=toks,
         chunks=[b"r0"])
    assert hits(w, "w1", toks, world_size=2) == 0
    w.ok("store_bytes", model_name=MODEL, world_size=2, worker_id=1, token_ids=toks,
         chunks=[b"r1"])
    assert hits(w, "w2", toks, world_size=2) == 1
    assert w.ok("retrieve_bytes", model_name=MODEL, world_size=2, worker_id=1,
                token_ids=toks)["chunks"] == [b"r1"]


# ---- sessions ------------------------------------------------------------------------------

def test_query_prefetch_status_answers_once(eng):
    _, w, e = eng()
    toks = prompt(13, 2)
    w.ok("store", instance_id=0, token_ids=toks, block_ids=[0, 1, 2, 3])
    assert hits(w, "once", toks) == 2
    assert w.ok("query_prefetch_status", request_id="once") == {"ok": True, "ready": True,
                                                                "hit_chunks": 0}
    assert w.ok("query_prefetch_status", request_id="never-looked-up")["hit_chunks"] == 0
    # the locks stay with the session after the status was consumed
    assert w.ok("retrieve", instance_id=0, request_id="once", token_ids=toks,
                block_ids=[0, 1, 2, 3])["retrieved_chunks"] == 2


def test_lookup_with_reply_status_answers_the_first_status(eng):
    _, w, e = eng()
    toks = prompt(15, 3)
    w.ok("store", instance_id=0, token_ids=toks[:2 * CHUNK], block_ids=[0, 1, 2, 3])
    # Without the field the reply is {ok} alone, as before.
    assert w.ok("lookup", request_id="plain", model_name=MODEL, token_ids=toks) == {"ok": True}
    # With it: the status query_prefetch_status would report first, reported once.
    rep = w.ok("lookup", request_id="st", model_name=MODEL, token_ids=toks, reply_status=True)
    assert rep == {"ok": True, "ready": True, "hit_chunks": 2}
    assert w.ok("query_prefetch_status", request_id="st") == {"ok": True, "ready": True,
                                                              "hit_chunks": 0}
    assert w.ok("retrieve", instance_id=0, request_id="st", token_ids=toks[:2 * CHUNK],
                block_ids=[0, 1, 2, 3])["retrieved_chunks"] == 2
    rep = w.ok("lookup", request_id="miss", model_name=MODEL, token_ids=prompt(16, 1),
               reply_status=True)
    assert rep == {"ok": True, "ready": True, "hit_chunks": 0}
    r = w.call("lookup", request_id="x", model_name=MODEL, token_ids=toks, reply_status=1)
    assert r["code"] == "bad_request" and "reply_status" in r["message"], r


def test_num_kv_readers_locks_are_consumed_by_retrieves(eng):
    _, w, e = eng()
    toks = prompt(14, 2)
    blocks = [0, 1, 2, 3]
    w.ok("store", instance_id=0, token_ids=toks, block_ids=blocks)
    assert hits(w, "r2", toks, num_kv_readers=2) == 2
    for _ in range(2):
        assert w.ok("retrieve", instance_id=0, request_id="r2", token_ids=toks,
                    block_ids=blocks)["retrieved_chunks"] == 2
    r = w.err("retrieve", "not_found", instance_id=0, request_id="r2", token_ids=toks,
              block_ids=blocks)
    assert r["retrieved_chunks"] == 0
    # without a request_id the server takes its own locks
    assert w.ok("retrieve", instance_id=0, token_ids=toks,
                block_ids=blocks)["retrieved_chunks"] == 2
    w.ok("end_session", request_id="r2")


def test_retrieve_bytes_with_session(srv):
    _, w = srv()
    toks = prompt(15, 1)
    w.ok("store_bytes", model_name=MODEL, token_ids=toks, chunks=[b"abc"])
    assert hits(w, "rb", toks) == 1
    assert w.ok("retrieve_bytes", model_name=MODEL, request_id="rb",
                token_ids=toks)["chunks"] == [b"abc"]
    # its one lock is used up
    assert w.ok("retrieve_bytes", model_name=MODEL, request_id="rb",
                token_ids=toks)["chunks"] == []


def test_free_lookup_locks(eng):
    _, w, e = eng()
    toks = prompt(16, 2)
    blocks = [0, 1, 2, 3]
    w.ok("store", instance_id=0, token_ids=toks, block_ids=blocks)
    assert hits(w, "f", toks, num_kv_readers=2) == 2
    # only the second chunk's locks: 2 readers x 1 chunk x 1 rank
    assert w.ok("free_lookup_locks", request_id="f", start=CHUNK)["released"] == 2
    r = w.err("retrieve", "not_found", instance_id=0, request_id="f", token_ids=toks,
              block_ids=blocks)
    assert r["retrieved_chunks"] == 1
    # the rest: one lock left on chunk 0
    assert w.ok("free_lookup_locks", request_id="f")["released"] == 1
    assert w.ok("free_lookup_locks", request_id="f")["released"] == 0
    r = w.err("retrieve", "not_found", instance_id=0, request_id="f", token_ids=toks,
              block_ids=blocks)
    assert r["retrieved_chunks"] == 0
    w.ok("end_session", request_id="f")


def test_end_session_releases_and_forgets(eng):
    _, w, e = eng()
    toks = prompt(17, 2)
    blocks = [0, 1, 2, 3]
    w.ok("store", instance_id=0, token_ids=toks, block_ids=blocks)
    assert hits(w, "s", toks, num_kv_readers=3) == 2
    w.ok("end_session", request_id="s")
    w.err("retrieve", "not_found", instance_id=0, request_id="s", token_ids=toks,
          block_ids=blocks)
    w.ok("end_session", request_id="s")  # unknown ids are fine
    w.ok("end_session", request_id="never-seen")


def test_second_lookup_replaces_the_first(eng):
    _, w, e = eng()
    toks = prompt(18, 2)
    blocks = [0, 1, 2, 3]
    w.ok("store", instance_id=0, token_ids=toks, block_ids=blocks)
    assert hits(w, "again", toks, num_kv_readers=5) == 2
    assert hits(w, "again", toks, num_kv_readers=1) == 2
    assert w.ok("retrieve", instance_id=0, request_id="again", token_ids=toks,
                block_ids=blocks)["retrieved_chunks"] == 2
    w.err("retrieve", "not_found", instance_id=0, request_id="again", token_ids=toks,
          block_ids=blocks)
    w.ok("end_session", request_id="again")


def test_clear_and_ping(eng):
    _, w, e = eng(instance=3)
    toks = prompt(19, 2)
    w.ok("store", instance_id=3, token_ids=toks, block_ids=[0, 1, 2, 3])
    r = w.ok("ping", instance_id=3)
    assert r["instance_id"] == 3 and r["server_time"] > 0
    assert w.ok("ping")["ok"]
    assert w.ok("clear")["cleared"] == 2
    assert hits(w, "after-clear", toks) == 0
    w.ok("end_session", request_id="after-clear")


# ---- invalid values ------------------------------------------------------------------------

T96 = list(range(3 * CHUNK))


# Regression: these error paths used to leak the range parse_range had allocated, which
# LeakSanitizer reported at shutdown (the ASan build runs this file too).
@pytest.mark.parametrize("op,payload,field", [
    ("lookup", dict(request_id="a", model_name=MODEL, token_ids=T96, start=5), "start"),
    ("lookup", dict(request_id="a", model_name=MODEL, chunk_hashes=[b"x" * 33]), "chunk_hashes"),
    ("lookup", dict(request_id="a", model_name=MODEL, chunk_hashes=[b""]), "chunk_hashes"),
])
def test_invalid_ranges_are_bad_request(srv, op, payload, field):
    _, w = srv()
    r = w.err(op, "bad_request", **payload)
    assert field in r["message"], r


@pytest.mark.parametrize("op,payload,field", [
    ("lookup", dict(request_id="a" * 257, model_name=MODEL, token_ids=T96), "request_id"),
    ("lookup", dict(request_id="a", model_name=MODEL, token_ids=T96, num_kv_readers=0),
     "num_kv_readers"),
    ("lookup", dict(request_id="a", model_name=MODEL, token_ids=[1 << 32] * CHUNK), "token_ids"),
    ("lookup", dict(request_id="a", model_name=MODEL, token_ids=[-1] * CHUNK), "token_ids"),
    ("lookup", dict(request_id="a", model_name=MODEL, token_ids=T96, world_size=0), "world_size"),
    ("retrieve_bytes", dict(model_name=MODEL, world_size=1, worker_id=3, token_ids=T96),
     "worker_id"),
    ("store_bytes", dict(model_name=MODEL, token_ids=T96, chunks=[b"a"]), "chunks"),
    ("store_bytes", dict(model_name=MODEL, token_ids=T96, chunks=["a", "b", "c"]), "chunks"),
    ("ping", dict(instance_id="x"), "instance_id"),
])
def test_invalid_values_are_bad_request(srv, op, payload, field):
    _, w = srv()
    r = w.err(op, "bad_request", **payload)
    assert field in r["message"], r


@pytest.mark.parametrize("change,field", [
    (dict(kv_count=3), "kv_count"),
    (dict(block_order="diagonal"), "block_order"),
    (dict(instance_id=-1), "instance_id"),
    (dict(model_name="a@b"), "model_name"),
])
def test_invalid_layouts_are_bad_request(srv, change, field):
    _, w = srv()
    layout = dict(instance_id=1, model_name=MODEL, shm_name="/lmc-proto-unused", num_layers=1,
                  num_blocks=4, tokens_per_block=TPB, bytes_per_token=16)
    r = w.err("register_kv_cache", "bad_request", **dict(layout, **change))
    assert field in r["message"], r


def test_empty_request_id_is_bad_request(srv):
    _, w = srv()
    w.send([b"", b"noop", b""])
    r_id, _, reply = w.recv()
    assert r_id == b"" and reply["code"] == "bad_request"


def test_reregistration_refreshes_or_replaces(srv):
    _, w = srv()
    small = Engine(w, instance=4, blocks=8)
    big = Engine(w, instance=9, blocks=16)  # a second object, registered as 9 for now
    try:
        toks = prompt(20, 1)
        # the same layout again only refreshes
        w.reg(instance_id=4, model_name=MODEL, shm_name=small.name,
              num_layers=LAYERS, num_blocks=8, tokens_per_block=TPB, bytes_per_token=BPT)
        w.err("store", "invalid_blocks", instance_id=4, token_ids=toks, block_ids=[14, 15])
        # another shm name and layout replaces the registration
        w.reg(instance_id=4, model_name=MODEL, shm_name=big.name,
              num_layers=LAYERS, num_blocks=16, tokens_per_block=TPB, bytes_per_token=BPT)
        big.fill(20)
        assert w.ok("store", instance_id=4, token_ids=toks,
                    block_ids=[14, 15])["stored_chunks"] == 1
    finally:
        small.close()
        big.close()
