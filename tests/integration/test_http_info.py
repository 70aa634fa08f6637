"""Liveness, health, status, configuration and version routes, as the HTTP API document says."""
import json
import subprocess

import requests

from conftest import ROOT


def test_root_is_static_liveness(server):
    r = server.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"status": "ok", "service": "LMCache HTTP API"}


def test_healthcheck_ready(server):
    r = server.get("/healthcheck")
    assert r.status_code == 200
    assert r.json() == {"status": "healthy"}


def test_503_before_engine_ready(make_server):
    s = make_server(env={"LMCACHE_TEST_INIT_DELAY_MS": "4000"}, wait_ready=False)
    r = s.get("/healthcheck")
    assert r.status_code == 503
    assert r.json() == {"status": "unhealthy", "reason": "engine not initialized"}
    r = s.get("/status")
    assert r.status_code == 503
    assert r.json() == {"error": "engine not initialized"}
    assert s.get("/config/adapters").status_code == 503
    # Routes that do not touch the engine answer at once.
    assert s.get("/").status_code == 200
    assert s.get("/version").status_code == 200
    assert s.get("/config").status_code == 200
    s.wait_ready()
    assert s.get("/status").status_code == 200


def test_status_fields(make_server):
    s = make_server(args=["--chunk-size", "128", "--instance-id", "node-a"])
    st = s.get("/status").json()
    for k in ("is_healthy", "engine_type", "chunk_size", "hash_algorithm", "active_sessions",
              "registered_gpu_ids", "cache_context_meta", "active_prefetch_jobs",
              "storage_manager"):
        assert k in st, k
    assert st["is_healthy"] is True
    assert st["chunk_size"] == 128
    assert st["hash_algorithm"] == "sha256"
    assert st["instance_id"] == "node-a"
    assert st["registered_gpu_ids"] == []
    assert st["storage_manager"]["is_healthy"] is True


def test_config_reflects_parsed_options(make_server):
    s = make_server(args=["--chunk-size", "64", "--eviction-trigger-watermark", "0.7",
                          "--script-allowed-imports", "math", "json",
                          "--l2-adapter", '{"type": "fs", "base_path": "/tmp/x"}'],
                    policy="IsolatedLRU")
    r = s.get("/config")
    assert r.status_code == 200
    assert "\n  " in r.text  # indented document
    c = r.json()
    assert set(c) == {"mp", "storage_manager", "observability"}
    assert c["mp"]["http_host"] == "127.0.0.1"
    assert c["mp"]["http_port"] == s.http_port
    assert c["mp"]["port"] == s.zmq_port
    assert c["mp"]["chunk_size"] == 64
    assert c["mp"]["script_allowed_imports"] == ["math", "json"]
    assert c["storage_manager"]["eviction_policy"] == "IsolatedLRU"
    assert c["storage_manager"]["eviction_trigger_watermark"] == 0.7
    assert c["storage_manager"]["l1_size_gb"] == 0.25
    assert c["storage_manager"]["l2_adapters"] == [{"type": "fs", "base_path": "/tmp/x"}]


def test_config_adapters_empty_without_l2(server):
    r = server.get("/config/adapters")
    assert r.status_code == 200
    assert r.json() == {"adapters": []}


def test_version_routes_are_bare_strings(server):
    lmc = server.get("/lmc_version").json()
    commit = server.get("/commit_id").json()
    ver = server.get("/version").json()
    assert isinstance(lmc, str) and lmc
    assert isinstance(commit, str)
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0 and commit:
        assert len(commit) == 40
    assert ver == "%s-%s" % (lmc or "NA", commit[:8] if commit else "NA")
    out = subprocess.run([server.argv[0], "version"], capture_output=True, text=True)
    assert out.returncode == 0 and lmc in out.stdout


def test_unknown_path_404_and_wrong_method_405(server):
    r = server.get("/no/such/route")
    assert r.status_code == 404
    assert r.json() == {"detail": "Not Found"}
    r = server.post("/status")
    assert r.status_code == 405
    assert r.json() == {"detail": "Method Not Allowed"}
    assert "GET" in r.headers["allow"]
    r = server.delete("/healthcheck")
    assert r.status_code == 405


def test_oversized_body_is_rejected_not_crashing(server):
    r = server.post("/metrics/reset", data=b"x" * (17 << 20))
    assert r.status_code == 413
    assert server.get("/healthcheck").status_code == 200


def test_keepalive_connection_reuse(server):
    with requests.Session() as sess:
        for _ in range(20):
            assert sess.get(server.url + "/").status_code == 200
