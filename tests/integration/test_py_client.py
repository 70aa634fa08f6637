"""python/lmcache_client against the real server: every operation, every reachable error code,
pipelined handles, KVCache in both block orders (proof of access answered inside), CURVE, ipc,
the chunk-hash recipe (the C test vectors), the install step and the engine simulator."""
import os
import re
import subprocess
import time
import uuid

import numpy as np
import pytest
import zmq

from conftest import free_port
from dp_util import seq_prompt
from py_client_util import BUILD, ROOT  # (puts <build>/python on sys.path)
import lmcache_client as lc
from lmcache_client import Client, KVCache, KVLayout, LmcacheError, errors

BIN = os.environ.get("LMCACHE_BIN", os.path.join(BUILD, "lmcache"))
CHUNK = 32
LAYOUT = dict(num_layers=2, num_blocks=64, tokens_per_block=16, bytes_per_token=64)


def prompt(chunks, seed):
    return seq_prompt(seed, chunks, CHUNK)


@pytest.fixture
def dp(make_server):
    """dp(*server_args, **server_kw) -> (server, Client); clients closed at the end."""
    clients = []

    def make(*args, **kw):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args), **kw)
        c = Client(s.zmq_port, timeout=20)
        clients.append(c)
        return s, c

    yield make
    for c in clients:
        c.close()


def fill(kv, seed):
    rng = np.random.default_rng(seed)
    kv.raw[:] = rng.integers(0, 256, kv.raw.shape, dtype=np.uint8)


def shm_leftovers(prefix):
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


# ---- chunk hashes -----------------------------------------------------------------------------

def test_chunk_hash_vectors_of_the_c_tests():
    """tests/unit/test_keys.c: test_chain_vectors and test_chain_partial_chunks_ignored."""
    assert lc.DEFAULT_SEED.hex() == \
        "75523f49815e6fed62b3dd1b2a0c42256c63e9453f36780d87587233ada6211b"
    h = lc.chunk_hashes([0, 1, 2, 3, 4, 5, 6, 0xdeadbeef], 4)
    assert [x.hex() for x in h] == [
        "123979a5f9c859984d66f467512a41c8e2c1e8bf462a08fe8e9bdab3f7b37077",
        "d245920a7a4ffd27fe1467d407885c8712adcfa7f93ece778dd7868286dcae31"]
    assert lc.chunk_hash(h[0], [4, 5, 6, 0xdeadbeef]) == h[1]
    toks = [1000 + i for i in range(600)]
    h = lc.chunk_hashes(toks, 256)
    assert [x.hex() for x in h] == [
        "58094779ed0264171db2972c10930e9bfabbbadeb15f5e200f6ddc313a5cb9ec",
        "68f769af90ce028f50e74565e0715268e094b03773017158c90246990d85f473"]
    assert lc.chunk_hashes(np.array(toks, dtype=np.int64), 256) == h
    assert lc.chunk_hashes(np.array(toks, dtype=np.uint32), 256) == h
    assert lc.chunk_hashes(toks[:255], 256) == []
    assert lc.chunk_hashes(toks, 256, max_chunks=1) == h[:1]
    with pytest.raises(ValueError):
        lc.chunk_hashes(toks, 0)
    other = lc.chunk_hashes(toks[:256], 256, seed="other")
    assert other != h[:1] and other == lc.chunk_hashes(toks[:256], 256,
                                                       seed=lc.seed_from_string("other"))
    assert lc.seed_from_string("") == lc.DEFAULT_SEED
    assert lc.chunk_hashes(toks, 256, seed="lmcache-chunk-hash-v1") == h
    for bad in ([-1], [2 ** 32], [1.5]):
        with pytest.raises(ValueError):
            lc.chunk_hashes(bad * 4, 4)


@pytest.mark.parametrize("hash_seed", [None, "tenant-seed"])
def test_chunk_hashes_name_the_servers_chunks(dp, hash_seed):
    """Chunks stored by token ids are found by the Python chain (with the server's
    --hash-seed), and only with the right seed."""
    s, c = dp(*(["--hash-seed", hash_seed] if hash_seed else []))
    toks = prompt(3, 5)
    c.store_bytes("m", [b"a", b"b", b"c"], token_ids=toks)
    right = lc.chunk_hashes(toks, CHUNK, seed=hash_seed)
    wrong = lc.chunk_hashes(toks, CHUNK, seed="x" if hash_seed else "tenant-seed")
    assert c.retrieve_bytes("m", chunk_hashes=right).chunks == [b"a", b"b", b"c"]
    assert c.retrieve_bytes("m", chunk_hashes=wrong).chunks == []
    assert c.lookup_wait("r", "m", chunk_hashes=right) == 3
    c.end_session("r")


def test_retrieve_bytes_as_chunk_frames(dp):
    """chunk_frames=True: the same chunks, as views of the frames they came in."""
    s, c = dp()
    toks = prompt(3, 4)
    objs = [bytes([i]) * (100 << 10) for i in range(3)]
    c.store_bytes("m", objs, token_ids=toks)
    got = c.retrieve_bytes("m", token_ids=toks, chunk_frames=True).chunks
    assert all(isinstance(g, memoryview) for g in got)
    assert [bytes(g) for g in got] == objs
    r = c.retrieve_bytes("m", token_ids=toks, start=CHUNK, chunk_frames=True)
    assert r.retrieved_chunks == 2 and [bytes(g) for g in r.chunks] == objs[1:]
    assert c.retrieve_bytes("m", token_ids=prompt(1, 5), chunk_frames=True).chunks == []
    plain = c.retrieve_bytes("m", token_ids=toks).chunks
    assert all(isinstance(g, bytes) for g in plain) and plain == objs


# ---- operations ---------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_every_operation_through_shared_memory(dp, order):
    s, c = dp()
    assert c.noop() is None
    assert c.get_chunk_size() == CHUNK and c.chunk_size == CHUNK
    name = "/lmc-py-" + uuid.uuid4().hex[:10]
    kv = KVCache(c, 3, "m", KVLayout(**LAYOUT, block_order=order, dtype="bfloat16"),
                 shm_name=name)
    try:
        assert os.stat("/dev/shm" + name).st_size == kv.layout.total_bytes + lc.PROOF_PAGE
        assert kv.view.shape == (2, 2, 64, 16, 32) and kv.view.dtype == np.uint16
        fill(kv, 1)
        toks = prompt(3, 1)
        blocks = list(range(10, 16))
        objects = [kv.read_tokens(blocks[2 * j:2 * j + 2]).tobytes() for j in range(3)]
        assert c.store(3, blocks, token_ids=toks) == lc.StoreResult(3, 0)
        assert kv.store(blocks, token_ids=toks) == lc.StoreResult(0, 3)
        # the L1 object of a chunk is [K|V][layer][token][bytes] of its blocks
        assert c.retrieve_bytes("m", token_ids=toks).chunks == objects
        c.lookup("req", "m", token_ids=toks, num_kv_readers=2)
        st = c.query_prefetch_status("req")
        while not st.ready:
            st = c.query_prefetch_status("req")
        assert st == lc.PrefetchStatus(True, 3)
        assert c.query_prefetch_status("req") == lc.PrefetchStatus(True, 0)  # reported once
        kv.raw[:] = 0
        r = kv.retrieve(blocks, token_ids=toks, request_id="req")
        assert r == lc.RetrieveResult(3)
        assert [kv.read_tokens(blocks[2 * j:2 * j + 2]).tobytes() for j in range(3)] == objects
        assert c.free_lookup_locks("req", start=0, end=2 * CHUNK) == 2  # the second readers
        assert c.free_lookup_locks("req") == 1
        assert c.end_session("req") is None
        # retrieve without a session, skipping the first tokens: those blocks stay untouched
        kv.raw[:] = 0
        assert kv.retrieve(blocks, token_ids=toks, skip_first_n_tokens=CHUNK) == \
            lc.RetrieveResult(3)
        assert not kv.read_tokens(blocks[:2]).any()
        assert kv.read_tokens(blocks[2:4]).tobytes() == objects[1]
        p = c.ping(3)
        assert p.instance_id == 3 and abs(p.server_time - time.time()) < 3600
        assert c.ping().instance_id is None
        assert c.clear() == 3
        assert c.lookup_wait("req2", "m", token_ids=toks) == 0
        c.end_session("req2")
    finally:
        kv.close()
    assert not os.path.exists("/dev/shm" + name)
    with pytest.raises(LmcacheError) as e:
        c.store(3, [0, 1], token_ids=prompt(1, 1))
    assert e.value.code == errors.NOT_REGISTERED


def test_kvcache_is_allocated_and_warmed_whole(dp):
    """KVCache allocates its object (posix_fallocate): the server faults all of it in after the
    registration, and wait_warm() waits for that."""
    s, c = dp()
    kv = KVCache(c, 1, "m", KVLayout(**LAYOUT))
    try:
        assert os.stat(kv.path).st_blocks * 512 >= kv.layout.total_bytes
        assert kv.wait_warm(timeout=30) is True
        p = kv.ping()
        assert p.registered is True and p.warming is False
        meta = s.get("/status").json()["cache_context_meta"]["1"]
        assert meta["warm_state"] == "warm" and meta["warmed_bytes"] == kv.layout.total_bytes
        assert c.ping(99).warming is None  # unknown instance
    finally:
        kv.close()


def test_layer_major_store_retrieves_into_block_major(dp):
    s, c = dp()
    a = KVCache(c, 1, "m", KVLayout(**LAYOUT))
    b = KVCache(c, 2, "m", KVLayout(**LAYOUT, block_order="block_major"))
    try:
        fill(a, 7)
        toks = prompt(2, 2)
        a.store([0, 1, 2, 3], token_ids=toks)
        b.retrieve([60, 61, 62, 63], token_ids=toks)
        assert (b.view[:, :, 60:64] == a.view[:, :, 0:4]).all()
        # the block-major object stores each block as one contiguous cross-layer page
        assert b.native.shape == (64, 2, 2, 16, 64)
        assert (b.native[61] == b.block(61)).all()
    finally:
        a.close()
        b.close()


def test_kvcache_views_follow_the_protocol_offsets(dp):
    s, c = dp()
    for order in ("layer_major", "block_major"):
        for kvc in (2, 1):
            lo = KVLayout(3, 5, 16, 8, kv_count=kvc, block_order=order)
            kv = KVCache(c, 9, "m", lo)
            try:
                for (layer, k, blk, tok) in [(0, 0, 0, 0), (2, kvc - 1, 4, 15), (1, 0, 3, 7)]:
                    kv.raw[:] = 0
                    kv.view[layer, k, blk, tok] = np.arange(1, 9, dtype=np.uint8)
                    off = lo.offset(layer, k, blk, tok)
                    assert kv.raw[off:off + 8].tolist() == list(range(1, 9))
                    assert kv.raw.sum() == 36
                    assert (kv.key(layer) == kv.layer(layer)[0]).all()
                if kvc == 1:
                    with pytest.raises(ValueError):
                        kv.value(0)
                else:
                    assert (kv.value(2) == kv.view[2, 1]).all()
                data = np.arange(kvc * 3 * 32 * 8, dtype=np.uint8).reshape(kvc, 3, 32, 8)
                kv.write_tokens([4, 1], data)
                assert (kv.read_tokens([4, 1]) == data).all()
            finally:
                kv.close()
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, 1)
    with pytest.raises(ValueError):
        KVLayout(1, 1, 1, 1, block_order="row_major")
    with pytest.raises(ValueError):
        KVCache(c, 1, "m", KVLayout(1, 1, 1, 3), dtype=np.float16)  # 3 bytes per token


def test_lookup_wait_with_and_without_reply_status(dp):
    s, c = dp()
    toks = prompt(2, 11)
    c.store_bytes("m", [b"a", b"b"], token_ids=toks)
    assert c.lookup_wait("lw", "m", token_ids=toks) == 2  # one request: the status in the reply
    # A server that predates reply_status replies {ok} to the lookup: lookup_wait then queries.
    from test_dataplane_client import OldServer
    old = OldServer()
    try:
        oc = Client(old.port, timeout=10)
        assert oc.lookup_wait("lw", "m", chunk_hashes=[b"h" * 32] * 3) == 3
        oc.close()
        assert [op for op, _ in old.seen] == ["lookup"] + ["query_prefetch_status"] * 3
        assert old.seen[0][1]["reply_status"] is True
    finally:
        old.close()


def test_store_bytes_and_ranks(dp):
    s, c = dp()
    toks = prompt(2, 9)
    kw = dict(token_ids=toks, cache_salt="tenant", world_size=2)
    assert c.store_bytes("m", [b"r0-a", b"r0-b"], worker_id=0, **kw) == lc.StoreResult(2, 0)
    assert c.lookup_wait("q", "m", **kw) == 0  # rank 1 is missing
    c.end_session("q")
    assert c.store_bytes("m", [np.frombuffer(b"r1-a", np.uint8), bytearray(b"r1-b")],
                         worker_id=1, **kw) == lc.StoreResult(2, 0)
    assert c.lookup_wait("q", "m", **kw) == 2
    assert c.retrieve_bytes("m", worker_id=1, request_id="q", **kw).chunks == [b"r1-a", b"r1-b"]
    assert c.free_lookup_locks("q", worker_id=0) == 2
    c.end_session("q")
    got = c.retrieve_bytes("m", token_ids=toks, cache_salt="tenant", world_size=2, start=CHUNK)
    assert got.chunks == [b"r0-b"] and got.retrieved_chunks == 1
    assert c.retrieve_bytes("m", token_ids=toks).chunks == []  # another salt and world size


# ---- error codes --------------------------------------------------------------------------------

def code_of(fn, *a, **kw):
    with pytest.raises(LmcacheError) as e:
        fn(*a, **kw)
    assert e.value.message and e.value.server_side, e.value
    return e.value


def test_error_codes(dp, tmp_path):
    s, c = dp("--max-request-objects", "4", "--max-message-mb", "1")
    toks = prompt(2, 3)
    e = code_of(c.store_bytes, "m", [b"x"], token_ids=toks, cache_salt="a@b")
    assert e.code == errors.BAD_REQUEST and e.op == "store_bytes" and e.reply["ok"] is False
    assert code_of(c.lookup, "r", "m", token_ids=toks, start=5).code == errors.BAD_REQUEST
    e = code_of(c.lookup_wait, "r", "m", token_ids=toks, start=5)
    assert e.code == errors.BAD_REQUEST and e.op == "lookup"
    assert code_of(c.call, "no_such_operation").code == errors.UNKNOWN_OPERATION
    assert code_of(c.lookup, "r", "m", token_ids=prompt(5, 1)).code == errors.TOO_LARGE
    assert code_of(c.store_bytes, "m", [b"x" * (2 << 20)], token_ids=toks).code == \
        errors.TOO_LARGE
    assert code_of(c.unregister_kv_cache, 77).code == errors.NOT_REGISTERED
    assert code_of(c.retrieve, 77, [0, 1], token_ids=toks).code == errors.NOT_REGISTERED
    kv = KVCache(c, 1, "m", KVLayout(**LAYOUT))
    try:
        assert code_of(kv.store, [0], token_ids=toks).code == errors.INVALID_BLOCKS
        assert code_of(kv.store, [0, 1, 2, 64], token_ids=toks).code == errors.INVALID_BLOCKS
        kv.store([0, 1], token_ids=toks[:CHUNK])
        e = code_of(kv.retrieve, [0, 1, 2, 3], token_ids=toks)
        assert e.code == errors.NOT_FOUND and e.result == lc.RetrieveResult(1)
        # a proof the client does not answer (the raw request, from another connection)
        with Client(s.zmq_port, timeout=20) as other:
            e = code_of(other.call, "register_kv_cache",
                        dict(instance_id=5, model_name="m", shm_name=kv.shm_name, **LAYOUT))
            assert e.code == errors.PROOF_REQUIRED and len(e.reply["nonce"]) == 32
            assert e.reply["proof_offset"] == kv.layout.total_bytes
            assert other.register_kv_cache(5, "m", kv.shm_name, KVLayout(**LAYOUT)) is None
    finally:
        kv.close()
    # shm_error: an object that is not there, and one without room for the layout
    assert code_of(c.register_kv_cache, 2, "m", "/lmc-py-missing-" + uuid.uuid4().hex[:8],
                   KVLayout(**LAYOUT)).code == errors.SHM_ERROR
    name = "/lmc-py-small-" + uuid.uuid4().hex[:8]
    with open("/dev/shm" + name, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        assert code_of(c.register_kv_cache, 2, "m", name, KVLayout(**LAYOUT)).code == \
            errors.SHM_ERROR
    finally:
        os.unlink("/dev/shm" + name)


def test_out_of_memory_keeps_the_stored_count(dp):
    s, c = dp(l1_size_gb="0.004")  # ~4 MiB of L1
    pinned = prompt(3, 4)
    c.store_bytes("m", [b"p" * (1 << 20)] * 3, token_ids=pinned)
    assert c.lookup_wait("pin", "m", token_ids=pinned) == 3  # read locks: nothing to evict
    e = code_of(c.store_bytes, "m", [b"a" * 1024, b"b" * (3 << 20)], token_ids=prompt(2, 5))
    assert e.code == errors.OUT_OF_MEMORY, e
    assert e.result == lc.StoreResult(1, 0)
    c.end_session("pin")


def test_too_many_names(dp):
    s, c = dp()
    toks = prompt(1, 1)
    handles = [c.send_store_bytes(f"model-{i}", [b"s"], token_ids=toks) for i in range(1024)]
    assert all(h.result().stored_chunks == 1 for h in handles)
    e = code_of(c.store_bytes, "model-late", [b"s"], token_ids=toks)
    assert e.code == errors.TOO_MANY_NAMES
    assert c.clear() == 1024


def test_failed_registration_leaves_no_object(dp):
    s, c = dp("--shm-name-prefixes", "/allowed-")
    prefix = "lmc-py-refused-" + uuid.uuid4().hex[:8]
    with pytest.raises(LmcacheError) as e:
        KVCache(c, 1, "m", KVLayout(**LAYOUT), shm_name="/" + prefix)
    assert e.value.code == errors.SHM_ERROR
    assert shm_leftovers(prefix) == []
    kv = KVCache(c, 1, "m", KVLayout(**LAYOUT), shm_name="/allowed-" + prefix)
    kv.close()
    assert shm_leftovers("allowed-" + prefix) == []
    with pytest.raises(ValueError):
        KVCache(c, 1, "m", KVLayout(**LAYOUT), shm_name="/bad/name")


def test_unclosed_cache_is_unlinked_at_exit(make_server):
    s = make_server(args=["--chunk-size", str(CHUNK)])
    name = "lmc-py-exit-" + uuid.uuid4().hex[:8]
    src = ("import lmcache_client as l; c = l.Client(%d); "
           "kv = l.KVCache(c, 1, 'm', l.KVLayout(2, 64, 16, 64), shm_name='/%s'); "
           "import os; print(os.path.exists(kv.path))" % (s.zmq_port, name))
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run(["/usr/bin/python3", "-c", src], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stdout + r.stderr
    assert shm_leftovers(name) == []


def test_register_an_object_created_elsewhere(dp):
    """Client.register_kv_cache answers the proof by opening the object itself."""
    s, c = dp()
    lo = KVLayout(**LAYOUT)
    name = "/lmc-py-ext-" + uuid.uuid4().hex[:8]
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, lo.total_bytes + lc.PROOF_PAGE)
        os.pwrite(fd, b"\x5a" * lo.total_bytes, 0)
        assert c.register_kv_cache(4, "m", name, lo) is None
        assert c.store(4, [0, 1], token_ids=prompt(1, 8)) == lc.StoreResult(1, 0)
        assert c.retrieve_bytes("m", token_ids=prompt(1, 8)).chunks == \
            [b"\x5a" * lo.chunk_object_bytes(CHUNK)]
        c.unregister_kv_cache(4)
    finally:
        os.close(fd)
        os.unlink("/dev/shm" + name)


# ---- pipelining, timeouts, malformed replies ----------------------------------------------------

def test_pipelined_requests_resolve_by_id(dp):
    s, c = dp()
    prompts = [prompt(2, 100 + i) for i in range(50)]
    done = []
    stores = [c.send_store_bytes("m", [b"%d-a" % i, b"%d-b" % i], token_ids=p)
              for i, p in enumerate(prompts)]
    stores[0].add_done_callback(lambda h: done.append(h.rid))
    assert c.in_flight == 50
    gets = [c.submit("retrieve_bytes", "m", token_ids=p) for p in prompts]
    # the last reply first: the others are kept and resolve their own handles
    assert gets[-1].result().chunks == [b"49-a", b"49-b"]
    assert done == [stores[0].rid]
    assert all(h.done() for h in stores)
    for i, h in enumerate(gets):
        assert h.result() == lc.RetrieveBytesResult([b"%d-a" % i, b"%d-b" % i])
    bad = c.send_unregister_kv_cache(12345)
    ok = c.send_noop()
    c.wait_all()
    assert c.in_flight == 0 and ok.result() is None
    assert isinstance(bad.exception(), LmcacheError) and bad.exception().code == "not_registered"
    with pytest.raises(ValueError):
        c.submit("no_such_op")


def test_handles_are_awaitable_in_asyncio(dp):
    """`await handle` inside an event loop: many requests in flight from several tasks, replies
    read when the socket becomes readable, the loop never blocked; a timeout leaves the request
    in flight."""
    import asyncio
    s, c = dp()
    ticks = []

    async def ticker():
        while True:
            ticks.append(1)
            await asyncio.sleep(0.001)

    async def task(i):
        toks = prompt(2, 500 + i)
        st = await c.send_store_bytes("m", [b"%d" % i, b"x"], token_ids=toks)
        assert st == lc.StoreResult(2, 0)
        hits = await c.send_lookup("a%d" % i, "m", token_ids=toks)
        assert hits is None
        got = await c.send_retrieve_bytes("m", token_ids=toks, request_id="a%d" % i)
        await c.send_end_session("a%d" % i)
        return got.chunks[0]

    async def main():
        t = asyncio.ensure_future(ticker())
        out = await asyncio.gather(*(task(i) for i in range(20)))
        with pytest.raises(LmcacheError) as e:
            await c.send_store(99, [0], token_ids=prompt(1, 1))
        assert e.value.code == errors.NOT_REGISTERED
        t.cancel()
        return out

    assert asyncio.run(main()) == [b"%d" % i for i in range(20)]
    assert c.in_flight == 0 and c._aio_loop is None
    assert len(ticks) > 0

    async def late():
        with Client(free_port(), timeout=5) as dead:
            h = dead.send_noop()
            with pytest.raises(LmcacheError) as e:
                await h.wait_async(timeout=0.05)
            assert e.value.code == errors.TIMEOUT and dead.in_flight == 1

    asyncio.run(late())


def test_timeouts_and_a_server_that_is_not_there():
    c = Client(free_port(), timeout=0.3)
    try:
        e = code_of_client(c.noop)
        assert e.code == errors.TIMEOUT and not e.server_side
        assert c.in_flight == 0  # a synchronous call forgets its request
        h = c.send_noop()
        with pytest.raises(LmcacheError) as e:
            h.result(timeout=0.1)
        assert e.value.code == errors.TIMEOUT and c.in_flight == 1 and not h.done()
        with pytest.raises(LmcacheError) as e:
            c.wait_all(timeout=0.1)
        assert e.value.code == errors.TIMEOUT
    finally:
        c.close()
    assert h.exception().code == errors.TRANSPORT  # closing fails what is in flight
    with pytest.raises(LmcacheError) as e:
        c.noop()
    assert e.value.code == errors.TRANSPORT
    for bad in ("nonsense", ("h",), "tcp:/x"):
        with pytest.raises(ValueError):
            Client(bad)
    with pytest.raises(ValueError):
        Client(5555, curve_server_key="x" * 40)


def code_of_client(fn):
    with pytest.raises(LmcacheError) as e:
        fn()
    return e.value


def test_malformed_replies_are_protocol_errors():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    c = Client(port, timeout=10)
    try:
        bodies = [b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa2ok\xc3"]  # bad msgpack, array, ok only
        handles = [c.send_noop(), c.send_noop(), c.send_ping(), c.send_noop()]
        for i, h in enumerate(handles):
            ident, rid, op, _ = router.recv_multipart()
            assert rid == h.rid and op == h.op.encode()
            if i < 3:
                router.send_multipart([ident, rid, op, bodies[i]])
            else:
                router.send_multipart([ident, rid, op])  # two frames
        for h in handles[:2] + handles[3:]:
            assert h.exception().code == errors.PROTOCOL
        assert handles[2].exception().code == errors.PROTOCOL  # ping without server_time
        # an unknown code is kept as the server sent it
        h = c.send_noop()
        ident, rid, op, _ = router.recv_multipart()
        router.send_multipart([ident, rid, op, b"\x83\xa2ok\xc2\xa4code\xa3new\xa7message\xa1m"])
        assert h.exception().code == "new"
    finally:
        c.close()
        router.close(0)


# ---- transports: CURVE and ipc ------------------------------------------------------------------

def keygen(prefix):
    r = subprocess.run([BIN, "curve-keygen", prefix], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return prefix + ".pub", prefix + ".key"


def test_curve(make_server, tmp_path):
    spub, _ = keygen(str(tmp_path / "server"))
    allowed = tmp_path / "clients"
    allowed.mkdir()
    cpub, ckey = keygen(str(allowed / "engine"))
    os.rename(ckey, str(tmp_path / "engine.key"))
    s = make_server(args=["--chunk-size", str(CHUNK), "--curve-secret-key-file",
                          str(tmp_path / "server.key"), "--curve-allowed-clients", str(allowed)])
    keys = dict(curve_server_key=lc.load_curve_key(spub), curve_public_key=lc.load_curve_key(cpub),
                curve_secret_key=lc.load_curve_key(str(tmp_path / "engine.key")))
    with Client(("127.0.0.1", s.zmq_port), timeout=20, **keys) as c:
        with KVCache(c, 1, "m", KVLayout(**LAYOUT)) as kv:
            fill(kv, 3)
            assert kv.store([0, 1], token_ids=prompt(1, 1)).stored_chunks == 1
    upub, usec = zmq.curve_keypair()
    with Client(s.zmq_port, timeout=1, curve_server_key=keys["curve_server_key"],
                curve_public_key=upub, curve_secret_key=usec) as c:
        assert code_of_client(c.noop).code == errors.TIMEOUT
    with Client(s.zmq_port, timeout=1) as c:  # plaintext
        assert code_of_client(c.noop).code == errors.TIMEOUT


def test_ipc_endpoint(make_server, tmp_path):
    sock = str(tmp_path / "dp.sock")
    make_server(args=["--chunk-size", str(CHUNK), "--ipc-path", sock])
    with Client("ipc://" + sock, timeout=20) as c:
        assert c.chunk_size == CHUNK
        with KVCache(c, 1, "m", KVLayout(**LAYOUT)) as kv:
            fill(kv, 5)
            toks = prompt(2, 5)
            before = kv.read_tokens([0, 1, 2, 3]).copy()
            assert kv.store([0, 1, 2, 3], token_ids=toks).stored_chunks == 2
            kv.raw[:] = 0
            assert kv.lookup_wait("r", token_ids=toks) == 2
            assert kv.retrieve([0, 1, 2, 3], token_ids=toks, request_id="r").retrieved_chunks == 2
            assert (kv.read_tokens([0, 1, 2, 3]) == before).all()
            c.end_session("r")


# ---- install, docs example and the engine simulator ---------------------------------------------

def test_installed_package_imports(tmp_path):
    prefix = tmp_path / "prefix"
    r = subprocess.run(["cmake", "--install", BUILD, "--prefix", str(prefix)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    site = list(prefix.glob("lib/python3*/dist-packages/lmcache_client/__init__.py"))
    assert len(site) == 1, list(prefix.rglob("*.py"))
    env = dict(os.environ, PYTHONPATH=str(site[0].parent.parent))
    r = subprocess.run(["/usr/bin/python3", "-c", "import lmcache_client as l; print(l.__file__);"
                        "print(l.chunk_hashes([0,1,2,3], 4)[0].hex())"],
                       env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(str(prefix))


def docs_python_example():
    with open(os.path.join(ROOT, "docs", "client.md")) as f:
        text = f.read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    return next(b for b in blocks if "KVCache(" in b and "ENDPOINT" in b)


def test_docs_client_python_example(make_server):
    s = make_server()
    src = docs_python_example().replace('ENDPOINT = "tcp://127.0.0.1:5555"',
                                        f'ENDPOINT = "tcp://127.0.0.1:{s.zmq_port}"')
    assert str(s.zmq_port) in src
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run(["/usr/bin/python3", "-c", src], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stored 2, hit 2, retrieved 2, identical True" in r.stdout, r.stdout


@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_engine_sim_reuses_verified_kv(make_server, order):
    s = make_server(args=["--chunk-size", "32"])
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "examples", "engine_sim.py"),
                        "--endpoint", f"tcp://127.0.0.1:{s.zmq_port}", "--seconds", "3",
                        "--layers", "4", "--kv-heads", "2", "--head-dim", "16",
                        "--tokens-per-block", "16", "--block-order", order, "--seed", "7"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    wrong = re.search(r"^wrong bytes: (\d+)$", r.stdout, re.M)
    hits = re.search(r"^hit chunks: (\d+) of (\d+)", r.stdout, re.M)
    assert wrong and int(wrong.group(1)) == 0, r.stdout
    assert hits and int(hits.group(1)) > 0, r.stdout
    assert re.search(r"^reused: [\d.]+ MB/s", r.stdout, re.M), r.stdout


def sanitized_build():
    try:
        with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
            cache = f.read()
    except FileNotFoundError:
        return False
    return bool(re.search(r"^LMCACHE_(SANITIZE|TSAN):BOOL=ON$", cache, re.M))


def test_bench_py_client_small(make_server):
    """The benchmark of scripts/bench-py-client.sh with a small layout: every phase reports, and
    (outside sanitizer builds, whose library cannot be loaded into python3) the interleaved
    comparison with liblmcache-client through ctypes."""
    s = make_server(args=["--chunk-size", "32"])
    argv = ["/usr/bin/python3", os.path.join(ROOT, "examples", "bench_py_client.py"),
            "--endpoint", f"tcp://127.0.0.1:{s.zmq_port}", "--layers", "2", "--kv-heads", "2",
            "--head-dim", "16", "--prompt-tokens", "96", "--prompts", "3", "--rounds", "2",
            "--bytes", "--warmup", "--seed", "3"]
    if not sanitized_build():
        argv += ["--interleave-c", os.path.join(BUILD, "liblmcache-client.so")]
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warm-up: stored and cleared 9 objects" in r.stdout, r.stdout
    for phase in ("store (shm)", "retrieve (shm)", "store_bytes", "retrieve_bytes"):
        assert re.search(r"^%s +[\d.]+ GB/s" % re.escape(phase), r.stdout, re.M), r.stdout
    assert re.search(r"lookup latency .*?6 samples", r.stdout), r.stdout
    if not sanitized_build():
        for op in ("store", "retrieve"):
            assert re.search(r"^interleaved %s .*\(per prompt, 6 each\).*Python/C \d+%%$" % op,
                             r.stdout, re.M), r.stdout
