from __future__ import annotations

import random

import pytest
import torch
from kv_testing import FULL, SLIDING, make_request

from wideserve.kv_cache.block_pool import BlockPool
from wideserve.kv_cache.groups import KVCacheGroup
from wideserve.kv_cache.hashing import BlockHasher, sub_block_key
from wideserve.kv_cache.group_managers import FullManager, SlidingWindowManager
from wideserve.kv_cache.spec import KVCacheSpec

L = 16   # logical block


def full_manager(ratio: int = 1, num_blocks: int = 32) -> FullManager:
    spec = KVCacheSpec(FULL, "kv", 4, torch.float32, compress_ratio=ratio)
    return FullManager(KVCacheGroup(0, spec, ("x",), L, 0), BlockPool(num_blocks), L, True)


def sliding_manager(window: int, page: int, num_blocks: int = 64, logical: int = L,
                    gid: int = 1) -> SlidingWindowManager:
    spec = KVCacheSpec(SLIDING, "w", 4, torch.float32, window=window)
    return SlidingWindowManager(KVCacheGroup(gid, spec, ("y",), page, 0), BlockPool(num_blocks),
                                logical, True)


def test_full_manager_grows_and_hits_a_prefix():
    m = full_manager(ratio=4)
    assert m.group.entries_per_block == 4           # the ratio only changes entries per page
    req = make_request("a", list(range(3 * L + 5)))
    BlockHasher(L)(req)
    assert m.num_blocks_to_allocate("a", 20, ()) == 2
    assert len(m.allocate_new_blocks("a", 20)) == 2
    assert len(m.allocate_new_blocks("a", 3 * L + 5)) == 2
    assert m.allocate_new_blocks("a", 3 * L + 5) == []
    m.cache_blocks(req, 2 * L + 3)                  # two full logical blocks computed
    blocks = m.blocks("a")
    assert [b.block_hash for b in blocks] == req.block_hashes[:2] + [None, None]
    assert m.req_tables["a"] == [b.block_id for b in blocks]
    m.cache_blocks(req, 3 * L + 5)
    assert blocks[2].block_hash == req.block_hashes[2] and blocks[3].block_hash is None
    assert m.find_longest_cache_hit(req.block_hashes, 3) == blocks[:3]
    assert m.find_longest_cache_hit(req.block_hashes, 2) == blocks[:2]
    other = make_request("b", list(range(L)) + [7] * (2 * L))
    BlockHasher(L)(other)
    assert m.find_longest_cache_hit(other.block_hashes, 3) == blocks[:1]
    m.free("a")
    assert m.pool.num_free_blocks == 31 and "a" not in m.req_tables


@pytest.mark.parametrize("window,page,logical", [(5, 8, 16), (8, 8, 16), (16, 16, 16),
                                                 (1, 1, 4), (20, 16, 16), (3, 4, 16)])
def test_remove_skipped_blocks_frees_exactly_what_no_query_reads(window, page, logical):
    m = sliding_manager(window, page, num_blocks=256, logical=logical)
    rng = random.Random(window * 100 + page)
    c = 0
    while c < 120:
        n = rng.randint(1, 9)
        m.remove_skipped_blocks("r", c)
        m.allocate_new_blocks("r", c + n)
        table = m.blocks("r")
        # The queries of this step (positions c .. c+n-1) read p - window + 1 .. p.
        for p in range(max(0, c - window + 1), c + n):
            assert not table[p // page].is_null, (c, p)
        # Every page wholly before c - window + 1 is freed (and only those).
        for j, blk in enumerate(table):
            assert blk.is_null == ((j + 1) * page <= c - window + 1), (c, j)
        c += n
    held = sum(1 for i in m.req_tables["r"] if i)
    assert held + m.pool.num_free_blocks == m.pool.num_usable
    m.free("r")
    assert m.pool.num_free_blocks == m.pool.num_usable


def test_sliding_publishes_only_pages_a_hit_can_use():
    # window 5, pages of 8 in a 16 logical block: only the second page of each block.
    m = sliding_manager(5, 8)
    assert [m.publishes(j) for j in range(4)] == [False, True, False, True]
    m = sliding_manager(3, 4)            # pages of 4: the window before a boundary is 1 page
    assert [m.publishes(j) for j in range(4)] == [False, False, False, True]
    m = sliding_manager(9, 4)            # 8 earlier positions: 2 pages
    assert [m.publishes(j) for j in range(4)] == [False, False, True, True]
    m = sliding_manager(1, 4)            # window 1 reads nothing earlier: nothing to keep
    assert not any(m.publishes(j) for j in range(4))


def test_sliding_cache_and_right_to_left_hit_search():
    m = sliding_manager(5, 8, num_blocks=64)
    req = make_request("a", list(range(4 * L + 3)))
    BlockHasher(L)(req)
    m.allocate_new_blocks("a", req.num_tokens)
    table = m.blocks("a")
    m.cache_blocks(req, req.num_tokens)
    published = [j for j, b in enumerate(table) if b.block_hash is not None]
    assert published == [1, 3, 5, 7]
    assert table[3].block_hash == sub_block_key(req.block_hashes[1], 1)
    hits = m.find_longest_cache_hit(req.block_hashes, 4)
    assert hits == [m.pool.null_block] * 7 + [table[7]]
    # Evict the page before boundary 4: the hit falls back to boundary 3.
    m.pool._evict(table[7])
    hits = m.find_longest_cache_hit(req.block_hashes, 4)
    assert hits == [m.pool.null_block] * 5 + [table[5]]
    assert m.find_longest_cache_hit(req.block_hashes, 2) == [m.pool.null_block] * 3 + [table[3]]
    for j in (1, 3, 5):
        m.pool._evict(table[j])
    assert m.find_longest_cache_hit(req.block_hashes, 4) == []


def test_sliding_hit_needs_a_contiguous_run_and_the_start_is_free():
    m = sliding_manager(9, 4, num_blocks=64)            # 2 pages before each boundary
    req = make_request("a", list(range(3 * L)))
    BlockHasher(L)(req)
    m.allocate_new_blocks("a", req.num_tokens)
    table = m.blocks("a")
    m.cache_blocks(req, req.num_tokens)
    assert m.find_longest_cache_hit(req.block_hashes, 3)[-2:] == table[10:12]
    m.pool._evict(table[10])                            # breaks the run before boundary 3
    assert m.find_longest_cache_hit(req.block_hashes, 3) == [m.pool.null_block] * 6 + table[6:8]
    m2 = sliding_manager(40, 16, num_blocks=64)         # window wider than the logical block
    req2 = make_request("b", list(range(3 * L)))
    BlockHasher(L)(req2)
    m2.allocate_new_blocks("b", req2.num_tokens)
    m2.cache_blocks(req2, req2.num_tokens)
    t2 = m2.blocks("b")
    assert all(b.block_hash is not None for b in t2)
    # Boundary 1 needs positions 0..15 only (the window is clipped at the start).
    assert m2.find_longest_cache_hit(req2.block_hashes, 1) == t2[:1]
    assert m2.find_longest_cache_hit(req2.block_hashes, 3) == t2[:3]
    m2.pool._evict(t2[0])
    assert m2.find_longest_cache_hit(req2.block_hashes, 3) == []   # 3 needs pages 0..2


def test_sliding_cache_after_null_pages_skips_them():
    m = sliding_manager(5, 8)
    req = make_request("a", list(range(4 * L)))
    BlockHasher(L)(req)
    m.allocate_new_blocks("a", 2 * L)
    m.remove_skipped_blocks("a", 2 * L)                 # pages 0..2 left the window
    assert m.req_tables["a"][:3] == [0, 0, 0] and m.req_tables["a"][3]
    m.cache_blocks(req, 2 * L)                          # only page 3 can still be published
    assert [b.block_hash is not None for b in m.blocks("a")] == [False] * 3 + [True]
