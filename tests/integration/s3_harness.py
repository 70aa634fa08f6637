#!/usr/bin/python3
"""Test harness for the S3 L2 adapter: installs s3rver 3.7.1 from npm when missing, starts it on
127.0.0.1 behind the SigV4-verifying proxy (s3_sigv4_proxy.py), creates the bucket with Debian's
awscli through the proxy, and stops everything afterwards.

    s3_harness.py run [--cache DIR] -- CMD...   runs CMD with LMCACHE_S3_TEST_* set (see env())
    s3_harness.py install [--cache DIR]         only installs s3rver

Used by tests/unit/test_l2_s3_live.c (which re-executes itself under `run`), by the pytest tests
(tests/integration/test_l2_s3*.py) and by scripts/bench-s3.sh. When node or npm is genuinely
missing, `run` sets LMCACHE_S3_TEST_SKIP to the reason and runs CMD anyway (the tests skip)."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request

from netutil import free_port, wait_port  # noqa: F401  (soak.py uses them from here)

HERE = os.path.dirname(os.path.abspath(__file__))
AWS = "/usr/bin/aws"
AKID, SECRET = "S3RVER", "S3RVER"
BUCKET = "lmcache-test"
S3RVER_VERSION = "3.7.1"


def default_cache():
    build = os.environ.get("LMCACHE_BUILD_DIR") or os.path.join(HERE, "..", "..", "build")
    return os.path.join(os.path.abspath(build), "s3rver-cache")


def ensure_s3rver(cache):
    """Returns the path of s3rver's CLI script, or raises RuntimeError("skip: ...")."""
    js = os.path.join(cache, "node_modules", "s3rver", "bin", "s3rver.js")
    if os.path.exists(js):
        return js
    if not shutil.which("node") or not shutil.which("npm"):
        raise RuntimeError("skip: node/npm are not installed")
    os.makedirs(cache, exist_ok=True)
    lock = os.path.join(cache, ".install.lock")
    import fcntl
    with open(lock, "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)  # ctest -j2 may start two installs
        if not os.path.exists(js):
            subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", cache,
                            f"s3rver@{S3RVER_VERSION}"], check=True, stdout=subprocess.DEVNULL,
                           timeout=600)
    return js


def aws_env():
    e = dict(os.environ)
    e.update(AWS_ACCESS_KEY_ID=AKID, AWS_SECRET_ACCESS_KEY=SECRET, AWS_DEFAULT_REGION="us-east-1",
             AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
             AWS_EC2_METADATA_DISABLED="true", AWS_PAGER="")
    e.pop("AWS_SESSION_TOKEN", None)
    e.pop("AWS_PROFILE", None)
    return e


def aws(endpoint, *args, check=True, **kw):
    return subprocess.run([AWS, "--endpoint-url", endpoint, *args], env=aws_env(), check=check,
                          capture_output=True, timeout=120, **kw)


class S3Env:
    """s3rver + proxy. endpoint: through the proxy; direct: s3rver itself."""

    def __init__(self, cache=None, bucket=BUCKET):
        self.cache = cache or default_cache()
        self.bucket = bucket
        self.procs = []
        self.tmp = None

    def start(self):
        js = ensure_s3rver(self.cache)
        self.tmp = tempfile.mkdtemp(prefix="lmcache-s3-")
        self.s3_port, self.proxy_port, self.admin_port = free_port(), free_port(), free_port()
        log = open(os.path.join(self.tmp, "s3rver.log"), "w")
        s3 = subprocess.Popen(["node", "--openssl-legacy-provider", js, "-s", "-d",
                               os.path.join(self.tmp, "data"), "-a", "127.0.0.1", "-p",
                               str(self.s3_port), "--no-vhost-buckets"],
                              stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(s3)
        os.makedirs(os.path.join(self.tmp, "data"), exist_ok=True)
        wait_port(self.s3_port, s3, "s3rver", timeout=60)
        plog = open(os.path.join(self.tmp, "proxy.log"), "w")
        px = subprocess.Popen(["/usr/bin/python3", os.path.join(HERE, "s3_sigv4_proxy.py"),
                               "--listen", str(self.proxy_port), "--admin",
                               str(self.admin_port), "--upstream", f"127.0.0.1:{self.s3_port}",
                               "--cred", f"{AKID}:{SECRET}"], stdout=plog,
                              stderr=subprocess.STDOUT)
        self.procs.append(px)
        wait_port(self.proxy_port, px, "proxy", timeout=60)
        wait_port(self.admin_port, px, "proxy admin", timeout=60)
        aws(self.endpoint, "s3api", "create-bucket", "--bucket", self.bucket)
        return self

    @property
    def endpoint(self):
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def direct(self):
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def admin(self):
        return f"http://127.0.0.1:{self.admin_port}"

    def admin_post(self, path):
        req = urllib.request.Request(self.admin + path, data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read()

    def env(self):
        return {"LMCACHE_S3_TEST_ENDPOINT": self.endpoint, "LMCACHE_S3_TEST_DIRECT": self.direct,
                "LMCACHE_S3_TEST_ADMIN": self.admin, "LMCACHE_S3_TEST_BUCKET": self.bucket,
                "LMCACHE_S3_TEST_AKID": AKID, "LMCACHE_S3_TEST_SECRET": SECRET}

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def main(argv):
    cache = None
    if "--cache" in argv:
        i = argv.index("--cache")
        cache = argv[i + 1]
        del argv[i:i + 2]
    if argv[:1] == ["install"]:
        print(ensure_s3rver(cache or default_cache()))
        return 0
    if argv[:1] != ["run"] or "--" not in argv:
        sys.stderr.write(__doc__)
        return 2
    cmd = argv[argv.index("--") + 1:]
    env = dict(os.environ)
    s3 = S3Env(cache)
    try:
        s3.start()
        env.update(s3.env())
    except RuntimeError as e:
        if not str(e).startswith("skip:"):
            s3.stop()
            raise
        env["LMCACHE_S3_TEST_SKIP"] = str(e)
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        s3.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
