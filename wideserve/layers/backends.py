"""Attention backend registry for DeepSeek-V4 (DESIGN.md, "Layers and backends").

A backend is a pair of ops over one step (`V4Step`):
  select(indexer, x, q_res, step, keys_name, cis) -> picks        (CSA top-k; None = dense)
  attend(attn, q, kv, step, picks) -> [T, H, D] fp32               (window + entries + sink)
`picks` is whatever that backend's `select` returns; only its own `attend` reads it.

- "reference": readable per-request ops (v4_reference.py), the oracle for the others.
- "batched": every token of every request in a constant number of torch ops (v4_batched.py).

Choice: an explicit name (model constructor / `set_attention_backend`), else the environment
variable WIDESERVE_ATTENTION_BACKEND, else DEFAULT_ATTENTION_BACKEND.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from wideserve.layers import v4_batched, v4_reference

ENV_VAR = "WIDESERVE_ATTENTION_BACKEND"
DEFAULT_ATTENTION_BACKEND = "batched"


@dataclass(frozen=True, slots=True)
class AttentionBackend:
    name: str
    select: Callable[..., Any]
    attend: Callable[..., Any]


# Read-only: the only module-level table.
ATTENTION_BACKENDS: Mapping[str, AttentionBackend] = MappingProxyType({
    "reference": AttentionBackend("reference", v4_reference.select, v4_reference.attend),
    "batched": AttentionBackend("batched", v4_batched.select, v4_batched.attend),
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
