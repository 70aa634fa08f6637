"""Admin API availability under slow handlers and hostile clients, bearer-token authentication
and HTTPS. Everything runs on loopback; slow clients come from other 127.0.0.x addresses so the
per-address limit applies to them and not to the probes from 127.0.0.1."""
import json
import os
import re
import select
import signal
import socket
import stat
import subprocess
import threading
import time

import pytest
import requests

from conftest import BIN, Server, free_port

SLEEP_SCRIPT = b"import time\ntime.sleep(%d)\nresult = 1\n"


def slow_script_args():
    return ["--run-script-api-enabled", "--script-allowed-imports", "time"]


def post_script(url, seconds, out, timeout=60):
    try:
        r = requests.post(url + "/run_script",
                          files={"script": ("s.py", SLEEP_SCRIPT % seconds)}, timeout=timeout)
        out.append((r.status_code, r.headers.get("Retry-After"), r.text))
    except requests.RequestException as e:  # recorded, asserted on by the caller
        out.append((None, None, repr(e)))


def start_slow_scripts(url, n, seconds):
    out = []
    threads = [threading.Thread(target=post_script, args=(url, seconds, out)) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, out


def slow_header_conns(port, src_ip, n):
    """Opens n connections from src_ip that send an incomplete request head and stop."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((src_ip, 0))
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        except OSError:
            s.close()
            continue
        socks.append(s)
    return socks


def closed_by_server(s):
    """True when the server closed (or reset) the connection."""
    r, _, _ = select.select([s], [], [], 0)
    if not r:
        return False
    try:
        return s.recv(4096) == b""
    except OSError:
        return True


def wait_closed(socks, want, timeout=20):
    """Polls until at least `want` of socks are closed by the server; returns the closed ones."""
    deadline = time.time() + timeout
    closed = set()
    while time.time() < deadline:
        for s in socks:
            if s not in closed and closed_by_server(s):
                closed.add(s)
        if len(closed) >= want:
            break
        time.sleep(0.05)
    return closed


def probe_healthcheck(url, times):
    """/healthcheck must answer 200 every time, within a 3 s client timeout: half the time a
    probe queued behind one of the 6 s scripts would wait, with room for a loaded sanitizer
    build (its latency is measured by the soak, not asserted here)."""
    for i in range(times):
        r = requests.get(url + "/healthcheck", timeout=3)
        assert r.status_code == 200, (i, r.status_code, r.text)
        assert r.json() == {"status": "healthy"}


def close_all(socks):
    for s in socks:
        s.close()


# ---- availability ----


def test_healthcheck_answers_during_slow_scripts_and_slowloris(make_server):
    s = make_server(slow_script_args())
    # More long-running scripts than workers: they hold every worker they may and queue.
    threads, out = start_slow_scripts(s.url, 4, 6)
    socks = []
    try:
        for i in range(2, 12):  # 10 addresses x 40 attempts (32 per address are kept)
            socks += slow_header_conns(s.http_port, f"127.0.0.{i}", 40)
        probe_healthcheck(s.url, 15)
        assert requests.get(s.url + "/", timeout=3).status_code == 200
        assert requests.get(s.url + "/metrics", timeout=3).status_code == 200
    finally:
        close_all(socks)
        for t in threads:
            t.join(60)
    assert [o[0] for o in out] == [200] * 4, out


def test_healthcheck_answers_with_1200_slow_header_connections(make_server):
    s = make_server()
    socks = []
    try:
        for i in range(2, 42):  # 40 addresses x 30: under the per-address limit, over the total
            socks += slow_header_conns(s.http_port, f"127.0.0.{i}", 30)
        probe_healthcheck(s.url, 15)
    finally:
        close_all(socks)


def test_per_address_connection_limit(make_server):
    s = make_server(["--http-max-connections-per-ip", "16"])
    socks = slow_header_conns(s.http_port, "127.0.0.2", 40)
    try:
        closed = wait_closed(socks, len(socks) - 16)
        assert len(closed) >= len(socks) - 16
        probe_healthcheck(s.url, 3)
    finally:
        close_all(socks)


def pool_state(s):
    m = s.get("/metrics").text
    busy = re.search(r"^lmcache_http_admin_busy_workers (\S+)$", m, re.M)
    queued = re.search(r"^lmcache_http_admin_queued_requests (\S+)$", m, re.M)
    return float(busy.group(1)), float(queued.group(1))


def wait_pool(s, busy, queued, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pool_state(s) == (busy, queued):
            return
        time.sleep(0.05)
    raise AssertionError(f"pool never reached busy={busy} queued={queued}: {pool_state(s)}")


def test_quick_routes_keep_a_worker_while_slow_routes_run(make_server):
    s = make_server(slow_script_args() + ["--admin-workers", "2"])
    threads, out = start_slow_scripts(s.url, 3, 10)
    try:
        # One script runs, two wait: long-running routes may not take the last worker.
        wait_pool(s, 1, 2)
        for _ in range(5):
            r = requests.get(s.url + "/config", timeout=5)
            assert r.status_code == 200
        assert len(out) == 0, out
    finally:
        for t in threads:
            t.join(60)
    assert [o[0] for o in out] == [200] * 3, out


def test_full_worker_queue_answers_503_with_retry_after(make_server):
    s = make_server(slow_script_args() + ["--admin-workers", "2", "--admin-queue-size", "1"])
    out = []
    threads = []
    for busy, queued in ((1, 0), (1, 1)):  # one at a time: the worker must take the first
        threads.append(threading.Thread(target=post_script, args=(s.url, 5, out)))
        threads[-1].start()
        wait_pool(s, busy, queued)
    r = requests.post(s.url + "/run_script", files={"script": ("s.py", SLEEP_SCRIPT % 0)},
                      timeout=5)
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "1"
    assert r.json() == {"detail": "admin API busy, retry later"}
    r = requests.get(s.url + "/status", timeout=5)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    probe_healthcheck(s.url, 2)
    for t in threads:
        t.join(60)
    assert [o[0] for o in out] == [200] * 2, out
    assert requests.get(s.url + "/status", timeout=5).status_code == 200


def test_shutdown_answers_queued_requests_and_waits_for_running_ones(make_server):
    s = make_server(slow_script_args() + ["--admin-workers", "2"])
    out, threads = [], []
    for busy, queued in ((1, 0), (1, 1)):
        threads.append(threading.Thread(target=post_script, args=(s.url, 8, out)))
        threads[-1].start()
        wait_pool(s, busy, queued)
    assert s.stop() == 0, s.output()
    for t in threads:
        t.join(60)
    assert sorted(o[0] for o in out) == [200, 503], out
    assert "server shutting down" in [o for o in out if o[0] == 503][0][2]


def test_requests_during_shutdown_get_503_and_the_server_exits_cleanly(make_server):
    """While a running request holds the shutdown, new requests are answered 503 (the listening
    socket stays open until libmicrohttpd stops), and the process exits 0."""
    s = make_server(slow_script_args() + ["--admin-workers", "2"])
    out = []
    t = threading.Thread(target=post_script, args=(s.url, 4, out))
    t.start()
    wait_pool(s, 1, 0)
    s.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 20
    seen = None
    while time.time() < deadline and seen is None:
        try:
            r = requests.get(s.url + "/healthcheck", timeout=5)
        except requests.RequestException:
            break  # already stopped: the running request was quicker than this loop
        if r.status_code == 503:
            seen = r.json()
        time.sleep(0.05)
    assert seen == {"detail": "server shutting down"}, seen
    t.join(60)
    assert [o[0] for o in out] == [200], out
    assert s.stop() == 0, s.output()


@pytest.mark.parametrize("head", [
    b"GET /status HTTP/1.1\r\nHost: x\r\nX-Slow: ",
    b"POST /cache/checksums HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n",
], ids=["headers", "body"])
def test_trickled_request_is_closed_at_the_request_deadline(make_server, head):
    s = make_server(["--http-request-timeout-seconds", "2", "--http-idle-timeout-seconds", "60"])
    c = socket.create_connection(("127.0.0.1", s.http_port))
    try:
        c.sendall(head)
        # One byte every 0.2 s keeps the idle timeout from ever firing.
        closed = False
        deadline = time.time() + 30
        while time.time() < deadline and not closed:
            try:
                c.sendall(b"X")
            except OSError:
                closed = True
                break
            closed = closed_by_server(c)
            time.sleep(0.2)
        assert closed, "a request trickled for 30 s was never cut off"
    finally:
        c.close()
    m = s.get("/metrics").text
    assert re.search(r'lmcache_http_connections_dropped_total\{reason="request_timeout"\} [1-9]', m), m
    probe_healthcheck(s.url, 2)


def test_keepalive_requests_within_deadline_are_served(make_server):
    s = make_server(["--http-request-timeout-seconds", "2"])
    with requests.Session() as sess:
        for _ in range(3):
            assert sess.get(s.url + "/version", timeout=5).status_code == 200


def test_connections_over_the_limit_replace_the_oldest_incomplete(make_server):
    s = make_server(["--http-max-connections", "32", "--http-max-connections-per-ip", "16"])
    socks = []
    try:
        for i in range(2, 6):  # 4 x 16 = 64 incomplete requests against a limit of 32
            socks += slow_header_conns(s.http_port, f"127.0.0.{i}", 16)
        closed = wait_closed(socks, len(socks) - 32)
        assert len(closed) >= len(socks) - 32
        # The oldest ones made room.
        assert socks[0] in closed
        probe_healthcheck(s.url, 5)
        m = s.get("/metrics").text
        assert re.search(r'lmcache_http_connections_dropped_total\{reason="connection_limit"\} '
                         r'[1-9]', m), m
    finally:
        close_all(socks)


def test_per_connection_warnings_are_rate_limited(make_server):
    s = make_server(["--http-max-connections-per-ip", "1"], wait_ready=False)
    socks = slow_header_conns(s.http_port, "127.0.0.2", 60)
    try:
        wait_closed(socks, len(socks) - 1)
    finally:
        close_all(socks)
    warnings = [l for l in s.output().splitlines() if "libmicrohttpd" in l]
    assert 1 <= len(warnings) <= 10, warnings


class Blackhole:
    """A TCP listener that accepts and never answers: an S3 endpoint that hangs."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self.stop = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        self.sock.settimeout(0.2)
        while not self.stop:
            try:
                c, _ = self.sock.accept()
                self.conns.append(c)
            except OSError:
                pass

    def close(self):
        self.stop = True
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.sock.close()


def test_healthcheck_answers_while_l2_listing_hangs(make_server):
    hole = Blackhole()
    cfg = {"type": "s3", "endpoint": f"http://127.0.0.1:{hole.port}", "bucket": "b",
           "region": "us-east-1", "access_key_id": "a", "secret_access_key": "b",
           "request_timeout_ms": 8000}
    try:
        s = make_server(["--l2-adapter", json.dumps(cfg)])
        out = []

        def listing():
            try:
                r = requests.get(s.url + "/cache/objects", timeout=60)
                out.append(r.status_code)
            except requests.RequestException as e:
                out.append(repr(e))

        threads = [threading.Thread(target=listing) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.time() + 10
        while time.time() < deadline and len(hole.conns) == 0:
            time.sleep(0.05)
        assert hole.conns, "the listing never reached the S3 endpoint"
        probe_healthcheck(s.url, 10)
        for t in threads:
            t.join(60)
        assert len(out) == 2 and all(isinstance(c, int) for c in out), out
    finally:
        hole.close()


# ---- authentication ----

TOKEN = "s3cr3t-t0ken_value"


def token_file(tmp_path, content=TOKEN + "\n", mode=0o600):
    p = tmp_path / "token"
    p.write_text(content)
    os.chmod(p, mode)
    return str(p)


def curl(*args):
    return subprocess.run(["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-D", "-",
                           "--max-time", "10"] + list(args),
                          capture_output=True, text=True, timeout=30)


def curl_status(r):
    return int(r.stdout.rsplit("\n", 1)[1])


def test_token_required_except_probes(make_server, tmp_path):
    s = make_server(["--admin-token-file", token_file(tmp_path)])
    for path in ("/status", "/config", "/quota", "/nope", "/metrics/reset"):
        r = requests.get(s.url + path, timeout=5)
        assert r.status_code == 401, path
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert r.json() == {"detail": "authentication required"}
    r = requests.post(s.url + "/cache/clear", json={"tier": "l1"}, timeout=5)
    assert r.status_code == 401
    r = requests.get(s.url + "/status", headers={"Authorization": "Bearer wrong"}, timeout=5)
    assert r.status_code == 401
    assert 'error="invalid_token"' in r.headers["WWW-Authenticate"]
    r = requests.get(s.url + "/status", headers={"Authorization": "Bearer " + TOKEN[:-1]},
                     timeout=5)
    assert r.status_code == 401
    r = requests.get(s.url + "/status", headers={"Authorization": "Basic " + TOKEN}, timeout=5)
    assert r.status_code == 401
    for path in ("/", "/healthcheck", "/metrics"):
        assert requests.get(s.url + path, timeout=5).status_code == 200, path
    r = curl("-H", "Authorization: Bearer " + TOKEN, s.url + "/status")
    assert curl_status(r) == 200, r.stdout + r.stderr
    r = curl(s.url + "/status")
    assert curl_status(r) == 401
    assert "WWW-Authenticate: Bearer" in r.stdout


def test_token_checked_before_the_body_is_read(make_server, tmp_path):
    s = make_server(["--admin-token-file", token_file(tmp_path)])
    c = socket.create_connection(("127.0.0.1", s.http_port), timeout=10)
    try:
        c.sendall(b"POST /cache/checksums HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
        head = c.recv(4096)  # no body sent: the answer must not wait for it
        assert head.startswith(b"HTTP/1.1 401"), head
    finally:
        c.close()


def test_token_protects_metrics_when_asked(make_server, tmp_path):
    s = make_server(["--admin-token-file", token_file(tmp_path), "--admin-token-protects-metrics"])
    assert requests.get(s.url + "/metrics", timeout=5).status_code == 401
    r = requests.get(s.url + "/metrics", headers={"Authorization": "Bearer " + TOKEN}, timeout=5)
    assert r.status_code == 200
    assert requests.get(s.url + "/healthcheck", timeout=5).status_code == 200


def run_server_expect_exit(args):
    p = subprocess.run([BIN, "server", "--host", "127.0.0.1", "--port", str(free_port()),
                        "--http-host", "127.0.0.1", "--http-port", str(free_port()),
                        "--l1-size-gb", "0.1", "--eviction-policy", "LRU"] + args,
                       capture_output=True, text=True, timeout=30)
    return p.returncode, p.stdout + p.stderr


def test_bad_token_file_refuses_to_start(tmp_path):
    rc, out = run_server_expect_exit(["--admin-token-file", str(tmp_path / "missing")])
    assert rc == 2 and "--admin-token-file" in out and "cannot read" in out, out
    rc, out = run_server_expect_exit(["--admin-token-file", token_file(tmp_path, "\n \n")])
    assert rc == 2 and "--admin-token-file" in out and "empty" in out, out
    rc, out = run_server_expect_exit(["--admin-token-file", token_file(tmp_path, "two words\n")])
    assert rc == 2 and "--admin-token-file" in out, out
    rc, out = run_server_expect_exit(["--admin-token-file", str(tmp_path)])
    assert rc == 2 and "--admin-token-file" in out, out


def test_world_readable_token_file_warns(make_server, tmp_path):
    s = make_server(["--admin-token-file", token_file(tmp_path, mode=0o644)])
    assert "readable by every user" in s.output()


# ---- TLS ----


def make_cert(tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    os.chmod(key, stat.S_IRUSR | stat.S_IWUSR)
    return cert, key


class TlsServer(Server):
    def __init__(self, cert, *a, **kw):
        self.cert = cert
        super().__init__(*a, **kw)

    def wait_listening(self, timeout=20):
        self.url = self.url.replace("http://", "https://")
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.output()}")
            try:
                requests.get(self.url + "/", timeout=1, verify=self.cert)
                return
            except (requests.ConnectionError, requests.Timeout):
                time.sleep(0.05)
        raise RuntimeError("server did not start listening: " + self.output())

    def wait_ready(self, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if requests.get(self.url + "/healthcheck", timeout=5,
                            verify=self.cert).status_code == 200:
                return
            time.sleep(0.05)
        raise RuntimeError("server did not become ready: " + self.output())


def test_https_with_token(tmp_path):
    cert, key = make_cert(tmp_path)
    s = TlsServer(cert, ["--http-tls-cert", cert, "--http-tls-key", key,
                         "--admin-token-file", token_file(tmp_path)])
    try:
        r = curl("--cacert", cert, s.url + "/healthcheck")
        assert curl_status(r) == 200, r.stdout + r.stderr
        assert '"healthy"' in r.stdout
        r = curl("--cacert", cert, s.url + "/status")
        assert curl_status(r) == 401
        r = curl("--cacert", cert, "-H", "Authorization: Bearer " + TOKEN, s.url + "/status")
        assert curl_status(r) == 200, r.stdout + r.stderr
        # Plain HTTP on the HTTPS port gets no answer; an unknown CA is refused by the client.
        plain = s.url.replace("https://", "http://")
        r = curl(plain + "/healthcheck")
        assert r.returncode != 0 or curl_status(r) != 200
        r = curl(s.url + "/healthcheck")
        assert r.returncode != 0
        assert "https://" in s.output()
    finally:
        assert s.stop() == 0, s.output()


def test_tls_options_are_checked_at_start(tmp_path):
    cert, key = make_cert(tmp_path)
    rc, out = run_server_expect_exit(["--http-tls-cert", cert])
    assert rc == 2 and "--http-tls-key" in out, out
    rc, out = run_server_expect_exit(["--http-tls-cert", cert, "--http-tls-key",
                                      str(tmp_path / "missing")])
    assert rc == 2 and "--http-tls-key" in out, out
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    rc, out = run_server_expect_exit(["--http-tls-cert", str(junk), "--http-tls-key", key])
    assert rc == 2 and "--http-tls-cert" in out, out
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = make_cert(other)
    rc, out = run_server_expect_exit(["--http-tls-cert", cert, "--http-tls-key", other_key])
    assert rc == 2 and "does not belong" in out, out


def test_run_script_app_reaches_a_protected_https_admin_api(tmp_path):
    """The script's `app` client carries the admin token and speaks HTTPS when the API does."""
    cert, key = make_cert(tmp_path)
    s = TlsServer(cert, ["--http-tls-cert", cert, "--http-tls-key", key,
                         "--admin-token-file", token_file(tmp_path), "--run-script-api-enabled"])
    try:
        script = tmp_path / "s.py"
        script.write_text("st = app.get('/status')\nresult = st['is_healthy']\n")
        r = curl("--cacert", cert, "-H", "Authorization: Bearer " + TOKEN,
                 "-F", f"script=@{script}", s.url + "/run_script")
        assert curl_status(r) == 200, r.stdout + r.stderr
        assert r.stdout.rsplit("\n", 1)[0].endswith("True"), r.stdout
        # and the route itself still wants the token
        r = curl("--cacert", cert, "-F", f"script=@{script}", s.url + "/run_script")
        assert curl_status(r) == 401
    finally:
        assert s.stop() == 0, s.output()
