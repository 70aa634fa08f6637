"""The daemon with an S3 L2 adapter (s3rver behind the SigV4-verifying proxy, s3_harness.py):
the adapter shows in /config/adapters and /status, and a bad S3 configuration stops start-up."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import s3_harness  # noqa: E402
from conftest import BIN, Server, free_port  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    env = s3_harness.S3Env()
    try:
        env.start()
    except RuntimeError as e:
        if str(e).startswith("skip:"):
            pytest.skip(str(e))
        raise
    yield env
    env.stop()


def adapter_arg(s3, **extra):
    cfg = {"type": "s3", "endpoint": s3.endpoint, "bucket": s3.bucket, "region": "us-east-1",
           "access_key_id": s3_harness.AKID, "secret_access_key": s3_harness.SECRET,
           "prefix": "daemon/"}
    cfg.update(extra)
    return ["--l2-adapter", json.dumps(cfg)]


def test_server_with_s3_adapter(s3):
    srv = Server(adapter_arg(s3))
    try:
        r = srv.get("/config/adapters")
        assert r.status_code == 200
        assert "S3L2Adapter" in r.text
        st = srv.get("/status")
        assert st.status_code == 200
        assert "S3L2Adapter" in st.text
        assert '"is_healthy"' in st.text
    finally:
        srv.stop()


def test_server_refuses_s3_without_bucket(s3):
    cfg = {"type": "s3", "endpoint": s3.endpoint, "access_key_id": "a", "secret_access_key": "b"}
    p = subprocess.run([BIN, "server", "--host", "127.0.0.1", "--port", str(free_port()),
                        "--http-port", str(free_port()),
                        "--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(cfg)],
                       capture_output=True, timeout=60)
    assert p.returncode != 0
    assert b"bucket" in p.stdout + p.stderr
