"""Placement hashes of lmcache servers (docs/fleet.md): what `lmcache server --master-address`
reports to the master for each object it holds, computed here from token ids alone so that a
router can ask the master where a prompt's prefix lives.

    placement_hashes("m", token_ids, cache_salt="tenant-a", chunk_size=256)
"""
from .hashes import (DEFAULT_SEED_STRING, FLEET_DOMAIN, chunk_hashes, kv_rank, placement_hash,
                     placement_hashes)

__all__ = ["DEFAULT_SEED_STRING", "FLEET_DOMAIN", "chunk_hashes", "kv_rank", "placement_hash",
           "placement_hashes"]
