"""Where a KV cache's bytes are, and which pages one request's pull moves.

The KV tensors of an engine are slabs (kv_cache/groups.py): bucket b has `num_slabs`
byte buffers of [num_blocks, page_bytes]; block id k of group g lives in page k of slabs
0..len(g.names)-1 of g's bucket. A *region* here is one slab; a transfer *descriptor* is one
(region, block) page, numbered region_base[r] + block, so both sides prepare their descriptor
lists once (per peer) and a pull is two int32 index arrays.

What moves (docs/disaggregation.md): for growing groups (V4's compressed entries and indexer
keys, Llama/Qwen's paged KV) every page from the local hit to the last loaded position; for
sliding groups (V4's window latents and compressor states) only the pages the window of the
next query reads — never the history. The pages that left the window are null on both sides
and are skipped, which is what keeps a long prompt's admission cheap.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch

from wideserve.kv_cache.groups import KVCacheConfig


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Region:
    bucket_id: int
    slab: int
    tensor: torch.Tensor          # flat uint8 view of the slab
    page_bytes: int
    num_blocks: int

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_blocks


@dataclass(slots=True)
class GroupPlan:
    page_size: int                # positions per page
    window: int                   # 0 for growing groups
    regions: np.ndarray           # int32 region indices backing this group's layers


class KVLayout:
    """The slabs of one engine and how groups map onto them."""

    def __init__(self, kv_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor]) -> None:
        self.regions: list[Region] = []
        for b in kv_config.buckets:
            for j in range(b.num_slabs):
                name = next(kv_config.groups[g].names[j] for g in b.group_ids
                            if len(kv_config.groups[g].names) > j)
                flat = kv_caches[name].reshape(-1).view(torch.uint8)
                assert flat.numel() == b.num_blocks * b.page_bytes
                self.regions.append(Region(b.bucket_id, j, flat, b.page_bytes, b.num_blocks))
        self.groups = group_plans(kv_config)
        self.base = region_bases([r.num_blocks for r in self.regions])
        self.fingerprint = layout_fingerprint(kv_config)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_blocks for r in self.regions)

    def region_info(self) -> list[tuple[int, int, int, int]]:
        """(addr, page_bytes, num_blocks, device id) per region: what a peer needs."""
        return [(r.addr, r.page_bytes, r.num_blocks, r.tensor.device.index or 0)
                for r in self.regions]


def descriptor_table(regions: list[tuple[int, int, int, int]]) -> np.ndarray:
    """[num_descriptors, 3] int64 (addr, len, device id): one row per (region, block)."""
    rows = []
    for addr, page_bytes, num_blocks, dev in regions:
        addrs = addr + np.arange(num_blocks, dtype=np.int64) * page_bytes
        rows.append(np.stack([addrs, np.full_like(addrs, page_bytes),
                              np.full_like(addrs, dev)], axis=1))
    return np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)


def group_plans(kv_config: KVCacheConfig) -> list[GroupPlan]:
    """Per group: page size, window and the regions (one per layer) backing it; regions are
    numbered bucket by bucket, slab by slab."""
    first, n = {}, 0
    for b in kv_config.buckets:
        first[b.bucket_id] = n
        n += b.num_slabs
    return [GroupPlan(g.block_size, g.spec.window if g.is_sliding else 0,
                      np.arange(first[g.bucket_id], first[g.bucket_id] + len(g.names),
                                dtype=np.int32)) for g in kv_config.groups]


def region_bases(num_blocks: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(num_blocks)[:-1]]).astype(np.int32) \
        if num_blocks else np.zeros(0, np.int32)


def layout_fingerprint(kv_config: KVCacheConfig) -> str:
    """Equal on two engines whose pages can be copied into each other."""
    desc = [(g.spec.kind.value, g.spec.role, g.spec.width, str(g.spec.dtype),
             g.spec.compress_ratio, g.spec.window, g.spec.record_format, g.block_size,
             len(g.names), g.bucket_id, g.page_bytes) for g in kv_config.groups]
    desc.append(kv_config.block_size)
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:32]


def plan_pages(groups: list[GroupPlan], local_rows: list[list[int]],
               remote_rows: list[list[int]], start: int, end: int
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per group, the (local, remote) page ids holding what positions [start, end) need.

    `start` is the local prefix hit (a logical-block boundary), `end` the first position
    computed locally. Growing groups: pages [start/P, ceil(end/P)); sliding groups from the
    page holding end - window + 1 (what the query at `end` reads) instead, when later.
    Raises ValueError when either side lacks a page (a null or missing table entry).
    """
    if len(local_rows) != len(groups) or len(remote_rows) != len(groups):
        raise ValueError(f"block tables for {len(remote_rows)} remote / {len(local_rows)} local "
                         f"groups, expected {len(groups)}")
    local_out, remote_out = [], []
    for gid, g in enumerate(groups):
        first = start // g.page_size
        if g.window:
            first = max(first, max(0, end - g.window + 1) // g.page_size)
        last = cdiv(end, g.page_size)
        loc = np.asarray(local_rows[gid][first:last], dtype=np.int32)
        rem = np.asarray(remote_rows[gid][first:last], dtype=np.int32)
        need = max(0, last - first)
        if len(loc) != need or len(rem) != need or not loc.all() or not rem.all():
            raise ValueError(f"group {gid}: pages {first}..{last - 1} are not all held "
                             f"(local {len(loc)}, remote {len(rem)} of {need}, or a null page)")
        local_out.append(loc)
        remote_out.append(rem)
    return local_out, remote_out


def descriptor_indices(groups: list[GroupPlan], base: np.ndarray,
                       pages: list[np.ndarray]) -> np.ndarray:
    """int32 descriptor indices (region-major within each group) of the given pages."""
    parts = [(base[g.regions][:, None] + p[None, :]).ravel()
             for g, p in zip(groups, pages) if len(p)]
    return np.concatenate(parts).astype(np.int32, copy=False) if parts \
        else np.zeros(0, np.int32)
