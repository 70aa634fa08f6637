"""Data-socket security: shared-memory registration (name checks, no links, no FIFOs or
directories, owner checks, proof of access, the name-prefix allow-list, peer credentials on the
ipc endpoint), lookup sessions bound to their connection, and CURVE with a client allow-list."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import uuid

import msgpack
import pytest
import zmq

from conftest import free_port
from dp_util import PROOF_PAGE, DPClient, ShmKV, register, seq_prompt, write_proof

BIN = os.environ.get("LMCACHE_BIN", "build/lmcache")
BUILD = os.environ.get("LMCACHE_BUILD_DIR", "build")
CHUNK = 32
NOBODY = 65534
LAYOUT = dict(num_layers=2, num_blocks=64, tokens_per_block=16, bytes_per_token=64, kv_count=2)
LAYOUT_BYTES = 2 * 2 * 64 * 16 * 64


@pytest.fixture
def dp(make_server):
    clients = []

    def make(*args, **kw):
        s = make_server(args=["--chunk-size", str(CHUNK)] + list(args), **kw)
        c = DPClient(s.zmq_port, timeout_ms=10000)
        clients.append(c)
        return s, c

    yield make
    for c in clients:
        c.close()


def shm_object(size=LAYOUT_BYTES + PROOF_PAGE, owner=None, mode=0o600, fill=b"S"):
    """A /dev/shm object holding `fill` bytes; returns (name, path)."""
    name = "/lmc-sec-" + uuid.uuid4().hex[:12]
    path = "/dev/shm" + name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.write(fd, fill * size)
        if owner is not None:
            os.fchown(fd, owner, owner)
    finally:
        os.close(fd)
    return name, path


def reg(c, name, instance=1, **kw):
    return c.raw("register_kv_cache", dict(instance_id=instance, model_name="m", shm_name=name,
                                           **dict(LAYOUT, **kw)))


def prompt(n, seed):
    return seq_prompt(seed, n, CHUNK)


def assert_unregistered(c, instance=1):
    r = c.raw("store", dict(instance_id=instance, token_ids=prompt(1, 1), block_ids=[0, 1]))
    assert r["code"] == "not_registered", r


# ---- shared memory ----------------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create another uid's object")


@needs_root
def test_foreign_object_is_refused_untouched(dp):
    """An object owned by another uid (mode 0600) cannot be registered over tcp: not one byte is
    read or written, and no store or retrieve reaches it."""
    _, c = dp()
    name, path = shm_object(owner=NOBODY)
    try:
        before = os.stat(path)
        for _ in range(2):  # a proof attempt changes nothing either
            r = reg(c, name)
            assert r["ok"] is False and r["code"] == "shm_error", r
            assert "uid 65534" in r["message"]
        assert_unregistered(c)
        r = c.raw("retrieve", dict(instance_id=1, token_ids=prompt(1, 1), block_ids=[0, 1]))
        assert r["code"] == "not_registered"
        with open(path, "rb") as f:
            assert f.read() == b"S" * (LAYOUT_BYTES + PROOF_PAGE)
        after = os.stat(path)
        assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
    finally:
        os.unlink(path)


@needs_root
def test_allowed_uids_admit_another_owner(dp):
    _, c = dp("--shm-allowed-uids", str(NOBODY))
    name, path = shm_object(owner=NOBODY)
    mine, mpath = shm_object()
    try:
        assert register(c.raw, dict(instance_id=1, model_name="m", shm_name=name, **LAYOUT))["ok"]
        # the daemon's own uid is no longer implied once the list is given
        assert reg(c, mine, instance=2)["code"] == "shm_error"
    finally:
        os.unlink(path)
        os.unlink(mpath)


def test_symlink_is_refused(dp):
    _, c = dp()
    target, tpath = shm_object()
    link = "/lmc-sec-link-" + uuid.uuid4().hex[:8]
    os.symlink(tpath, "/dev/shm" + link)
    try:
        r = reg(c, link)
        assert r["code"] == "shm_error" and "regular file" in r["message"], r
        assert_unregistered(c)
    finally:
        os.unlink("/dev/shm" + link)
        os.unlink(tpath)


def test_directory_is_refused(dp):
    _, c = dp()
    name = "/lmc-sec-dir-" + uuid.uuid4().hex[:8]
    os.mkdir("/dev/shm" + name)
    try:
        r = reg(c, name)
        assert r["code"] == "shm_error" and "regular file" in r["message"], r
    finally:
        os.rmdir("/dev/shm" + name)


def test_fifo_is_refused_without_blocking(dp):
    """Regression: opening a FIFO parked the worker forever and SIGTERM no longer stopped the
    daemon. Now the reply comes at once and the daemon exits 0."""
    s, c = dp()
    name = "/lmc-sec-fifo-" + uuid.uuid4().hex[:8]
    os.mkfifo("/dev/shm" + name, 0o600)
    try:
        r = reg(c, name)  # the client's 10 s receive timeout bounds the wait
        assert r["code"] == "shm_error" and "regular file" in r["message"], r
        assert c.call("noop")["result"] == "OK"
        assert s.stop(signal.SIGTERM) == 0, s.output()
    finally:
        os.unlink("/dev/shm" + name)


@pytest.mark.parametrize("name", ["x", "/", "/a/b", "/.", "/..", "/../etc/passwd", "/a b",
                                  "/" + "a" * 201, "/caf\u00e9"])
def test_invalid_names_are_bad_request(dp, name):
    _, c = dp()
    r = reg(c, name)
    assert r["code"] == "bad_request" and "shm_name" in r["message"], r


def test_name_prefixes(dp):
    _, c = dp("--shm-name-prefixes", "/lmc-ok-", "/other-")
    good = "/lmc-ok-" + uuid.uuid4().hex[:8]
    name, path = shm_object()
    os.rename(path, "/dev/shm" + good)
    try:
        assert register(c.raw, dict(instance_id=1, model_name="m", shm_name=good, **LAYOUT))["ok"]
        other, opath = shm_object()
        try:
            r = reg(c, other, instance=2)
            assert r["code"] == "shm_error" and "prefix" in r["message"], r
        finally:
            os.unlink(opath)
    finally:
        os.unlink("/dev/shm" + good)


def test_proof_of_access_is_required_over_tcp(dp):
    _, c = dp()
    name, path = shm_object(fill=b"\0")
    try:
        r = reg(c, name)
        assert r["code"] == "proof_required", r
        assert len(r["nonce"]) == 32 and r["proof_offset"] == LAYOUT_BYTES
        # asking again without writing changes nothing; a wrong nonce does not pass
        assert reg(c, name)["code"] == "proof_required"
        fd = os.open(path, os.O_RDWR)
        os.pwrite(fd, bytes(32), LAYOUT_BYTES)
        os.close(fd)
        assert reg(c, name)["code"] == "proof_required"
        write_proof(r, name)
        assert reg(c, name)["ok"]
    finally:
        os.unlink(path)


def test_object_without_proof_page_is_refused(dp):
    _, c = dp()
    name, path = shm_object(size=LAYOUT_BYTES)
    try:
        r = reg(c, name)
        assert r["code"] == "shm_error" and "proof page" in r["message"], r
    finally:
        os.unlink(path)


def test_ipc_layout_must_leave_the_proof_page(dp, ipc_dir):
    """Over ipc no proof is asked, but a layout reaching into the last 4096 bytes is refused
    (the daemon never writes where a tcp client's proof is read); with --shm-proof never the
    whole object may be used."""
    sock = os.path.join(ipc_dir, "dp.sock")
    for mode, ok in (("tcp", False), ("never", True)):
        s, _ = dp("--ipc-path", sock, "--shm-proof", mode)
        c = DPClient("ipc://" + sock, timeout_ms=10000)
        name, path = shm_object(size=LAYOUT_BYTES)
        try:
            r = reg(c, name)
            assert r["ok"] is ok, r
            if not ok:
                assert r["code"] == "shm_error" and "proof page" in r["message"], r
        finally:
            c.close()
            os.unlink(path)
            assert s.stop() == 0


def test_proof_cannot_be_planted_by_the_daemon(dp):
    """The proof page is the object's last page, whatever layout a client names. Before, it
    followed the layout the client chose: an attacker could store its nonce as a chunk with
    store_bytes, wait for the victim to retrieve that chunk into its blocks, then register the
    victim's object with a layout ending exactly there and read or write it."""
    s, victim = dp()
    kv = ShmKV()
    attacker = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        victim.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        r = attacker.raw("register_kv_cache", dict(instance_id=2, model_name="m", **kv.layout()))
        assert r["code"] == "proof_required", r
        assert r["proof_offset"] == kv.size  # the last page, not after a chosen layout
        # the attacker plants its nonce in a chunk and the victim retrieves it into block 0..1
        chunk_bytes = 2 * 2 * CHUNK * 64
        toks = prompt(1, 77)
        assert attacker.call("store_bytes", model_name="m", token_ids=toks,
                             chunks=[r["nonce"] + bytes(chunk_bytes - 32)])["stored_chunks"] == 1
        assert victim.call("retrieve", instance_id=1, token_ids=toks,
                           block_ids=[0, 1])["retrieved_chunks"] == 1
        assert bytes(kv.mem[0:32]) == r["nonce"]  # planted at offset 0 of the victim's object
        # a layout whose end falls on the planted bytes cannot serve as a proof page any more
        for blocks in (1, 2, 63):
            tiny = dict(kv.layout(), num_blocks=blocks)
            r2 = attacker.raw("register_kv_cache", dict(instance_id=2, model_name="m", **tiny))
            assert r2["code"] == "proof_required" and r2["proof_offset"] == kv.size, r2
        assert_unregistered(attacker, instance=2)
    finally:
        attacker.close()
        kv.close()


def test_another_connections_proof_does_not_count(dp):
    """An engine proves access to its own object; a second connection that cannot write the
    object is still asked for its own nonce and stays unregistered."""
    s, victim = dp()
    kv = ShmKV()
    attacker = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        victim.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        r = attacker.raw("register_kv_cache",
                         dict(instance_id=2, model_name="m", **kv.layout()))
        assert r["code"] == "proof_required", r
        # the victim's nonce (still in the page) is not the attacker's
        r2 = attacker.raw("register_kv_cache", dict(instance_id=2, model_name="m", **kv.layout()))
        assert r2["code"] == "proof_required" and r2["nonce"] == r["nonce"]
        assert_unregistered(attacker, instance=2)
    finally:
        attacker.close()
        kv.close()


def test_registration_belongs_to_its_connection(dp):
    """Another connection cannot gather a registered engine's blocks into the cache (to read them
    with retrieve_bytes), scatter into them, or unregister them: the instance is unknown to it."""
    s, engine = dp()
    kv = ShmKV()
    other = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        engine.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        kv.fill_blocks([0, 1], "SECRET")
        toks = prompt(1, 9)
        for op in ("store", "retrieve"):
            r = other.raw(op, dict(instance_id=1, token_ids=toks, block_ids=[0, 1]))
            assert r["code"] == "not_registered", r
        assert other.raw("unregister_kv_cache", dict(instance_id=1))["code"] == "not_registered"
        assert other.call("retrieve_bytes", model_name="m", token_ids=toks)["chunks"] == []
        # the engine itself still can
        assert engine.call("store", instance_id=1, token_ids=toks, block_ids=[0, 1])["ok"]
        engine.call("unregister_kv_cache", instance_id=1)
    finally:
        other.close()
        kv.close()


def test_proof_can_be_turned_off(dp):
    _, c = dp("--shm-proof", "never")
    name, path = shm_object(size=LAYOUT_BYTES)
    try:
        assert reg(c, name)["ok"]
    finally:
        os.unlink(path)


# ---- the ipc endpoint: peer credentials ---------------------------------------------------------

IPC_CLIENT = textwrap.dedent("""
    import json, sys, msgpack, zmq
    ep, payload = sys.argv[1], json.loads(sys.argv[2])
    s = zmq.Context().socket(zmq.DEALER)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    s.send_multipart([b"1", b"register_kv_cache", msgpack.packb(payload)])
    print(json.dumps(msgpack.unpackb(s.recv_multipart()[2], raw=False)))
""")


def ipc_register(ep, name, uid):
    payload = dict(instance_id=5, model_name="m", shm_name=name, **LAYOUT)
    r = subprocess.run([sys.executable, "-c", IPC_CLIENT, ep, __import__("json").dumps(payload)],
                       user=uid, group=uid, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return __import__("json").loads(r.stdout)


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="lmc-ipc-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@needs_root
def test_ipc_peer_must_own_the_object(dp, ipc_dir):
    sock = os.path.join(ipc_dir, "dp.sock")
    s, _ = dp("--ipc-path", sock)
    os.chmod(sock, 0o666)
    ep = "ipc://" + sock
    # no proof is asked over ipc, but the proof page is still reserved at the end
    mine, mpath = shm_object(owner=NOBODY)
    root, rpath = shm_object(size=LAYOUT_BYTES)
    try:
        r = ipc_register(ep, root, NOBODY)
        assert r["code"] == "shm_error" and "uid 0" in r["message"], r
        assert ipc_register(ep, mine, NOBODY)["ok"]
        # a root peer may register what it could open anyway
        c = DPClient(ep, timeout_ms=10000)
        try:
            assert c.raw("register_kv_cache", dict(instance_id=6, model_name="m", shm_name=mine,
                                                   **LAYOUT))["ok"]
        finally:
            c.close()
    finally:
        os.unlink(mpath)
        os.unlink(rpath)


def test_ipc_needs_no_proof_unless_always(dp, ipc_dir):
    sock = os.path.join(ipc_dir, "dp.sock")
    for mode, proof in (("tcp", False), ("always", True)):
        s, _ = dp("--ipc-path", sock, "--shm-proof", mode)
        c = DPClient("ipc://" + sock, timeout_ms=10000)
        name, path = shm_object()
        try:
            r = reg(c, name)
            assert (r.get("code") == "proof_required") == proof and r["ok"] is not proof, r
            if proof:
                write_proof(r, name)
                assert reg(c, name)["ok"]
        finally:
            c.close()
            os.unlink(path)
            assert s.stop() == 0


# ---- lookup sessions ----------------------------------------------------------------------------

def test_sessions_belong_to_their_connection(dp):
    s, a = dp()
    b = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        toks = prompt(2, 3)
        a.call("store_bytes", model_name="m", token_ids=toks, chunks=[b"x" * 100, b"y" * 100])
        a.call("lookup", request_id="req-1", model_name="m", token_ids=toks, num_kv_readers=2)
        # another connection sees an unknown id: nothing to query, consume, free or end
        assert b.call("query_prefetch_status", request_id="req-1") == {
            "ok": True, "ready": True, "hit_chunks": 0}
        r = b.call("retrieve_bytes", model_name="m", token_ids=toks, request_id="req-1")
        assert r["chunks"] == []
        assert b.call("free_lookup_locks", request_id="req-1")["released"] == 0
        assert b.call("end_session", request_id="req-1")["ok"]
        # the same request id from the other connection is a session of its own
        b.call("lookup", request_id="req-1", model_name="m", token_ids=toks)
        assert b.call("query_prefetch_status", request_id="req-1")["hit_chunks"] == 2
        # the owner's session is intact
        st = a.call("query_prefetch_status", request_id="req-1")
        assert st["ready"] and st["hit_chunks"] == 2
        r = a.call("retrieve_bytes", model_name="m", token_ids=toks, request_id="req-1")
        assert r["chunks"] == [b"x" * 100, b"y" * 100]
        assert a.call("free_lookup_locks", request_id="req-1")["released"] == 2
        a.call("end_session", request_id="req-1")
        b.call("end_session", request_id="req-1")
    finally:
        b.close()


# ---- CURVE --------------------------------------------------------------------------------------

def keygen(prefix):
    r = subprocess.run([BIN, "curve-keygen", prefix], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    pub = open(prefix + ".pub").read().strip()
    sec = [ln for ln in open(prefix + ".key").read().splitlines() if not ln.startswith("#")][0]
    assert r.stdout.strip() == pub and len(pub) == 40 and len(sec) == 40
    assert os.stat(prefix + ".key").st_mode & 0o777 == 0o600
    return pub.encode(), sec.encode()


@pytest.fixture
def curve(make_server, tmp_path):
    spub, _ = keygen(str(tmp_path / "server"))
    allowed = tmp_path / "clients"
    allowed.mkdir()
    cpub, csec = keygen(str(allowed / "engine"))
    os.unlink(str(allowed / "engine.key"))
    s = make_server(args=["--curve-secret-key-file", str(tmp_path / "server.key"),
                          "--curve-allowed-clients", str(allowed)])
    return s, spub, cpub, csec


def test_curve_admits_only_allowed_keys(curve):
    s, spub, cpub, csec = curve
    ok = DPClient(s.zmq_port, timeout_ms=10000, curve=(spub, cpub, csec))
    assert ok.call("noop")["result"] == "OK"
    ok.close()
    upub, usec = zmq.curve_keypair()
    for cv in [(spub, upub, usec), None]:  # an unknown key, then a plaintext client
        c = DPClient(s.zmq_port, timeout_ms=1500, curve=cv)
        try:
            c.sock.send_multipart([b"1", b"noop", msgpack.packb({})])
            with pytest.raises(zmq.Again):
                c.sock.recv_multipart()
        finally:
            c.close()
    assert "is not allowed" in s.output()


def test_curve_c_client(curve):
    s, spub, cpub, csec = curve
    exe = os.path.join(BUILD, "lmcache_client_smoke")
    env = dict(os.environ, LMC_SMOKE_CURVE_SERVER=spub.decode(),
               LMC_SMOKE_CURVE_PUBLIC=cpub.decode(), LMC_SMOKE_CURVE_SECRET=csec.decode())
    r = subprocess.run([exe, "127.0.0.1", str(s.zmq_port)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_curve_needs_an_allow_list(tmp_path):
    keygen(str(tmp_path / "server"))
    r = subprocess.run([BIN, "server", "--l1-size-gb", "0.01", "--eviction-policy", "LRU",
                        "--host", "127.0.0.1", "--port", str(free_port()),
                        "--http-host", "127.0.0.1", "--http-port", str(free_port()),
                        "--curve-secret-key-file", str(tmp_path / "server.key")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--curve-allowed-clients" in r.stderr + r.stdout


def test_curve_refuses_a_receive_high_water_mark_of_one(tmp_path):
    """libzmq delivers no message at all of a CURVE connection to a ROUTER whose receive
    high-water mark is 1 (a noop times out): the server refuses that configuration."""
    keygen(str(tmp_path / "server"))
    allowed = tmp_path / "clients"
    allowed.mkdir()
    keygen(str(allowed / "engine"))
    r = subprocess.run([BIN, "server", "--l1-size-gb", "0.01", "--eviction-policy", "LRU",
                        "--host", "127.0.0.1", "--port", str(free_port()),
                        "--http-host", "127.0.0.1", "--http-port", str(free_port()),
                        "--curve-secret-key-file", str(tmp_path / "server.key"),
                        "--curve-allowed-clients", str(allowed), "--zmq-rcvhwm", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--zmq-rcvhwm must be at least 2 with CURVE" in \
        r.stderr + r.stdout, r.stderr + r.stdout


# ---- the documented connector -------------------------------------------------------------------

def test_protocol_doc_example_registers_with_proof(make_server):
    """The pyzmq connector at the end of docs/protocol.md runs as written (it answers the
    proof-of-access challenge of a tcp client)."""
    from conftest import ROOT
    text = open(os.path.join(ROOT, "docs", "protocol.md")).read()
    code = text[text.rindex("```python") + len("```python"):text.rindex("```")]
    s = make_server()
    name = "lmc-doc-" + uuid.uuid4().hex[:8]
    code = (code.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{s.zmq_port}")
            .replace("my-kv", name))
    assert f"/dev/shm/{name}" in code and "proof_required" in code
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        if os.path.exists("/dev/shm/" + name):
            os.unlink("/dev/shm/" + name)


def test_registrations_are_capped_per_connection_and_in_all(dp):
    """Regression: registrations had no cap; each maps (and populates) the whole object in the
    daemon, so one client could exhaust its page tables and mappings."""
    s, c = dp("--max-kv-registrations-per-client", "2", "--max-kv-registrations", "3")
    kv = ShmKV()
    other = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        for i in (1, 2):
            c.call("register_kv_cache", instance_id=i, model_name="m", **kv.layout())
        r = register(c.raw, dict(instance_id=3, model_name="m", **kv.layout()))
        assert r["code"] == "too_large" and "per connection" in r["message"], r
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())  # a refresh
        other.call("register_kv_cache", instance_id=4, model_name="m", **kv.layout())
        r = register(other.raw, dict(instance_id=5, model_name="m", **kv.layout()))
        assert r["code"] == "too_large" and "in all" in r["message"], r
        c.call("unregister_kv_cache", instance_id=2)
        other.call("register_kv_cache", instance_id=5, model_name="m", **kv.layout())
    finally:
        other.close()
        kv.close()


def test_a_strangers_pings_do_not_keep_a_registration_alive(dp):
    s, owner = dp("--worker-reap-timeout-seconds", "1", "--worker-registration-grace-seconds", "1")
    kv = ShmKV()
    stranger = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        owner.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        owner.call("ping", instance_id=1)
        # only the stranger speaks for 4 s (the reap timeout is 1 s); any store of the owner's
        # would itself count as a sign of life, so it comes once, at the end
        t = __import__("time")
        end = t.monotonic() + 4
        while t.monotonic() < end:
            stranger.call("ping", instance_id=1)
            t.sleep(0.2)
        r = owner.raw("store", dict(instance_id=1, token_ids=prompt(1, 3), block_ids=[0, 1]))
        assert r.get("code") == "not_registered", r
    finally:
        stranger.close()
        kv.close()


def test_other_clients_locks_cannot_fill_an_objects_reader_count(dp):
    """Regression: the read-lock count of an object was 16 bits; 64 lookups with
    num_kv_readers 1024 by any client filled it, and the owner's own lookups and retrieves of
    that object then missed for the read lease (300 s)."""
    s, victim = dp()
    attacker = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        toks = prompt(1, 11)
        data = bytes(range(256)) * (2 * 2 * CHUNK * 64 // 256)
        victim.call("store_bytes", model_name="m", token_ids=toks, chunks=[data],
                    cache_salt="victim")
        for i in range(70):
            attacker.call("lookup", request_id=f"pin{i}", model_name="m", token_ids=toks,
                          cache_salt="victim", num_kv_readers=1024)
        victim.call("lookup", request_id="mine", model_name="m", token_ids=toks,
                    cache_salt="victim")
        st = victim.call("query_prefetch_status", request_id="mine")
        assert st["ready"] and st["hit_chunks"] == 1, st
        got = victim.call("retrieve_bytes", model_name="m", token_ids=toks, cache_salt="victim")
        assert got["chunks"] == [data]
    finally:
        attacker.close()


def test_registration_allocates_nothing_of_a_sparse_object(dp):
    """Registering a large object that holds no memory (ftruncate only) makes the server fault
    in nothing: a 200-byte request must not allocate 256 MiB of shared memory on the client's
    behalf (charged to the daemon). The object stays a hole after the warm-up."""
    s, c = dp()
    kv = ShmKV(layers=2, blocks=32768, tokens_per_block=16, bytes_per_token=128)  # 256 MiB
    try:
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        c.wait_warm(1)
        meta = s.get("/status").json()["cache_context_meta"]["1"]
        assert meta["warm_state"] == "warm" and meta["warmed_bytes"] == 0, meta
        assert meta["mapped_bytes"] == kv.size
        # the object holds no page but its proof page (the nonce the client wrote there)
        assert os.fstat(kv.fd).st_blocks * 512 <= PROOF_PAGE
        # The half the engine then writes is used as usual.
        kv.fill_blocks(range(2), "w")
        r = c.call("store", instance_id=1, token_ids=prompt(1, 0), block_ids=[0, 1])
        assert r["stored_chunks"] == 1
    finally:
        kv.close()


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.1, 0.3])
def test_an_object_shrunk_while_it_is_faulted_in_does_not_kill_the_server(dp, delay):
    """The server faults a registered object in after answering; the client shrinks it under
    that (after `delay` seconds). The warm-up stops (a SIGBUS inside it is caught), the server
    keeps serving, and copies through the registration fail with shm_error."""
    s, c = dp()
    kv = ShmKV(layers=2, blocks=16384, tokens_per_block=16, bytes_per_token=128)  # 128 MiB
    kv.allocate()
    other = DPClient(s.zmq_port, timeout_ms=10000)
    try:
        c.call("register_kv_cache", instance_id=1, model_name="m", **kv.layout())
        __import__("time").sleep(delay)
        os.ftruncate(kv.fd, 4096)
        assert c.wait_warm(1)["warming"] is False
        assert s.get("/healthcheck").status_code == 200
        meta = s.get("/status").json()["cache_context_meta"]["1"]
        assert meta["warm_state"] in ("warm", "failed"), meta
        r = c.raw("store", dict(instance_id=1, token_ids=prompt(1, 0),
                                block_ids=[16000, 16001]))
        assert r.get("code") == "shm_error", r
        assert other.call("noop")["result"] == "OK"
    finally:
        other.close()
        kv.close()
