"""What travels between the router, the prefill instance and the decode instance.

`kv_transfer_params` (a JSON object in the OpenAI request and response, as vLLM spells it):
- router -> prefill: `{"do_remote_decode": true}`: compute the prompt, sample one token, and
  hold the request's blocks under a lease for a decode instance to pull.
- prefill -> router (in the response): a `RemoteKV` handle, which the router passes
  unchanged to the decode instance (`do_remote_prefill: true`).

A handle is signed by the producer (`remote_mac`: HMAC-SHA256 with the shared KV secret over
every field, the lease id and a digest of the prompt's token ids and image digests included):
a decode instance
admits only a handle whose signature verifies and whose prompt digest is its own prompt's, so
a client can neither forge one nor name blocks the producer did not export for that prompt
(docs/disaggregation.md, "Threat model").

Glossary: *remote* = the prefill instance; *local* = the decode instance doing the load.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from wideserve.disagg.leases import LeaseRef

if TYPE_CHECKING:
    from wideserve.types.multimodal import ImageInput

HANDLE_TAG = b"wideserve-kv-handle-v1"     # domain separation from the side channel's MACs


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
    remote_lease: str = ""                  # the lease id (leases.py): names the held blocks
    remote_prompt_digest: str = ""          # prompt_digest of the prompt it was computed for
    remote_mac: str = ""                    # handle_mac: the producer's signature

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    def lease_ref(self) -> LeaseRef:
        return LeaseRef(self.remote_request_id, self.remote_lease, self.remote_block_ids,
                        self.remote_num_tokens)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> RemoteKV:
        try:
            return msgspec.convert(params, cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"kv_transfer_params: {e}") from None


def prompt_digest(token_ids: Sequence[int] | np.ndarray,
                  images: Sequence[ImageInput] | None = None) -> str:
    """SHA-256 of the ids as little-endian int32 bytes (the engine's int32 prompt buffer is
    hashed in place, no int64 copy) and, for a prompt holding images, each image's offset,
    length and content digest: the ids of an image span are all image_token_id, so without
    the images a handle minted for one image would admit another image's prompt (whose KV
    differs). Ids outside int32 (refused by every engine anyway) are hashed as int64 bytes,
    which no int32 prompt's digest equals."""
    arr = np.asarray(token_ids)
    if arr.dtype != np.int32 or arr.dtype.byteorder == ">":
        arr = np.asarray(token_ids, dtype=np.int64)
        if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
            return hashlib.sha256(b"int64" + arr.astype("<i8").tobytes()).hexdigest()
        arr = arr.astype("<i4")
    h = hashlib.sha256(np.ascontiguousarray(arr))
    for im in images or ():
        h.update(b"image:%d:%d:" % (im.offset, im.length) + im.digest)
    return h.hexdigest()


def handle_mac(secret: bytes, r: RemoteKV) -> str:
    body = msgspec.msgpack.encode((
        HANDLE_TAG, r.remote_engine_id, r.remote_host, r.remote_port, r.remote_request_id,
        r.remote_lease, r.remote_block_ids, r.remote_num_tokens, r.remote_layout,
        r.remote_prompt_digest))
    return hmac.new(secret, body, hashlib.sha256).hexdigest()


def sign_handle(secret: bytes, r: RemoteKV) -> RemoteKV:
    r.remote_mac = handle_mac(secret, r)
    return r


def handle_problem(secret: bytes, r: RemoteKV, token_ids: Sequence[int],
                   images: Sequence[ImageInput] | None = None) -> str | None:
    """Why a decode instance must refuse the handle `r` for a prompt of `token_ids` and
    `images` (None: it was minted by a holder of the KV secret for exactly this prompt)."""
    if not r.remote_mac:
        return ("kv_transfer_params: the handle is not signed; only a prefill instance with "
                "this server's KV secret mints handles (clients may not send them)")
    if not hmac.compare_digest(r.remote_mac.encode(), handle_mac(secret, r).encode()):
        return ("kv_transfer_params: the handle's signature does not verify (forged or "
                "altered, or minted with another KV secret)")
    if not hmac.compare_digest(r.remote_prompt_digest.encode(),
                               prompt_digest(token_ids, images).encode()):
        return "kv_transfer_params: the handle was issued for a different prompt"
    return None


def client_handle_problem(secret: bytes | None, params: dict[str, Any] | None,
                          token_ids: Sequence[int],
                          images: Sequence[ImageInput] | None = None) -> str | None:
    """The API server's check of a request's handle before the request starts (a stream's
    400 cannot come later): it must verify with the KV secret for this prompt. None when
    there is no handle, or no secret (not a consumer: the engine then says why)."""
    if secret is None or not wants_remote_prefill(params):
        return None
    assert params is not None
    try:
        remote = RemoteKV.from_dict(params)
    except ValueError as e:
        return str(e)
    return handle_problem(secret, remote, token_ids, images)


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
