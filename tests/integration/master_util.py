"""Starting and stopping `lmcache master` for the master's integration tests."""

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build_dir():
    return os.environ.get("LMCACHE_BUILD_DIR", os.path.join(ROOT, "build"))


def lmcache_bin():
    return os.environ.get("LMCACHE_BIN", os.path.join(build_dir(), "lmcache"))


def use_python_package():
    """Makes `import umbp` find the build tree's copy (with generated stubs)."""
    p = os.path.join(build_dir(), "python")
    if p not in sys.path:
        sys.path.insert(0, p)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("master exited early with %s" % proc.returncode)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("master did not listen on %d" % port)


class Master:
    """A running master on free loopback ports. env adds to the environment."""

    def __init__(self, env=None, metrics=True, argv0=None, extra_args=()):
        self.port = free_port()
        self.metrics_port = free_port() if metrics else 0
        self.addr = "127.0.0.1:%d" % self.port
        e = dict(os.environ)
        e["LMCACHE_MASTER_METRICS_HOST"] = "127.0.0.1"
        e.update(env or {})
        if argv0:
            cmd = [argv0, self.addr, str(self.metrics_port)]
        else:
            cmd = [lmcache_bin(), "master", self.addr, str(self.metrics_port)]
        cmd += list(extra_args)
        self.proc = subprocess.Popen(
            cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        wait_port(self.port, self.proc)
        if self.metrics_port:
            wait_port(self.metrics_port, self.proc)
        self.stdout = ""
        self.stderr = ""

    def metrics(self):
        import urllib.request

        with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % self.metrics_port) as r:
            return r.read().decode()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.stdout, self.stderr = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.stdout, self.stderr = self.proc.communicate()
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
