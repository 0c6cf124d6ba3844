"""The batch a model sees: flat varlen tokens over a paged KV cache (DESIGN.md).

Shapes: T new tokens in the step, R requests, tokens of request r are rows
query_start_loc[r] : query_start_loc[r+1], at positions seq_lens[r] - query_len[r] ... seq_lens[r]-1.

KV caches are per cache name (what a layer declared in `kv_cache_specs()`), each a tensor
[num_blocks, entries_per_block, width]; the name's group gives block size, block table and
slot mapping. A slot is a flat index into the cache viewed as [num_blocks * entries_per_block, width].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class KVGroupView:
    """One KV cache group as one step sees it."""

    block_size: int              # positions per block
    compress_ratio: int          # positions per entry
    block_table: torch.Tensor    # [R, max_blocks] int64; entries beyond a request's blocks are 0
    # [T] int64: slot of each new token's entry (ratio-1 groups only; -1 = do not write)
    slot_mapping: torch.Tensor | None = None

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.compress_ratio

    def entry_slots(self, req_idx: torch.Tensor, entry_idx: torch.Tensor) -> torch.Tensor:
        """Flat slots of entries `entry_idx` (entry w covers positions [w*ratio, (w+1)*ratio))."""
        pos = entry_idx * self.compress_ratio
        blocks = self.block_table[req_idx, torch.div(pos, self.block_size, rounding_mode="floor")]
        return blocks * self.entries_per_block + (pos % self.block_size) // self.compress_ratio


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor          # [T] int64 (always present: hash-MoE routes by token id)
    positions: torch.Tensor          # [T] int64
    query_start_loc: torch.Tensor    # [R+1] int64
    seq_lens: torch.Tensor           # [R] int64: context length once this step's tokens are in
    # Host copies of the two above, for reference ops that loop over requests (never over tokens).
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    kv_caches: dict[str, torch.Tensor]
    kv_groups: list[KVGroupView]
    cache_group: dict[str, int]      # cache name -> index into kv_groups
    # [R] positions below this were computed before and their entries in growing (FULL) groups
    # are already cached; they are recomputed only to rebuild window/state (bounded replay).
    # None means every new position is written everywhere.
    kv_write_start: torch.Tensor | None = None
    # [R] host array: where each request's bounded replay began (its window and compressor
    # state hold nothing below it, even in a later chunk of the replay); with kv_write_start.
    kv_replay_start: np.ndarray | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])

    def cache(self, name: str) -> tuple[torch.Tensor, KVGroupView]:
        return self.kv_caches[name], self.kv_groups[self.cache_group[name]]

    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)

    def context_lens_cpu(self) -> np.ndarray:
        """Positions already in the cache before this step, per request."""
        return self.seq_lens_cpu - self.query_lens_cpu()
