"""The small-batch decode path: the shortest host path for decode steps of 1-4 requests.

docs/host_path.md ("The small-batch decode path") has the design and the measurements. At a
batch of one the model's forward on a small model is a few ms of C++ ops, and what the
runner and the model decide around them per step (building the batch's metadata arrays, the
lean forward's per-layer plan: kernel choice, weight checks, op arguments) is a large share
of the step. When a decode step is small (every request one new token, past its first step,
no drafts, no replay, no prompt logprobs, at most `max_size` requests), the runner takes it
here instead of `ModelRunner.build_batch`:

- **Preallocated inputs.** Token ids, positions, context lengths, query offsets, table rows
  and each ratio-1 group's slots live in buffers made once (`StaticDecodeInputs`, the
  captured step's buffers, worker/decode_capture.py); the batch of r requests is the same
  views of their first r rows every step, so a step writes a few integers and allocates no
  metadata tensor. Unlike the captured step there is no padding: r rows are r rows.
- **The plan kept across steps.** Because the batch's tensors are the same objects from step
  to step, what a model derives from them and from its weights alone can be kept: the batch
  carries `plan_cache`, one dict per batch size, which the Llama family's lean forward
  (models/lean_decode.py) fills once and reuses. The dicts are emptied whenever a block table
  is reallocated (a new tensor the old plan does not point at) and by `invalidate`, for a
  caller that changes the model's weights or kernel switches after startup (the engine sets
  both once, before the first step, and leaves the path off with EPLB, whose expert moves
  rewrite weights while serving).
- **Small-M GEMMs for plain linears** (LoadConfig.small_batch_gemms, on by default;
  --no-small-batch-gemms turns them off). A model whose projections are plain `nn.Linear`
  modules (DeepSeek-V4 / V4.1) runs them, in a small step only (`kernels`), through the
  kernel table's small-M GEMM kept per row count instead of oneDNN's F.linear, ~20x cheaper
  at one row (layers/small_m.py). Not under --batch-invariant, whose InvariantLinears keep
  one kernel for every row count.
- **Fused mHC sites** (with the small-M GEMMs, on the same terms): DeepSeek-V4 / V4.1's
  hyper-connection sites on bf16 streams run the fused C++ op in a small step, three calls
  for ~65 torch ops a site (layers/mhc.py, kernels/mhc.py), equal to fp32 rounding.

Greedy outputs are the standard path's in fp32, on every family (tests/worker/
test_small_batch.py), and in bf16 bitwise under --batch-invariant. In the default mode's bf16
the small-M GEMMs round like the kernel table's small-M kernel, one bf16 ulp off oneDNN on ~1
value in 10^4-10^5, and on a near tie that flips a greedy token (1 of 12 random prompts over
48 tokens on V4): one more batch-size-dependent choice of that mode, whose guarantee is fp32
greedy equality (docs/cpu_kernels.md, "Batch invariance"). LoadConfig.small_batch_decode sets
the largest batch taken here (0: off, for A/B runs).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from wideserve.layers.mhc import use_fused_mhc
from wideserve.layers.small_m import GemmScope, SmallMLinear, use_small_m_linears
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
# The runner's request and layout, as the captured step reads them (a superset of ours).
from wideserve.worker.decode_capture import (GroupLayout, StaticDecodeInputs, StepRequest,
                                              is_decode_step)

if TYPE_CHECKING:
    from wideserve.models.interface import CausalLM
    from wideserve.worker.block_tables import BlockTables

# Largest batch the path takes by default (the recipe's "batch 1-4").
DEFAULT_MAX_SIZE = 4


class SmallBatchDecode:
    """Static inputs for decode steps of up to `max_size` requests, and their kept plans."""

    def __init__(self, groups: Sequence[GroupLayout], cache_group: dict[str, int],
                 kv_caches: dict[str, torch.Tensor], tables: BlockTables,
                 device: torch.device, max_size: int = DEFAULT_MAX_SIZE,
                 separate_copy: bool = False, model: CausalLM | None = None) -> None:
        """separate_copy: device buffers uploaded each step even on the CPU (what CUDA
        does; lets the CPU tests exercise that path). model: the model whose plain linears
        run small-M GEMMs in small steps (when it has such: `functional_gemms`, and not
        under --batch-invariant, whose InvariantLinears keep one kernel for every M)."""
        if max_size < 1:
            raise ValueError(f"small_batch_decode must be >= 1 to enable the path, got "
                             f"{max_size}")
        self.groups, self.cache_group, self.kv_caches = list(groups), cache_group, kv_caches
        self.tables, self.device, self.max_size = tables, device, max_size
        self.slot_groups = [g for g, lay in enumerate(self.groups) if lay.compress_ratio == 1]
        self._slot_layout = [(g, self.groups[g].block_size) for g in self.slot_groups]
        self.inputs = StaticDecodeInputs(max_size, self.slot_groups, device, separate_copy)
        host, dev = self.inputs.host, self.inputs.dev
        self._ids, self._pos = host["input_ids"], host["positions"]
        self._lens, self._rows = host["seq_lens"], host["req_rows"]
        self._slots = [host[f"slots{g}"] for g in self.slot_groups]
        # Per batch size r (index r - 1): the views of the first r rows, made once.
        self._views = [self._size_views(dev, host, r) for r in range(1, max_size + 1)]
        self._plans: list[dict] = [{} for _ in range(max_size)]
        self._group_views: list[list[KVGroupView] | None] = [None] * max_size
        self._tables: list[torch.Tensor] = []     # the device tables the views point at
        self.steps = 0                            # steps taken here (stats, tests)
        self.scope = GemmScope()
        self.linears: list[SmallMLinear] = []
        self.mhc_sites = 0
        if model is not None and model.functional_gemms and not model.batch_invariant:
            self.linears = use_small_m_linears(model, self.scope)
        if model is not None and not model.batch_invariant:
            self.mhc_sites = use_fused_mhc(model, self.scope)

    @contextmanager
    def kernels(self) -> Iterator[None]:
        """The small step's model calls (forward, logits): plain linears run small-M GEMMs."""
        self.scope.on = True
        try:
            yield
        finally:
            self.scope.on = False

    @staticmethod
    def _size_views(dev: dict, host: dict, r: int) -> tuple:
        return (dev["input_ids"][:r], dev["positions"][:r], dev["query_start_loc"][:r + 1],
                dev["seq_lens"][:r], dev["req_rows"][:r], host["query_start_loc"][:r + 1],
                host["seq_lens"][:r], host["req_rows"][:r])

    def applies(self, reqs: Sequence[StepRequest]) -> bool:
        """A decode step of at most max_size requests, none in its first step (a first step
        is a prefill, even of one token), no drafts, replay or prompt logprobs."""
        return 0 < len(reqs) <= self.max_size and is_decode_step(reqs) \
            and not any(q.is_new for q in reqs)

    def invalidate(self) -> None:
        """Forget every kept plan and small-M GEMM (the next step of each size plans again)."""
        for plans in self._plans:
            plans.clear()
        for m in self.linears:
            m.forget()

    def batch(self, reqs: Sequence[StepRequest]) -> ForwardBatch:
        """The step's batch: its rows written into the static buffers, the kept views."""
        r = len(reqs)
        ids, pos, lens, rows = self._ids, self._pos, self._lens, self._rows
        update, host_table = self.tables.update, self.tables.host
        for i, q in enumerate(reqs):
            row = update(q.request_id, q.block_ids, False)
            p = q.start
            ids[i] = q.token_ids[0]
            pos[i] = p
            lens[i] = p + 1
            rows[i] = row
            for slots, (g, bs) in zip(self._slots, self._slot_layout):
                slots[i] = host_table(g)[row, p // bs] * bs + p % bs
        self.inputs.upload(r)
        views = self._kv_views(r)
        (input_ids, positions, qsl, seq_lens, _, qsl_cpu, seq_lens_cpu, _) = self._views[r - 1]
        self.steps += 1
        return ForwardBatch(
            input_ids=input_ids, positions=positions, query_start_loc=qsl, seq_lens=seq_lens,
            query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq_lens_cpu, kv_caches=self.kv_caches,
            kv_groups=views, cache_group=self.cache_group, plan_cache=self._plans[r - 1])

    def _kv_views(self, r: int) -> list[KVGroupView]:
        """Size r's group views; remade (and every kept plan dropped) when a block table was
        reallocated since they were made."""
        tables = [self.tables.device_table(g) for g in range(len(self.groups))]
        if len(tables) != len(self._tables) or \
                any(a is not b for a, b in zip(tables, self._tables)):
            self._tables = tables
            self._group_views = [None] * self.max_size
            self.invalidate()
        views = self._group_views[r - 1]
        if views is None:
            _, _, _, _, req_rows, _, _, req_rows_cpu = self._views[r - 1]
            dev = self.inputs.dev
            views = [KVGroupView(lay.block_size, lay.compress_ratio, tables[g],
                                 slot_mapping=dev[f"slots{g}"][:r]
                                 if lay.compress_ratio == 1 else None,
                                 req_rows=req_rows, req_rows_cpu=req_rows_cpu)
                     for g, lay in enumerate(self.groups)]
            self._group_views[r - 1] = views
        return views
