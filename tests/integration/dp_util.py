"""A minimal data-plane client written from docs/protocol.md (pyzmq + msgpack only)."""
import hashlib
import itertools
import mmap
import os
import random
import struct
import time
import uuid

import msgpack
import zmq


PROOF_PAGE = 4096  # bytes after the layout that carry the proof-of-access nonce


def random_prompt(seed, chunks, chunk, bits=31):
    """chunks * chunk pseudo-random token ids below 2**bits, the same for the same seed."""
    rnd = random.Random(seed)
    return [rnd.randrange(1 << bits) for _ in range(chunks * chunk)]


def seq_prompt(seed, chunks, chunk):
    """chunks * chunk token ids counting up from a start derived from seed (all below 50000)."""
    return [(seed * 7919 + i) % 50000 for i in range(chunks * chunk)]


def write_proof(reply, shm_name):
    """Answers a proof_required reply: the nonce goes to byte proof_offset of the object."""
    fd = os.open("/dev/shm" + shm_name, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, reply["nonce"], reply["proof_offset"])
    finally:
        os.close(fd)


def register(raw, payload):
    """register_kv_cache through raw(op, payload) -> reply, proving access when asked to."""
    reply = raw("register_kv_cache", payload)
    if not reply["ok"] and reply.get("code") == "proof_required":
        write_proof(reply, payload["shm_name"])
        reply = raw("register_kv_cache", payload)
    return reply


class DPClient:
    """endpoint: a port (tcp on loopback) or a ZMQ endpoint string. curve: (server_public,
    client_public, client_secret) as Z85 bytes, or None."""

    def __init__(self, port, timeout_ms=30000, curve=None):
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve:
            self.sock.curve_serverkey, self.sock.curve_publickey, self.sock.curve_secretkey = curve
        self.sock.connect(port if isinstance(port, str) else f"tcp://127.0.0.1:{port}")
        self.ids = itertools.count()

    def raw(self, op, payload):
        rid = str(next(self.ids)).encode()
        self.sock.send_multipart([rid, op.encode(), msgpack.packb(payload)])
        r_id, r_op, body = self.sock.recv_multipart()
        assert r_id == rid and r_op == op.encode()
        return msgpack.unpackb(body)

    def wait_warm(self, instance_id, timeout=60):
        """Pings until the server has faulted the instance's shared memory in."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.call("ping", instance_id=instance_id)
            assert r["registered"], r
            if not r["warming"]:
                return r
            assert time.monotonic() < deadline, "the server is still faulting the region in"
            time.sleep(0.005)

    def call(self, op, **payload):
        reply = register(self.raw, payload) if op == "register_kv_cache" else self.raw(op, payload)
        if not reply["ok"]:
            raise RuntimeError(f'{reply["code"]}: {reply["message"]}')
        return reply

    def close(self):
        self.sock.close(0)


class ShmKV:
    """An engine-like paged KV cache in POSIX shared memory (layer-major layout)."""

    def __init__(self, layers=2, blocks=64, tokens_per_block=16, bytes_per_token=64, kv_count=2):
        self.layers, self.blocks, self.tpb, self.bpt, self.kv = (layers, blocks, tokens_per_block,
                                                                 bytes_per_token, kv_count)
        self.block_bytes = tokens_per_block * bytes_per_token
        self.size = layers * kv_count * blocks * self.block_bytes
        self.name = "/lmc-test-" + uuid.uuid4().hex[:12]
        self.fd = os.open("/dev/shm" + self.name, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(self.fd, self.size + PROOF_PAGE)
        self.mem = mmap.mmap(self.fd, self.size)

    def layout(self):
        return dict(num_layers=self.layers, num_blocks=self.blocks,
                    tokens_per_block=self.tpb, bytes_per_token=self.bpt, kv_count=self.kv,
                    shm_name=self.name)

    def block_off(self, layer, k, block):
        return ((layer * self.kv + k) * self.blocks + block) * self.block_bytes

    def fill_blocks(self, blocks, seed):
        for b in blocks:
            for layer in range(self.layers):
                for k in range(self.kv):
                    off = self.block_off(layer, k, b)
                    data = (f"{seed}:{b}:{layer}:{k}:".encode() * self.block_bytes)[:self.block_bytes]
                    self.mem[off:off + self.block_bytes] = data

    def read_blocks(self, blocks):
        out = []
        for b in blocks:
            for layer in range(self.layers):
                for k in range(self.kv):
                    off = self.block_off(layer, k, b)
                    out.append(bytes(self.mem[off:off + self.block_bytes]))
        return out

    def zero(self):
        self.mem[:] = b"\0" * self.size

    def allocate(self):
        """Gives the object its memory (as an engine that has used every block): the server
        faults in only pages an object holds."""
        os.posix_fallocate(self.fd, 0, self.size + PROOF_PAGE)

    def close(self):
        self.mem.close()
        os.close(self.fd)
        try:
            os.unlink("/dev/shm" + self.name)
        except FileNotFoundError:
            pass


def hashes(n, tag=b""):
    """n distinct 32-byte chunk hashes (SHA-256 of tag and the index)."""
    return [hashlib.sha256(tag + struct.pack(">I", i)).digest() for i in range(n)]


def wire_maker(make_server, chunk):
    """make(*server_args, **server_kw) -> (server, Wire) of a server with --chunk-size chunk."""
    from test_protocol import Wire  # test_protocol imports this module

    def make(*args, **kw):
        s = make_server(args=["--chunk-size", str(chunk)] + list(args), **kw)
        return s, Wire(s.zmq_port)
    return make


def proc_status(pid, field):
    """A /proc/PID/status field in bytes (VmRSS, VmHWM, ...)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)
