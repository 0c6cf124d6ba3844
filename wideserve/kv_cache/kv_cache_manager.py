"""KVCacheManager: the one object the scheduler talks to about KV memory.

Glossary
- position: a token's index in its request. Block tables are positional: entry j of a group's
  table holds positions [j*P, (j+1)*P), P = the group's page size (groups.py).
- logical block: CacheConfig.block_size positions (default 256), the unit of prefix hashing;
  FULL groups page at exactly this size, sliding groups at a divisor of it.
- computed tokens: positions whose KV this request can read (request.num_computed_tokens).
- cached block: a block published under its hash; it can be shared by later requests and,
  once unreferenced, waits in the free queue until it is evicted by reuse (block_pool.py).
- hit: the longest prefix of logical blocks cached in EVERY group (P positions). The last
  token is never a hit, so a request always computes at least one token (its logits).
- null block: block 0 of every pool; the table entry of a sliding page that left the window.
- kv_write_start (bounded replay only): positions below it are in cached, shared FULL-group
  blocks; the model recomputes them to rebuild its windows but must not write their entries.

A request's positions at an `allocate_slots` call:

    |<- num_computed_tokens ->|<- new hit ->|<---- new ---->|<- lookahead ->|
    |  already in its tables  | hit blocks  | num_new_tokens| draft slots,  |
    |                         | (admission) | (this step)   | never cached  |
    |<--------- total_computed ------------>|
    |<---------------------- slots the tables cover after the call ------------------>|
    |<-- published: full logical blocks of computed tokens -->|

Sliding groups free the pages wholly before total_computed - window + 1 (the next query, at
total_computed, reads positions total_computed - window + 1 .. total_computed) before any
allocation; FULL groups only grow. A call with nothing to allocate or publish (most decode
steps) does no work at all, so a page that left its window may wait for the request's next
page allocation: at most one page per sliding group lags (groups.bounded_blocks_per_request
counts it), and the per-step host cost of a decode step is a few comparisons. Blocks are published
(cached) only once computed, by the first `allocate_slots` after a logical block is computed
and by `free`: a block is never shared before its KV is written (whatever order the model
processes a batch in), and draft and lookahead positions never enter a hash.

Hashing is lazy, so no single step hashes a long prompt whole: a lookup hashes the prompt's
blocks only as far as a hit can reach (a growing group's hit ends at its first miss, so a new
prompt hashes one batch of blocks, not the prompt), and publishing hashes the blocks computed
since: a chunked prefill hashes each chunk's blocks in its step. An `allocate_slots` call
publishes at most PUBLISH_BLOCKS_PER_CALL logical blocks, so a P/D load of 855K tokens
publishes over ~50 steps instead of in one, except that in keep mode a sliding page this call
frees (it left its window) is published first, with every block before it (a page freed
unpublished is lost to later hits). `free` (and `trim_to_window`) publish all computed.

Prefix window modes (CacheConfig.prefix_window_mode):
- "keep": sliding groups publish the pages before each logical boundary; a hit at P needs
  them in every sliding group (hybrid fixed point: the growing groups bound P from the left,
  each sliding group may lower it, repeat until all agree).
- "replay": sliding groups are never cached. A hit at P (growing groups only) returns
  computed = max(0, P - replay_tokens): the model recomputes the last replay_tokens positions
  to rebuild windows and compressor state, exactly when replay_tokens >= depth*(window-1)
  (groups.exact_replay_tokens), without rewriting cached entries below kv_write_start = P.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from wideserve.config import CacheConfig
from wideserve.kv_cache.block_pool import BlockPool, KVBlock
from wideserve.kv_cache.groups import KVCacheConfig
from wideserve.kv_cache.hashing import BlockHasher, ExtraKeysFn
from wideserve.kv_cache.integrity import check_manager_integrity
from wideserve.kv_cache.group_managers import GroupManager, SlidingWindowManager, make_manager

if TYPE_CHECKING:
    from wideserve.types.request import Request


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks per group (blocks[g][j] = group g, j-th block); hides the manager's structure."""

    blocks: list[list[KVBlock]]

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted when a request is admitted (allocate_slots succeeds), not at lookup, so a
    lookup retried after a failed allocation is not counted twice."""

    requests: int = 0
    queries: int = 0            # tokens of admitted requests
    hits: int = 0               # of which computed tokens came from the cache
    replayed: int = 0           # cached tokens recomputed to rebuild windows (replay mode)
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


_NEVER = 1 << 62
# Logical blocks a lookup hashes before its first check for a miss; doubled each round.
LOOKUP_HASH_BATCH = 8
# Logical blocks an allocate_slots call hashes and publishes at most (64 x 256 tokens: eight
# 2,048-token prefill chunks, so an ordinary chunked prefill never lags behind).
PUBLISH_BLOCKS_PER_CALL = 64


@dataclass(slots=True)
class _RequestState:
    """When a running request next needs the slow path of allocate_slots (lower bounds)."""

    capacity: int          # positions covered in every group
    next_cache_at: int     # computed tokens at which another logical block can be published
    skip_limit: int        # computed tokens at which 2 sliding pages would wait to be freed


class KVCacheManager:
    def __init__(self, kv_config: KVCacheConfig, cache_config: CacheConfig, max_model_len: int,
                 replay_tokens: int | None = None, extra_keys: ExtraKeysFn | None = None) -> None:
        mode = cache_config.prefix_window_mode
        if mode not in ("keep", "replay"):
            raise ValueError(f"CacheConfig.prefix_window_mode must be 'keep' or 'replay', "
                             f"got {mode!r}")
        requested = cache_config.block_size          # None: the model's default was taken
        if requested is not None and kv_config.block_size != requested:
            raise ValueError(f"KVCacheConfig.block_size={kv_config.block_size} differs from "
                             f"CacheConfig.block_size={cache_config.block_size}")
        self.enable_caching = cache_config.enable_prefix_caching
        if self.enable_caching and mode == "replay" and (replay_tokens is None
                                                         or replay_tokens < 0):
            raise ValueError("prefix_window_mode='replay' needs replay_tokens >= 0 "
                             "(see groups.exact_replay_tokens)")
        self.kv_config = kv_config
        self.block_size = kv_config.block_size
        self.max_model_len = max_model_len
        self.mode = mode
        self.replay_tokens = replay_tokens or 0
        self.block_hasher = BlockHasher(self.block_size, extra_keys)
        self.pools = [BlockPool(b.num_blocks) for b in kv_config.buckets]
        self.managers: list[GroupManager] = [
            make_manager(g, self.pools[g.bucket_id], self.block_size,
                         caching=self.enable_caching and (not g.is_sliding or mode == "keep"))
            for g in kv_config.groups]
        # Growing groups first: their left-to-right scan gives the tightest bound.
        self._full = [m for m in self.managers if not isinstance(m, SlidingWindowManager)]
        self._sliding: list[SlidingWindowManager] = [
            m for m in self.managers if isinstance(m, SlidingWindowManager)]
        self._requests: set[str] = set()          # admitted and not freed
        # Keys holding the blocks of P/D loads given up before their transfer was known to
        # have stopped (quarantine): held, never published, freed by release_quarantine.
        self._quarantined: set[str] = set()
        self._write_start: dict[str, int] = {}
        self._replay_start: dict[str, int] = {}    # where a bounded replay began (S)
        # Logical blocks of each request published (or hit) so far: publishing resumes there.
        self._published: dict[str, int] = {}
        self._state: dict[str, _RequestState] = {}
        self.stats = PrefixCacheStats()             # since start (engine stats, metrics)

    # -------------------------------------------------------------------- prefix hits
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Prefix hit for a request that holds no blocks: (hit blocks per group, computed)."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} already holds KV blocks")
        empty = KVCacheBlocks([[] for _ in self.managers])
        # Prompt logprobs need the logits of every prompt position, so nothing may be skipped.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return empty, 0
        # Never the last token: its logits must be computed.
        num_logical = (request.num_tokens - 1) // self.block_size
        if self._full:
            self._hash_while_hits(request, num_logical)
        else:
            self.block_hasher(request)      # sliding only: a hit may lie past a miss
        num_logical = min(num_logical, len(request.block_hashes))
        if num_logical <= 0:
            return empty, 0
        if self.mode == "keep":
            return self._find_keep(request.block_hashes, num_logical)
        return self._find_replay(request.block_hashes, num_logical)

    def _hash_while_hits(self, request: Request, limit: int) -> None:
        """Hash the request's first `limit` logical blocks only as far as the first growing
        group holds them: past its first miss no block can be a hit (a chain hash). Batches
        double from LOOKUP_HASH_BATCH, so a hit of h blocks hashes fewer than 2h + 8."""
        probe = self._full[0]
        get, gid = probe.pool.get_cached_block, probe.group_id
        hashes = request.block_hashes
        i, batch = 0, LOOKUP_HASH_BATCH
        while True:
            for i in range(i, min(len(hashes), limit)):
                if get(hashes[i], gid) is None:
                    return
            i = min(len(hashes), limit)
            if i >= limit or not self.block_hasher(request, min(limit, i + batch)):
                return
            batch *= 2

    def _find_keep(self, hashes: list[bytes], num_logical: int) -> tuple[KVCacheBlocks, int]:
        k = num_logical
        found: dict[int, list[KVBlock]] = {}
        for m in self._full:
            found[m.group_id] = m.find_longest_cache_hit(hashes, k)
            k = min(k, len(found[m.group_id]))
        while True:
            new_k = k
            for m in self._sliding:
                found[m.group_id] = m.find_longest_cache_hit(hashes, new_k)
                new_k = min(new_k, len(found[m.group_id]) // m.pages_per_logical)
            if new_k == k:
                break
            k = new_k
        blocks = [found[m.group_id][:k * m.pages_per_logical] for m in self.managers]
        return KVCacheBlocks(blocks), k * self.block_size

    def _find_replay(self, hashes: list[bytes], num_logical: int) -> tuple[KVCacheBlocks, int]:
        if not self._full:
            return KVCacheBlocks([[] for _ in self.managers]), 0
        k = num_logical
        found: dict[int, list[KVBlock]] = {}
        for m in self._full:
            found[m.group_id] = m.find_longest_cache_hit(hashes, k)
            k = min(k, len(found[m.group_id]))
        computed = max(0, k * self.block_size - self.replay_tokens)
        for sw in self._sliding:
            # Nothing below the replay start is read back: the model rebuilds the windows.
            found[sw.group_id] = sw.null_prefix(computed)
        return KVCacheBlocks([found[m.group_id][:k] if m in self._full else found[m.group_id]
                              for m in self.managers]), computed

    def _hit_tokens(self, hits: list[list[KVBlock]]) -> int:
        """P of a hit returned by get_computed_blocks (growing groups, else sliding ones)."""
        if self._full:
            return len(hits[self._full[0].group_id]) * self.block_size
        if self.mode == "keep" and self._sliding:
            return len(hits[self._sliding[0].group_id]) * self._sliding[0].block_size
        return 0

    def _expected_computed(self, hit_tokens: int) -> int:
        if self.mode == "replay" and hit_tokens:
            return max(0, hit_tokens - self.replay_tokens)
        return hit_tokens

    # --------------------------------------------------------------------- allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0,
                       num_external_tokens: int = 0) -> KVCacheBlocks | None:
        """Give the request slots up to total_computed + num_new_tokens + lookahead in every
        group, or change nothing but out-of-window frees and return None (the caller
        preempts). Returns the newly allocated blocks per group.

        num_external_tokens (P/D admission only): positions after the hit whose KV arrives
        from another instance. They get slots (sliding groups only the pages the window
        after them reads) but stay uncomputed, so unpublished, until the caller advances
        request.num_computed_tokens over them once they have arrived."""
        if min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
               num_external_tokens) < 0:
            raise ValueError(f"allocate_slots: negative token count (new={num_new_tokens}, "
                             f"new_computed={num_new_computed_tokens}, "
                             f"lookahead={num_lookahead_tokens})")
        if not num_new_computed_tokens and not num_external_tokens and (
                new_computed_blocks is None or not new_computed_blocks.num_blocks) \
                and self.has_room(request, num_new_tokens, num_lookahead_tokens):
            return KVCacheBlocks([[] for _ in self.managers])
        return self._allocate(request, num_new_tokens, new_computed_blocks,
                              num_new_computed_tokens, num_lookahead_tokens,
                              self._state.get(request.request_id), num_external_tokens)

    def has_room(self, request: Request, num_new_tokens: int,
                 num_lookahead_tokens: int = 0) -> bool:
        """allocate_slots' fast path for a running request (most decode steps): True when a
        call with these counts and no hit would allocate, free and publish nothing, so the
        call can be skipped. That is: every table already covers the slots, no new logical
        block is computed, and at most one page per sliding group waits to be freed (at the
        request's next page allocation)."""
        st = self._state.get(request.request_id)
        if st is None:
            return False
        c = request.num_computed_tokens
        return (min(c + num_new_tokens + num_lookahead_tokens, self.max_model_len)
                <= st.capacity and min(c, len(request.all_token_ids)) < st.next_cache_at
                and c < st.skip_limit)

    def _allocate(self, request: Request, num_new_tokens: int,
                  new_computed_blocks: KVCacheBlocks | None, num_new_computed_tokens: int,
                  num_lookahead_tokens: int, st: _RequestState | None,
                  num_external_tokens: int = 0) -> KVCacheBlocks | None:
        rid = request.request_id
        admission = rid not in self._requests
        if num_external_tokens and not admission:
            raise ValueError(f"request {rid!r} is running; external KV is for admission only")
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else None
        if hits is not None and len(hits) != len(self.managers):
            raise ValueError(f"new_computed_blocks has {len(hits)} groups, "
                             f"expected {len(self.managers)}")
        if not admission and (num_new_computed_tokens or (hits and any(hits))):
            raise ValueError(f"request {rid!r} is running; prefix hits are for admission only")
        if admission and hits is not None:
            expected = self._expected_computed(self._hit_tokens(hits))
            if num_new_computed_tokens != expected:
                raise ValueError(f"num_new_computed_tokens={num_new_computed_tokens} does not "
                                 f"match the hit blocks given (expected {expected})")
        elif admission and num_new_computed_tokens:
            raise ValueError("num_new_computed_tokens > 0 needs new_computed_blocks")
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        if st is not None and min(request.num_computed_tokens, request.num_tokens) \
                >= st.next_cache_at:
            # Before freeing out-of-window pages, so the ones a hit can use keep their hash.
            self._cache_computed(request, PUBLISH_BLOCKS_PER_CALL,
                                 self._publish_before_skip(rid, total_computed))
        # Where the next query will be: sliding pages wholly before its window stay null.
        query_at = total_computed + num_external_tokens
        num_slots = min(query_at + num_new_tokens + num_lookahead_tokens,
                        self.max_model_len)
        for sw in self._sliding:
            sw.remove_skipped_blocks(rid, total_computed)
        demand = [0] * len(self.pools)
        for m in self.managers:
            demand[m.group.bucket_id] += m.num_blocks_to_allocate(
                rid, num_slots, hits[m.group_id] if hits else (), query_at)
        if any(d > pool.num_free_blocks for d, pool in zip(demand, self.pools)):
            return None
        if admission:
            for m in self.managers:
                m.save_hit_blocks(rid, hits[m.group_id] if hits else ())
            self._admit(request, hits, num_new_computed_tokens)
        new = KVCacheBlocks([m.allocate_new_blocks(rid, num_slots, query_at)
                             for m in self.managers])
        # Publishing may lag (PUBLISH_BLOCKS_PER_CALL): the next call resumes where it stopped.
        self._state[rid] = _RequestState(
            capacity=min(m.num_slots(rid) for m in self.managers),
            next_cache_at=(self._published.get(rid, 0) + 1) * self.block_size
            if self.enable_caching else _NEVER,
            skip_limit=min((sw.lazy_skip_limit(rid) for sw in self._sliding), default=_NEVER))
        return new

    def _admit(self, request: Request, hits: list[list[KVBlock]] | None,
               computed: int) -> None:
        rid = request.request_id
        self._requests.add(rid)
        hit_tokens = self._hit_tokens(hits) if hits else 0
        self._published[rid] = hit_tokens // self.block_size
        if hit_tokens > computed:
            self._write_start[rid] = hit_tokens
            self._replay_start[rid] = computed
        s = self.stats
        s.requests += 1
        s.queries += request.num_tokens
        s.hits += computed
        s.replayed += max(0, hit_tokens - computed)

    def _cache_computed(self, request: Request, max_blocks: int | None = None,
                        need: int = 0) -> None:
        """Publish the request's computed full logical blocks, hashing them first: all of
        them, or at most `max_blocks` past those published before, but at least `need`."""
        if not self.enable_caching:
            return
        rid = request.request_id
        done = self._published.get(rid, 0)
        limit = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max(done + max_blocks, need))
        if limit <= done:
            return
        self.block_hasher(request, limit)
        for m in self.managers:
            m.cache_blocks(request, limit * self.block_size)
        self._published[rid] = limit

    def _publish_before_skip(self, rid: str, total_computed: int) -> int:
        """Keep mode: the logical blocks whose sliding pages this call frees must be published
        first (a page freed unpublished is lost to later hits)."""
        if self.mode != "keep":
            return 0
        return max((sw.logical_blocks_to_publish_before_skip(rid, total_computed)
                    for sw in self._sliding), default=0)

    def trim_to_window(self, request: Request, query_at: int) -> None:
        """Free the sliding pages no query at `query_at` or later reads, publishing computed
        blocks first (so freed pages keep their hash for prefix hits). For a finished request
        whose blocks stay held (a P/D lease): it then holds only what is still useful."""
        if request.request_id not in self._requests:
            return
        self._cache_computed(request)
        for sw in self._sliding:
            sw.remove_skipped_blocks(request.request_id, query_at)

    def free(self, request: Request) -> None:
        """Release the request's blocks (publishing its computed full blocks first)."""
        rid = request.request_id
        self._write_start.pop(rid, None)
        self._replay_start.pop(rid, None)
        if rid not in self._requests:
            return
        self._cache_computed(request)
        for m in self.managers:
            m.free(rid)
        self._requests.discard(rid)
        self._state.pop(rid, None)
        self._published.pop(rid, None)

    def quarantine(self, request_id: str, key: str) -> None:
        """Keep a request's blocks held under `key`, unpublished, instead of freeing them: a
        remote write may still land in them (a P/D load given up before its transfer was
        known to have stopped, docs/disaggregation.md). The request no longer holds blocks
        (it may be admitted again, with new ones); `release_quarantine(key)` frees them."""
        self._write_start.pop(request_id, None)
        self._replay_start.pop(request_id, None)
        self._state.pop(request_id, None)
        self._published.pop(request_id, None)
        if request_id not in self._requests:
            return
        for m in self.managers:
            for table in m.request_tables():
                if request_id in table:
                    table[key] = table.pop(request_id)
        self._requests.discard(request_id)
        self._quarantined.add(key)

    def release_quarantine(self, key: str) -> None:
        """The transfer that could write into `key`'s blocks has stopped: free them (their
        content is unknown, so nothing is published)."""
        if key in self._quarantined:
            for m in self.managers:
                m.free(key)
            self._quarantined.discard(key)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(set(m.req_tables.get(k, ())) - {0})
                   for k in self._quarantined for m in self.managers)

    # ------------------------------------------------------------------------ queries
    def kv_write_start(self, request_id: str) -> int:
        return self._write_start.get(request_id, 0)

    def replay_start(self, request_id: str) -> int:
        """First recomputed position of a bounded replay (its windows hold nothing older);
        0 when the request replays nothing. A replay may span several prefill chunks."""
        return self._replay_start.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[list[int]]:
        """Per group, a copy of the request's block-table row (0 = null block: a sliding page
        that left the window). Rows only grow, and entries only ever change to 0."""
        return [list(m.req_tables.get(request_id, ())) for m in self.managers]

    def block_rows(self, request_id: str) -> list[list[int]]:
        """Per group, the request's block-table row itself (no copy; read it, never modify
        or keep it): what the runner's persistent block tables append from each step."""
        return [m.req_tables.get(request_id, []) for m in self.managers]

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def usage(self) -> float:
        """Fraction of blocks not free or cached, in the fullest bucket (what limits admission)."""
        return max(p.usage for p in self.pools)

    @property
    def num_free_blocks(self) -> int:
        """Free + cached blocks summed over buckets (see free_blocks_per_bucket)."""
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def free_blocks_per_bucket(self) -> list[int]:
        return [p.num_free_blocks for p in self.pools]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while any request holds blocks."""
        if self._requests or any(p.num_free_blocks != p.num_usable for p in self.pools):
            return False
        for p in self.pools:
            p.reset_prefix_cache()
        self.stats.resets += 1
        return True

    def check_integrity(self) -> dict[int, dict[str, int]]:
        """Assert the pool invariants; returns {bucket: {"free", "cached", "used",
        "quarantined"}} (quarantined blocks are also counted as used: they are held)."""
        return check_manager_integrity(self.pools, self.managers, self._requests,
                                       set(self._write_start), self._quarantined)
