"""`KVCache`: an engine's paged KV cache in POSIX shared memory, registered with the server, with
numpy views per layer, K/V and block for both block orders of docs/protocol.md."""
import mmap
import os
import re
import stat
import time
import weakref

import numpy as np

from .errors import LmcacheError
from .results import BLOCK_MAJOR, PROOF_PAGE, KVLayout

_SHM_NAME = re.compile(r"/[A-Za-z0-9._-]{1,200}")

# numpy has no bfloat16: its elements are viewed as uint16 (the bits).
_DTYPE_NAMES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
                "float8": np.uint8, "fp8": np.uint8, "uint8": np.uint8, "int8": np.int8}


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _element_dtype(layout, dtype):
    if dtype is None:
        dtype = _DTYPE_NAMES.get(layout.dtype or "", np.uint8)
    dt = np.dtype(dtype)
    if layout.bytes_per_token % dt.itemsize:
        raise ValueError(f"bytes_per_token {layout.bytes_per_token} is not a multiple of "
                         f"{dt.name}'s {dt.itemsize} bytes")
    return dt


class KVCache:
    """Creates (or reuses) the shared-memory object `shm_name` (default
    "/lmcache-kv-<pid>-<instance_id>", mode 0600), sizes it to the layout plus the 4096-byte
    proof page, maps it and registers it as `instance_id` through `client`, answering the
    server's proof-of-access challenge. On failure nothing is left behind.

    Views (numpy arrays over the mapping; writes go straight to the engine's blocks):
      `view`      [layer, k, block, token, element] in both block orders (strided as needed)
      `native`    the object in its storage order: layer_major [layer, k, block, token, element],
                  block_major [block, layer, k, token, element]
      `raw`       the layout's bytes, flat uint8
      `layer(l)`  [k, block, token, element]; `key(l)`, `value(l)`: [block, token, element]
      `block(b)`  [layer, k, token, element]
    `dtype` is the element type of the last axis (default from `layout.dtype`: bfloat16 is
    viewed as uint16, unknown names as uint8 bytes).

    Do not write blocks that a store in flight reads, nor read blocks that a retrieve in flight
    writes. `close()` unregisters, unmaps and unlinks (an object this cache created; one left
    unclosed is unlinked when the cache is garbage-collected or the interpreter exits)."""

    def __init__(self, client, instance_id, model_name, layout, *, shm_name=None, world_size=1,
                 worker_id=0, dtype=None):
        if not isinstance(layout, KVLayout):
            layout = KVLayout(**layout)
        self.client = client
        self.instance_id = instance_id
        self.model_name = model_name
        self.layout = layout
        self.world_size = world_size
        self.worker_id = worker_id
        self.dtype = _element_dtype(layout, dtype)
        self.shm_name = shm_name or f"/lmcache-kv-{os.getpid()}-{instance_id}"
        if not _SHM_NAME.fullmatch(self.shm_name) or self.shm_name in ("/.", "/.."):
            raise ValueError(f"shm_name {self.shm_name!r}: '/' then 1-200 of A-Z a-z 0-9 . _ -")
        self.path = "/dev/shm" + self.shm_name
        self._fd = None
        self._mm = None
        self._created = False
        self._registered = False
        try:
            self._create()
            self.client.register_kv_cache(instance_id, model_name, self.shm_name, layout,
                                          world_size=world_size, worker_id=worker_id,
                                          proof_fd=self._fd)
            self._registered = True
        except BaseException:
            self._teardown()
            raise

    def _create(self):
        flags = os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o600)
            # unlinked by close(), or when the cache is collected or the interpreter exits
            self._created = weakref.finalize(self, _unlink, self.path)
        except FileExistsError:
            self._fd = os.open(self.path, flags)
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise OSError(f"{self.path}: not a regular file of this user") from None
        size = self.layout.total_bytes
        os.ftruncate(self._fd, size + PROOF_PAGE)
        if self._created:
            # Allocated now: a full /dev/shm fails here (ENOSPC), not as a SIGBUS at a first
            # write, and the server faults in only pages that exist (docs/protocol.md).
            os.posix_fallocate(self._fd, 0, size + PROOF_PAGE)
        self._mm = mmap.mmap(self._fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        lo = self.layout
        e = lo.bytes_per_token // self.dtype.itemsize
        self.raw = np.frombuffer(self._mm, dtype=np.uint8, count=size)
        if lo.block_order == BLOCK_MAJOR:
            self.native = self.raw.view(self.dtype).reshape(
                lo.num_blocks, lo.num_layers, lo.kv_count, lo.tokens_per_block, e)
            self.view = self.native.transpose(1, 2, 0, 3, 4)
        else:
            self.native = self.raw.view(self.dtype).reshape(
                lo.num_layers, lo.kv_count, lo.num_blocks, lo.tokens_per_block, e)
            self.view = self.native

    # ---- views --------------------------------------------------------------------------------

    def layer(self, layer):
        return self.view[layer]

    def key(self, layer):
        return self.view[layer, 0]

    def value(self, layer):
        if self.layout.kv_count < 2:
            raise ValueError("kv_count 1 (MLA): the layer has one latent tensor, key(layer)")
        return self.view[layer, 1]

    def block(self, block):
        return self.view[:, :, block]

    def read_tokens(self, block_ids):
        """A copy of the KV of the given blocks, token after token, in the L1 object order
        [k, layer, token, element] (one chunk's object when the blocks make one chunk)."""
        g = self.view[:, :, np.asarray(block_ids, dtype=np.intp)]  # [L, K, n, T, E]
        L, K, n, T, E = g.shape
        return np.ascontiguousarray(g.transpose(1, 0, 2, 3, 4)).reshape(K, L, n * T, E)

    def write_tokens(self, block_ids, data):
        """Writes `data` ([k, layer, tokens, element], tokens = len(block_ids) x
        tokens_per_block) into the given blocks."""
        lo = self.layout
        b = np.asarray(block_ids, dtype=np.intp)
        d = np.asarray(data).reshape(lo.kv_count, lo.num_layers, len(b), lo.tokens_per_block, -1)
        self.view[:, :, b] = d.transpose(1, 0, 2, 3, 4)

    # ---- operations on this cache ---------------------------------------------------------------

    def store(self, block_ids, **chunks):
        """client.store for this instance: token_ids= or chunk_hashes=, start=, end=,
        cache_salt= -> StoreResult."""
        return self.client.store(self.instance_id, block_ids, **chunks)

    def retrieve(self, block_ids, **kw):
        """client.retrieve for this instance (request_id=, skip_first_n_tokens= and the chunk
        fields) -> RetrieveResult."""
        return self.client.retrieve(self.instance_id, block_ids, **kw)

    def send_store(self, block_ids, **chunks):
        return self.client.send_store(self.instance_id, block_ids, **chunks)

    def send_retrieve(self, block_ids, **kw):
        return self.client.send_retrieve(self.instance_id, block_ids, **kw)

    def lookup_wait(self, request_id, **kw):
        """client.lookup_wait with this cache's model_name and world_size -> hit chunks."""
        kw.setdefault("world_size", self.world_size)
        return self.client.lookup_wait(request_id, self.model_name, **kw)

    def ping(self):
        return self.client.ping(self.instance_id)

    def wait_warm(self, timeout=60.0, poll=0.01):
        """Waits until the server has faulted this cache's shared memory in (it does so in the
        background after registration: copies work meanwhile, but may pay per page). Returns
        True, or False when `timeout` seconds passed first."""
        deadline = time.monotonic() + timeout
        while True:
            p = self.ping()
            if not p.warming:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)

    def blocks_per_chunk(self):
        return self.layout.blocks_per_chunk(self.client.chunk_size)

    # ---- teardown ---------------------------------------------------------------------------------

    def _teardown(self):
        for a in ("raw", "native", "view"):
            self.__dict__.pop(a, None)
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # views are still referenced: the mapping goes with the last of them
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._created:
            self._created()  # the finalizer: unlinks once
            self._created = False

    def close(self, unregister=True):
        """Sends unregister_kv_cache (unless `unregister` is False or the client is closed),
        then unmaps and unlinks. The local teardown happens even when the request fails; its
        LmcacheError is raised afterwards."""
        err = None
        if self._registered and unregister and not self.client.closed:
            try:
                self.client.unregister_kv_cache(self.instance_id)
            except LmcacheError as e:
                err = e
        self._registered = False
        self._teardown()
        if err is not None:
            raise err

    @property
    def closed(self):
        return self._fd is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
