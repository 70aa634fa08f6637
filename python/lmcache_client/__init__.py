"""Python client of the `lmcache server` data plane (docs/protocol.md, docs/client.md).

    from lmcache_client import Client, KVCache, KVLayout
    with Client("tcp://127.0.0.1:5555") as c:
        kv = KVCache(c, instance_id=0, model_name="my-model",
                     layout=KVLayout(num_layers=32, num_blocks=1024, tokens_per_block=16,
                                     bytes_per_token=2048, dtype="bfloat16"))
        ...  # write KV into kv.view / kv.layer(l) / kv.key(l) / kv.value(l)
        kv.store(block_ids, token_ids=prompt)
        hits = kv.lookup_wait("req-1", token_ids=prompt)
        kv.retrieve(block_ids, token_ids=prompt, end=hits * c.chunk_size, request_id="req-1")
        c.end_session("req-1")

Depends on pyzmq, msgpack and numpy only (Debian: python3-zmq, python3-msgpack, python3-numpy).
"""
from . import errors
from .client import Client, Pending, load_curve_key, write_proof
from .errors import LmcacheError
from .hashing import (DEFAULT_SEED, DEFAULT_SEED_STRING, chunk_hash, chunk_hashes,
                      seed_from_string, token_array)
from .kvcache import KVCache
from .results import (BLOCK_MAJOR, LAYER_MAJOR, PROOF_PAGE, KVLayout, PingResult, PrefetchStatus,
                      RetrieveBytesResult, RetrieveResult, StoreResult)

__all__ = [
    "Client", "Pending", "KVCache", "KVLayout", "LmcacheError", "errors", "load_curve_key",
    "write_proof", "chunk_hash", "chunk_hashes", "seed_from_string", "token_array",
    "DEFAULT_SEED", "DEFAULT_SEED_STRING", "LAYER_MAJOR", "BLOCK_MAJOR", "PROOF_PAGE",
    "StoreResult", "RetrieveResult", "RetrieveBytesResult", "PrefetchStatus", "PingResult",
]
