"""Run a wideserve model over a simple paged KV cache, without the engine.

Each request slot r owns blocks [1 + r*B, 1 + (r+1)*B) of every group (block 0 is never
handed out). With poison=True, entries of sliding-window groups that have left the window are
overwritten with NaN after every step, so a model that reads outside its window fails loudly.
`specs` overrides the caches to allocate (e.g. a model's specs plus its MTP specs); `run`
applies any function to the step's batch (e.g. a main forward followed by an MTP forward).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import numpy as np
import torch

from wideserve.kv_cache.spec import CacheKind, KVCacheSpec, split_shared
from wideserve.types.forward_batch import ForwardBatch, KVGroupView


def default_block_size(specs: dict[str, KVCacheSpec], at_least: int = 16) -> int:
    lcm = math.lcm(*(s.compress_ratio for s in specs.values())) if specs else 1
    return lcm * max(1, math.ceil(at_least / lcm))


def schedule_steps(schedule: list[list[int]], seqs: list[list[int]]
                   ) -> Iterator[tuple[int, list[int], list[list[int]]]]:
    """(step, slots, new tokens) per step of a chunk schedule: request r feeds its next
    schedule[r][step] tokens of seqs[r] at that step, or sits the step out when it is 0 or
    its chunks are used up."""
    done = [0] * len(seqs)
    for step in range(max(len(c) for c in schedule)):
        slots, new = [], []
        for r, chunks in enumerate(schedule):
            n = chunks[step] if step < len(chunks) else 0
            if n:
                slots.append(r)
                new.append(seqs[r][done[r]:done[r] + n])
                done[r] += n
        yield step, slots, new


class PagedHarness:
    def __init__(self, model, max_reqs: int, max_len: int, block_size: int | None = None,
                 poison: bool = True, device: str | torch.device = "cpu",
                 specs: dict[str, KVCacheSpec] | None = None) -> None:
        self.model = model
        # Shared caches (SharedKVSpec) are their owner's tensor and group.
        self.specs, shared = split_shared(model.kv_cache_specs() if specs is None else specs)
        self.block_size = block_size or default_block_size(self.specs)
        self.blocks_per_req = math.ceil(max_len / self.block_size)
        self.poison = poison
        self.device = torch.device(device)
        self.group_specs: list[KVCacheSpec] = []
        self.cache_group: dict[str, int] = {}
        for name, spec in self.specs.items():
            if spec not in self.group_specs:
                self.group_specs.append(spec)
            self.cache_group[name] = self.group_specs.index(spec)
        num_blocks = 1 + max_reqs * self.blocks_per_req
        self.kv_caches = {   # quantised records: uint8 [blocks, entries, record bytes]
            name: torch.zeros(num_blocks, spec.entries_per_block(self.block_size),
                              spec.width if spec.record_format == "raw" else spec.entry_bytes,
                              dtype=spec.dtype if spec.record_format == "raw" else torch.uint8,
                              device=self.device)
            for name, spec in self.specs.items()}
        for name, owner in shared.items():
            self.kv_caches[name] = self.kv_caches[owner]
            self.cache_group[name] = self.cache_group[owner]
        self.seq_lens = [0] * max_reqs

    def reset(self, slot: int) -> None:
        self.seq_lens[slot] = 0

    def _block_table(self, slots: list[int]) -> torch.Tensor:
        base = torch.tensor(slots, dtype=torch.int64)[:, None] * self.blocks_per_req
        return (1 + base + torch.arange(self.blocks_per_req)[None, :]).to(self.device)

    def build_batch(self, slots: list[int], new_tokens: list[list[int]],
                    kv_write_start: list[int] | None = None) -> ForwardBatch:
        qlens = np.array([len(t) for t in new_tokens], dtype=np.int64)
        starts = np.array([self.seq_lens[s] for s in slots], dtype=np.int64)
        qsl = np.concatenate([[0], np.cumsum(qlens)])
        positions = np.concatenate([np.arange(b, b + n) for b, n in zip(starts, qlens)]
                                   + [np.zeros(0, dtype=np.int64)])
        req_of_token = np.repeat(np.arange(len(slots)), qlens)
        table = self._block_table(slots)
        pos_t = torch.from_numpy(positions).to(self.device)
        req_t = torch.from_numpy(req_of_token).to(self.device)
        groups = []
        for spec in self.group_specs:
            view = KVGroupView(self.block_size, spec.compress_ratio, table)
            if spec.compress_ratio == 1:
                view.slot_mapping = view.entry_slots(req_t, pos_t)
            groups.append(view)
        return ForwardBatch(
            input_ids=torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.int64,
                                   device=self.device),
            positions=pos_t,
            query_start_loc=torch.from_numpy(qsl).to(self.device),
            seq_lens=torch.from_numpy(starts + qlens).to(self.device),
            query_start_loc_cpu=qsl, seq_lens_cpu=starts + qlens,
            kv_caches=self.kv_caches, kv_groups=groups, cache_group=self.cache_group,
            kv_write_start=None if kv_write_start is None else torch.tensor(
                kv_write_start, dtype=torch.int64, device=self.device))

    def step(self, slots: list[int], new_tokens: list[list[int]],
             kv_write_start: list[int] | None = None) -> torch.Tensor:
        """Run one step; returns logits [T, vocab] for every new token."""
        return self.run(slots, new_tokens,
                        lambda b: self.model.compute_logits(self.model.forward(b)),
                        kv_write_start)

    @torch.inference_mode()
    def run(self, slots: list[int], new_tokens: list[list[int]],
            fn: Callable[[ForwardBatch], Any], kv_write_start: list[int] | None = None) -> Any:
        """Build the step's batch, return fn(batch), then advance and poison."""
        result = fn(self.build_batch(slots, new_tokens, kv_write_start))
        for s, toks in zip(slots, new_tokens):
            self.seq_lens[s] += len(toks)
        if self.poison:
            self._poison_out_of_window(slots)
        return result

    def _poison_out_of_window(self, slots: list[int]) -> None:
        for name, spec in self.specs.items():
            if (spec.kind is not CacheKind.SLIDING_WINDOW or not spec.dtype.is_floating_point
                    or spec.record_format != "raw"):
                continue
            cache = self.kv_caches[name].view(-1, spec.width)
            for s in slots:
                stale = self.seq_lens[s] - spec.window + 1
                if stale <= 0:
                    continue
                first = (1 + s * self.blocks_per_req) * self.block_size
                cache[first:first + stale] = float("nan")
