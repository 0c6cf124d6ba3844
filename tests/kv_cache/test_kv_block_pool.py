from __future__ import annotations

import pytest

from wideserve.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, FreeBlockQueue, KVBlock


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable == 4 and pool.num_free_blocks == 4
    assert NULL_BLOCK_ID not in queue_ids(pool)
    got = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    # Freeing the null block is a no-op (sliding tables hold it as a placeholder).
    pool.free_blocks([pool.null_block])
    assert pool.num_free_blocks == 0 and pool.null_block.ref_cnt == 0
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_lru_order_tail_first_and_hashless_first():
    pool = BlockPool(9)
    a = pool.get_new_blocks(4)                    # a request's blocks, in table order
    for i, blk in enumerate(a):
        assert pool.cache_block(blk, h(i), group=0)
    b = pool.get_new_blocks(2)                    # never cached
    assert queue_ids(pool) == [7, 8]
    pool.free_blocks(reversed(a))                 # tail first
    pool.free_blocks(reversed(b))
    # Hashless blocks are reused first; among cached ones the request's last block goes first.
    assert queue_ids(pool) == [5, 6, 7, 8, 4, 3, 2, 1]
    assert pool.num_free_blocks == 8 and len(pool.cached) == 4
    # Allocation drains in that order; reusing a cached block drops its hash.
    got = pool.get_new_blocks(5)
    assert [x.block_id for x in got] == [5, 6, 7, 8, 4]
    assert got[-1].block_hash is None and pool.get_cached_block(h(3), 0) is None
    assert pool.get_cached_block(h(2), 0) is a[2]


def test_hit_removes_from_the_middle_of_the_queue():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(5)
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, h(i), 0)
    pool.free_blocks(blocks)
    assert queue_ids(pool) == [1, 2, 3, 4, 5]
    hit = pool.get_cached_block(h(2), 0)
    assert hit is blocks[2] and hit.ref_cnt == 0
    pool.touch([hit, pool.null_block])
    assert hit.ref_cnt == 1 and queue_ids(pool) == [1, 2, 4, 5]
    assert hit.prev is None and hit.next is None
    pool.touch([hit])                            # a second request shares it
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 4
    pool.free_blocks([hit])
    assert queue_ids(pool) == [1, 2, 4, 5]       # still held once
    pool.free_blocks([hit])
    assert queue_ids(pool) == [1, 2, 4, 5, 3]    # back, most recently freed = evicted last
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([hit])


def test_hash_map_is_per_group_and_one_to_one():
    pool = BlockPool(5)
    x, y, z = pool.get_new_blocks(3)
    assert pool.cache_block(x, h(7), group=0)
    assert not pool.cache_block(y, h(7), group=0)  # same content computed twice: not cached
    assert y.block_hash is None
    assert pool.cache_block(z, h(7), group=1)      # same hash, another group: another entry
    assert pool.get_cached_block(h(7), 0) is x and pool.get_cached_block(h(7), 1) is z
    assert pool.cache_block(x, h(7), group=0)      # re-publishing is idempotent
    pool.free_blocks([x, y, z])
    assert queue_ids(pool) == [2, 4, 1, 3]


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.cache_block(a[0], h(1), 0)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(a)
    assert pool.reset_prefix_cache()
    assert not pool.cached and all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 3


def test_free_queue_remove_and_pop():
    blocks = [KVBlock(i) for i in range(1, 5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[0])
    q.remove(blocks[3])
    assert [b.block_id for b in q] == [2, 3] and len(q) == 2
    with pytest.raises(AssertionError, match="not in the free queue"):
        q.remove(blocks[0])
    q.appendleft(blocks[3])
    assert q.popleft() is blocks[3] and q.popleft() is blocks[1] and q.popleft() is blocks[2]
    with pytest.raises(ValueError):
        q.popleft()
