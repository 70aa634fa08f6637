"""Starting and stopping `lmcache master` for the master's integration tests."""

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from netutil import free_port, wait_port  # noqa: F401  (tests import them from here)

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


class RedisServer:
    """Debian's redis-server on a free loopback port, with its own temp dir."""

    def __init__(self, port=None, extra=(), password=None):
        self.port = port or free_port()
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="lmc-redis-")
        self.extra = list(extra)
        self.proc = None
        self.start()

    @property
    def uri(self):
        return "tcp://127.0.0.1:%d" % self.port

    def start(self):
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
               "--dir", self.dir, "--save", "", "--appendonly", "no",
               "--protected-mode", "no"] + self.extra
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.cli("PING") == "PONG":
                return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start on %d" % self.port)

    def cli(self, *args):
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        r = subprocess.run(["redis-cli", "-p", str(self.port)] + auth + [str(a) for a in args],
                           capture_output=True, text=True)
        return r.stdout.strip()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


_redis = [None]
_redis2 = [None]
_ns = itertools.count()
BACKEND = ["inmemory"]


def shared_redis():
    """One redis-server for the whole test run (each master gets its own namespace)."""
    if _redis[0] is None:
        _redis[0] = RedisServer()
        atexit.register(_redis[0].close)
    return _redis[0]


def shared_redis_pair():
    """Two redis-servers for multi mode (the first is shared_redis())."""
    if _redis2[0] is None:
        _redis2[0] = RedisServer()
        atexit.register(_redis2[0].close)
    return shared_redis(), _redis2[0]


def redis_multi_env(namespace=None, pair=None):
    a, b = pair or shared_redis_pair()
    return {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_SHARD_URIS": a.uri + "," + b.uri,
            "UMBP_REDIS_NAMESPACE": namespace or "t%d-%d" % (os.getpid(), next(_ns))}


def redis_env(namespace=None, redis=None):
    r = redis or shared_redis()
    return {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": r.uri,
            "UMBP_REDIS_NAMESPACE": namespace or "t%d-%d" % (os.getpid(), next(_ns))}


@pytest.fixture(scope="module", params=["inmemory", "redis", "redis-multi"], autouse=True)
def backend(request):
    """Runs every test of a module that imports it against both metadata stores (the Redis
    one on one endpoint and in multi mode on two): a Master started while a Redis leg runs
    uses a fresh namespace of shared redis-servers."""
    if request.param != "inmemory" and not shutil.which("redis-server"):
        # in CI they must run: scripts/install-deps.sh installs redis-server there
        if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
            pytest.fail("redis-server is not installed (scripts/install-deps.sh installs it)")
        pytest.skip("redis-server not installed")
    BACKEND[0] = request.param
    yield request.param
    BACKEND[0] = "inmemory"


class Master:
    """A running master on free loopback ports. env adds to the environment."""

    def __init__(self, env=None, metrics=True, argv0=None, extra_args=()):
        if BACKEND[0] != "inmemory" and "UMBP_METADATA_BACKEND" not in (env or {}):
            base = redis_env() if BACKEND[0] == "redis" else redis_multi_env()
            env = dict(base, **(env or {}))
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
        wait_port(self.port, self.proc, "master")
        if self.metrics_port:
            wait_port(self.metrics_port, self.proc, "master")
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


@pytest.fixture(scope="module")
def master(backend):
    """One master per test module, on the backend the module is parametrized with; it must exit
    cleanly at the end."""
    m = Master()
    yield m
    assert m.stop() == 0


def stub(m):
    """A raw grpcio stub of master m (for requests the Python client would refuse to send)."""
    import grpc

    use_python_package()
    from umbp import pb_grpc

    return pb_grpc.UMBPMasterStub(grpc.insecure_channel(m.addr))
