"""From a model's cache specs to groups, buckets, pool sizes and the KV tensors.

Glossary
- group: the cache names (layers) whose specs are equal. One block table per request per
  group; one manager per group (managers.py).
- page (block) size of a group, in positions: FULL groups page at the logical block
  (CacheConfig.block_size, the prefix-hash unit, default 256); a FULL spec with compress
  ratio m stores block_size/m entries per page. SLIDING_WINDOW groups page at the smallest
  divisor of the logical block that is >= the window (window 128 -> 128-position pages, an
  8-position compressor state -> 8-position pages), so they hold about two pages per request.
- page bytes: bytes of one page of ONE layer of the group.
- bucket: the groups with equal page bytes; they share one block pool (block_pool.py).
- slab: inside a bucket, layer j of every group is backed by slab j, a [num_blocks, page]
  buffer. Block id b handed to group g is backed by page b of slabs 0..len(g.names)-1; the
  pool hands b to one group at a time, so groups never see each other's bytes.
- growing vs bounded: FULL groups grow with the context; SLIDING_WINDOW groups hold a bounded
  number of pages per request.

Sizing (budget in bytes -> blocks per bucket): bounded groups first get enough pages for
max_num_seqs requests at full window (+ lookahead), the pages one step's new tokens need, and
in "keep" mode room to keep the window pages of `window_cache_hit_points` prefix hit points
cached; what is left buys logical blocks for the growing groups, the same number for each
FULL group (every request grows in all of them at once), i.e. in proportion to bytes per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from wideserve.config import CacheConfig, SchedulerConfig
from wideserve.kv_cache import host_memory
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec, SharedKVSpec, split_shared

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    names: tuple[str, ...]     # layer j of the group is backed by slab j of its bucket
    block_size: int            # positions per page
    bucket_id: int

    @property
    def is_sliding(self) -> bool:
        return self.spec.kind is CacheKind.SLIDING_WINDOW

    @property
    def compress_ratio(self) -> int:
        return self.spec.compress_ratio

    @property
    def entries_per_block(self) -> int:
        return self.spec.entries_per_block(self.block_size)

    @property
    def page_bytes(self) -> int:
        return self.spec.page_bytes(self.block_size)


@dataclass(slots=True)
class KVCacheBucket:
    bucket_id: int
    page_bytes: int              # one layer's page
    group_ids: tuple[int, ...]
    num_slabs: int               # the most layers of any of its groups
    num_blocks: int = 0          # including the null block 0

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.num_slabs

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks


@dataclass(slots=True)
class KVCacheConfig:
    block_size: int                              # logical (hash) block, positions
    groups: list[KVCacheGroup]
    buckets: list[KVCacheBucket]
    cache_group: dict[str, int]                  # cache name -> group id
    # model-arch.md §6.2 formulas summed over layers, per role ("compressed", "indexer", ...)
    bytes_per_token: dict[str, float] = field(default_factory=dict)
    bounded_bytes_per_request: dict[str, int] = field(default_factory=dict)
    # Pool bytes per token of growing capacity, counting slab padding (>= total_bytes_per_token).
    pool_bytes_per_token: float = 0.0
    # Tokens of context the growing groups hold, all requests together (None: no such group).
    capacity_tokens: int | None = None
    budget_bytes: int | None = None              # None when sized by num_blocks_override
    # reader cache name -> owner cache name (SharedKVSpec): same tensor, same group
    shared: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes_per_token(self) -> float:
        return sum(self.bytes_per_token.values())

    @property
    def total_bounded_bytes_per_request(self) -> int:
        return sum(self.bounded_bytes_per_request.values())

    @property
    def total_bytes(self) -> int:
        return sum(b.total_bytes for b in self.buckets)

    def summary(self) -> str:
        lines = [f"KV cache: {len(self.groups)} groups in {len(self.buckets)} buckets, "
                 f"{self.total_bytes / 2**20:.1f} MiB, logical block {self.block_size}, "
                 f"capacity {self.capacity_tokens} tokens, "
                 f"{self.total_bytes_per_token:.2f} B/token, "
                 f"bounded {self.total_bounded_bytes_per_request} B/request"]
        for b in self.buckets:
            kinds = ", ".join(f"{self.groups[g].spec.role}x{len(self.groups[g].names)}"
                              f"@{self.groups[g].block_size}" for g in b.group_ids)
            lines.append(f"  bucket {b.bucket_id}: {b.num_blocks} blocks x {b.block_bytes} B "
                         f"({b.num_slabs} slabs x {b.page_bytes} B): {kinds}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------- grouping
# The default prefix-hash granularity, in positions (docs/memory.md, "The logical block";
# measured in BENCHMARKS.md, "KV block size on the agentic workload"): a hit is only ever a
# whole number of blocks, so the part of a shared prefix past the last boundary is recomputed.
# On the agentic replay 64-token blocks served more of the prompt from the cache than 128 or
# 256 and their steps were no slower; models with compressed caches cannot go below the
# least common multiple of their compression ratios (DeepSeek-V4: 4 and 128 -> 128).
DEFAULT_BLOCK_POSITIONS = 64


def default_block_size(specs: dict[str, KVCacheSpec]) -> int:
    """The smallest multiple of every compression ratio that is >= DEFAULT_BLOCK_POSITIONS."""
    lcm = math.lcm(*{s.compress_ratio for s in specs.values()})
    return lcm * math.ceil(DEFAULT_BLOCK_POSITIONS / lcm)


def _check_logical_block(specs: dict[str, KVCacheSpec], block_size: int) -> None:
    ratios = {s.compress_ratio for s in specs.values()}
    lcm = math.lcm(*ratios)
    if block_size < 1 or block_size % lcm:
        bad = next(n for n, s in specs.items() if block_size < 1 or block_size % s.compress_ratio)
        good = lcm * max(1, math.ceil(block_size / lcm))
        raise ValueError(
            f"CacheConfig.block_size={block_size} is not a multiple of every compress ratio "
            f"(cache {bad!r} has ratio {specs[bad].compress_ratio}); use a multiple of {lcm}, "
            f"e.g. block_size={good}")


def sliding_page_size(spec: KVCacheSpec, block_size: int) -> int:
    """Smallest divisor of the logical block that is >= the window (and a multiple of the
    spec's ratio); the logical block itself when the window is larger."""
    for d in range(1, block_size + 1):
        if block_size % d == 0 and d >= spec.window and d % spec.compress_ratio == 0:
            return d
    return block_size


def _group_specs(specs: dict[str, KVCacheSpec], block_size: int) -> list[KVCacheGroup]:
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    page_bytes_to_bucket: dict[int, int] = {}
    groups = []
    for gid, (spec, names) in enumerate(by_spec.items()):
        bs = sliding_page_size(spec, block_size) if spec.kind is CacheKind.SLIDING_WINDOW \
            else block_size
        bucket = page_bytes_to_bucket.setdefault(spec.page_bytes(bs), len(page_bytes_to_bucket))
        groups.append(KVCacheGroup(gid, spec, tuple(names), bs, bucket))
    return groups


def _make_buckets(groups: list[KVCacheGroup]) -> list[KVCacheBucket]:
    buckets: list[KVCacheBucket] = []
    for g in groups:
        if g.bucket_id == len(buckets):
            buckets.append(KVCacheBucket(g.bucket_id, g.page_bytes, (), 0))
        b = buckets[g.bucket_id]
        b.group_ids += (g.group_id,)
        b.num_slabs = max(b.num_slabs, len(g.names))
    return buckets


# ------------------------------------------------------------------------------ sizing
def bounded_blocks_per_request(group: KVCacheGroup, num_lookahead_tokens: int = 0) -> int:
    """Pages a decoding request can hold at once in a sliding group: the window, the position
    being written and the lookahead, +1 for a window that does not start on a page boundary,
    +1 for a page that left the window and waits for the next allocation (manager.py)."""
    return math.ceil((group.spec.window + num_lookahead_tokens) / group.block_size) + 2


def window_pages_for_hit(group: KVCacheGroup) -> int:
    """Pages before a hit point P that hold positions P-window+1 .. P-1."""
    return math.ceil((group.spec.window - 1) / group.block_size)


def _bounded_blocks(group: KVCacheGroup, sched: SchedulerConfig, keep: bool,
                    hit_points: int) -> int:
    n = sched.max_num_seqs * bounded_blocks_per_request(group, sched.num_lookahead_tokens)
    n += math.ceil(sched.max_num_batched_tokens / group.block_size)
    if keep:
        n += hit_points * window_pages_for_hit(group)
    return n


def _budget_bytes(cache_config: CacheConfig, device: torch.device) -> int:
    if cache_config.kv_cache_memory is not None:
        return int(cache_config.kv_cache_memory)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * cache_config.gpu_memory_utilization)
    return DEFAULT_CPU_KV_CACHE_BYTES


def _size_from_budget(cfg: KVCacheConfig, bounded: list[int], budget: int,
                      max_model_len: int | None) -> None:
    full_per_bucket = [sum(not cfg.groups[g].is_sliding for g in b.group_ids)
                       for b in cfg.buckets]
    fixed = sum((1 + n) * b.block_bytes for n, b in zip(bounded, cfg.buckets))
    left = budget - fixed
    if left < 0:
        raise ValueError(
            f"KV cache budget of {budget} B cannot hold the sliding windows of max_num_seqs "
            f"requests ({fixed} B needed); raise the budget or lower max_num_seqs")
    per_logical_block = sum(n * b.block_bytes for n, b in zip(full_per_bucket, cfg.buckets))
    if per_logical_block == 0:
        # Only bounded groups: spend the rest on keeping more window pages cached.
        nulls = sum(b.block_bytes for b in cfg.buckets)
        scale = (budget - nulls) / (fixed - nulls)
        for n, b in zip(bounded, cfg.buckets):
            b.num_blocks = 1 + int(n * scale)
        return
    num_logical = left // per_logical_block
    cfg.capacity_tokens = num_logical * cfg.block_size
    if num_logical < 1 or (max_model_len is not None and cfg.capacity_tokens < max_model_len):
        raise ValueError(
            f"KV cache budget of {budget} B holds {cfg.capacity_tokens} tokens of context "
            f"({cfg.pool_bytes_per_token:.1f} B/token after {fixed} B of sliding windows), less "
            f"than max_model_len={max_model_len}; raise the budget (CacheConfig.kv_cache_memory "
            f"or gpu_memory_utilization) or lower max_model_len / max_num_seqs")
    for n, nf, b in zip(bounded, full_per_bucket, cfg.buckets):
        b.num_blocks = 1 + n + nf * num_logical


def _size_from_override(cfg: KVCacheConfig, num_blocks: int) -> None:
    # Capacity here is an upper bound: sliding groups sharing a bucket take their pages too.
    capacity = None
    for b in cfg.buckets:
        b.num_blocks = num_blocks
        nf = sum(not cfg.groups[g].is_sliding for g in b.group_ids)
        if nf:
            tokens = (num_blocks - 1) // nf * cfg.block_size
            capacity = tokens if capacity is None else min(capacity, tokens)
    cfg.capacity_tokens = capacity


def build_kv_cache_config(specs: dict[str, KVCacheSpec | SharedKVSpec],
                          cache_config: CacheConfig,
                          scheduler_config: SchedulerConfig | None = None, *,
                          device: str | torch.device = "cpu", max_model_len: int | None = None,
                          window_cache_hit_points: int | None = None) -> KVCacheConfig:
    """Group the specs, bucket the groups, and size every bucket's pool.

    window_cache_hit_points: in "keep" mode, how many prefix hit points' window/state pages
    the bounded pools keep cached beyond the running requests' needs (default 2 x
    max_num_seqs). max_model_len: when sizing from a budget, fail unless one request of
    this length fits.
    """
    specs, shared = split_shared(specs)
    if not specs:
        raise ValueError("the model declared no KV cache specs")
    sched = scheduler_config or SchedulerConfig()
    block_size = cache_config.block_size
    if block_size is None:
        block_size = default_block_size(specs)
    _check_logical_block(specs, block_size)
    groups = _group_specs(specs, block_size)
    cfg = KVCacheConfig(block_size=block_size, groups=groups, buckets=_make_buckets(groups),
                        cache_group={n: g.group_id for g in groups for n in g.names},
                        shared=shared)
    cfg.cache_group.update({n: cfg.cache_group[o] for n, o in shared.items()})
    for spec in specs.values():
        if spec.grows_with_context:
            cfg.bytes_per_token[spec.role] = cfg.bytes_per_token.get(spec.role, 0.0) \
                + spec.bytes_per_token
        else:
            cfg.bounded_bytes_per_request[spec.role] = \
                cfg.bounded_bytes_per_request.get(spec.role, 0) + spec.bounded_bytes
    cfg.pool_bytes_per_token = sum(cfg.buckets[g.bucket_id].block_bytes / block_size
                                   for g in groups if not g.is_sliding)
    keep = cache_config.enable_prefix_caching and cache_config.prefix_window_mode == "keep"
    hit_points = 2 * sched.max_num_seqs if window_cache_hit_points is None \
        else window_cache_hit_points
    bounded = [sum(_bounded_blocks(groups[g], sched, keep, hit_points)
                   for g in b.group_ids if groups[g].is_sliding) for b in cfg.buckets]
    if cache_config.num_blocks_override is not None:
        _size_from_override(cfg, cache_config.num_blocks_override)
    else:
        cfg.budget_bytes = _budget_bytes(cache_config, torch.device(device))
        _size_from_budget(cfg, bounded, cfg.budget_bytes, max_model_len)
    return cfg


def exact_replay_tokens(specs: dict[str, KVCacheSpec | SharedKVSpec],
                        replay_depth: int) -> int:
    """Positions to recompute before a prefix hit so every window is rebuilt exactly.

    Layer l's window entries at position p depend on layer l-1's output at p, which depends on
    layer l-1's window (window - 1 earlier positions). Restarting with empty windows at S, the
    entries of the l-th windowed layer (0-based) are exact from S + l*(window-1) on; the last
    of `replay_depth` windowed layers needs exact entries from P - window + 1, hence
    R = replay_depth * (window - 1) with the largest window.
    """
    windows = [s.window for s in split_shared(specs)[0].values()
               if s.kind is CacheKind.SLIDING_WINDOW]
    if replay_depth < 0:
        raise ValueError(f"replay_depth must be >= 0, got {replay_depth}")
    return replay_depth * (max(windows) - 1) if windows else 0


# ----------------------------------------------------------------------------- tensors
def allocate_kv_tensors(kv_config: KVCacheConfig, device: str | torch.device,
                        huge_pages: bool = False) -> dict[str, torch.Tensor]:
    """Cache name -> zeroed view [num_blocks, entries_per_block, width] of its slab.

    Raw records have `spec.dtype` and `spec.width`; quantised records (fp8_ds_mla, fp8_index,
    mxfp4_index) are uint8 [num_blocks, entries_per_block, entry_bytes]. huge_pages: the
    slabs on transparent huge pages (CacheConfig.kv_huge_pages; host_memory.zeros).
    """
    device = torch.device(device)
    host_memory.check_pool_fits(
        sum(b.num_blocks * b.page_bytes * b.num_slabs for b in kv_config.buckets), device)
    out: dict[str, torch.Tensor] = {}
    for b in kv_config.buckets:
        slabs = [host_memory.zeros(b.num_blocks * b.page_bytes, device, huge_pages)
                 for _ in range(b.num_slabs)]
        for gid in b.group_ids:
            g = kv_config.groups[gid]
            spec, epb = g.spec, g.entries_per_block
            for j, name in enumerate(g.names):
                if spec.record_format == "raw":
                    out[name] = slabs[j].view(spec.dtype).view(b.num_blocks, epb, spec.width)
                else:
                    out[name] = slabs[j].view(b.num_blocks, epb, spec.entry_bytes)
    out.update({name: out[owner] for name, owner in kv_config.shared.items()})
    return out
