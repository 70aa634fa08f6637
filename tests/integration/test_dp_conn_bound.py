"""What libzmq may hold for one tcp connection of the data socket (docs/security.md, Bounded
work and memory per request): a multipart message whose frames never end is cut once libzmq
holds more than --zmq-rcvhwm + 1 messages of --max-message-mb for it, while pipelined requests
of a client pushed back by a full worker queue, and idle connections, never are; and a flood
of empty frames, which costs libzmq 32 times its wire size, is cut by the heap bound
(--max-heap-mb) long before the per-connection bound could see it.

The flood is sent by a hand-written ZMTP 3.0 peer (NULL mechanism): libzmq clients keep the
frames of an unfinished message in their own process until its last frame is sent, so only a
peer that writes ZMTP itself can make the server buffer them."""
import select
import socket
import struct
import time

import msgpack
import zmq

import pytest

from dp_util import hashes, wire_maker, proc_status
from test_protocol import Wire

CHUNK = 32
MODEL = "conn-bound-model"
CUT = "lmcache_mp_dataplane_connections_cut_total"


@pytest.fixture
def srv(make_server):
    return wire_maker(make_server, CHUNK)


def metric(s, name):
    for line in s.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not on /metrics")


class RawZmtp:
    """A ZMTP 3.0 DEALER over a plain TCP socket: greeting, READY, then frames as given."""

    def __init__(self, port, timeout=20):
        self.timeout = timeout
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) +
                          b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
        body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        self.sock.sendall(bytes([0x04, len(body)]) + body)
        # The server's greeting and READY: no message may be sent before the handshake is over.
        self.recv_exact(64)
        flags = self.recv_exact(1)[0]
        assert flags & 0x04, flags  # a command
        size = (struct.unpack(">Q", self.recv_exact(8))[0] if flags & 0x02
                else self.recv_exact(1)[0])
        assert self.recv_exact(size).startswith(b"\x05READY")

    def recv_exact(self, n):
        out = b""
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            assert got, "the server closed the connection during the handshake"
            out += got
        return out

    def frame(self, data, more):
        """Sends one frame; False once the server has closed the connection (a reset, or its
        FIN: a closed connection may advertise no window and so never reset the sender)."""
        return self.raw(bytes([0x02 | (1 if more else 0)]) + struct.pack(">Q", len(data)) + data)

    def raw(self, data):
        """Sends bytes as they are (frames already encoded); False as frame() does."""
        buf = memoryview(data)
        self.sock.setblocking(False)
        try:
            while buf:
                try:
                    buf = buf[self.sock.send(buf):]
                    continue
                except BlockingIOError:
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    return False
                r, w, _ = select.select([self.sock], [self.sock], [], self.timeout)
                assert r or w, "the server neither reads nor closes the connection"
                if r:
                    try:
                        if not self.sock.recv(1 << 16):
                            return False
                    except ConnectionResetError:
                        return False
        finally:
            self.sock.settimeout(self.timeout)
        return True

    @property
    def local_port(self):
        return self.sock.getsockname()[1]

    def close(self):
        self.sock.close()


def test_endless_multipart_message_is_cut(srv):
    # Regression: a peer sending 64 KiB frames with MORE forever made libzmq buffer all of them
    # (300 MiB here grew the server by 300 MiB; without end, until it was OOM-killed): libzmq's
    # --zmq-rcvhwm counts whole messages, and this one never completes.
    s, w = srv("--max-message-mb", "1", "--zmq-rcvhwm", "1", "--l1-prefault=false",
               l1_size_gb="0.05")
    assert w.ok("noop")["result"] == "OK"  # a well-behaved client, connected all along
    assert metric(s, CUT) == 0
    before = proc_status(s.proc.pid, "VmRSS")
    flood, frame = 300 << 20, b"\x5a" * (64 << 10)
    z = RawZmtp(s.zmq_port)
    port = z.local_port
    sent = 0
    try:
        assert z.frame(b"rid", True) and z.frame(b"noop", True)
        while sent < flood and z.frame(frame, True):  # until the server cuts the connection
            sent += len(frame)
    finally:
        z.close()
    assert sent < flood, "the server read the whole endless message without cutting it"
    grown = proc_status(s.proc.pid, "VmHWM") - before
    assert grown < 100 << 20, grown  # the old server grew by the whole flood
    assert metric(s, CUT) >= 1
    line = [l for l in s.output().splitlines() if f"127.0.0.1:{port} cut" in l]
    assert line and "bytes received and not delivered" in line[0], s.output()[-2000:]
    assert s.get("/healthcheck").status_code == 200
    # The other client still gets its replies, big ones included.
    assert w.ok("noop")["result"] == "OK"
    h = hashes(2, b"after-flood")
    chunks = [b"\x11" * (256 << 10), b"\x22" * (256 << 10)]
    assert w.ok("store_bytes", model_name=MODEL, chunk_hashes=h, chunks=chunks)["stored_chunks"] == 2
    assert w.ok("retrieve_bytes", model_name=MODEL, chunk_hashes=h)["chunks"] == chunks
    w2 = Wire(s.zmq_port)  # and a new connection
    assert w2.ok("retrieve_bytes", model_name=MODEL, chunk_hashes=h)["chunks"] == chunks


def test_empty_frames_are_cut_by_the_heap_limit(srv):
    # Regression: empty frames cost libzmq 64 bytes each for 2 bytes on the wire, so a flood of
    # them grew the server 32 times faster than the per-connection bound on received bytes
    # (about 17 GiB at the defaults used here) could notice: 64 MB of them made 2 GiB.
    limit = 192
    s, w = srv("--max-heap-mb", str(limit), "--l1-prefault=false", l1_size_gb="0.05")
    assert w.ok("noop")["result"] == "OK"
    assert metric(s, "lmcache_mp_dataplane_heap_cuts_total") == 0
    heap = metric(s, "lmcache_mp_heap_bytes")
    assert 0 < heap < limit << 20, heap
    before = proc_status(s.proc.pid, "VmRSS")
    flood, block = 64 << 20, b"\x01\x00" * (1 << 19)  # 512 Ki empty frames with MORE a MiB
    z = RawZmtp(s.zmq_port)
    port = z.local_port
    sent = 0
    try:
        assert z.frame(b"rid", True) and z.frame(b"noop", True)
        while sent < flood and z.raw(block):
            sent += len(block)
    finally:
        z.close()
    assert sent < flood, "the server buffered the whole flood of empty frames"
    grown = proc_status(s.proc.pid, "VmHWM") - before
    # the limit, and what arrives within a check (50 ms) or two
    assert grown < (limit + 448) << 20, grown
    assert metric(s, "lmcache_mp_dataplane_heap_cuts_total") >= 1
    assert metric(s, CUT) >= 1
    line = [l for l in s.output().splitlines() if f"127.0.0.1:{port} cut" in l]
    assert line and "over --max-heap-mb" in line[0], s.output()[-2000:]
    # libzmq frees the cut connection's frames: the heap is back under the limit
    deadline = time.time() + 10
    while metric(s, "lmcache_mp_heap_bytes") > limit << 20 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(s, "lmcache_mp_heap_bytes") < limit << 20
    assert s.get("/healthcheck").status_code == 200
    assert w.ok("noop")["result"] == "OK"
    h = hashes(1, b"after-empty-frames")
    assert w.ok("store_bytes", model_name=MODEL, chunk_hashes=h,
                chunks=[b"\x33" * (1 << 20)])["stored_chunks"] == 1
    assert Wire(s.zmq_port).ok("retrieve_bytes", model_name=MODEL,
                               chunk_hashes=h)["chunks"] == [b"\x33" * (1 << 20)]


def non_reader(port):
    """A DEALER that sends and does not read: its receive buffers hold almost nothing, so the
    server's replies stay in the server's libzmq."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def wait_metric(s, name, at_least, seconds=30):
    deadline = time.time() + seconds
    while metric(s, name) < at_least and time.time() < deadline:
        time.sleep(0.1)
    return metric(s, name)


UNREAD = "lmcache_mp_dataplane_unread_reply_refusals_total"


def test_a_client_that_does_not_read_its_replies_is_refused_past_its_bound(srv):
    # Regression: replies were handed to libzmq and forgotten, so 40 retrieve_bytes requests of
    # 76 bytes, never read, grew the server by 1.2 GiB (and more requests, by more). A client's
    # replies still unwritten now count against --max-unread-reply-mb; past it, its requests
    # are answered too_large without running. Other clients are served throughout.
    s, w = srv("--max-unread-reply-mb", "64", "--max-heap-mb", "0",
               "--l1-pinned-reply-ratio", "0", "--l1-prefault=false", l1_size_gb="0.25")
    h = hashes(1, b"unread")
    obj = b"\x5a" * (16 << 20)
    assert w.ok("store_bytes", model_name=MODEL, chunk_hashes=h, chunks=[obj])["stored_chunks"] == 1
    # What malloc holds (live allocations, also under the sanitizers, whose quarantine would
    # make RSS grow with the freed replies).
    before = metric(s, "lmcache_mp_heap_bytes")
    flood = non_reader(s.zmq_port)
    req = msgpack.packb({"model_name": MODEL, "chunk_hashes": h})
    n = 40
    try:
        for i in range(n):
            flood.send_multipart([str(i).encode(), b"retrieve_bytes", req])
        assert wait_metric(s, UNREAD, n - 10) >= n - 10
        grown = metric(s, "lmcache_mp_heap_bytes") - before
        # the bound, the reply over it, one in the making and the kernel's buffers: not 40 x 16
        assert grown < 200 << 20, grown
        # another client is served, large replies included
        assert w.ok("noop")["result"] == "OK"
        assert Wire(s.zmq_port).ok("retrieve_bytes", model_name=MODEL,
                                   chunk_hashes=h)["chunks"] == [obj]
        # the non-reader reads at last: the first replies whole, the rest refused
        flood.setsockopt(zmq.RCVTIMEO, 20000)
        ok = refused = 0
        for i in range(n):
            frames = flood.recv_multipart()
            assert frames[0] == str(i).encode()
            reply = msgpack.unpackb(frames[2])
            if reply["ok"]:
                assert reply["chunks"] == [obj]
                ok += 1
            else:
                assert reply["code"] == "too_large"
                assert "--max-unread-reply-mb (64)" in reply["message"], reply
                refused += 1
        assert ok >= 4 and refused >= n - 10 and ok + refused == n
        # read, it is served again
        flood.send_multipart([b"again", b"retrieve_bytes", req])
        frames = flood.recv_multipart()
        assert msgpack.unpackb(frames[2])["chunks"] == [obj]
    finally:
        flood.close(0)


def test_unread_replies_count_for_the_heap_bound(srv):
    # Regression: the heap bound chose among the bytes libzmq received, so replies left unread
    # pushed the heap over --max-heap-mb and the cut fell on honest clients with large stores in
    # flight, never on the client that did not read. It is now counted and cut.
    limit = 256
    s, w = srv("--max-heap-mb", str(limit), "--max-unread-reply-mb", "0",
               "--l1-pinned-reply-ratio", "0", "--l1-prefault=false", l1_size_gb="0.25")
    h = hashes(1, b"unread-heap")
    obj = b"\x6b" * (16 << 20)
    assert w.ok("store_bytes", model_name=MODEL, chunk_hashes=h, chunks=[obj])["stored_chunks"] == 1
    flood = non_reader(s.zmq_port)
    req = msgpack.packb({"model_name": MODEL, "chunk_hashes": h})
    try:
        for i in range(40):
            flood.send_multipart([str(i).encode(), b"retrieve_bytes", req])
        assert wait_metric(s, "lmcache_mp_dataplane_heap_cuts_total", 1) >= 1
    finally:
        flood.close(0)
    line = [l for l in s.output().splitlines() if "of replies it has not read" in l]
    assert line and "over --max-heap-mb" in line[0], s.output()[-2000:]
    deadline = time.time() + 10
    while metric(s, "lmcache_mp_heap_bytes") > limit << 20 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(s, "lmcache_mp_heap_bytes") < limit << 20
    assert Wire(s.zmq_port).ok("retrieve_bytes", model_name=MODEL,
                               chunk_hashes=h)["chunks"] == [obj]


def store_request(i, chunk, ntok):
    """A store_bytes payload of one chunk and an ntok-token prompt (~5 bytes a token) whose
    first token is i: the worker hashes the whole prompt, so it runs far slower than the socket
    delivers it."""
    be = struct.pack(">%dI" % ntok, *range(1 << 20, (1 << 20) + ntok))
    tok = bytearray(5 * ntok)
    tok[0::5] = b"\xce" * ntok
    for lane in range(4):
        tok[1 + lane::5] = be[lane::4]
    tok[1:5] = struct.pack(">I", i)
    return (bytes([0x84]) + msgpack.packb("model_name") + msgpack.packb(MODEL) +
            msgpack.packb("end") + msgpack.packb(CHUNK) + msgpack.packb("chunks") + b"\x91" +
            b"\xc6" + struct.pack(">I", len(chunk)) + chunk +
            msgpack.packb("token_ids") + b"\xdd" + struct.pack(">I", ntok) + bytes(tok))


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_pipelined_requests_held_back_and_idle_connections_are_not_cut(srv, tmp_path, curve):
    # Requests of nearly --max-message-mb pipelined while the loop stops reading (each one is
    # over --worker-queue-mb): libzmq holds --zmq-rcvhwm of them and reads the next one, the
    # kernel queues more, for as long as the worker takes; none of that is over the bound.
    args, keys, hwm = [], None, "1"
    if curve:
        hwm = "2"  # with CURVE, libzmq 4.3.4 delivers nothing to a ROUTER of high-water mark 1
        spub, ssec = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        (tmp_path / "server.key").write_bytes(ssec + b"\n")
        (tmp_path / "clients").write_bytes(cpub + b"\n")
        args = ["--curve-secret-key-file", str(tmp_path / "server.key"),
                "--curve-allowed-clients", str(tmp_path / "clients")]
        keys = (spub, cpub, csec)
    s, _ = srv("--max-workers", "1", "--worker-queue-mb", "1", "--zmq-rcvhwm", hwm,
               "--max-message-mb", "8", "--l1-prefault=false", *args, l1_size_gb="0.1")
    chunk, ntok, n = b"\x5a" * (2 << 20), 1 << 20, 24
    msg = store_request(0, chunk, ntok)
    assert 7 << 20 < len(msg) < 8 << 20

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.setsockopt(zmq.LINGER, 0)
    if keys:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    sock.connect(f"tcp://127.0.0.1:{s.zmq_port}")
    try:
        for i in range(n):
            sock.send_multipart([b"%d" % i, b"store_bytes", store_request(i, chunk, ntok)])
        replies = {}
        for _ in range(n):
            rid, op, body = sock.recv_multipart()
            replies[int(rid)] = msgpack.unpackb(body)
        assert sorted(replies) == list(range(n))
        for i, r in replies.items():
            assert r["ok"] and r["stored_chunks"] == 1, (i, r)
        assert metric(s, "lmcache_mp_dataplane_read_pauses_total") >= 1  # it was held back
        # Idle across many checks (every 50 ms), with ZMTP heartbeats: received, never delivered.
        hb = zmq.Context.instance().socket(zmq.DEALER)
        hb.setsockopt(zmq.RCVTIMEO, 20000)
        hb.setsockopt(zmq.LINGER, 0)
        hb.setsockopt(zmq.HEARTBEAT_IVL, 100)
        if keys:
            hb.curve_serverkey, hb.curve_publickey, hb.curve_secretkey = keys
        hb.connect(f"tcp://127.0.0.1:{s.zmq_port}")
        hb.send_multipart([b"hb", b"noop", msgpack.packb({})])
        assert hb.recv_multipart()[0] == b"hb"
        time.sleep(1.5)  # the passing of time is what is tested: nothing to poll for
        for c in (sock, hb):
            c.send_multipart([b"again", b"noop", msgpack.packb({})])
            rid, _, body = c.recv_multipart()
            assert rid == b"again" and msgpack.unpackb(body)["ok"]
        hb.close(0)
    finally:
        sock.close(0)
    assert metric(s, CUT) == 0
    assert " cut: " not in s.output()
