"""Blocks, the eviction-ordered free queue, and the per-bucket block pool.

A pool hands out block ids of one bucket (kv_cache/groups.py): every group in the bucket
allocates from it, and a block is owned by at most one group at a time.

States of a block (exactly one holds; `check_integrity` proves it):
- used:   ref_cnt > 0, held by one or more requests (more than one only via prefix hits).
- cached: ref_cnt == 0, in the free queue, still has its hash, so a later request can hit it.
- free:   ref_cnt == 0, in the free queue, no hash.
Block 0 is the null block: never handed out, never freed, never in the queue. Block tables use
it as a placeholder for sliding-window pages that left the window (and were freed).

Eviction order (the free queue, head = next to reuse): blocks without a hash go to the head
(they are worth nothing), blocks with a hash to the tail (least recently freed is evicted
first). A request frees its blocks tail-first, so of one request its last blocks, the least
likely to be shared, are evicted first. A hit on a cached block removes it from the middle of
the queue in O(1): the queue is an intrusive doubly linked list through the blocks.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

NULL_BLOCK_ID = 0


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Hash key of the content (see hashing.py) and the group it was cached for; a key is only
    # meaningful within its group, because groups store different things under equal tokens.
    block_hash: bytes | None = None
    hash_group: int = -1
    prev: KVBlock | None = None
    next: KVBlock | None = None

    @property
    def is_null(self) -> bool:
        return self.block_id == NULL_BLOCK_ID

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h}, group={self.hash_group})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks between two sentinels."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def _link_after(self, anchor: KVBlock, block: KVBlock) -> None:
        nxt = anchor.next
        assert nxt is not None
        block.prev, block.next = anchor, nxt
        anchor.next = block
        nxt.prev = block
        self.num_free += 1

    def append(self, block: KVBlock) -> None:
        """To the tail: evicted last."""
        assert self._tail.prev is not None
        self._link_after(self._tail.prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """To the head: reused next."""
        self._link_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise AssertionError(f"{block!r} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is None or block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVBlock]:
        """The first n blocks, unlinked as one run: a walk over n nodes and two relinks,
        not n removals (a long prompt's admission takes thousands of blocks at once)."""
        if n > self.num_free:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free} free")
        out: list[KVBlock] = []
        node = self._head.next
        for _ in range(n):
            assert node is not None
            out.append(node)
            node = node.next
        assert node is not None
        self._head.next, node.prev = node, self._head
        for block in out:
            block.prev = block.next = None
        self.num_free -= n
        return out

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """All blocks of one bucket: allocation, ref counts, and the (hash, group) -> block map.

    The map is one-to-one: when two requests compute the same block at the same time, the
    second copy is simply not cached (it stays hashless and is reused first once freed), so
    block tables stay append-only and no request's block is ever swapped under it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), "
                             f"got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[tuple[bytes, int], KVBlock] = {}

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Free or cached: what an allocation can take."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable

    def get_cached_block(self, block_hash: bytes, group: int) -> KVBlock | None:
        return self.cached.get((block_hash, group))

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = self.free_queue.popleft_n(n)
        for block in out:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks (a cached block leaves the free queue)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: bytes, group: int) -> bool:
        """Publish a full block under (hash, group); False if another block already has it."""
        if block.block_hash is not None:
            return block.block_hash == block_hash and block.hash_group == group
        key = (block_hash, group)
        if key in self.cached:
            return False
        block.block_hash, block.hash_group = block_hash, group
        self.cached[key] = block
        return True

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order."""
        for block in ordered:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        key = (block.block_hash, block.hash_group)
        if self.cached.get(key) is block:
            del self.cached[key]
        block.block_hash, block.hash_group = None, -1

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_usable:
            return False
        for block in self.blocks:
            block.block_hash, block.hash_group = None, -1
        self.cached.clear()
        return True
