"""Typed results of the data-plane operations and the KV layout of docs/protocol.md."""
from dataclasses import dataclass
from typing import List, Optional

LAYER_MAJOR = "layer_major"
BLOCK_MAJOR = "block_major"
PROOF_PAGE = 4096  # the object's last bytes, after the layout: the proof-of-access page


@dataclass(frozen=True)
class StoreResult:
    """stored: written by this request; skipped: already resident; pending: another request was
    still writing them when the server stopped waiting (not stored). l2_stored_chunks: with
    wait_l2, the stored chunks every L2 tier holds (None without wait_l2)."""
    stored_chunks: int
    skipped_chunks: int
    pending_chunks: int = 0
    l2_stored_chunks: Optional[int] = None


@dataclass(frozen=True)
class RetrieveResult:
    retrieved_chunks: int


@dataclass(frozen=True)
class RetrieveBytesResult:
    """The leading chunks of the range that are present, each an L1 object
    ([K|V][layer][token][bytes]). Asked for with chunk_frames=True (and answered so by the
    server), each chunk is a read-only memoryview of the frame it came in (no copy); it keeps the
    frame alive while referenced. bytes(chunk) copies it out."""
    chunks: List[bytes]

    @property
    def retrieved_chunks(self):
        return len(self.chunks)


@dataclass(frozen=True)
class PrefetchStatus:
    ready: bool
    hit_chunks: int


@dataclass(frozen=True)
class PingResult:
    instance_id: Optional[int]
    server_time: float
    registered: Optional[bool] = None  # with an instance_id: whether the server knows it
    # registered: whether the server is still faulting the shared memory in (docs/protocol.md)
    warming: Optional[bool] = None


@dataclass(frozen=True)
class KVLayout:
    """The layout of a registered KV cache (docs/protocol.md, "Registered KV caches").

    bytes_per_token: bytes of K (or of V) of one token of one layer
    (kv_heads x head_dim x dtype size). kv_count: 2 (K and V) or 1 (MLA latent). dtype: the
    informational dtype name sent to the server ("bfloat16", "float16", ...)."""
    num_layers: int
    num_blocks: int
    tokens_per_block: int
    bytes_per_token: int
    kv_count: int = 2
    block_order: str = LAYER_MAJOR
    dtype: Optional[str] = None

    def __post_init__(self):
        for f in ("num_layers", "num_blocks", "tokens_per_block", "bytes_per_token"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f} must be a positive integer")
        if self.kv_count not in (1, 2):
            raise ValueError("kv_count must be 1 or 2")
        if self.block_order not in (LAYER_MAJOR, BLOCK_MAJOR):
            raise ValueError("block_order must be 'layer_major' or 'block_major'")

    @property
    def block_bytes(self):
        """Bytes of one block of one layer for K (or V)."""
        return self.tokens_per_block * self.bytes_per_token

    @property
    def total_bytes(self):
        """The layout size; the shared-memory object is this plus the proof page."""
        return self.num_layers * self.kv_count * self.num_blocks * self.block_bytes

    def offset(self, layer, k, block, token=0):
        """Byte offset of (layer, K/V k, block, token) in the object (the protocol's formula)."""
        if self.block_order == LAYER_MAJOR:
            i = (layer * self.kv_count + k) * self.num_blocks + block
        else:
            i = (block * self.num_layers + layer) * self.kv_count + k
        return i * self.block_bytes + token * self.bytes_per_token

    def chunk_object_bytes(self, chunk_size):
        """Size of one cached chunk object: kv_count x num_layers x chunk_size x bytes_per_token."""
        return self.kv_count * self.num_layers * chunk_size * self.bytes_per_token

    def blocks_per_chunk(self, chunk_size):
        if chunk_size % self.tokens_per_block:
            raise ValueError(f"chunk_size {chunk_size} is not a multiple of tokens_per_block "
                             f"{self.tokens_per_block}")
        return chunk_size // self.tokens_per_block

    def fields(self):
        """The layout fields of a register_kv_cache payload."""
        d = dict(num_layers=self.num_layers, num_blocks=self.num_blocks,
                 tokens_per_block=self.tokens_per_block, bytes_per_token=self.bytes_per_token,
                 kv_count=self.kv_count, block_order=self.block_order)
        if self.dtype is not None:
            d["dtype"] = self.dtype
        return d
