"""The attention backend registry: every backend of every attention kind, in one place.

A *kind* is an attention family with its own op signature; a *backend* is one implementation
of that kind's ops. Each kind has a readable "reference" backend (the oracle, a host loop over
requests) and a "batched" one (the default: a constant number of torch ops per layer).

- kind "v4" (DeepSeek-V4 CSA/HCA/sliding attention, v4_attention.py): a backend is a pair of
  ops over one step (`V4Step`):
    select(indexer, x, q_res, step, keys_name, cis) -> picks     (CSA top-k; None = dense)
    attend(attn, q, kv, step, picks) -> [T, H, D]   (window + entries + sink; the batched
                                                    backend: in the layer's compute dtype)
  `picks` is whatever that backend's `select` returns; only its own `attend` reads it.
  Decode batches do not go through these where `static_decode(name, device)` holds: the model
  then builds a v4_static.V4DecodeStep and its layers call v4_static.py's ops (static shapes,
  device-only: what a CUDA graph records). "static" is "batched" for the other batches.
- kind "v41" (DeepSeek-V4.1 CSA2 attention, v41_attention.py): the same pair of ops, select
  being the two-level CSA2 indexer (v41_batched.py: select(indexer, x, q_res, step, keys_name,
  cis, ratio, state, candidate_source, use_candidates, topk_blocks, block_size) leaves its
  picks in the step's CSA2State) and attend V4's batched op. Only "batched" exists (the
  oracle of V4.1 is the reference implementation the tests load), so the environment
  variable does not apply to this kind.
- kind "paged" (standard GQA paged attention for Llama / Qwen2 / Qwen3 / Qwen3-MoE): a backend
  is one op fn(q, k, v, batch, cache_name, scale, window, plans), where `plans` is the step's
  PagedAttentionPlans (built once per forward; backends that need no plan ignore it).
  "static" (paged_decode_static.py) runs decode batches in shapes fixed by the batch size,
  over device metadata only: what a CUDA graph records (docs/cuda_graphs.md). It is where
  "batched" sends decode batches on devices other than the CPU; the backend "static" sends
  them there on every device (the CPU tests run the CUDA decode path that way). Other
  batches (prefill, mixed, bounded replay) go to the batched op under both names.

Choice: an explicit name (model constructor / `set_attention_backend`), else the environment
variable WIDESERVE_ATTENTION_BACKEND (one knob for every kind: the names mean the same thing
in each), else the kind's default.

The backend modules never import this one (nor the layer modules), so the imports form a tree:
layer -> registry -> backend ops -> step layouts.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

from wideserve.types.forward_batch import ForwardBatch
from wideserve.layers.attention import v41_batched, v4_batched, v4_reference
from wideserve.layers.attention.paged_attention import paged_attention
from wideserve.layers.attention.paged_attention_batched import (PagedAttentionPlans,
                                                                paged_attention_batched)
from wideserve.layers.attention.paged_decode_static import is_decode_batch, paged_decode_static

ENV_VAR = "WIDESERVE_ATTENTION_BACKEND"
DEFAULT_ATTENTION_BACKEND = "batched"
DEFAULT_PAGED_ATTENTION_BACKEND = "batched"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    """A DeepSeek-V4 attention backend (kind "v4")."""

    name: str
    select: Callable[..., Any]
    attend: Callable[..., Any]


PagedAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, ForwardBatch, str, float, "int | None",
     PagedAttentionPlans], torch.Tensor]


def _paged_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                     cache_name: str, scale: float, window: int | None,
                     plans: PagedAttentionPlans) -> torch.Tensor:
    return paged_attention(q, k, v, batch, cache_name, scale, window)


def static_decode(name: str, device: torch.device) -> bool:
    """Whether paged backend `name` runs decode batches on `device` through the static,
    graph-capturable path."""
    return name == "static" or (name == "batched" and device.type != "cpu")


def _paged_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                   cache_name: str, scale: float, window: int | None,
                   plans: PagedAttentionPlans) -> torch.Tensor:
    if static_decode("batched", q.device) and is_decode_batch(batch):
        return paged_decode_static(q, k, v, batch, cache_name, scale, window)
    return paged_attention_batched(q, k, v, batch, cache_name, scale, window, plans)


def _paged_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                  cache_name: str, scale: float, window: int | None,
                  plans: PagedAttentionPlans) -> torch.Tensor:
    if is_decode_batch(batch):
        return paged_decode_static(q, k, v, batch, cache_name, scale, window)
    return paged_attention_batched(q, k, v, batch, cache_name, scale, window, plans)


# Read-only: the module's only tables.
ATTENTION_BACKENDS: Mapping[str, AttentionBackend] = MappingProxyType({
    "reference": AttentionBackend("reference", v4_reference.select, v4_reference.attend),
    "batched": AttentionBackend("batched", v4_batched.select, v4_batched.attend),
    # Decode batches run v4_static.py's ops on every device (the model picks them by the
    # step it builds, `static_decode`); other batches these.
    "static": AttentionBackend("static", v4_batched.select, v4_batched.attend),
})
V41_ATTENTION_BACKENDS: Mapping[str, AttentionBackend] = MappingProxyType({
    "batched": AttentionBackend("batched", v41_batched.select, v4_batched.attend),
    "static": AttentionBackend("static", v41_batched.select, v4_batched.attend),
})
PAGED_ATTENTION_BACKENDS: Mapping[str, PagedAttentionFn] = MappingProxyType({
    "reference": _paged_reference,
    "batched": _paged_batched,
    "static": _paged_static,
})


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def resolve_backend(name: str | None, table: Mapping[str, Any], default: str,
                    noun: str) -> str:
    """The backend name to use: `name`, else $WIDESERVE_ATTENTION_BACKEND, else `default`;
    an unknown name is a ValueError naming its source and listing the known ones."""
    source = "attention_backend"
    if name is None:
        name = os.environ.get(ENV_VAR) or None
        source = ENV_VAR
    if name is None:
        return default
    if name not in table:
        raise ValueError(f"{source}={name!r} is not {_article(noun)} {noun}; "
                         f"choose one of {sorted(table)}")
    return name


def lookup_backend(name: str, table: Mapping[str, Any], noun: str) -> Any:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {noun} {name!r}; choose one of {sorted(table)}") from None


def resolve_attention_backend(name: str | None = None) -> str:
    return resolve_backend(name, ATTENTION_BACKENDS, DEFAULT_ATTENTION_BACKEND,
                           "attention backend")


def get_attention_backend(name: str) -> AttentionBackend:
    return lookup_backend(name, ATTENTION_BACKENDS, "attention backend")


def resolve_v41_attention_backend(name: str | None = None) -> str:
    """An explicit name, else "batched" (the only one; see the module docstring)."""
    return lookup_backend(name or DEFAULT_ATTENTION_BACKEND, V41_ATTENTION_BACKENDS,
                          "DeepSeek-V4.1 attention backend").name


def get_v41_attention_backend(name: str) -> AttentionBackend:
    return lookup_backend(name, V41_ATTENTION_BACKENDS, "DeepSeek-V4.1 attention backend")


def resolve_paged_attention_backend(name: str | None = None) -> str:
    return resolve_backend(name, PAGED_ATTENTION_BACKENDS, DEFAULT_PAGED_ATTENTION_BACKEND,
                           "paged attention backend")


def get_paged_attention_backend(name: str) -> PagedAttentionFn:
    return lookup_backend(name, PAGED_ATTENTION_BACKENDS, "paged attention backend")
