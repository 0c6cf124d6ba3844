"""Backend registry for the standard paged attention (Llama / Qwen2 / Qwen3 / Qwen3-MoE).

- "reference": one SDPA call per request (paged_attention.py), the readable oracle.
- "batched": all requests in a constant number of torch ops (paged_attention_batched.py).

Every backend is called as fn(q, k, v, batch, cache_name, scale, window, plans), where `plans`
is the step's PagedAttentionPlans (built once per forward; backends that need no plan ignore it).

Choice: an explicit name (model constructor / `set_attention_backend`), else the environment
variable WIDESERVE_ATTENTION_BACKEND (the same knob as DeepSeek-V4's backends.py, whose names
"reference" and "batched" mean the same thing here), else DEFAULT_PAGED_ATTENTION_BACKEND.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch

from wideserve.executor.forward_batch import ForwardBatch
from wideserve.layers.backends import lookup_backend, resolve_backend
from wideserve.layers.paged_attention import paged_attention
from wideserve.layers.paged_attention_batched import PagedAttentionPlans, paged_attention_batched

PagedAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch, str, float, "int | None",
     PagedAttentionPlans], torch.Tensor]

DEFAULT_PAGED_ATTENTION_BACKEND = "batched"


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               cache_name: str, scale: float, window: int | None,
               plans: PagedAttentionPlans) -> torch.Tensor:
    return paged_attention(q, k, v, batch, cache_name, scale, window)


# Read-only: the only module-level table.
PAGED_ATTENTION_BACKENDS: Mapping[str, PagedAttentionFn] = MappingProxyType({
    "reference": _reference,
    "batched": paged_attention_batched,
})


def resolve_paged_attention_backend(name: str | None = None) -> str:
    return resolve_backend(name, PAGED_ATTENTION_BACKENDS, DEFAULT_PAGED_ATTENTION_BACKEND,
                           "paged attention backend")


def get_paged_attention_backend(name: str) -> PagedAttentionFn:
    return lookup_backend(name, PAGED_ATTENTION_BACKENDS, "paged attention backend")
