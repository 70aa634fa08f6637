"""Secrets in the configuration never leave the daemon: an S3 adapter configured with a known
secret key and session token shows them in no admin response, in no log line, and a rejected
--l2-adapter JSON is not echoed into the error message."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from conftest import BIN, free_port  # noqa: E402

SECRET = "SEKRETvalue-9f3c2a7d41"
TOKEN = "SESSIONtoken-5b8e0c6d92"


def s3_arg(**extra):
    # Nothing listens on the endpoint: the adapter starts without contacting S3, and its store
    # attempts fail, which exercises the error paths and their messages too.
    cfg = {"type": "s3", "endpoint": "http://127.0.0.1:%d" % free_port(), "bucket": "b",
           "region": "us-east-1", "access_key_id": "AKIDEXAMPLE", "secret_access_key": SECRET,
           "session_token": TOKEN, "prefix": "p/", "request_timeout_ms": 500,
           "connect_timeout_ms": 200, "breaker_threshold": 1}
    cfg.update(extra)
    return ["--l2-adapter", json.dumps(cfg)]


def assert_clean(text, where):
    for s in (SECRET, TOKEN, SECRET[:12], TOKEN[:12]):
        assert s not in text, (where, s)


def test_no_admin_route_or_log_line_shows_an_s3_secret(make_server):
    from dp_util import DPClient
    srv = make_server(["--chunk-size", "16", "--log-level", "DEBUG"] + s3_arg(),
                      env={"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN})
    cfg = srv.get("/config")
    assert cfg.status_code == 200
    ad = cfg.json()["storage_manager"]["l2_adapters"][0]
    assert ad["secret_access_key"] == "<redacted>" and ad["session_token"] == "<redacted>"
    assert ad["bucket"] == "b" and ad["access_key_id"] == "AKIDEXAMPLE"
    # Some traffic so that the adapter fails, logs and records errors.
    c = DPClient(srv.zmq_port)
    try:
        c.call("store_bytes", model_name="m", token_ids=list(range(32)), chunks=[b"x" * 64] * 2)
    finally:
        c.close()
    paths = ["/", "/healthcheck", "/status", "/config", "/config/adapters", "/version",
             "/metrics", "/loglevel", "/quota", "/env", "/threads", "/periodic-threads",
             "/periodic-threads-health", "/cache/objects", "/reconfigure/s3/status"]
    for p in paths:
        r = srv.get(p)
        assert_clean(r.text, p)
    st = srv.get("/status").json()["storage_manager"]
    assert st["adapters"], st
    srv.stop()
    out = srv.output()
    assert "S3 adapter" in out  # the log is really there
    assert_clean(out, "server log")


def test_rejected_l2_adapter_json_is_not_echoed():
    # jansson quotes up to 20 characters of the offending token: short secrets are the risk.
    SECRET = "SHORTsekret42"  # noqa: N806
    TOKEN = "SHORTtoken17"  # noqa: N806
    bad = ['{"type": "s3", "secret_access_key": "%s' % SECRET,        # unterminated string
           '{"type": "s3", "secret_access_key": %s}' % SECRET,        # bare token
           '{"type": "s3", "session_token": "%s", "session_token": "x"}' % TOKEN,
           '["%s"]' % SECRET,
           '{"type": "nope", "secret_access_key": "%s"}' % SECRET,
           '{"type": "s3", "bucket": "b", "secret_access_key": "%s"}' % SECRET,
           '{"type": "s3", "bucket": "B!", "access_key_id": "a", "secret_access_key": "%s"}'
           % SECRET]
    for j in bad:
        p = subprocess.run([BIN, "server", "--host", "127.0.0.1", "--port", str(free_port()),
                            "--http-port", str(free_port()), "--l1-size-gb", "0.01",
                            "--eviction-policy", "LRU", "--l2-adapter", j],
                           capture_output=True, timeout=60)
        assert p.returncode != 0, j
        text = (p.stdout + p.stderr).decode(errors="replace")
        assert "l2-adapter" in text.lower() or "adapter" in text, text
        for s in (SECRET, TOKEN, SECRET[:8], TOKEN[:8]):
            assert s not in text, (j, text)
