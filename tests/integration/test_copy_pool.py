"""The copy pool (--copy-threads) over the real server: chunks of 2 MiB, large enough to be
split between the data-plane worker and the dp-copy helpers, round-trip byte for byte through
shared memory (both block orders, with skipped tokens) and through the bytes path, with the pool
off, small and larger, and with concurrent clients; a bad block id or a shrunk mapping still
fails the whole request."""
import mmap
import os
import threading

import pytest

from dp_util import DPClient, ShmKV, random_prompt

CHUNK = 64  # tokens per chunk: 4 blocks of 16 tokens
LAYERS = 8  # 2 (K, V) x 8 layers x 64 tokens x 2048 bytes = 2 MiB objects
BPT = 2048


class ShmKVOrder(ShmKV):
    """ShmKV in layer_major or block_major order, filled with random bytes."""

    def __init__(self, order, blocks=24):
        super().__init__(layers=LAYERS, blocks=blocks, tokens_per_block=16, bytes_per_token=BPT)
        self.order = order
        self.mem[:] = os.urandom(self.size)

    def layout(self):
        return dict(super().layout(), block_order=self.order)

    def block_off(self, layer, k, block):
        if self.order == "layer_major":
            return super().block_off(layer, k, block)
        return ((block * self.layers + layer) * self.kv + k) * self.block_bytes

    def tokens(self, block, first_token=0):
        """Per (layer, K/V): the bytes of the block's tokens from first_token on."""
        out = []
        for layer in range(self.layers):
            for k in range(self.kv):
                off = self.block_off(layer, k, block) + first_token * self.bpt
                out.append(bytes(self.mem[off:self.block_off(layer, k, block) + self.block_bytes]))
        return out


@pytest.fixture
def dp(make_server):
    def make(*args):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args), l1_size_gb="0.5")
        return s, DPClient(s.zmq_port)
    return make


def thread_names(s):
    return [l.split("(")[0].split("Thread: ")[1].strip() for l in
            s.get("/threads").text.splitlines() if l.startswith("Thread: ")]


def shm_round_trip(c, kv, iid, seed):
    """Stores 3 chunks from blocks 0..11, retrieves them into blocks 12..23 skipping the first
    chunk and half of the second chunk's first block; asserts the bytes."""
    per = CHUNK // kv.tpb
    c.call("register_kv_cache", instance_id=iid, model_name="m", **kv.layout())
    toks = random_prompt(seed, 3, CHUNK)
    src, dst = list(range(3 * per)), list(range(3 * per, 6 * per))
    r = c.call("store", instance_id=iid, token_ids=toks, block_ids=src)
    assert r["stored_chunks"] == 3
    before = {b: kv.tokens(b) for b in dst}
    skip = CHUNK + 8
    r = c.call("retrieve", instance_id=iid, token_ids=toks, block_ids=dst,
               skip_first_n_tokens=skip)
    assert r["retrieved_chunks"] == 3
    for i, (s_b, d_b) in enumerate(zip(src, dst)):
        first = min(max(skip - i * kv.tpb, 0), kv.tpb)
        assert kv.tokens(d_b, first) == kv.tokens(s_b, first), (i, first)
        if first:  # the skipped tokens were not written
            assert [t[:first * kv.bpt] for t in kv.tokens(d_b)] == \
                [t[:first * kv.bpt] for t in before[d_b]], i
    return toks


@pytest.mark.parametrize("threads", ["0", "1", "3"])
@pytest.mark.parametrize("order", ["layer_major", "block_major"])
def test_shm_and_bytes_round_trip_with_copy_threads(dp, threads, order):
    # --copy-threads-always: the helpers take part even on a loaded machine
    s, c = dp("--copy-threads", threads, "--copy-threads-always")
    kv = ShmKVOrder(order)
    try:
        assert sum(n.startswith("dp-copy-") for n in thread_names(s)) == int(threads)
        assert s.get("/config").json()["mp"]["copy_threads"] == int(threads)
        shm_round_trip(c, kv, 5, 1)
        # The bytes path: message -> L1 and L1 -> reply, 2 MiB chunks.
        toks = random_prompt(2, 3, CHUNK)
        chunks = [os.urandom(2 * LAYERS * CHUNK * BPT) for _ in range(3)]
        r = c.call("store_bytes", model_name="b", token_ids=toks, chunks=chunks)
        assert r["stored_chunks"] == 3
        assert c.call("retrieve_bytes", model_name="b", token_ids=toks)["chunks"] == chunks
    finally:
        c.close()
        kv.close()


def test_default_pool_with_its_free_core_gate_round_trips(dp):
    s, c = dp()  # --copy-threads -1, helpers only while a core is free
    kv = ShmKVOrder("block_major")
    try:
        ncpu = os.cpu_count()
        helpers = sum(n.startswith("dp-copy-") for n in thread_names(s))
        assert helpers == min(max(ncpu - 1, 0), 8)
        for i in range(3):
            shm_round_trip(c, kv, 9, 20 + i)
    finally:
        c.close()
        kv.close()


def test_concurrent_clients_share_the_pool(dp):
    s, _ = dp("--max-workers", "2", "--copy-threads", "3", "--copy-threads-always")
    errors = []

    def client(n):
        c = DPClient(s.zmq_port)
        kv = ShmKVOrder("block_major" if n % 2 else "layer_major")
        try:
            for i in range(4):
                shm_round_trip(c, kv, 100 + n, 1000 * n + i)
                chunks = [os.urandom(2 * LAYERS * CHUNK * BPT) for _ in range(2)]
                toks = random_prompt(50 + 10 * n + i, 2, CHUNK)
                c.call("store_bytes", model_name=f"b{n}", token_ids=toks, chunks=chunks)
                if c.call("retrieve_bytes", model_name=f"b{n}", token_ids=toks)["chunks"] != chunks:
                    errors.append((n, i, "bytes"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            c.close()
            kv.close()

    ts = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def test_bad_block_id_fails_the_whole_request(dp):
    s, c = dp("--copy-threads", "3", "--copy-threads-always")
    kv = ShmKVOrder("layer_major")
    per = CHUNK // kv.tpb
    try:
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        toks = random_prompt(7, 3, CHUNK)
        bad = list(range(3 * per))
        bad[-1] = kv.blocks  # the last block of the last chunk is outside the cache
        r = c.raw("store", {"instance_id": 1, "token_ids": toks, "block_ids": bad})
        assert r["ok"] is False and r["code"] == "invalid_blocks"
        assert s.get("/status").json()["storage_manager"]["l1"]["objects"] == 0
        c.call("store", instance_id=1, token_ids=toks, block_ids=list(range(3 * per)))
        dst = list(range(3 * per, 6 * per))
        before = [kv.tokens(b) for b in dst]
        bad = list(dst)
        bad[-1] = kv.blocks + 5
        r = c.raw("retrieve", {"instance_id": 1, "token_ids": toks, "block_ids": bad})
        assert r["ok"] is False and r["code"] == "invalid_blocks"
        assert [kv.tokens(b) for b in dst] == before  # nothing copied
    finally:
        c.close()
        kv.close()


def test_shrunk_mapping_fails_a_pooled_copy_not_the_server(dp):
    """Every range of a split copy runs under its own thread's SIGBUS guard: a mapping that
    shrank under the helpers is shm_error, as on the worker."""
    s, c = dp("--copy-threads", "3", "--copy-threads-always")
    kv = ShmKVOrder("layer_major")
    per = CHUNK // kv.tpb
    try:
        c.call("register_kv_cache", instance_id=3, model_name="m", **kv.layout())
        toks = random_prompt(9, 1, CHUNK)
        c.call("store", instance_id=3, token_ids=toks, block_ids=list(range(per)))
        kv.mem.close()
        os.ftruncate(kv.fd, kv.size // 4)  # the later layers of every block are gone
        r = c.raw("store", {"instance_id": 3, "token_ids": random_prompt(10, 1, CHUNK),
                            "block_ids": list(range(per))})
        assert r["ok"] is False and r["code"] == "shm_error"
        r = c.raw("retrieve", {"instance_id": 3, "token_ids": toks, "block_ids": list(range(per))})
        assert r["ok"] is False and r["code"] == "shm_error"
        assert s.get("/status").json()["storage_manager"]["l1"]["objects"] == 1
        assert c.call("noop")["result"] == "OK"
    finally:
        c.close()
        kv.mem = None
        os.close(kv.fd)
        os.unlink("/dev/shm" + kv.name)


def test_a_requests_chunks_are_one_pool_job(dp):
    """The chunks of a store and of a retrieve are copied as one pool job per request, not one
    per chunk (the pool's counters, logged at shutdown)."""
    s, c = dp("--copy-threads", "1", "--copy-threads-always")
    kv = ShmKVOrder("layer_major")
    try:
        shm_round_trip(c, kv, 4, 77)  # one store and one retrieve of 3 chunks of 2 MiB
    finally:
        c.close()
        kv.close()
    s.stop()
    assert "copy pool: 2 copies split with the helpers" in s.output()


def test_shrunk_mapping_mid_request_keeps_the_chunks_before(dp):
    """A mapping that shrank under the second chunk of a batched copy: the first chunk is stored
    (or copied back) whole, the later ones are not counted; the request is shm_error."""
    s, c = dp("--copy-threads", "1", "--copy-threads-always")
    kv = ShmKVOrder("block_major")  # block b: one contiguous region
    per = CHUNK // kv.tpb
    region = kv.layers * kv.kv * kv.block_bytes
    try:
        c.call("register_kv_cache", instance_id=5, model_name="m", **kv.layout())
        toks = random_prompt(11, 3, CHUNK)
        c.call("store", instance_id=5, token_ids=toks, block_ids=list(range(3 * per)))
        src = [kv.tokens(b) for b in range(per)]
        kv.mem.close()
        os.ftruncate(kv.fd, (3 * per + per) * region)  # blocks from 4 * per on are gone
        kv.mem = None
        r = c.raw("retrieve", {"instance_id": 5, "token_ids": toks,
                               "block_ids": list(range(3 * per, 6 * per))})
        assert r["ok"] is False and r["code"] == "shm_error"
        kv.mem = mmap.mmap(kv.fd, (3 * per + per) * region)
        assert [kv.tokens(b) for b in range(3 * per, 4 * per)] == src  # chunk 0 copied whole
        toks2 = random_prompt(12, 3, CHUNK)
        r = c.raw("store", {"instance_id": 5, "token_ids": toks2,
                            "block_ids": list(range(3 * per, 6 * per))})
        assert r["ok"] is False and r["code"] == "shm_error"
        assert s.get("/status").json()["storage_manager"]["l1"]["objects"] == 4  # 3 + chunk 0
        kv.mem[3 * per * region:4 * per * region] = b"\0" * (per * region)
        r = c.call("retrieve", instance_id=5, token_ids=toks2[:CHUNK],
                   block_ids=list(range(3 * per, 4 * per)))
        assert r["retrieved_chunks"] == 1
        assert [kv.tokens(b) for b in range(3 * per, 4 * per)] == src  # the same bytes stored
        assert c.call("noop")["result"] == "OK"
    finally:
        c.close()
        if kv.mem is not None:
            kv.mem.close()
        kv.mem = None
        os.close(kv.fd)
        os.unlink("/dev/shm" + kv.name)
