"""The persistent decode batch: decode steps of any size over inputs kept across steps.

docs/host_path.md ("The persistent decode batch"). The small-batch path (small_batch.py)
showed that at batch 1-4 a decode step's host cost is mostly what the runner and the model
re-derive every step (the metadata arrays, the lean forward's per-layer plan: kernel choice,
weight checks, op arguments) to reach the answer of the step before. That cost does not
depend on the batch size, so a batch of 64 pays it too: on the 11M Qwen3-MoE the lean plan
alone was ~0.3 ms of every 64-request decode step, serial Python that a second torch thread
cannot share. Here every decode step that neither the captured step nor the small-batch path
took (every request one new token, past its first step, no drafts, no replay, no prompt
logprobs) gets what the small path gives, without its small-M GEMMs:

- **Preallocated inputs, exact size.** Token ids, positions, context lengths, query offsets,
  table rows and each ratio-1 group's slots live in the captured step's `StaticDecodeInputs`,
  made once for `max_size` rows (the scheduler's max_num_seqs); a step of r requests fills
  their first r rows with a few numpy assignments (no per-request numpy scalar writes) and
  the batch is the same views of them for every step of size r (made at the first one).
- **The plan kept per size.** The batch carries `plan_cache`, one dict per size r, which the
  Llama family's lean forward (models/lean_decode.py) fills once and reuses while the batch's
  tensors are the same objects. The dicts are emptied when a block table is reallocated (the
  old plan points at the old tensor) and by `invalidate`. The engine leaves the path off
  with EPLB, whose expert moves rewrite weights under a kept plan.

The model runs the same ops on the same values as on `ModelRunner.build_batch`'s batch, so
outputs are the standard path's, bitwise (tests/worker/test_decode_batch.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.worker.decode_capture import (GroupLayout, StaticDecodeInputs, StepRequest,
                                              is_decode_step)

if TYPE_CHECKING:
    from wideserve.worker.block_tables import BlockTables


class DecodeBatch:
    """Static inputs for decode steps of up to `max_size` requests, views and plans per size."""

    def __init__(self, groups: Sequence[GroupLayout], cache_group: dict[str, int],
                 kv_caches: dict[str, torch.Tensor], tables: BlockTables,
                 device: torch.device, max_size: int, separate_copy: bool = False) -> None:
        """separate_copy: device buffers uploaded each step even on the CPU (what CUDA does;
        lets the CPU tests exercise that path)."""
        if max_size < 1:
            raise ValueError(f"the persistent decode batch needs max_size >= 1, got {max_size}")
        self.groups, self.cache_group, self.kv_caches = list(groups), cache_group, kv_caches
        self.tables, self.device, self.max_size = tables, device, max_size
        self.slot_groups = [g for g, lay in enumerate(self.groups) if lay.compress_ratio == 1]
        self.inputs = StaticDecodeInputs(max_size, self.slot_groups, device, separate_copy)
        host = self.inputs.host
        self._ids, self._pos = host["input_ids"], host["positions"]
        self._lens, self._rows = host["seq_lens"], host["req_rows"]
        self._slots = [(host[f"slots{g}"], g, self.groups[g].block_size)
                       for g in self.slot_groups]
        # Per size r, made at its first step: the batch's tensors, its group views, its plans.
        self._views: dict[int, tuple] = {}
        self._group_views: dict[int, list[KVGroupView]] = {}
        self._plans: dict[int, dict] = {}
        self._tables: list[torch.Tensor] = []     # the device tables the group views point at
        self.steps = 0                            # steps taken here (stats, tests)

    def applies(self, reqs: Sequence[StepRequest]) -> bool:
        """A decode step of at most max_size requests, none in its first step (a first step
        is a prefill, even of one token), no drafts, replay or prompt logprobs."""
        return 0 < len(reqs) <= self.max_size and is_decode_step(reqs) \
            and not any(q.is_new for q in reqs)

    def invalidate(self) -> None:
        """Forget every kept plan (the next step of each size plans again)."""
        for plans in self._plans.values():
            plans.clear()

    def batch(self, reqs: Sequence[StepRequest]) -> ForwardBatch:
        """The step's batch: its rows written into the static buffers, the kept views."""
        r = len(reqs)
        update = self.tables.update
        rows = [update(q.request_id, q.block_ids, False) for q in reqs]
        pos = self._pos[:r]
        pos[:] = [q.start for q in reqs]
        self._ids[:r] = [q.token_ids[0] for q in reqs]
        np.add(pos, 1, out=self._lens[:r])
        self._rows[:r] = rows
        if self._slots:
            row_idx = self._rows[:r]
            for slots, g, bs in self._slots:
                block, offset = np.divmod(pos, bs)
                out = slots[:r]
                np.multiply(self.tables.host(g)[row_idx, block], bs, out=out)
                out += offset
        self.inputs.upload(r)
        views = self._kv_views(r)
        input_ids, positions, qsl, seq_lens, qsl_cpu, seq_lens_cpu = self._size_views(r)
        self.steps += 1
        return ForwardBatch(
            input_ids=input_ids, positions=positions, query_start_loc=qsl, seq_lens=seq_lens,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, kv_caches=self.kv_caches,
            kv_groups=views, cache_group=self.cache_group, plan_cache=self._plans[r])

    def _size_views(self, r: int) -> tuple:
        views = self._views.get(r)
        if views is None:
            dev, host = self.inputs.dev, self.inputs.host
            views = (dev["input_ids"][:r], dev["positions"][:r], dev["query_start_loc"][:r + 1],
                     dev["seq_lens"][:r], host["query_start_loc"][:r + 1], host["seq_lens"][:r])
            self._views[r] = views
            self._plans[r] = {}
        return views

    def _kv_views(self, r: int) -> list[KVGroupView]:
        """Size r's group views; remade (and every kept plan dropped) when a block table was
        reallocated since they were made."""
        tables = [self.tables.device_table(g) for g in range(len(self.groups))]
        if len(tables) != len(self._tables) or \
                any(a is not b for a, b in zip(tables, self._tables)):
            self._tables = tables
            self._group_views.clear()
            self.invalidate()
        views = self._group_views.get(r)
        if views is None:
            dev, host = self.inputs.dev, self.inputs.host
            req_rows, req_rows_cpu = dev["req_rows"][:r], host["req_rows"][:r]
            views = [KVGroupView(lay.block_size, lay.compress_ratio, tables[g],
                                 slot_mapping=dev[f"slots{g}"][:r]
                                 if lay.compress_ratio == 1 else None,
                                 req_rows=req_rows, req_rows_cpu=req_rows_cpu)
                     for g, lay in enumerate(self.groups)]
            self._group_views[r] = views
        return views
