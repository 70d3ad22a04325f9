"""Paged KV cache bookkeeping. Importable without torch, Ray or NIXL."""

from cluster.engine.kv_cache.block_pool import Block, BlockPool
from cluster.engine.kv_cache.hashing import BlockHash, extend_salt, hash_block_tokens, hash_request_blocks
from cluster.engine.kv_cache.loads import LoadJob, TierLoader
from cluster.engine.kv_cache.tier import BlockCopier, BlockTier, TierStats, TierUsage
from cluster.engine.kv_cache.manager import CachedPrefix, KVCacheManager, NoFreeBlocksError

__all__ = [
    "Block",
    "BlockCopier",
    "BlockHash",
    "BlockPool",
    "BlockTier",
    "CachedPrefix",
    "KVCacheManager",
    "LoadJob",
    "NoFreeBlocksError",
    "TierLoader",
    "TierStats",
    "TierUsage",
    "extend_salt",
    "hash_block_tokens",
    "hash_request_blocks",
]
