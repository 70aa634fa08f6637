"""`Client`: every data-plane operation of docs/protocol.md over one ZMQ DEALER socket,
synchronous (`client.store(...)`) or pipelined (`client.send_store(...)` returns a `Pending`
that the client resolves as replies arrive; no thread of its own)."""
import asyncio
import os
import time

import msgpack
import numpy as np
import zmq

from . import errors
from .errors import LmcacheError
from .results import (KVLayout, PingResult, PrefetchStatus, RetrieveBytesResult, RetrieveResult,
                      StoreResult)

_BIG_FRAME = 1 << 16  # payloads above this are handed to ZMQ without a copy


def load_curve_key(path):
    """The Z85 key line (40 characters) of a key file written by `lmcache curve-keygen`
    (`PREFIX.pub` or `PREFIX.key`; `#` lines are skipped)."""
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                return line
    raise ValueError(f"{path}: no key line")


def _endpoint(endpoint):
    if isinstance(endpoint, int) and not isinstance(endpoint, bool):
        return f"tcp://127.0.0.1:{endpoint}"
    if isinstance(endpoint, tuple) and len(endpoint) == 2:
        return f"tcp://{endpoint[0]}:{int(endpoint[1])}"
    if isinstance(endpoint, str):
        if "://" in endpoint:
            return endpoint
        host, sep, port = endpoint.rpartition(":")
        if sep and host and port.isdigit():
            return f"tcp://{endpoint}"
    raise ValueError(f"not an endpoint: {endpoint!r} (tcp://HOST:PORT, ipc://PATH, HOST:PORT, "
                     "(host, port) or a port on 127.0.0.1)")


def _ids(block_ids):
    if isinstance(block_ids, np.ndarray):
        return block_ids.reshape(-1).tolist()
    return list(block_ids)


def _chunk_fields(p, token_ids, chunk_hashes, start, end, cache_salt):
    """Adds the protocol's chunk fields to payload p."""
    if (token_ids is None) == (chunk_hashes is None):
        raise ValueError("exactly one of token_ids or chunk_hashes is required")
    if token_ids is not None:
        if isinstance(token_ids, np.ndarray):
            from .hashing import token_array
            p["token_ids"] = token_array(token_ids).tolist()
        else:
            p["token_ids"] = token_ids if isinstance(token_ids, list) else list(token_ids)
    else:
        p["chunk_hashes"] = [bytes(h) for h in chunk_hashes]
    if start:
        p["start"] = start
    if end is not None:
        p["end"] = end
    if cache_salt:
        p["cache_salt"] = cache_salt
    return p


def _int(reply, name, op, default=None):
    v = reply.get(name, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise LmcacheError(errors.PROTOCOL, f"reply field {name!r} is missing or not an integer",
                           op)
    return v


def _dec_none(reply, op):
    return None


def _dec_store(reply, op):
    l2 = reply.get("l2_stored_chunks")
    return StoreResult(_int(reply, "stored_chunks", op), _int(reply, "skipped_chunks", op, 0),
                       _int(reply, "pending_chunks", op, 0),
                       _int(reply, "l2_stored_chunks", op) if l2 is not None else None)


def _dec_retrieve(reply, op):
    return RetrieveResult(_int(reply, "retrieved_chunks", op))


def _dec_retrieve_bytes(reply, op):
    chunks = reply.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(c, (bytes, memoryview))
                                               for c in chunks):
        raise LmcacheError(errors.PROTOCOL, "reply field 'chunks' is not an array of bin", op)
    return RetrieveBytesResult(chunks)


def _dec_status(reply, op):
    ready = reply.get("ready")
    if not isinstance(ready, bool):
        raise LmcacheError(errors.PROTOCOL, "reply field 'ready' is not a boolean", op)
    return PrefetchStatus(ready, _int(reply, "hit_chunks", op, 0))


def _dec_lookup_status(reply, op):
    """A lookup asked for reply_status: its first status, or None from a server without it."""
    return None if "ready" not in reply else _dec_status(reply, op)


def _dec_ping(reply, op):
    inst = reply.get("instance_id")
    t = reply.get("server_time")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise LmcacheError(errors.PROTOCOL, "reply field 'server_time' is not a number", op)
    reg = reply.get("registered")
    warming = reply.get("warming")
    return PingResult(inst if isinstance(inst, int) and inst >= 0 else None, float(t),
                      reg if isinstance(reg, bool) else None,
                      warming if isinstance(warming, bool) else None)


def _dec_chunk_size(reply, op):
    return _int(reply, "chunk_size", op)


def _dec_cleared(reply, op):
    return _int(reply, "cleared", op)


def _dec_released(reply, op):
    return _int(reply, "released", op)


def _dec_raw(reply, op):
    return reply


# Counts the server reports along with an error are kept as LmcacheError.result.
_PARTIAL = {"store": _dec_store, "store_bytes": _dec_store, "retrieve": _dec_retrieve}


class Pending:
    """The handle of one request in flight (a future resolved by its client). `result()` waits
    for the reply (reading the socket; replies of other requests that arrive meanwhile resolve
    their own handles) and returns the typed result or raises `LmcacheError`. `done()` checks
    without blocking. Callbacks added with `add_done_callback(fn)` run, with the handle, inside
    whichever client call receives the reply."""

    __slots__ = ("_client", "op", "rid", "_payload", "_frames", "_decode", "_retry", "_done",
                 "_value", "_exc", "_callbacks")

    def __init__(self, client, op, payload, decode):
        self._client = client
        self.op = op
        self.rid = b""
        self._payload = payload
        self._frames = ()  # frames after the payload (store_bytes chunk frames)
        self._decode = decode
        self._retry = None
        self._done = False
        self._value = None
        self._exc = None
        self._callbacks = []

    def done(self):
        if not self._done:
            self._client.poll(0)
        return self._done

    def result(self, timeout=None):
        """The operation's result; `timeout` in seconds (None: the client's timeout). On
        timeout raises LmcacheError('timeout') and the request stays in flight."""
        if not self._done:
            self._client._wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout=None):
        if not self._done:
            self._client._wait(self, timeout)
        return self._exc

    def __await__(self):
        """`await handle` (inside an asyncio event loop): the result, without blocking the loop;
        replies are read when the client's socket becomes readable."""
        return self._client._await(self, None).__await__()

    async def wait_async(self, timeout=None):
        """`await handle` with a timeout in seconds (None: the client's)."""
        return await self._client._await(self, timeout)

    def add_done_callback(self, fn):
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def _finish(self, value=None, exc=None):
        self._value, self._exc, self._done = value, exc, True
        self._payload = None
        self._frames = ()
        for fn in self._callbacks:
            fn(self)
        self._callbacks = []

    def __repr__(self):
        state = "done" if self._done else "pending"
        return f"<Pending {self.op} id={self.rid.decode()} {state}>"


class Client:
    """A connection to the data socket of `lmcache server`.

    endpoint: "tcp://HOST:PORT", "ipc://PATH" (the server's `--ipc-path`: on the same host the
    server then knows the engine's uid and asks no proof of access), "HOST:PORT", (host, port),
    or a port number on 127.0.0.1. timeout: seconds for every synchronous call and for
    `Pending.result()` without its own timeout. connect_timeout: ZMQ's connect timeout. CURVE
    (docs/security.md): the server's public key and this client's key pair, 40-character Z85
    strings (`load_curve_key` reads the files `lmcache curve-keygen` writes); all three or none.
    A client key the server does not allow gets no reply: calls fail with code 'timeout'.

    Not internally locked: use a client from one thread at a time (one client per thread; each
    has its own ZMQ context and DEALER socket unless `context` is given). Lookup sessions and
    registrations belong to the client (connection) that made them."""

    def __init__(self, endpoint, *, timeout=30.0, connect_timeout=5.0, curve_server_key=None,
                 curve_public_key=None, curve_secret_key=None, context=None):
        self.endpoint = _endpoint(endpoint)
        keys = (curve_server_key, curve_public_key, curve_secret_key)
        if any(k is not None for k in keys) and not all(k is not None for k in keys):
            raise ValueError("CURVE needs all three keys: curve_server_key, curve_public_key and "
                             "curve_secret_key")
        keys = [k.encode() if isinstance(k, str) else k for k in keys]
        if keys[0] is not None and any(len(k) != 40 for k in keys):
            raise ValueError("CURVE keys are 40-character Z85 strings")
        self.timeout = float(timeout)
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sock = self._ctx.socket(zmq.DEALER)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, 0)  # unlimited: a deep pipeline never blocks...
            self._sock.setsockopt(zmq.RCVHWM, 0)  # ...nor drops replies
            self._sock.setsockopt(zmq.CONNECT_TIMEOUT, int(connect_timeout * 1000))
            if keys[0] is not None:
                self._sock.curve_serverkey = keys[0]
                self._sock.curve_publickey = keys[1]
                self._sock.curve_secretkey = keys[2]
            self._sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            if self._own_ctx:
                self._ctx.term()
            raise LmcacheError(errors.TRANSPORT, f"connect {self.endpoint}: {e}") from None
        self._next = 0
        self._pending = {}
        self._chunk_size = None
        self._aio_waiters = set()  # asyncio.Events of the tasks awaiting a handle
        self._aio_loop = None      # the event loop watching the socket's fd, while any wait

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self):
        """Closes the socket; requests still in flight fail with code 'transport'."""
        if self._sock is None:
            return
        if self._aio_loop is not None:
            self._aio_loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._aio_loop = None
        self._sock.close(0)
        self._sock = None
        if self._own_ctx:
            self._ctx.term()
        pending, self._pending = self._pending, {}
        for p in pending.values():
            p._finish(exc=LmcacheError(errors.TRANSPORT, "client closed", p.op))
        for ev in list(self._aio_waiters):
            ev.set()

    @property
    def closed(self):
        return self._sock is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def in_flight(self):
        """Requests sent whose replies have not arrived yet."""
        return len(self._pending)

    # ---- the wire -------------------------------------------------------------------------------

    def _transmit(self, p):
        if self._sock is None:
            raise LmcacheError(errors.TRANSPORT, "client is closed", p.op)
        self._next += 1
        p.rid = b"%d" % self._next
        body = p._payload
        try:
            if p._frames:  # sent from the caller's buffers, which pyzmq holds until sent
                self._sock.send_multipart([p.rid, p.op.encode(), body, *p._frames], copy=False)
            elif len(body) > _BIG_FRAME:
                self._sock.send_multipart([p.rid, p.op.encode(), body], copy=False)
            else:
                self._sock.send_multipart([p.rid, p.op.encode(), body])
        except zmq.ZMQError as e:
            raise LmcacheError(errors.TRANSPORT, f"send: {e}", p.op) from None
        self._pending[p.rid] = p
        return p

    def send_raw(self, op, payload=None, decode=_dec_raw, frames=()):
        """Sends operation `op` with `payload` (a dict packed as the msgpack map, or bytes sent
        verbatim as frame 2) and `frames` after it (bytes-like, sent without a copy). The
        handle's result is the reply map (`decode`: a function of (reply, op) for a typed one);
        an error reply raises LmcacheError."""
        if isinstance(payload, (bytes, bytearray, memoryview)):
            body = bytes(payload)
        else:
            body = msgpack.packb(payload or {}, use_bin_type=True)
        p = Pending(self, op, body, decode)
        p._frames = tuple(frames)
        return self._transmit(p)

    def _resolve(self, p, reply):
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            p._finish(exc=LmcacheError(errors.PROTOCOL, "reply is not a map with a boolean 'ok'",
                                       p.op))
            return
        if not reply["ok"]:
            code = reply.get("code")
            msg = reply.get("message", "")
            code = code if isinstance(code, str) else errors.PROTOCOL
            if p._retry is not None and p._retry(p, reply):
                return  # sent again (proof of access written)
            partial = None
            dec = _PARTIAL.get(p.op)
            if dec is not None:
                try:
                    partial = dec(reply, p.op)
                except LmcacheError:
                    pass
            p._finish(exc=LmcacheError(code, msg if isinstance(msg, str) else str(msg), p.op,
                                       reply, partial))
            return
        try:
            value = p._decode(reply, p.op)
        except LmcacheError as e:
            p._finish(exc=e)
            return
        p._finish(value)

    def _receive(self, timeout_ms):
        """Reads at most one reply, waiting up to timeout_ms (-1: forever); True if one came."""
        if self._sock is None:
            raise LmcacheError(errors.TRANSPORT, "client is closed")
        try:
            if not self._sock.poll(timeout_ms, zmq.POLLIN):
                return False
            frames = self._sock.recv_multipart(copy=False)
        except zmq.ZMQError as e:
            raise LmcacheError(errors.TRANSPORT, f"receive: {e}") from None
        if len(frames) < 1:
            return True
        p = self._pending.pop(frames[0].bytes, None)
        if p is None:
            return True  # a reply to a request whose caller gave up (timed out): dropped
        if len(frames) < 3:
            p._finish(exc=LmcacheError(errors.PROTOCOL, f"reply of {len(frames)} frames", p.op))
            return True
        try:
            reply = msgpack.unpackb(frames[2].buffer, raw=False)
        except Exception as e:  # any malformed msgpack
            p._finish(exc=LmcacheError(errors.PROTOCOL, f"reply is not msgpack: {e}", p.op))
            return True
        # retrieve_bytes with chunk_frames: the chunks follow the map, as many as it announces.
        extra = frames[3:]
        n = reply.get("chunk_frames") if isinstance(reply, dict) else None
        if extra or n is not None:
            if type(n) is not int or n != len(extra):
                p._finish(exc=LmcacheError(errors.PROTOCOL, f"reply of {len(frames)} frames",
                                           p.op))
                return True
            reply["chunks"] = [f.buffer for f in extra]
        self._resolve(p, reply)
        return True

    def poll(self, timeout=0):
        """Handles the replies that have arrived (waiting up to `timeout` seconds for the first);
        returns how many were read."""
        n = 0
        t = -1 if timeout is None else int(timeout * 1000)
        while self._pending and self._receive(t if n == 0 else 0):
            n += 1
        return n

    def _wait(self, p, timeout):
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not p._done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LmcacheError(errors.TIMEOUT, f"no reply within {timeout:g} s", p.op)
            self._receive(max(1, int(left * 1000 + 0.999)))

    def _on_readable(self):
        # ZMQ's fd is edge-triggered: read every reply that is there, then wake the waiters.
        try:
            self.poll(0)
        except LmcacheError:
            pass  # closed: the waiters see their handles failed
        for ev in list(self._aio_waiters):
            ev.set()

    async def _await(self, p, timeout):
        timeout = self.timeout if timeout is None else timeout
        if p._done or self._sock is None:
            return p.result(0)
        loop = asyncio.get_running_loop()
        if self._aio_loop is None:
            loop.add_reader(self._sock.getsockopt(zmq.FD), self._on_readable)
            self._aio_loop = loop
        elif self._aio_loop is not loop:
            raise RuntimeError("a Client's handles are awaited from one event loop at a time")
        ev = asyncio.Event()
        self._aio_waiters.add(ev)
        deadline = loop.time() + timeout
        try:
            while True:
                self.poll(0)  # drain what is there (also re-arms the edge-triggered fd)
                if p._done:
                    break
                left = deadline - loop.time()
                if left <= 0:
                    raise LmcacheError(errors.TIMEOUT, f"no reply within {timeout:g} s", p.op)
                ev.clear()
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._aio_waiters.discard(ev)
            if not self._aio_waiters and self._aio_loop is not None:
                if self._sock is not None:
                    self._aio_loop.remove_reader(self._sock.getsockopt(zmq.FD))
                self._aio_loop = None
        return p.result(0)

    def wait_all(self, timeout=None):
        """Waits until no request is in flight (`timeout` seconds in all; None: the client's)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LmcacheError(errors.TIMEOUT, f"{len(self._pending)} replies missing after "
                                   f"{timeout:g} s")
            self._receive(max(1, int(left * 1000)))

    def _sync(self, p):
        try:
            return p.result()
        except LmcacheError as e:
            if e.code == errors.TIMEOUT:
                self._pending.pop(p.rid, None)  # forgotten: a late reply is dropped
            raise

    def call(self, op, payload=None):
        """Synchronous `send_raw`: the reply map of a successful request."""
        return self._sync(self.send_raw(op, payload))

    def submit(self, op, *args, **kwargs):
        """`client.submit("store", ...)` is `client.send_store(...)`."""
        fn = getattr(self, "send_" + op, None)
        if fn is None:
            raise ValueError(f"unknown operation {op!r}")
        return fn(*args, **kwargs)

    # ---- pipelined operations: send_<op>(...) -> Pending ----------------------------------------

    def send_noop(self):
        return self.send_raw("noop", None, _dec_none)

    def send_ping(self, instance_id=None):
        return self.send_raw("ping", {} if instance_id is None else {"instance_id": instance_id},
                             _dec_ping)

    def send_get_chunk_size(self):
        return self.send_raw("get_chunk_size", None, _dec_chunk_size)

    def send_clear(self):
        return self.send_raw("clear", None, _dec_cleared)

    def send_register_kv_cache(self, instance_id, model_name, shm_name, layout, *, world_size=1,
                               worker_id=0, proof_fd=None):
        """register_kv_cache for an existing shared-memory object `shm_name` ("/name"). A
        `proof_required` reply is answered here: the nonce is written at `proof_offset` of the
        object (through `proof_fd` when given, else by opening /dev/shm/<name>) and the request
        is sent again, under the same handle."""
        if not isinstance(layout, KVLayout):
            layout = KVLayout(**layout)
        p = dict(instance_id=instance_id, model_name=model_name, world_size=world_size,
                 worker_id=worker_id, shm_name=shm_name, **layout.fields())
        h = self.send_raw("register_kv_cache", p, _dec_none)
        h._retry = _ProofAnswer(self, h._payload, shm_name, proof_fd)
        return h

    def send_unregister_kv_cache(self, instance_id):
        return self.send_raw("unregister_kv_cache", {"instance_id": instance_id}, _dec_none)

    def send_lookup(self, request_id, model_name, *, token_ids=None, chunk_hashes=None, start=0,
                    end=None, cache_salt="", world_size=1, num_kv_readers=1,
                    _reply_status=False):
        p = {"request_id": request_id, "model_name": model_name}
        if world_size != 1:
            p["world_size"] = world_size
        if num_kv_readers != 1:
            p["num_kv_readers"] = num_kv_readers
        if _reply_status:  # lookup_wait: the reply carries the first status (or None: old server)
            p["reply_status"] = True
        return self.send_raw("lookup", _chunk_fields(p, token_ids, chunk_hashes, start, end,
                                                     cache_salt),
                             _dec_lookup_status if _reply_status else _dec_none)

    def send_query_prefetch_status(self, request_id):
        return self.send_raw("query_prefetch_status", {"request_id": request_id}, _dec_status)

    def send_store(self, instance_id, block_ids, *, token_ids=None, chunk_hashes=None, start=0,
                   end=None, cache_salt="", wait_l2=False):
        """wait_l2: the reply waits for the write-through to every L2 tier (l2_stored_chunks)."""
        p = {"instance_id": instance_id, "block_ids": _ids(block_ids)}
        if wait_l2:
            p["wait_l2"] = True
        return self.send_raw("store", _chunk_fields(p, token_ids, chunk_hashes, start, end,
                                                    cache_salt), _dec_store)

    def send_retrieve(self, instance_id, block_ids, *, token_ids=None, chunk_hashes=None,
                      start=0, end=None, cache_salt="", request_id=None, skip_first_n_tokens=0):
        p = {"instance_id": instance_id, "block_ids": _ids(block_ids)}
        if request_id is not None:
            p["request_id"] = request_id
        if skip_first_n_tokens:
            p["skip_first_n_tokens"] = skip_first_n_tokens
        return self.send_raw("retrieve", _chunk_fields(p, token_ids, chunk_hashes, start, end,
                                                       cache_salt), _dec_retrieve)

    def send_store_bytes(self, model_name, chunks, *, token_ids=None, chunk_hashes=None, start=0,
                         end=None, cache_salt="", world_size=1, worker_id=0, wait_l2=False,
                         chunk_frames=False):
        """chunks: one bytes-like object per chunk of the range, in the L1 object layout
        [K|V][layer][token][bytes] (numpy arrays are sent as their bytes). wait_l2: as store.
        chunk_frames=True sends each chunk as a frame after the payload, from its own buffer
        (no copy into the request; keep the buffers unchanged until the reply has arrived);
        servers before chunk frames answer bad_request."""
        frames = ()
        if chunk_frames:
            frames = [_as_frame(c) for c in chunks]
            p = {"model_name": model_name, "chunk_frames": len(frames)}
        else:
            p = {"model_name": model_name, "chunks": [_as_bin(c) for c in chunks]}
        if wait_l2:
            p["wait_l2"] = True
        if world_size != 1:
            p["world_size"] = world_size
        if worker_id:
            p["worker_id"] = worker_id
        return self.send_raw("store_bytes", _chunk_fields(p, token_ids, chunk_hashes, start, end,
                                                          cache_salt), _dec_store, frames)

    def send_retrieve_bytes(self, model_name, *, token_ids=None, chunk_hashes=None, start=0,
                            end=None, cache_salt="", world_size=1, worker_id=0, request_id=None,
                            chunk_frames=False):
        """chunk_frames=True asks for the chunks as frames after the reply map (sent from the
        server's cache memory, kept here as received: see RetrieveBytesResult)."""
        p = {"model_name": model_name}
        if chunk_frames:
            p["chunk_frames"] = True
        if world_size != 1:
            p["world_size"] = world_size
        if worker_id:
            p["worker_id"] = worker_id
        if request_id is not None:
            p["request_id"] = request_id
        return self.send_raw("retrieve_bytes", _chunk_fields(p, token_ids, chunk_hashes, start,
                                                             end, cache_salt),
                             _dec_retrieve_bytes)

    def send_free_lookup_locks(self, request_id, *, start=None, end=None, worker_id=None):
        p = {"request_id": request_id}
        if start is not None:
            p["start"] = start
        if end is not None:
            p["end"] = end
        if worker_id is not None:
            p["worker_id"] = worker_id
        return self.send_raw("free_lookup_locks", p, _dec_released)

    def send_end_session(self, request_id):
        return self.send_raw("end_session", {"request_id": request_id}, _dec_none)

    # ---- synchronous operations ------------------------------------------------------------------

    def noop(self):
        """A cheap round trip (ZMQ connects lazily: an absent server shows up as 'timeout')."""
        return self._sync(self.send_noop())

    def ping(self, instance_id=None):
        """Refreshes the liveness of a registration (send one every ~10 s while idle)."""
        return self._sync(self.send_ping(instance_id))

    def get_chunk_size(self):
        self._chunk_size = self._sync(self.send_get_chunk_size())
        return self._chunk_size

    @property
    def chunk_size(self):
        """The server's chunk size in tokens (asked once, then remembered)."""
        if self._chunk_size is None:
            self.get_chunk_size()
        return self._chunk_size

    def clear(self):
        """Removes every L1 object; returns how many."""
        return self._sync(self.send_clear())

    def register_kv_cache(self, instance_id, model_name, shm_name, layout, *, world_size=1,
                          worker_id=0, proof_fd=None):
        """Registers an existing shared-memory object (see `KVCache` to create one)."""
        return self._sync(self.send_register_kv_cache(instance_id, model_name, shm_name, layout,
                                                      world_size=world_size,
                                                      worker_id=worker_id, proof_fd=proof_fd))

    def unregister_kv_cache(self, instance_id):
        return self._sync(self.send_unregister_kv_cache(instance_id))

    def lookup(self, request_id, model_name, **kw):
        """Starts a lookup session (read locks on the leading present chunks); see
        `query_prefetch_status` and `lookup_wait`."""
        return self._sync(self.send_lookup(request_id, model_name, **kw))

    def query_prefetch_status(self, request_id):
        return self._sync(self.send_query_prefetch_status(request_id))

    def lookup_wait(self, request_id, model_name, *, poll_interval=0.0001, **kw):
        """lookup, then query_prefetch_status until ready; returns the hit chunks. The lookup
        asks for the session's first status in its reply (reply_status), so a lookup served from
        L1 costs one request and one reply; a server that predates it is queried at once."""
        lk = self.send_lookup(request_id, model_name, _reply_status=True, **kw)
        st = self._sync(lk)  # a refused lookup raises its own error
        if st is not None and st.ready:
            return st.hit_chunks
        deadline = time.monotonic() + self.timeout
        first = st is None
        while True:
            if not first:
                time.sleep(poll_interval)
            first = False
            st = self._sync(self.send_query_prefetch_status(request_id))
            if st.ready:
                return st.hit_chunks
            if time.monotonic() >= deadline:
                raise LmcacheError(errors.TIMEOUT, f"lookup {request_id!r} not ready within "
                                   f"{self.timeout:g} s", "lookup")

    def store(self, instance_id, block_ids, **kw):
        """Copies the chunks of the range from the engine blocks into L1 -> StoreResult."""
        return self._sync(self.send_store(instance_id, block_ids, **kw))

    def retrieve(self, instance_id, block_ids, **kw):
        """Copies the chunks of the range from L1 into the engine blocks -> RetrieveResult."""
        return self._sync(self.send_retrieve(instance_id, block_ids, **kw))

    def store_bytes(self, model_name, chunks, **kw):
        return self._sync(self.send_store_bytes(model_name, chunks, **kw))

    def retrieve_bytes(self, model_name, **kw):
        return self._sync(self.send_retrieve_bytes(model_name, **kw))

    def free_lookup_locks(self, request_id, **kw):
        """Releases the session's remaining locks in the range; returns how many."""
        return self._sync(self.send_free_lookup_locks(request_id, **kw))

    def end_session(self, request_id):
        return self._sync(self.send_end_session(request_id))


def _as_bin(c):
    if isinstance(c, bytes):
        return c
    if isinstance(c, np.ndarray):
        return c.tobytes()
    return bytes(c)


def _as_frame(c):
    """A chunk as a frame: its own buffer when it is contiguous (no copy), else its bytes."""
    if isinstance(c, bytes):
        return c
    if isinstance(c, np.ndarray):
        return c if c.flags.c_contiguous else c.tobytes()
    m = memoryview(c)
    return m if m.contiguous else m.tobytes()


class _ProofAnswer:
    """Answers one proof_required reply of register_kv_cache, then sends the request again."""

    def __init__(self, client, body, shm_name, fd):
        self.client, self.body, self.shm_name, self.fd = client, body, shm_name, fd

    def __call__(self, p, reply):
        if reply.get("code") != errors.PROOF_REQUIRED or self.body is None:
            return False
        nonce, off = reply.get("nonce"), reply.get("proof_offset")
        if not isinstance(nonce, bytes) or not isinstance(off, int) or off < 0:
            return False
        try:
            write_proof(self.shm_name, nonce, off, self.fd)
        except OSError as e:
            p._finish(exc=e)
            return True
        p._payload, self.body = self.body, None  # one answer per request
        self.client._transmit(p)
        return True


def write_proof(shm_name, nonce, offset, fd=None):
    """Writes the proof-of-access nonce at byte `offset` of the object (docs/protocol.md)."""
    if fd is not None:
        os.pwrite(fd, nonce, offset)
        return
    fd = os.open("/dev/shm" + shm_name, os.O_RDWR | os.O_NOFOLLOW)
    try:
        os.pwrite(fd, nonce, offset)
    finally:
        os.close(fd)
