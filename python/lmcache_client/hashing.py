"""The chunk-hash recipe of docs/protocol.md ("Keys"), the same as the server's.

A prompt is cut into chunks of `chunk_size` tokens; only full chunks count. Chunk i is
h_0 = SHA-256(seed || t_0), h_i = SHA-256(h_{i-1} || t_i), where t_i are the chunk's token ids
as big-endian uint32 and seed = SHA-256(seed string): "lmcache-chunk-hash-v1" unless the server
runs with `--hash-seed STRING`.
"""
import hashlib

import numpy as np

DEFAULT_SEED_STRING = "lmcache-chunk-hash-v1"


def seed_from_string(s):
    """The 32-byte seed of the chain for a `--hash-seed` string ("" = the built-in one)."""
    if isinstance(s, str):
        s = s.encode()
    if not s:
        s = DEFAULT_SEED_STRING.encode()
    return hashlib.sha256(s).digest()


DEFAULT_SEED = seed_from_string(DEFAULT_SEED_STRING)


def token_array(token_ids):
    """token ids (a sequence or a numpy array of integers) as a uint32 array; ValueError for
    values outside 0..2**32-1."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32:
        return token_ids.reshape(-1)
    a = np.asarray(token_ids)
    if a.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if a.dtype.kind not in "iu":
        raise ValueError("token ids must be integers")
    a = a.reshape(-1)
    if a.dtype.kind == "i" or a.dtype.itemsize > 4:
        if int(a.min()) < 0 or int(a.max()) > 0xFFFFFFFF:
            raise ValueError("token ids must be in 0..2**32-1")
    return a.astype(np.uint32)


def _seed_bytes(seed):
    if seed is None:
        return DEFAULT_SEED
    if isinstance(seed, str):
        return seed_from_string(seed)
    seed = bytes(seed)
    if len(seed) != 32:
        raise ValueError("a seed is 32 bytes (or a seed string)")
    return seed


def chunk_hash(prev, tokens):
    """One step of the chain: SHA-256(prev || tokens as big-endian uint32)."""
    h = hashlib.sha256(bytes(prev))
    h.update(token_array(tokens).astype(">u4").tobytes())
    return h.digest()


def chunk_hashes(token_ids, chunk_size, seed=None, max_chunks=None):
    """The hashes (32-byte `bytes`) of the full chunks of a prompt, in order. `seed`: None (the
    built-in seed), a seed string as given to `--hash-seed`, or the 32 seed bytes."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    toks = token_array(token_ids)
    n = len(toks) // chunk_size
    if max_chunks is not None:
        n = min(n, max_chunks)
    be = toks[:n * chunk_size].astype(">u4").tobytes()
    step = 4 * chunk_size
    prev = _seed_bytes(seed)
    out = []
    for i in range(n):
        h = hashlib.sha256(prev)
        h.update(be[i * step:(i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out
