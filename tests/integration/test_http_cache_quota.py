"""POST /cache/clear and the /quota endpoints, with every example of the HTTP API document."""
import time


def test_cache_clear_default_and_explicit(server):
    r = server.post("/cache/clear")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "cleared": {"tier": "l1"}}
    r = server.post("/cache/clear", json={"tier": "l1", "force": False})
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "cleared": {"tier": "l1"}}
    r = server.post("/cache/clear", data="", headers={"Content-Type": "application/json"})
    assert r.status_code == 200


def test_cache_clear_bad_input(server):
    r = server.post("/cache/clear", json={"tier": "l2"})
    assert r.status_code == 400
    assert "reason" in r.json() and "l2" in r.json()["reason"]
    assert server.post("/cache/clear", json={"tier": 3}).status_code == 400
    assert server.post("/cache/clear", data="{not json").status_code == 400
    assert server.post("/cache/clear", data="[1]").status_code == 400
    assert server.get("/healthcheck").status_code == 200


def test_cache_clear_503_before_ready(make_server):
    s = make_server(env={"LMCACHE_TEST_INIT_DELAY_MS": "3000"}, wait_ready=False)
    r = s.post("/cache/clear")
    assert r.status_code == 503
    assert r.json() == {"detail": "server not initialized"}
    assert s.get("/quota").status_code == 503
    s.wait_ready()


def test_quota_document_examples(make_server):
    s = make_server(policy="IsolatedLRU")
    assert s.get("/quota").json() == {"users": {}}

    r = s.put("/quota/alice", json={"limit_gb": 10.0})
    assert r.status_code == 200
    assert r.json() == {"cache_salt": "alice", "limit_gb": 10.0, "status": "ok"}
    r = s.put("/quota/bob", json={"limit_gb": 4.0})
    assert r.status_code == 200

    r = s.get("/quota/alice")
    assert r.status_code == 200
    assert r.json() == {"cache_salt": "alice", "limit_gb": 10.0, "current_usage_gb": 0.0,
                        "exists": True}

    users = s.get("/quota").json()["users"]
    assert users == {"alice": {"limit_gb": 10.0, "current_usage_gb": 0.0},
                     "bob": {"limit_gb": 4.0, "current_usage_gb": 0.0}}

    r = s.delete("/quota/alice")
    assert r.status_code == 200
    assert r.json() == {"cache_salt": "alice", "status": "removed"}
    r = s.delete("/quota/alice")
    assert r.status_code == 200
    assert r.json() == {"cache_salt": "alice", "status": "not_found"}

    # Unknown salt: never 404, exists false, limit 0.
    r = s.get("/quota/carol")
    assert r.status_code == 200
    assert r.json() == {"cache_salt": "carol", "limit_gb": 0.0, "current_usage_gb": 0.0,
                        "exists": False}


def test_quota_default_sentinel(server):
    r = server.put("/quota/_default", json={"limit_gb": 2})
    assert r.status_code == 200
    assert r.json()["cache_salt"] == "_default"
    assert server.get("/quota/_default").json()["exists"] is True
    assert "_default" in server.get("/quota").json()["users"]
    assert server.delete("/quota/_default").json()["status"] == "removed"


def test_quota_zero_is_valid_and_update_replaces(server):
    assert server.put("/quota/z", json={"limit_gb": 0}).status_code == 200
    assert server.get("/quota/z").json()["limit_gb"] == 0.0
    assert server.put("/quota/z", json={"limit_gb": 0.5}).status_code == 200
    assert server.get("/quota/z").json()["limit_gb"] == 0.5


def test_quota_bad_bodies_are_400(server):
    bad = ['{bad json', '{}', '{"limit_gb": "ten"}', '{"limit_gb": null}', '{"limit_gb": -1}',
           '{"limit_gb": NaN}', '{"limit_gb": Infinity}', '{"limit_gb": 1e400}',
           '{"limit_gb": true}', '[]', '']
    for body in bad:
        r = server.put("/quota/alice", data=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, body
        assert "detail" in r.json()
    assert server.get("/quota/alice").json()["exists"] is False
    # A salt that breaks the ObjectKey invariants.
    r = server.put("/quota/a@b", json={"limit_gb": 1})
    assert r.status_code == 400
    r = server.put("/quota/" + "x" * 200, json={"limit_gb": 1})
    assert r.status_code == 400


def test_quota_visible_in_l1_status(server):
    st = server.get("/status").json()["storage_manager"]["l1"]
    for k in ("objects", "bytes_used", "bytes_total", "locked_objects", "staging_objects",
              "usage_ratio"):
        assert k in st
    assert st["bytes_total"] == int(0.25 * (1 << 30))
    assert st["objects"] == 0 and st["usage_ratio"] == 0.0


def test_l1_evictor_is_a_healthy_periodic_thread(server):
    deadline = time.monotonic() + 10
    while True:
        t = server.get("/periodic-threads/l1-evictor")
        assert t.status_code == 200
        if t.json()["total_runs"] >= 2:
            break
        assert time.monotonic() < deadline, "l1-evictor ran %d times in 10 s" % t.json()["total_runs"]
        time.sleep(0.1)
    t = t.json()
    assert t["total_runs"] >= 2
    assert t["level"] == "high" and t["is_running"] and t["is_active"]
    assert "evicted_objects" in t["last_summary"]
    assert server.get("/periodic-threads-health").json()["healthy"] is True
    body = server.get("/metrics").text
    for name in ("lmcache_mp_l1_memory_usage_bytes", "lmcache_mp_l1_usage_ratio",
                 "lmcache_mp_l1_eviction_loop_ticks_total",
                 'lmcache_mp_l1_allocation_failure_total{during="l1_store"}'):
        assert name in body, name


def test_quota_salt_not_utf8_or_with_nul_is_400_and_not_stored(server):
    # %FF used to be stored and then fail to render (500); %00 used to cut the salt at the NUL.
    for seg in ("zz%FFzz", "a%00b", "%00", "a%01b", "tab%09", "del%7F", "%C0%80", "%ED%A0%80",
                "a%40b"):
        for method in ("put", "get", "delete"):
            kw = {"json": {"limit_gb": 1}} if method == "put" else {}
            r = getattr(server, method)("/quota/" + seg, **kw)
            assert r.status_code == 400, (method, seg, r.text)
            assert "cache_salt" in r.json()["detail"]
    assert server.get("/quota").json() == {"users": {}}
    assert server.get("/quota/a").json()["exists"] is False
    # Printable UTF-8 stays accepted and is echoed back decoded.
    r = server.put("/quota/caf%C3%A9", json={"limit_gb": 1})
    assert r.status_code == 200 and r.json()["cache_salt"] == "caf\u00e9"
    assert list(server.get("/quota").json()["users"]) == ["caf\u00e9"]


def test_checksums_errors_use_the_error_field(server):
    cases = [({"block_ids": [], "chunk_size": 2}, 400),
             ({"block_ids": [1], "chunk_size": 0}, 400),
             ({"block_ids": [1]}, 400),
             ({"chunk_size": 1}, 400),
             ({"block_ids": "x", "chunk_size": 1}, 422),
             ({"block_ids": [1], "chunk_size": 1, "instance_id": 7}, 404)]
    for body, code in cases:
        r = server.post("/cache/checksums", json=body)
        assert r.status_code == code, body
        assert set(r.json()) == {"error"}, (body, r.text)
    for raw in ("{bad", "[1]", ""):
        r = server.post("/cache/checksums", data=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == 422 and set(r.json()) == {"error"}, raw


def test_prefetch_unknown_layout_is_409_even_when_short(server):
    # No engine registered this (model_name, world_size): the 409 must not hide behind a
    # "noop" for a sequence shorter than one chunk.
    for toks in ([], [1, 2, 3]):
        r = server.post("/cache/prefetches", json={"model_name": "no/such-model", "world_size": 1,
                                                    "token_ids": toks})
        assert r.status_code == 409, r.text
        assert "no/such-model" in r.json()["detail"]
