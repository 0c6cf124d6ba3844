"""One manager per KV cache group: a request's block table in that group.

All managers of a bucket allocate from the bucket's pool. A table is positional: entry j holds
positions [j*P, (j+1)*P) of the request, P = the group's page size. Sliding-window tables
keep their length and put the null block where pages left the window.

Hash keys: a FULL group pages at the logical block, so page j is keyed by the request's
logical hash j. A sliding group with pages below the logical block keys page k of logical
block i by (hash i, k) (hashing.sub_block_key), and only publishes the pages a prefix hit can
use: those overlapping the window before their logical block's end (with a 128 window and
128-position pages, the second page of each 256-token block; with an 8-position state, the
last of 32). The rest are freed hashless, and hashless free blocks are reused first, so the
bounded pools spend their spare room on pages that can serve hits.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from wideserve.kv_cache.block_pool import NULL_BLOCK_ID, BlockPool, KVBlock
from wideserve.kv_cache.groups import KVCacheGroup, window_pages_for_hit
from wideserve.kv_cache.hashing import sub_block_key

if TYPE_CHECKING:
    from wideserve.types.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    def __init__(self, group: KVCacheGroup, pool: BlockPool, logical_block_size: int,
                 caching: bool) -> None:
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self.pages_per_logical = logical_block_size // group.block_size
        self.pool = pool
        self.caching = caching             # this group publishes hashes and serves hits
        # request id -> block-table row (block ids; 0 = null). Plain ints so handing rows to
        # the runner is a list copy; the block objects are pool.blocks[id].
        self.req_tables: dict[str, list[int]] = {}
        # Pages whose publication has been decided (published, skipped, or a prefix hit).
        self.num_cached: dict[str, int] = {}

    def blocks(self, request_id: str) -> list[KVBlock]:
        return [self.pool.blocks[i] for i in self.req_tables.get(request_id, ())]

    def skipped_entries(self) -> dict[str, int] | None:
        """request id -> leading table entries already nulled, for managers that null
        them (sliding windows); None: this manager never does."""
        return None

    def request_tables(self) -> tuple[dict, ...]:
        """Every per-request dict this manager keeps (re-keyed together: manager.py)."""
        return self.req_tables, self.num_cached

    def num_slots(self, request_id: str) -> int:
        """Positions the request's table covers."""
        return len(self.req_tables[request_id]) * self.block_size

    # ------------------------------------------------------------------- allocation
    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               hit_blocks: Sequence[KVBlock], query_at: int = 0) -> int:
        """Blocks this call takes from the pool: new pages up to `num_tokens` positions, plus
        hit blocks that are now cached-but-free (they leave the free queue). `query_at`:
        the next query position (pages no query from there reads need no block)."""
        held = len(self.req_tables.get(request_id, ())) + len(hit_blocks)
        held = max(held, self.first_needed_page(query_at))
        new = max(0, cdiv(num_tokens, self.block_size) - held)
        return new + sum(1 for b in hit_blocks if b.ref_cnt == 0 and not b.is_null)

    def first_needed_page(self, query_at: int) -> int:
        """Pages before this one are never read by a query at `query_at` or later."""
        return 0

    def save_hit_blocks(self, request_id: str, hit_blocks: Sequence[KVBlock]) -> None:
        if request_id in self.req_tables:
            raise ValueError(f"request {request_id!r} already holds blocks in group "
                             f"{self.group_id}; prefix hits are for admission only")
        self.pool.touch(hit_blocks)
        self.req_tables[request_id] = [b.block_id for b in hit_blocks]
        self.num_cached[request_id] = len(hit_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            query_at: int = 0) -> list[KVBlock]:
        table = self.req_tables.setdefault(request_id, [])
        self.num_cached.setdefault(request_id, 0)
        # Only P/D admission (KV arriving after a short hit) starts the table past its end:
        # the pages in between are out of the window and stay null.
        skip = min(self.first_needed_page(query_at), cdiv(num_tokens, self.block_size))
        if skip > len(table):
            self._null_fill(request_id, table, skip)
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        table.extend([b.block_id for b in new])
        return new

    def free(self, request_id: str) -> None:
        table = self.req_tables.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if table:
            # Tail first: a request's last blocks are the first to be evicted.
            blocks = self.pool.blocks
            self.pool.free_blocks([blocks[i] for i in reversed(table) if i])

    def _null_fill(self, request_id: str, table: list[int], num_pages: int) -> None:
        table.extend([NULL_BLOCK_ID] * (num_pages - len(table)))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free pages no future query reads (none for growing groups)."""

    # --------------------------------------------------------------------- caching
    def block_key(self, block_hashes: Sequence[bytes], page: int) -> bytes:
        if self.pages_per_logical == 1:
            return block_hashes[page]
        return sub_block_key(block_hashes[page // self.pages_per_logical],
                             page % self.pages_per_logical)

    def publishes(self, page: int) -> bool:
        return True

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the pages of full logical blocks below `num_tokens` (computed positions)."""
        if not self.caching:
            return
        rid = request.request_id
        table = self.req_tables.get(rid)
        if table is None:
            return
        hashes = request.block_hashes
        n_logical = min(num_tokens // (self.block_size * self.pages_per_logical), len(hashes))
        start = self.num_cached.get(rid, 0)
        end = min(n_logical * self.pages_per_logical, len(table))
        for j in range(start, end):
            if table[j] and self.publishes(j):
                self.pool.cache_block(self.pool.blocks[table[j]], self.block_key(hashes, j),
                                      self.group_id)
        self.num_cached[rid] = max(start, end)

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               num_logical: int) -> list[KVBlock]:
        """Cached pages for the longest hit of at most `num_logical` logical blocks; the hit
        covers len(result) // pages_per_logical logical blocks."""
        raise NotImplementedError


class FullManager(GroupManager):
    """Growing group: one page per logical block; the compress ratio only changes how many
    entries a page holds."""

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               num_logical: int) -> list[KVBlock]:
        hits = []
        for i in range(num_logical):
            # A chain hash: if block i is missing, no later block can be a hit.
            block = self.pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                break
            hits.append(block)
        return hits


class SlidingWindowManager(GroupManager):
    """Bounded group: query position p reads positions p - window + 1 .. p."""

    def __init__(self, group: KVCacheGroup, pool: BlockPool, logical_block_size: int,
                 caching: bool) -> None:
        super().__init__(group, pool, logical_block_size, caching)
        self.window = group.spec.window
        self.pages_for_hit = window_pages_for_hit(group)
        self.num_skipped: dict[str, int] = {}    # leading table entries already nulled

    def skipped_entries(self) -> dict[str, int] | None:
        return self.num_skipped

    def request_tables(self) -> tuple[dict, ...]:
        return self.req_tables, self.num_cached, self.num_skipped

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # The next query is at p = num_computed_tokens and reads p - window + 1 .. p, so pages
        # that end at or before p - window + 1 are never read again.
        table = self.req_tables.get(request_id)
        if not table:
            return
        first_kept = min(max(0, num_computed_tokens - self.window + 1) // self.block_size,
                         len(table))
        skipped = self.num_skipped.get(request_id, 0)
        if first_kept <= skipped:
            return
        blocks = self.pool.blocks
        removed = [blocks[i] for i in reversed(table[skipped:first_kept]) if i]
        table[skipped:first_kept] = [NULL_BLOCK_ID] * (first_kept - skipped)
        self.num_skipped[request_id] = first_kept
        self.pool.free_blocks(removed)

    def first_needed_page(self, query_at: int) -> int:
        return max(0, query_at - self.window + 1) // self.block_size

    def logical_blocks_to_publish_before_skip(self, request_id: str,
                                              num_computed_tokens: int) -> int:
        """Logical blocks that must be published before `remove_skipped_blocks(request_id,
        num_computed_tokens)`: every live page it would free that a hit reads (`publishes`)
        lies below them (0: it frees none)."""
        table = self.req_tables.get(request_id)
        if not table:
            return 0
        first_kept = min(max(0, num_computed_tokens - self.window + 1) // self.block_size,
                         len(table))
        for j in range(first_kept - 1, self.num_skipped.get(request_id, 0) - 1, -1):
            if table[j] and self.publishes(j):
                return j // self.pages_per_logical + 1
        return 0

    def _null_fill(self, request_id: str, table: list[int], num_pages: int) -> None:
        super()._null_fill(request_id, table, num_pages)
        self.num_skipped[request_id] = max(self.num_skipped.get(request_id, 0), num_pages)

    def lazy_skip_limit(self, request_id: str) -> int:
        """num_computed_tokens at which two pages would wait to be freed. Frees may lag one
        page (they happen at the next page allocation); a longer lag (a prefill chunk, a
        burst of accepted drafts) is freed at the next allocate_slots call."""
        return (self.num_skipped.get(request_id, 0) + 2) * self.block_size + self.window - 1

    def save_hit_blocks(self, request_id: str, hit_blocks: Sequence[KVBlock]) -> None:
        super().save_hit_blocks(request_id, hit_blocks)
        # Hits are [null]*k + live pages: the leading nulls are already skipped.
        self.num_skipped[request_id] = next(
            (j for j, b in enumerate(hit_blocks) if not b.is_null), len(hit_blocks))

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.num_skipped.pop(request_id, None)

    def publishes(self, page: int) -> bool:
        pages_after = self.pages_per_logical - 1 - page % self.pages_per_logical
        return pages_after < self.pages_for_hit

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes],
                               num_logical: int) -> list[KVBlock]:
        # Right to left over logical boundaries k*L: a hit at k needs the pages holding
        # positions kL - window + 1 .. kL - 1 (fewer at the start of the sequence).
        ppl, get, gid = self.pages_per_logical, self.pool.get_cached_block, self.group_id
        k = num_logical
        while k > 0:
            end = k * ppl
            start = max(0, end - self.pages_for_hit)
            hits: list[KVBlock] = []
            miss = -1
            for j in range(end - 1, start - 1, -1):
                block = get(self.block_key(block_hashes, j), gid)
                if block is None:
                    miss = j
                    break
                hits.append(block)
            if miss < 0:
                hits.reverse()
                return [self.pool.null_block] * start + hits
            # Every boundary whose window contains page `miss` fails too.
            k = min(k - 1, miss // ppl)
        return []

    def null_prefix(self, num_tokens: int) -> list[KVBlock]:
        """Table entries for `num_tokens` positions nobody will read (bounded replay)."""
        return [self.pool.null_block] * (num_tokens // self.block_size)


def make_manager(group: KVCacheGroup, pool: BlockPool, logical_block_size: int,
                 caching: bool) -> GroupManager:
    cls = SlidingWindowManager if group.is_sliding else FullManager
    return cls(group, pool, logical_block_size, caching)
