"""The placement-hash recipe, the same as src/server/fleethash.c and src/server/keys.c."""
import hashlib
import struct

DEFAULT_SEED_STRING = "lmcache-chunk-hash-v1"
FLEET_DOMAIN = b"lmcache-fleet-v1"


def chunk_hashes(token_ids, chunk_size=256, seed_string=None):
    """The prefix chain of the server (`--chunk-size`, `--hash-seed`): one 32-byte hash per full
    chunk, h_0 = SHA-256(seed || t_0), h_i = SHA-256(h_{i-1} || t_i), tokens as big-endian
    uint32, seed = SHA-256(seed string). Trailing tokens that do not fill a chunk are ignored."""
    if chunk_size <= 0:
        raise ValueError("chunk_size must be positive")
    prev = hashlib.sha256((seed_string or DEFAULT_SEED_STRING).encode()).digest()
    out = []
    for i in range(len(token_ids) // chunk_size):
        chunk = token_ids[i * chunk_size:(i + 1) * chunk_size]
        prev = hashlib.sha256(prev + struct.pack(">%dI" % len(chunk), *chunk)).digest()
        out.append(prev)
    return out


def kv_rank(world_size=1, rank=0):
    """world_size << 24 | rank << 16 | world_size << 8 | rank (TP1: 0x01000100)."""
    if not 1 <= world_size <= 255 or not 0 <= rank < world_size:
        raise ValueError("world_size must be 1..255 and rank 0..world_size-1")
    return world_size << 24 | rank << 16 | world_size << 8 | rank


def placement_hash(model_name, cache_salt, rank, chunk_hash):
    """Lowercase hex of SHA-256("lmcache-fleet-v1" 0 model 0 salt 0 kv_rank(u32 BE) chunk_hash)."""
    h = hashlib.sha256()
    h.update(FLEET_DOMAIN + b"\0" + model_name.encode() + b"\0" + (cache_salt or "").encode() +
             b"\0" + struct.pack(">I", rank) + bytes(chunk_hash))
    return h.hexdigest()


def placement_hashes(model_name, token_ids, cache_salt="", chunk_size=256, world_size=1, rank=0,
                     seed_string=None):
    """The placement hashes of a prompt's full chunks for one rank, in prompt order."""
    r = kv_rank(world_size, rank)
    return [placement_hash(model_name, cache_salt, r, c)
            for c in chunk_hashes(token_ids, chunk_size, seed_string)]
