"""Option validation, signals, and readiness reported to systemd."""
import os
import signal
import socket
import subprocess
import tempfile
import time

import pytest
import requests

from conftest import BIN, Server, free_port

BAD = [
    (["--eviction-policy", "LRU"], "--l1-size-gb"),
    (["--l1-size-gb", "1"], "--eviction-policy"),
    (["--l1-size-gb", "1", "--eviction-policy", "FIFO"], "--eviction-policy"),
    (["--l1-size-gb", "abc", "--eviction-policy", "LRU"], "--l1-size-gb"),
    (["--l1-size-gb", "-1", "--eviction-policy", "LRU"], "--l1-size-gb"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--chunk-size", "0"], "--chunk-size"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--http-port", "70000"], "--http-port"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--eviction-trigger-watermark", "1.5"],
     "--eviction-trigger-watermark"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--l2-adapter", "{not json"],
     "--l2-adapter"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--l2-adapter", '{"type":"ftp"}'],
     "--l2-adapter"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--no-such-flag"], "--no-such-flag"),
    (["--l1-size-gb", "1", "--eviction-policy", "LRU", "--port"], "--port"),
]


@pytest.mark.parametrize("args,named", BAD)
def test_bad_option_exits_2_with_one_line(args, named):
    port = free_port()
    p = subprocess.run([BIN, "server", "--http-port", str(port)] + args, capture_output=True,
                       text=True, timeout=20)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert named in lines[0]
    # Nothing was bound: the port is still free.
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_bad_log_level_env_exits_2():
    p = subprocess.run([BIN, "server", "--l1-size-gb", "1", "--eviction-policy", "LRU"],
                       capture_output=True, text=True, env=dict(os.environ, LMCACHE_LOG_LEVEL="LOUD"),
                       timeout=20)
    assert p.returncode == 2 and "LMCACHE_LOG_LEVEL" in p.stderr


def test_help_lists_every_option():
    p = subprocess.run([BIN, "server", "--help"], capture_output=True, text=True, timeout=20)
    assert p.returncode == 0
    for flag in ("--host", "--port", "--http-host", "--http-port", "--chunk-size",
                 "--l1-size-gb", "--eviction-policy", "--eviction-trigger-watermark",
                 "--l1-read-ttl-seconds", "--l1-write-ttl-seconds", "--max-workers",
                 "--hash-algorithm", "--instance-id", "--l2-adapter", "--run-script-api-enabled",
                 "--script-allowed-imports", "--env-api-unredacted", "--log-level"):
        assert flag in p.stdout, flag


def test_port_in_use_fails_cleanly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([BIN, "server", "--l1-size-gb", "0.1", "--eviction-policy", "LRU",
                            "--http-host", "127.0.0.1", "--http-port", str(port)],
                           capture_output=True, text=True, timeout=20)
        assert p.returncode == 1
        assert str(port) in p.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_zero_quickly(sig):
    s = Server()
    with requests.Session() as sess:  # an idle keep-alive connection must not hold shutdown
        assert sess.get(s.url + "/").status_code == 200
        t0 = time.time()
        assert s.stop(sig=sig, timeout=10) == 0
        assert time.time() - t0 < 5


def test_sd_notify_ready(tmp_path):
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(20)
        s = Server(env={"NOTIFY_SOCKET": path})
        try:
            msg = sock.recv(4096).decode()
            assert "READY=1" in msg
            assert s.get("/healthcheck").status_code == 200
        finally:
            assert s.stop() == 0
        assert "STOPPING=1" in sock.recv(4096).decode()


def test_configuration_doc_matches_option_table():
    from conftest import ROOT
    gen = subprocess.run([BIN, "server", "--help-markdown"], capture_output=True, text=True,
                         timeout=20).stdout
    doc = open(os.path.join(ROOT, "docs", "configuration.md")).read()
    start = doc.index("\n", doc.index("<!-- BEGIN OPTIONS")) + 1
    end = doc.index("<!-- END OPTIONS")
    assert doc[start:end] == gen, "regenerate the table with lmcache server --help-markdown"


@pytest.mark.parametrize("adapter,named", [
    ('{"type": "fs"}', "base_path"),
    ('{"type": "fs", "base_path": "/tmp/x", "eviction": {"eviction_policy": "FIFO"}}',
     "eviction"),
])
def test_bad_l2_adapter_config_exits_2_before_binding(adapter, named):
    port, zport = free_port(), free_port()
    p = subprocess.run([BIN, "server", "--l1-size-gb", "0.1", "--eviction-policy", "LRU",
                        "--http-port", str(port), "--port", str(zport), "--l2-adapter", adapter],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2, p.stderr
    err = [l for l in p.stderr.splitlines() if l.startswith("lmcache server: error:")]
    assert len(err) == 1 and "--l2-adapter" in err[0] and named in err[0], p.stderr
    for prt in (port, zport):
        with socket.socket() as s:
            s.bind(("127.0.0.1", prt))
