"""L1 under hostile or careless clients, over the real daemon: forced clears racing with reads
never hand out another object's bytes, a tenant without quota cannot pin L1 with read locks
under IsolatedLRU, and read-only requests with ever new cache_salts never fill the name table."""
import os
import random
import threading

from dp_util import DPClient, random_prompt

CHUNK = 64  # tokens per chunk (--chunk-size)
NAMES = 4096  # distinct cache_salts L1 keeps (the default)
ROUNDS = int(os.environ.get("LMCACHE_CLEAR_ROUNDS", "600"))


def prompt(seed, chunks=1):
    return random_prompt(seed, chunks, CHUNK)


def blob(i, size):
    return bytes([(i * 37 + 11) & 0xff]) * size


def test_forced_clear_loop_never_returns_another_keys_bytes(make_server):
    # Prompts of 4 chunks of 1 MiB: a reply copies 4 MiB out of L1, long enough for clears and
    # stores of other prompts to land in the middle of many copies.
    # Several data-plane workers, so stores run while a reply is being copied.
    s = make_server(args=["--chunk-size", str(CHUNK), "--max-workers", "4"],
                    l1_size_gb=24 / 1024)
    nkeys, nch, size = 12, 4, 1 << 20
    prompts = [prompt(i, nch) for i in range(nkeys)]
    blobs = [[blob(i * nch + j, size) for j in range(nch)] for i in range(nkeys)]
    stop = threading.Event()
    errors = []

    def clearer():
        c = DPClient(s.zmq_port)
        try:
            n = 0
            while not stop.is_set():
                if n % 2:
                    c.call("clear")
                else:
                    assert s.post("/cache/clear").status_code == 200
                n += 1
        except Exception as e:  # noqa: BLE001 - reported on the main thread
            errors.append(e)
        finally:
            c.close()

    def storer(seed):
        c = DPClient(s.zmq_port)
        rnd = random.Random(seed)
        try:
            while not stop.is_set():
                i = rnd.randrange(nkeys)
                c.call("store_bytes", model_name="m", token_ids=prompts[i], chunks=blobs[i])
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            c.close()

    threads = [threading.Thread(target=clearer)] + \
        [threading.Thread(target=storer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    reader = DPClient(s.zmq_port)
    rnd = random.Random(99)
    wrong = hits = 0
    try:
        for n in range(ROUNDS):
            i = rnd.randrange(nkeys)
            if n % 2:
                got = reader.call("retrieve_bytes", model_name="m", token_ids=prompts[i])["chunks"]
            else:  # through a lookup session's locks
                rid = f"r{n}"
                reader.call("lookup", request_id=rid, model_name="m", token_ids=prompts[i])
                got = reader.call("retrieve_bytes", model_name="m", token_ids=prompts[i],
                                  request_id=rid)["chunks"]
                reader.call("end_session", request_id=rid)
            for j, chunk in enumerate(got):
                hits += 1
                wrong += chunk != blobs[i][j]
    finally:
        stop.set()
        for t in threads:
            t.join()
        reader.close()
    print(f"{hits} chunks read, {wrong} wrong")
    assert not errors, errors
    assert hits > 0
    assert wrong == 0, f"{wrong} of {hits} chunks carried another object's bytes"


def test_forced_clear_keeps_locked_objects_until_released(make_server):
    s = make_server(args=["--chunk-size", str(CHUNK)])
    c = DPClient(s.zmq_port)
    toks = prompt(7, 2)
    chunks = [b"a" * 5000, b"b" * 5000]
    try:
        c.call("store_bytes", model_name="m", token_ids=toks, chunks=chunks)
        c.call("lookup", request_id="held", model_name="m", token_ids=toks, num_kv_readers=2)
        assert c.call("clear")["cleared"] == 2
        l1 = s.get("/status").json()["storage_manager"]["l1"]
        assert l1["objects"] == 0 and l1["doomed_objects"] == 2 and l1["bytes_used"] > 0
        # Gone for everyone else; a store of the same chunks cannot take the key while the
        # holder reads: it waits (bounded) and says the chunks are not stored.
        assert c.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"] == []
        r = c.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"x" * 5000] * 2)
        assert (r["stored_chunks"], r["skipped_chunks"], r["pending_chunks"]) == (0, 0, 2), r
        # The session still reads its own objects, then its release frees them.
        got = c.call("retrieve_bytes", model_name="m", token_ids=toks, request_id="held")
        assert got["chunks"] == chunks
        c.call("end_session", request_id="held")
        l1 = s.get("/status").json()["storage_manager"]["l1"]
        assert l1["doomed_objects"] == 0 and l1["bytes_used"] == 0
        assert c.call("store_bytes", model_name="m", token_ids=toks,
                      chunks=chunks)["stored_chunks"] == 2
    finally:
        c.close()


def test_isolated_lru_tenant_without_quota_cannot_pin_l1(make_server):
    # 16 MiB of L1; mallory (no quota) stores 24 MiB and read-locks every object with a lookup
    # it never retrieves; bob (1 GiB quota) must still be able to store.
    s = make_server(args=["--chunk-size", str(CHUNK)], l1_size_gb=16 / 1024, policy="IsolatedLRU")
    assert s.put("/quota/bob", json={"limit_gb": 1}).status_code == 200
    c = DPClient(s.zmq_port)
    data = b"m" * (256 << 10)
    try:
        for i in range(96):
            c.raw("store_bytes", dict(model_name="m", cache_salt="mallory",
                                      token_ids=prompt(i), chunks=[data]))
            c.call("lookup", request_id=f"pin{i}", model_name="m", cache_salt="mallory",
                   token_ids=prompt(i))
        for i in range(32):
            r = c.raw("store_bytes", dict(model_name="m", cache_salt="bob",
                                          token_ids=prompt(1000 + i), chunks=[data]))
            assert r["ok"], r
            assert r["stored_chunks"] == 1
        got = c.call("retrieve_bytes", model_name="m", cache_salt="bob",
                     token_ids=prompt(1031))["chunks"]
        assert got == [data]
    finally:
        c.close()


def test_lookups_with_fresh_salts_do_not_lock_out_new_tenants(make_server):
    s = make_server(args=["--chunk-size", str(CHUNK)])
    c = DPClient(s.zmq_port)
    toks = prompt(1)
    try:
        for i in range(NAMES + 904):
            salt = f"fresh-{i}"
            if i % 3 == 0:
                c.call("lookup", request_id="x", model_name=f"model-{i}", cache_salt=salt,
                       token_ids=toks)
            elif i % 3 == 1:
                assert c.call("retrieve_bytes", model_name="m", cache_salt=salt,
                              token_ids=toks)["chunks"] == []
            else:
                r = c.raw("retrieve", dict(instance_id=1, model_name="m", cache_salt=salt,
                                           token_ids=toks, block_ids=[0]))
                assert not r["ok"] and r["code"] in ("not_registered", "not_found")
        c.call("end_session", request_id="x")
        assert s.get(f"/quota/fresh-{NAMES}").json()["exists"] is False
        r = c.call("store_bytes", model_name="m", cache_salt="new-tenant", token_ids=toks,
                   chunks=[b"v" * 4096])
        assert r["stored_chunks"] == 1
        assert c.call("retrieve_bytes", model_name="m", cache_salt="new-tenant",
                      token_ids=toks)["chunks"] == [b"v" * 4096]
    finally:
        c.close()


def test_name_table_full_is_a_client_error_and_clear_frees_it(make_server):
    s = make_server(args=["--chunk-size", str(CHUNK)])
    c = DPClient(s.zmq_port)
    toks = prompt(2)
    try:
        for i in range(NAMES):
            r = c.call("store_bytes", model_name="m", cache_salt=f"t{i}", token_ids=toks,
                       chunks=[b"s"])
            assert r["stored_chunks"] == 1
        # Every salt still has an object: a new one is refused with a documented code.
        r = c.raw("store_bytes", dict(model_name="m", cache_salt="late", token_ids=toks,
                                      chunks=[b"s"]))
        assert not r["ok"]
        assert r["code"] == "too_many_names"
        # Known salts keep working, reads of unknown ones are plain misses.
        assert c.call("store_bytes", model_name="m", cache_salt="t7", token_ids=prompt(3),
                      chunks=[b"s"])["stored_chunks"] == 1
        assert c.call("retrieve_bytes", model_name="m", cache_salt="late",
                      token_ids=toks)["chunks"] == []
        # A clear leaves no object of any salt: the names are free for new tenants.
        assert c.call("clear")["cleared"] == NAMES + 1
        for i in range(8):
            r = c.call("store_bytes", model_name="m", cache_salt=f"late{i}", token_ids=toks,
                       chunks=[b"s"])
            assert r["stored_chunks"] == 1
        assert c.call("retrieve_bytes", model_name="m", cache_salt="t7",
                      token_ids=toks)["chunks"] == []
    finally:
        c.close()
