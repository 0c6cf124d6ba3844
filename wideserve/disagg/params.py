"""What travels between the router, the prefill instance and the decode instance.

`kv_transfer_params` (a JSON object in the OpenAI request and response, as vLLM spells it):
- router -> prefill: `{"do_remote_decode": true}`: compute the prompt, sample one token, and
  hold the request's blocks under a lease for a decode instance to pull.
- prefill -> router (in the response): a `RemoteKV` handle, which the router passes
  unchanged to the decode instance (`do_remote_prefill: true`).

Glossary: *remote* = the prefill instance; *local* = the decode instance doing the load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np


class RemoteKV(msgspec.Struct, kw_only=True):
    """A prefill instance's handle to one request's held KV."""

    do_remote_prefill: bool = True
    remote_engine_id: str
    remote_host: str
    remote_port: int
    remote_request_id: str
    remote_block_ids: list[list[int]]       # per KV cache group: the request's table row
    remote_num_tokens: int                  # positions whose KV the prefill computed
    remote_layout: str                      # KVLayout.fingerprint: both sides must agree

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemoteKV:
        try:
            return msgspec.convert(params, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params: {e}") from None


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: dict[str, Any] | None) -> bool:
    return bool(params and params.get("do_remote_prefill"))


@dataclass(slots=True)
class LoadSpec:
    """One request's pull, as the worker half sees it: pages to copy, per group, from the
    remote table row into the local one (clipped: see layout.plan_pages)."""

    request_id: str
    remote: RemoteKV
    local_pages: list[np.ndarray]           # per group, int32 local block ids
    remote_pages: list[np.ndarray]          # per group, int32 remote block ids (same length)

    @property
    def num_pages(self) -> int:
        return sum(len(p) for p in self.local_pages)


@dataclass(slots=True)
class ConnectorMeta:
    """The per-step plan for the worker half (rides in SchedulerOutput.kv_connector_meta)."""

    loads: list[LoadSpec] = field(default_factory=list)
    # Remote handles to release without (or after giving up on) a pull.
    releases: list[RemoteKV] = field(default_factory=list)
    # Local request ids whose load must stop (aborted while loading).
    cancels: list[str] = field(default_factory=list)


@dataclass(slots=True)
class WorkerResult:
    """What the worker half reports after a step."""

    finished_loads: list[str] = field(default_factory=list)
    failed_loads: dict[str, str] = field(default_factory=dict)      # request id -> why
    # Failed loads whose transfer may still write into their blocks (not known to have
    # stopped): request id -> fence id. Their blocks are quarantined, not freed ...
    quarantined: dict[str, str] = field(default_factory=dict)
    # ... until the fence id shows up here (the transfer has stopped, or its producer is gone).
    fenced: list[str] = field(default_factory=list)
    # Producer: held requests a consumer has released (pulled, or given up).
    released: list[str] = field(default_factory=list)
    bytes_loaded: int = 0
    pages_loaded: int = 0
    num_transfers: int = 0
