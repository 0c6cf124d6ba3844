"""The batch a model sees: flat varlen tokens over a paged KV cache (docs/architecture.md).

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
    """One KV cache group as one step sees it.

    The block table may hold more rows than the step has requests (the runner's persistent
    table, worker/block_tables.py): request r's row is `req_rows[r]` (identity when None).
    Index it through `entry_slots` / `host_rows`, never by request index directly."""

    block_size: int              # positions per block
    compress_ratio: int          # positions per entry
    block_table: torch.Tensor    # [rows, max_blocks] int64; entries beyond a row's blocks are 0
    # [T] int64: slot of each new token's entry (ratio-1 groups only); every token has one
    slot_mapping: torch.Tensor | None = None
    req_rows: torch.Tensor | None = None        # [R] int64 table row of each request
    req_rows_cpu: np.ndarray | None = None      # the same on the host

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.compress_ratio

    def rows(self, req_idx: torch.Tensor) -> torch.Tensor:
        return req_idx if self.req_rows is None else self.req_rows[req_idx]

    def row(self, r: int) -> int:
        return r if self.req_rows_cpu is None else int(self.req_rows_cpu[r])

    def host_rows(self, req_idx: np.ndarray) -> np.ndarray:
        return req_idx if self.req_rows_cpu is None else self.req_rows_cpu[req_idx]

    def entry_slots(self, req_idx: torch.Tensor, entry_idx: torch.Tensor) -> torch.Tensor:
        """Flat slots of entries `entry_idx` (entry w covers positions [w*ratio, (w+1)*ratio))."""
        pos = entry_idx * self.compress_ratio
        blocks = self.block_table[self.rows(req_idx),
                                  torch.div(pos, self.block_size, rounding_mode="floor")]
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
    kv_write_start_cpu: np.ndarray | None = None   # [R] the same on the host (runner-built)
    # [R] host array: where each request's bounded replay began (its window and compressor
    # state hold nothing below it, even in a later chunk of the replay); with kv_write_start.
    kv_replay_start: np.ndarray | None = None
    # [R] host array: how many of each request's last rows the caller reads the hidden states
    # of (0: none, a chunk that does not sample; 1: the sampled row; drafts + 1; every row for
    # prompt logprobs). None: every row. A model may leave the other rows' outputs unset
    # where that saves work (DeepSeek-V4.1's decoder bounded replay).
    num_output_rows_cpu: np.ndarray | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # Set by the small-batch decode path (worker/small_batch.py) only: a dict that lives as
    # long as this batch's tensors are reused step to step, where a model may keep what it
    # derives from them and its weights (models/lean_decode.py). None: plan every step.
    plan_cache: dict | None = None

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

    def write_start_cpu(self) -> np.ndarray | None:
        """[R] kv_write_start on the host (a hand-built batch without the copy pays a read)."""
        if self.kv_write_start is None:
            return None
        if self.kv_write_start_cpu is None:
            self.kv_write_start_cpu = self.kv_write_start.cpu().numpy().astype(np.int64)
        return self.kv_write_start_cpu

    def replay_write_rows_cpu(self) -> np.ndarray | None:
        """Token rows whose positions are at or past their request's kv_write_start (the rows
        a bounded replay writes into growing caches); None when every row is written."""
        ws = self.write_start_cpu()
        if ws is None:
            return None
        qlens = self.query_lens_cpu()
        ctx = self.seq_lens_cpu - qlens
        req = np.repeat(np.arange(len(qlens)), qlens)
        pos = np.arange(int(qlens.sum())) - np.repeat(self.query_start_loc_cpu[:-1], qlens) \
            + ctx[req]
        keep = pos >= ws[req]
        return None if keep.all() else np.nonzero(keep)[0]
