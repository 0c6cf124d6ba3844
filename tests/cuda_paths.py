"""Run a GQA model's forward on CPU tensors through the code paths it takes on CUDA.

On the CPU the decoder's layers pick C++ ops (norms, q/k norm + RoPE, paged attention, fused
experts, the GEMM micro-kernel and the fused router) and oneDNN-packed weights; on CUDA every one of them is the plain torch path, the
attention of decode batches is the static-shape op and the routed experts are "grouped_mm".
`force_cuda_paths` switches a model (its KernelConfig: every CPU op off) to those, so a CPU test runs the forward a CUDA graph would record. CaptureGuard
(wideserve/worker/capture_guard.py) rejects every CPU-only op, so a path this misses fails
the guarded tests instead of passing unnoticed.
"""
from __future__ import annotations

import pytest
import torch

from wideserve.config import KernelConfig
from wideserve.layers import linear
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.linear import WeightPack


def force_cuda_paths(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module) -> None:
    model.apply_kernel_config(KernelConfig(cpu_norm=False, cpu_rope=False, cpu_gemm=False,
                                           cpu_attention=False))
    monkeypatch.setattr(linear, "packing_runs", lambda dtype: False)
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.impl = "grouped_mm"
            m._resolved.clear()
            m.weights_changed()
        for value in vars(m).values():
            if isinstance(value, WeightPack):
                value.invalidate()
    model.set_attention_backend("static")


def allow_batch(guard, batch) -> None:
    """A batch built after `guard` (a CaptureGuard) was made: its tensors are the forward's
    inputs, not tensors the forward built on the host."""
    fields = [batch.input_ids, batch.positions, batch.query_start_loc, batch.seq_lens,
              batch.kv_write_start, *batch.kv_caches.values(), *batch.extras.values()]
    for view in batch.kv_groups:
        fields += [view.block_table, view.slot_mapping, view.req_rows]
    guard.allow(t for t in fields if t is not None)
