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

import os
from types import MappingProxyType
from typing import Callable, Mapping

import torch

from wideserve.executor.forward_batch import ForwardBatch
from wideserve.layers.backends import ENV_VAR
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
    """The backend name to use: `name`, else $WIDESERVE_ATTENTION_BACKEND, else the default;
    an unknown name is a ValueError listing the known ones."""
    source = "attention_backend"
    if name is None:
        name = os.environ.get(ENV_VAR) or None
        source = ENV_VAR
    if name is None:
        return DEFAULT_PAGED_ATTENTION_BACKEND
    if name not in PAGED_ATTENTION_BACKENDS:
        raise ValueError(f"{source}={name!r} is not a paged attention backend; "
                         f"choose one of {sorted(PAGED_ATTENTION_BACKENDS)}")
    return name


def get_paged_attention_backend(name: str) -> PagedAttentionFn:
    try:
        return PAGED_ATTENTION_BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown paged attention backend {name!r}; choose one of "
                         f"{sorted(PAGED_ATTENTION_BACKENDS)}") from None
