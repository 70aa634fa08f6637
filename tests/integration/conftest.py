"""Fixtures that start the real `lmcache server` binary on free loopback ports."""
import os
import signal
import subprocess
import time

import pytest
import requests

from netutil import free_port  # noqa: F401  (tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("LMCACHE_BIN", os.path.join(ROOT, "build", "lmcache"))


class Server:
    """One running daemon; `url` is its admin API base URL."""

    def __init__(self, args=(), env=None, wait_ready=True, l1_size_gb="0.25", policy="LRU"):
        # A port taken by another process between free_port() and the daemon's bind makes it
        # exit at start; it is started again on other ports (the test never talks to a stranger
        # that happened to listen there).
        for attempt in range(3):
            try:
                self._start(args, env, wait_ready, l1_size_gb, policy)
                return
            except RuntimeError as e:
                if attempt == 2 or "already in use" not in str(e).lower():
                    raise

    def _start(self, args, env, wait_ready, l1_size_gb, policy):
        self.http_port = free_port()
        self.zmq_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.argv = [BIN, "server", "--host", "127.0.0.1", "--port", str(self.zmq_port),
                     "--http-host", "127.0.0.1", "--http-port", str(self.http_port)]
        if l1_size_gb is not None:
            self.argv += ["--l1-size-gb", str(l1_size_gb)]
        if policy is not None:
            self.argv += ["--eviction-policy", policy]
        self.argv += list(args)
        e = dict(os.environ)
        e.update(env or {})
        self.log_path = f"/tmp/lmcache-test-{self.http_port}.log"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=e, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_listening()
        if wait_ready:
            self.wait_ready()
        if self.proc.poll() is not None:  # what answered was another process on that port
            raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")

    def wait_listening(self, timeout=20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                requests.get(self.url + "/", timeout=1)
                return
            except (requests.ConnectionError, requests.Timeout):  # a loaded machine is slow
                time.sleep(0.05)
        raise RuntimeError("server did not start listening: " + self.output())

    def wait_ready(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                if requests.get(self.url + "/healthcheck", timeout=5).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):  # exited: reported above
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become ready: " + self.output())

    def get(self, path, **kw):
        return requests.get(self.url + path, timeout=30, **kw)

    def post(self, path, **kw):
        return requests.post(self.url + path, timeout=30, **kw)

    def put(self, path, **kw):
        return requests.put(self.url + path, timeout=30, **kw)

    def delete(self, path, **kw):
        return requests.delete(self.url + path, timeout=30, **kw)

    def output(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout=20):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("server did not exit within %ss of %s" % (timeout, sig))
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def make_server():
    servers = []

    def make(*args, **kw):
        s = Server(*args, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        rc = s.stop()
        assert rc == 0, f"server exited with {rc}:\n{s.output()}"


@pytest.fixture
def server(make_server):
    return make_server()
