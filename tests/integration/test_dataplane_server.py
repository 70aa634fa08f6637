"""The data plane end to end over the real socket: byte-identical round trips, /status,
POST /cache/checksums, concurrency, a working set larger than L1, quotas on real traffic,
and locks of a vanished client released by lease expiry."""
import hashlib
import subprocess
import threading
import time

import pytest

from dp_util import PROOF_PAGE, DPClient, ShmKV, random_prompt

CHUNK = 64  # tokens per chunk in these tests (--chunk-size)


@pytest.fixture
def dp(make_server):
    def make(*args, **kw):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args), **kw)
        return s, DPClient(s.zmq_port)
    return make


def prompt(seed, chunks):
    return random_prompt(seed, chunks, CHUNK)


def test_store_retrieve_byte_identical_and_status(dp):
    s, c = dp()
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=7, model_name="m", **kv.layout())
        per = CHUNK // kv.tpb
        toks = prompt(1, 3)
        blocks = list(range(3 * per))
        kv.fill_blocks(blocks, "a")
        want = kv.read_blocks(blocks)
        r = c.call("store", instance_id=7, token_ids=toks, block_ids=blocks)
        assert r["stored_chunks"] == 3 and r["skipped_chunks"] == 0
        st = s.get("/status").json()
        assert st["registered_gpu_ids"] == [7]
        meta = st["cache_context_meta"]["7"]
        assert meta["model_name"] == "m" and meta["world_size"] == 1
        assert meta["kv_cache_layout"]["num_layers"] == kv.layers
        assert st["storage_manager"]["l1"]["objects"] == 3

        c.call("lookup", request_id="r1", model_name="m", token_ids=toks)
        assert s.get("/status").json()["active_sessions"] == 1
        q = c.call("query_prefetch_status", request_id="r1")
        assert q["ready"] and q["hit_chunks"] == 3
        # Retrieve into other blocks, then compare.
        dst = list(range(3 * per, 6 * per))
        r = c.call("retrieve", instance_id=7, request_id="r1", token_ids=toks, block_ids=dst)
        assert r["retrieved_chunks"] == 3
        assert kv.read_blocks(dst) == want
        c.call("end_session", request_id="r1")
        assert s.get("/status").json()["active_sessions"] == 0
        body = s.get("/metrics").text
        assert 'lmcache_mp_lookup_hit_tokens_total{model_name="m",cache_salt=""} %.1f' % (
            3 * CHUNK) in body
        assert "lmcache_mp_l0_l1_store_throughput_bytes_per_second_count" in body
        p = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True,
                           text=True)
        assert p.returncode == 0 and not (p.stdout + p.stderr).strip(), p.stdout + p.stderr
    finally:
        c.close()
        kv.close()


def test_checksums_endpoint(dp):
    s, c = dp()
    kv = ShmKV(layers=3)
    try:
        c.call("register_kv_cache", instance_id=0, model_name="m", **kv.layout())
        kv.fill_blocks(range(kv.blocks), "z")
        ids = [0, 2, 3, 4, 5, 8]
        r = s.post("/cache/checksums", json={"block_ids": ids, "chunk_size": 2})
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["status"] == "success" and j["chunk_size"] == 2 and j["num_chunks"] == 3
        assert j["layerwise"] is False and j["block_id_ranges"] == "0,[2,5],8"
        for n, group in enumerate([ids[0:2], ids[2:4], ids[4:6]]):
            h = hashlib.md5()
            for layer in range(kv.layers):
                for k in range(kv.kv):
                    for b in group:
                        off = kv.block_off(layer, k, b)
                        h.update(kv.mem[off:off + kv.block_bytes])
            assert j["chunk_checksums"][n] == h.hexdigest()
        r = s.post("/cache/checksums", json={"block_ids": ids, "chunk_size": 2, "layerwise": True})
        lw = r.json()["chunk_checksums"]
        assert sorted(lw) == ["layer_0", "layer_1", "layer_2"]
        assert all(len(v) == 3 for v in lw.values())
        h = hashlib.md5()
        for k in range(kv.kv):
            for b in ids[0:2]:
                off = kv.block_off(1, k, b)
                h.update(kv.mem[off:off + kv.block_bytes])
        assert lw["layer_1"][0] == h.hexdigest()
        # Errors as documented.
        assert s.post("/cache/checksums", json={"block_ids": [], "chunk_size": 2}).status_code == 400
        assert s.post("/cache/checksums", json={"block_ids": [1], "chunk_size": 0}).status_code == 400
        assert s.post("/cache/checksums", json={"block_ids": [1]}).status_code == 400
        assert s.post("/cache/checksums", json={"block_ids": [1], "chunk_size": 1,
                                                "instance_id": 9}).status_code == 404
        assert s.post("/cache/checksums", json={"block_ids": "x", "chunk_size": 1}).status_code == 422
        assert s.post("/cache/checksums", json={"block_ids": [10**6], "chunk_size": 1}).status_code == 400
        assert s.post("/cache/checksums", data="{bad").status_code == 422
    finally:
        c.close()
        kv.close()


def test_checksums_work_is_bounded_by_the_cache_not_the_body(dp):
    # Regression: ids could repeat without end and every layer of every id made a digest: a
    # 60 KB body took 5.7 s and 258 MiB and answered 43 MiB. At most num_blocks ids (the whole
    # cache hashed once) and 262,144 digests are accepted now.
    s, c = dp()
    kv = ShmKV(layers=64, blocks=4200, tokens_per_block=16, bytes_per_token=2)
    try:
        c.call("register_kv_cache", instance_id=0, model_name="m", **kv.layout())
        r = s.post("/cache/checksums", json={"block_ids": [1] * 4201, "chunk_size": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == ("block_ids has 4201 ids, more than the KV cache's "
                                     "num_blocks (4200)")
        ids = list(range(4200))
        r = s.post("/cache/checksums", json={"block_ids": ids, "chunk_size": 1,
                                             "layerwise": True})
        assert r.status_code == 400, r.text
        assert r.json()["error"].startswith("the answer would hold 268800 checksums, more "
                                            "than 262144")
        # The whole cache, once, is fine.
        r = s.post("/cache/checksums", json={"block_ids": ids, "chunk_size": 1})
        assert r.status_code == 200 and r.json()["num_chunks"] == 4200, r.text
        r = s.post("/cache/checksums", json={"block_ids": ids, "chunk_size": 64,
                                             "layerwise": True})
        assert r.status_code == 200 and len(r.json()["chunk_checksums"]) == 64, r.text
    finally:
        c.close()
        kv.close()


def test_concurrent_clients_overlapping_prompts(dp):
    s, _ = dp("--max-workers", "2")
    errors = []

    def worker(n):
        c = DPClient(s.zmq_port)
        try:
            for i in range(30):
                p = (n + i) % 7  # prompts overlap across clients
                toks = prompt(p, 2)
                chunks = [hashlib.sha256(f"{p}:{j}".encode()).digest() * 64 for j in range(2)]
                c.call("store_bytes", model_name="m", token_ids=toks, chunks=chunks)
                got = c.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"]
                if got != chunks:
                    errors.append((n, i, p))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            c.close()

    ts = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def test_working_set_three_times_l1_never_fails_a_store(dp):
    # 16 MiB L1, 256 KiB objects: 192 objects = 48 MiB written.
    s, c = dp(l1_size_gb=16 / 1024)
    blob = b"x" * (256 << 10)
    for i in range(192):
        r = c.call("store_bytes", model_name="m", token_ids=prompt(1000 + i, 1), chunks=[blob])
        assert r["stored_chunks"] == 1
    st = s.get("/status").json()["storage_manager"]["l1"]
    assert st["bytes_used"] <= st["bytes_total"]
    assert 'lmcache_mp_l1_evicted_chunks_total{cache_salt=""}' in s.get("/metrics").text
    # The most recent prompt is still there.
    assert len(c.call("retrieve_bytes", model_name="m", token_ids=prompt(1191, 1))["chunks"]) == 1


def test_isolated_lru_quota_on_real_traffic(dp):
    s, c = dp(policy="IsolatedLRU")
    assert s.put("/quota/alice", json={"limit_gb": 1}).status_code == 200
    assert s.put("/quota/bob", json={"limit_gb": 1}).status_code == 200
    blob = b"q" * (64 << 10)
    for salt in ("alice", "bob"):
        for i in range(8):
            c.call("store_bytes", model_name="m", cache_salt=salt, token_ids=prompt(i, 1),
                   chunks=[blob])
    usage = s.get("/quota/alice").json()["current_usage_gb"]
    assert usage > 0
    # Removing alice's quota makes her data over budget: gone within ~2 s; bob is untouched.
    assert s.delete("/quota/alice").json()["status"] == "removed"
    deadline = time.time() + 5
    while time.time() < deadline and s.get("/quota/alice").json()["current_usage_gb"] > 0:
        time.sleep(0.1)
    assert s.get("/quota/alice").json()["current_usage_gb"] == 0
    assert len(c.call("retrieve_bytes", model_name="m", cache_salt="alice",
                      token_ids=prompt(0, 1))["chunks"]) == 0
    bob = c.call("retrieve_bytes", model_name="m", cache_salt="bob", token_ids=prompt(0, 1))
    assert bob["chunks"] == [blob]
    assert s.get("/quota/bob").json()["current_usage_gb"] > 0


def test_vanished_client_locks_expire(dp):
    s, c = dp("--l1-read-ttl-seconds", "1", "--session-ttl-seconds", "600")
    toks = prompt(5, 2)
    c.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"a" * 1000, b"b" * 1000])
    c.call("lookup", request_id="gone", model_name="m", token_ids=toks, num_kv_readers=3)
    assert s.get("/status").json()["storage_manager"]["l1"]["read_locked_objects"] == 2
    c.close()  # the client disappears without retrieving or ending its session
    deadline = time.time() + 10
    while time.time() < deadline:
        if s.get("/status").json()["storage_manager"]["l1"]["read_locked_objects"] == 0:
            break
        time.sleep(0.1)
    assert s.get("/status").json()["storage_manager"]["l1"]["read_locked_objects"] == 0
    # The objects are evictable again: a forced-free path (clear) and a fresh store work.
    c2 = DPClient(s.zmq_port)
    try:
        assert c2.call("clear")["cleared"] == 2
    finally:
        c2.close()


def test_reaper_drops_silent_registrations(dp):
    s, c = dp("--worker-reap-timeout-seconds", "1", "--worker-registration-grace-seconds", "1")
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=3, model_name="m", **kv.layout())
        c.call("ping", instance_id=3)
        assert s.get("/status").json()["registered_gpu_ids"] == [3]
        deadline = time.time() + 10
        while time.time() < deadline and s.get("/status").json()["registered_gpu_ids"]:
            time.sleep(0.2)
        assert s.get("/status").json()["registered_gpu_ids"] == []
        r = c.raw("store", {"instance_id": 3, "token_ids": prompt(1, 1), "block_ids": [0, 1, 2, 3]})
        assert r["ok"] is False and r["code"] == "not_registered"
        t = s.get("/periodic-threads/worker-reaper").json()
        assert t["total_runs"] >= 1
    finally:
        c.close()
        kv.close()


def test_retrieve_cannot_read_another_tenants_object(dp):
    """Regression: a retrieve with request_id used the object its lookup locked even when the
    retrieve named another salt, handing one tenant another tenant's bytes."""
    s, c = dp()
    toks = prompt(11, 1)
    c.call("store_bytes", model_name="m", cache_salt="x", token_ids=toks, chunks=[b"X" * 512])
    c.call("store_bytes", model_name="m", cache_salt="", token_ids=toks, chunks=[b"Y" * 512])
    c.call("lookup", request_id="r1", model_name="m", cache_salt="x", token_ids=toks)
    c.call("lookup", request_id="r2", model_name="m", cache_salt="", token_ids=toks)
    got = c.call("retrieve_bytes", model_name="m", cache_salt="", token_ids=toks,
                 request_id="r1")["chunks"]
    assert got == []  # r1 holds no lock on the salt-"" object
    assert s.get("/status").json()["storage_manager"]["l1"]["read_locked_objects"] == 2
    assert c.call("retrieve_bytes", model_name="m", cache_salt="", token_ids=toks,
                  request_id="r2")["chunks"] == [b"Y" * 512]
    assert c.call("retrieve_bytes", model_name="m", cache_salt="x", token_ids=toks,
                  request_id="r1")["chunks"] == [b"X" * 512]
    c.close()


def test_reregister_after_the_engine_recreated_its_shm(dp):
    """Regression: re-registering the same name and layout kept the old, unlinked mapping."""
    import os
    s, c = dp()
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        name = kv.name
        kv.close()  # the engine restarts: unlink, recreate with the same name and layout
        kv2 = ShmKV()
        os.unlink("/dev/shm" + kv2.name)
        kv2.mem.close()
        os.close(kv2.fd)
        kv2.name = name
        kv2.fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(kv2.fd, kv2.size + PROOF_PAGE)
        import mmap
        kv2.mem = mmap.mmap(kv2.fd, kv2.size)
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv2.layout())
        per = CHUNK // kv2.tpb
        blocks = list(range(per))
        kv2.fill_blocks(blocks, "NEW")
        want = kv2.read_blocks(blocks)
        toks = prompt(12, 1)
        c.call("store", instance_id=1, token_ids=toks, block_ids=blocks)
        kv2.zero()
        c.call("retrieve", instance_id=1, token_ids=toks, block_ids=blocks)
        assert kv2.read_blocks(blocks) == want
        kv2.close()
    finally:
        c.close()


def test_shrunk_shared_memory_is_an_error_not_a_crash(dp):
    """Regression: an engine that shrank its registered object made the next copy SIGBUS."""
    import os
    s, c = dp()
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=2, model_name="m", **kv.layout())
        os.ftruncate(kv.fd, 0)
        r = c.raw("store", {"instance_id": 2, "token_ids": prompt(13, 1),
                            "block_ids": list(range(CHUNK // kv.tpb))})
        assert r["ok"] is False and r["code"] == "shm_error"
        r = s.post("/cache/checksums", json={"block_ids": [0, 1], "chunk_size": 2,
                                            "instance_id": 2})
        assert r.status_code == 404
        assert s.get("/healthcheck").status_code == 200
        assert c.call("noop")["result"] == "OK"
    finally:
        c.close()
        kv.close()


def smaps_of(pid, path):
    """{field: kB} of the mapping of path in /proc/PID/smaps (the fields summed over its VMAs)."""
    out, inside = {}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                inside = len(head) >= 6 and head[5] == path
            elif inside and len(head) >= 2 and head[0].endswith(":") and head[1].isdigit():
                out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


def test_registration_maps_the_region_populated_and_writable(dp):
    """The first retrieve into a registered region pays no per-page cost: after registration
    the server's `kv-warm` thread faults every page in writable (dirty), not only readable (a
    clean page costs a dirty-bit update on its first write, a hypervisor exit on shadow-paged
    VMs); `ping` says when that is over, /status shows it."""
    s, c = dp()
    kv = ShmKV(layers=4, blocks=256)  # 4 x 2 x 256 x 1 KiB = 2 MiB
    kv.allocate()
    try:
        r = c.call("register_kv_cache", instance_id=3, model_name="m", **kv.layout())
        assert isinstance(r["warming"], bool)
        assert c.wait_warm(3)["warming"] is False
        m = smaps_of(s.proc.pid, "/dev/shm" + kv.name)
        assert m, "the region is not mapped by the server"
        assert m["Rss"] * 1024 >= kv.size
        assert m["Shared_Dirty"] + m["Private_Dirty"] == m["Rss"], m
        meta = s.get("/status").json()["cache_context_meta"]["3"]
        assert meta["warm_state"] == "warm"
        assert meta["warmed_bytes"] == meta["mapped_bytes"] == kv.size
        # An unknown instance says nothing of warming.
        assert "warming" not in c.call("ping", instance_id=4)
    finally:
        c.close()
        kv.close()


def test_kv_readers_cap_and_unknown_operation_reply_is_decodable(dp):
    s, c = dp()
    r = c.raw("lookup", {"request_id": "a", "model_name": "m", "token_ids": prompt(1, 1),
                         "num_kv_readers": 65535})
    assert r["ok"] is False and r["code"] == "bad_request"
    rid = b"7"
    c.sock.send_multipart([rid, b"\xff\xfe", b""])
    import msgpack
    reply = msgpack.unpackb(c.sock.recv_multipart()[2])  # valid UTF-8 throughout
    assert reply["code"] == "unknown_operation" and "\\xff" in reply["message"]
    c.close()


def test_store_bytes_and_retrieve_bytes_count_as_stores_and_retrieves(dp):
    """The stores/retrieves counters move for the bytes-in-the-message operations too."""
    s, c = dp()
    names = ["lmcache_mp_num_submitted_stores_total", "lmcache_mp_num_finished_stores_total",
             "lmcache_mp_num_submitted_retrieves_total", "lmcache_mp_num_finished_retrieves_total"]

    def counts():
        values = {}
        for line in s.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                values[name] = float(value)
        return [values.get(n) for n in names]

    assert counts() == [0, 0, 0, 0]
    toks = prompt(77, 2)
    r = c.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"a" * 256, b"b" * 256])
    assert r["stored_chunks"] == 2
    assert counts() == [1, 1, 0, 0]
    assert len(c.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"]) == 2
    assert counts() == [1, 1, 1, 1]
    # A store that fails is submitted but not finished.
    with pytest.raises(RuntimeError, match="bad_request"):
        c.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"a" * 256])
    assert counts() == [2, 1, 1, 1]
