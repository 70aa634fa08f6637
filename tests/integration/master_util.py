"""Starting and stopping `lmcache master` for the master's integration tests."""

import atexit
import itertools
import os
import shutil
import signal
import socket
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


def _port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# In CI the Redis tests must run (scripts/install-deps.sh installs redis-server): a skip there
# would hide a failure, so the mark skips only outside CI.
needs_redis = pytest.mark.skipif(
    not shutil.which("redis-server") and os.environ.get("CI", "").lower() in ("", "0", "false", "no"),
    reason="redis-server missing")


def fnv1a32(x):
    """The Redis store's shard hash of a key (FNV-1a 32-bit)."""
    h = 2166136261
    for ch in x.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


class RedisServer:
    """Debian's redis-server on a free loopback port, with its own temp dir."""

    def __init__(self, port=None, extra=(), password=None):
        self.port = port or free_port()
        self.password = password
        self.dir = tempfile.mkdtemp(prefix="lmc-redis-")
        self.extra = list(extra)
        self.proc = None
        try:
            self.start()
        except Exception:
            self.close()
            raise

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


class RedisCluster:
    """A Redis Cluster of `masters` redis-servers (--cluster-enabled yes, no replicas) on
    loopback, created with `redis-cli --cluster create`."""

    def __init__(self, masters=3):
        ports = []
        while len(ports) < masters:  # the cluster bus listens on port + 10000
            p = free_port()
            if p + 10000 <= 65535 and p not in ports and _port_free(p + 10000):
                ports.append(p)
        self.nodes = []
        try:
            for p in ports:
                self.nodes.append(RedisServer(port=p, extra=[
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes-%d.conf" % p,
                    "--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "no"]))
        except Exception:
            self.close()
            raise
        r = subprocess.run(["redis-cli", "--cluster", "create"] +
                           ["127.0.0.1:%d" % p for p in ports] +
                           ["--cluster-replicas", "0", "--cluster-yes"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            self.close()
            raise RuntimeError("redis-cli --cluster create failed: " + r.stdout + r.stderr)
        deadline = time.monotonic() + 30
        while any("cluster_state:ok" not in n.cli("CLUSTER", "INFO") for n in self.nodes):
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the cluster did not become ok")
            time.sleep(0.05)

    @property
    def uri(self):
        return self.nodes[0].uri

    def owner(self, slot):
        """The node serving slot, by its own CLUSTER NODES line."""
        for n in self.nodes:
            me = n.cli("CLUSTER", "MYID")
            for line in n.cli("CLUSTER", "NODES").splitlines():
                f = line.split()
                if f[0] != me:
                    continue
                for rng in f[8:]:
                    lo, _, hi = rng.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return n
        return None

    def close(self):
        for n in self.nodes:
            n.close()


_redis = [None]
_redis2 = [None]
_cluster = [None]
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


def shared_cluster():
    """One 3-master Redis Cluster for the whole test run."""
    if _cluster[0] is None:
        _cluster[0] = RedisCluster()
        atexit.register(_cluster[0].close)
    return _cluster[0]


def redis_cluster_env(namespace=None, cluster=None):
    c = cluster or shared_cluster()
    return {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_CLUSTER": "1",
            "UMBP_REDIS_URI": ",".join(n.uri for n in c.nodes),
            "UMBP_REDIS_NAMESPACE": namespace or "t%d-%d" % (os.getpid(), next(_ns))}


def redis_env(namespace=None, redis=None):
    r = redis or shared_redis()
    return {"UMBP_METADATA_BACKEND": "redis", "UMBP_REDIS_URI": r.uri,
            "UMBP_REDIS_NAMESPACE": namespace or "t%d-%d" % (os.getpid(), next(_ns))}


@pytest.fixture(scope="module", params=["inmemory", "redis", "redis-multi", "redis-cluster"],
                autouse=True)
def backend(request):
    """Runs every test of a module that imports it against both metadata stores (the Redis
    one on one endpoint, in multi mode on two, and on a 3-master Redis Cluster): a Master
    started while a Redis leg runs uses a fresh namespace of shared redis-servers."""
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
            base = {"redis": redis_env, "redis-multi": redis_multi_env,
                    "redis-cluster": redis_cluster_env}[BACKEND[0]]()
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
        # Under a ThreadSanitizer build a report makes the master exit 66; many tests stop
        # their masters through `with` without looking at the exit code, so fail here.
        if "WARNING: ThreadSanitizer" in (self.stderr or ""):
            raise AssertionError("ThreadSanitizer report from the master:\n" + self.stderr)
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
