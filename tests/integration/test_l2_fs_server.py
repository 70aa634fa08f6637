"""The fs L2 tier through the real daemon: write-through, lookups served from L2 after L1 lost
the data, restarts, corrupt files, a full disk, the /cache/objects and /cache/prefetches
endpoints."""
import glob
import json
import os
import subprocess
import time

import pytest
import requests

from dp_util import DPClient, ShmKV, random_prompt

CHUNK = 64


def prompt(seed, chunks):
    return random_prompt(seed, chunks, CHUNK)


def fs_adapter(path, **extra):
    cfg = {"type": "fs", "base_path": str(path)}
    cfg.update(extra)
    return ["--l2-adapter", json.dumps(cfg)]


def wait_for(cond, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def l2_objects(s):
    return sum(a["usage"]["objects"] for a in s.get("/status").json()["storage_manager"]["adapters"])


def lookup_hits(c, rid, toks, **kw):
    c.call("lookup", request_id=rid, model_name="m", token_ids=toks, **kw)
    for _ in range(400):
        q = c.call("query_prefetch_status", request_id=rid)
        if q["ready"]:
            return q["hit_chunks"]
        time.sleep(0.01)
    raise AssertionError("lookup never became ready")


@pytest.fixture
def fs_server(make_server, tmp_path):
    def make(*args, path=None, **kw):
        base = path or tmp_path / "l2"
        base.mkdir(exist_ok=True)
        s = make_server(args=["--chunk-size", str(CHUNK)] + fs_adapter(base) + list(args), **kw)
        return s, DPClient(s.zmq_port), base
    return make


def test_store_evict_lookup_from_l2_byte_identical(fs_server):
    s, c, base = fs_server()
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=0, model_name="m", **kv.layout())
        per = CHUNK // kv.tpb
        toks = prompt(1, 3)
        src = list(range(3 * per))
        kv.fill_blocks(src, "l2")
        want = kv.read_blocks(src)
        assert c.call("store", instance_id=0, token_ids=toks, block_ids=src)["stored_chunks"] == 3
        assert wait_for(lambda: l2_objects(s) == 3)
        ad = s.get("/config/adapters").json()["adapters"]
        assert ad == [{"index": 0, "type_name": "fs", "tier": "l2", "primary": True,
                       "reconfigurable": False}]
        # L1 loses everything; the lookup finds the chunks in L2 and loads them.
        assert s.post("/cache/clear").status_code == 200
        assert s.get("/status").json()["storage_manager"]["l1"]["objects"] == 0
        assert lookup_hits(c, "r1", toks) == 3
        dst = list(range(3 * per, 6 * per))
        r = c.call("retrieve", instance_id=0, request_id="r1", token_ids=toks, block_ids=dst)
        assert r["retrieved_chunks"] == 3
        assert kv.read_blocks(dst) == want
        c.call("end_session", request_id="r1")
        body = s.get("/metrics").text
        assert 'lmcache_mp_l2_load_completed_objects_chunks_total{l2_name="fs"} 3.0' in body
        assert "lmcache_mp_lookup_hit_l2_tokens_total" in body
        st = s.get("/status").json()["storage_manager"]
        assert st["is_healthy"] is True and st["adapters"][0]["is_healthy"] is True
    finally:
        c.close()
        kv.close()


def test_restart_serves_from_fs(make_server, fs_server):
    s, c, base = fs_server()
    toks = prompt(2, 2)
    chunks = [b"A" * 3000, b"B" * 4000]
    c.call("store_bytes", model_name="m", token_ids=toks, chunks=chunks)
    assert wait_for(lambda: l2_objects(s) == 2)
    c.close()
    assert s.stop() == 0
    s2, c2, _ = fs_server(path=base)
    try:
        assert l2_objects(s2) == 2
        usage = s2.get("/quota/_default").json()["current_usage_gb"]
        assert usage > 0
        assert lookup_hits(c2, "r", toks) == 2
        got = c2.call("retrieve_bytes", model_name="m", token_ids=toks, request_id="r")["chunks"]
        assert got == chunks
    finally:
        c2.close()


def test_corrupt_file_is_a_miss_never_wrong_data(fs_server):
    s, c, base = fs_server()
    toks = prompt(3, 2)
    chunks = [b"x" * 5000, b"y" * 5000]
    c.call("store_bytes", model_name="m", token_ids=toks, chunks=chunks)
    assert wait_for(lambda: l2_objects(s) == 2)
    s.post("/cache/clear")
    assert c.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"] == []  # L1 empty
    files = sorted(glob.glob(os.path.join(str(base), "**", "*"), recursive=True))
    files = [f for f in files if os.path.isfile(f)]
    assert len(files) == 2
    # A file starts with its payload: find each chunk's file and corrupt only the second one's,
    # flipping bytes in the middle of the payload.
    by_payload = {}
    for f in files:
        with open(f, "rb") as fh:
            by_payload[fh.read(1)] = f
    assert sorted(by_payload) == [b"x", b"y"]
    good, bad = by_payload[b"x"], by_payload[b"y"]
    with open(bad, "r+b") as fh:
        fh.seek(100)
        fh.write(b"\xff" * 16)
    hits = lookup_hits(c, "r", toks)
    assert hits == 1  # the good first chunk is found; the corrupt second one is a miss
    got = c.call("retrieve_bytes", model_name="m", token_ids=toks, request_id="r")["chunks"]
    assert got == [chunks[0]]  # served byte-identical, and never the corrupt bytes
    c.call("end_session", request_id="r")
    assert wait_for(lambda: l2_objects(s) == 1)  # the corrupt file was removed...
    assert os.path.exists(good) and not os.path.exists(bad)  # ...and only that one
    ad = s.get("/status").json()["storage_manager"]["adapters"][0]
    assert ad["checksum_failures"] == 1


def test_full_disk_stores_fail_cleanly_l1_keeps_serving(make_server, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        s = make_server(args=["--chunk-size", str(CHUNK)] + fs_adapter(mnt))
        c = DPClient(s.zmq_port)
        blob = b"z" * (64 << 10)
        toks = [prompt(100 + i, 1) for i in range(12)]
        for t in toks:
            r = c.call("store_bytes", model_name="m", token_ids=t, chunks=[blob])
            assert r["stored_chunks"] == 1  # the store into L1 succeeds regardless
        def failed():
            st = s.get("/status").json()["storage_manager"]["adapters"][0]
            return st["counters"]["store_keys_failed"] > 0
        assert wait_for(failed)
        # L1 still serves every chunk.
        for t in toks:
            assert c.call("retrieve_bytes", model_name="m", token_ids=t)["chunks"] == [blob]
        assert s.get("/healthcheck").status_code == 200
        c.close()
        assert s.stop() == 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_cache_objects_list_and_delete(fs_server):
    s, c, base = fs_server()
    for i in range(5):
        c.call("store_bytes", model_name="m", token_ids=prompt(10 + i, 1), chunks=[b"o" * 100])
    c.call("store_bytes", model_name="other", token_ids=prompt(99, 1), chunks=[b"p" * 100])
    assert wait_for(lambda: l2_objects(s) == 6)
    seen, token = [], None
    while True:
        params = {"model_name": "m", "page_size": 2}
        if token:
            params["page_token"] = token
        r = s.get("/cache/objects", params=params)
        assert r.status_code == 200
        page = r.json()
        assert page["adapter"] == "fs" and len(page["entries"]) <= 2
        seen += page["entries"]
        token = page["next_page_token"]
        if token is None:
            break
    assert len(seen) == 5
    assert all(e["key"]["model_name"] == "m" and e["size_bytes"] == 100 for e in seen)
    assert s.get("/cache/objects", params={"page_size": 0}).status_code == 422
    assert s.get("/cache/objects", params={"page_size": 5001}).status_code == 422
    assert s.get("/cache/objects", params={"adapter": "nope"}).status_code == 404
    assert s.get("/cache/objects", params={"page_token": "%%%garbage"}).status_code == 400

    keys = [e["key"] for e in seen[:2]]
    r = s.delete("/cache/objects", json={"keys": keys})
    assert r.status_code == 200
    j = r.json()
    assert j["requested"] == 2 and j["adapter"] == "fs" and j["ok"] is True
    assert wait_for(lambda: l2_objects(s) == 4)
    # Idempotent; shape and invariant errors.
    assert s.delete("/cache/objects", json={"keys": keys}).json()["ok"] is True
    bad = dict(keys[0], chunk_hash_hex="zz")
    assert s.delete("/cache/objects", json={"keys": [bad]}).status_code == 400
    bad = dict(keys[0], model_name="a@b")
    assert s.delete("/cache/objects", json={"keys": [bad]}).status_code == 400
    bad = dict(keys[0], cache_salt="x/y")
    assert s.delete("/cache/objects", json={"keys": [bad]}).status_code == 400
    assert s.delete("/cache/objects", json={}).status_code == 422
    assert s.delete("/cache/objects", json={"keys": [{"model_name": 3}]}).status_code == 422
    assert s.delete("/cache/objects", json={"keys": keys, "adapter": "nope"}).status_code == 404
    assert s.delete("/cache/objects", json={"keys": [keys[0]] * 10001}).status_code == 400


def test_cache_objects_without_l2_is_503(server):
    assert server.get("/cache/objects").status_code == 503
    assert server.delete("/cache/objects", json={"keys": []}).status_code == 503


def test_warm_prefetch(fs_server):
    s, c, base = fs_server()
    kv = ShmKV()
    try:
        c.call("register_kv_cache", instance_id=0, model_name="m", **kv.layout())
        toks = prompt(7, 3)
        obj = kv.kv * kv.layers * CHUNK * kv.bpt  # the registered layout's object size
        c.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"w" * obj] * 3)
        assert wait_for(lambda: l2_objects(s) == 3)
        s.post("/cache/clear")
        # Too short: nothing to submit.
        r = s.post("/cache/prefetches", json={"model_name": "m", "world_size": 1,
                                              "token_ids": toks[:10]})
        assert r.status_code == 202 and r.json() == {"chunks": 0, "status": "noop"}
        # Unknown layout.
        r = s.post("/cache/prefetches", json={"model_name": "m", "world_size": 2,
                                              "token_ids": toks})
        assert r.status_code == 409
        assert s.post("/cache/prefetches", json={"model_name": "m", "world_size": 1,
                                                 "token_ids": toks, "cache_salt": "a@b"}
                      ).status_code == 400
        assert s.post("/cache/prefetches", json={"model_name": "m"}).status_code == 422
        r = s.post("/cache/prefetches", json={"model_name": "m", "world_size": 1,
                                              "token_ids": toks})
        assert r.status_code == 202
        j = r.json()
        assert j["status"] == "submitted" and j["chunks"] == 3
        rid = j["request_id"]
        done = None
        for _ in range(400):
            p = s.get("/cache/prefetches/" + rid)
            assert p.status_code == 200
            if p.json()["status"] == "completed":
                done = p.json()
                break
            assert p.json() == {"status": "pending"}
            time.sleep(0.01)
        assert done == {"status": "completed", "found_keys": 3, "total_keys": 3}
        assert s.get("/cache/prefetches/" + rid).status_code == 404  # reported exactly once
        assert s.get("/cache/prefetches/nope").status_code == 404
        # The warm data is retained in L1: a lookup hits without L2.
        assert s.get("/status").json()["storage_manager"]["l1"]["objects"] == 3
        assert c.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"] == [b"w" * obj] * 3
    finally:
        c.close()
        kv.close()
