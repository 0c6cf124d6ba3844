"""Paged, prefix-cached KV cache that understands DeepSeek-V4's layer kinds.

spec.py (what a layer caches) -> groups.py (groups, buckets, sizing, tensors) ->
block_pool.py (blocks, free queue, hash map) + hashing.py (chained block hashes) ->
managers.py (one per group) -> manager.py (KVCacheManager, what the scheduler sees).
"""
from __future__ import annotations

from wideserve.kv_cache.block_pool import BlockPool, KVBlock
from wideserve.kv_cache.groups import (KVCacheBucket, KVCacheConfig, KVCacheGroup,
                                       allocate_kv_tensors, build_kv_cache_config,
                                       exact_replay_tokens)
from wideserve.kv_cache.hashing import BlockHasher, hash_block_tokens
from wideserve.kv_cache.kv_cache_manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec, SharedKVSpec, split_shared

__all__ = [
    "BlockHasher", "BlockPool", "CacheKind", "KVBlock", "KVCacheBlocks", "KVCacheBucket",
    "KVCacheConfig", "KVCacheGroup", "KVCacheManager", "KVCacheSpec", "PrefixCacheStats",
    "SharedKVSpec", "allocate_kv_tensors", "build_kv_cache_config", "exact_replay_tokens",
    "hash_block_tokens", "split_shared",
]
