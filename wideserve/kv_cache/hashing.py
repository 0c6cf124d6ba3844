"""Prefix-cache block hashes: a chain over `block_size`-token logical blocks.

    hash[i] = blake2b-256(hash[i-1] or NONE_HASH, len(extra) || extra, token ids of block i)

Token ids are hashed as little-endian int64 bytes (the request's int32 buffer cast once per
call and sliced per block, types/request.py; no per-token Python work), extra keys as
length-prefixed typed bytes (`encode_extra_keys`); nothing is pickled, so the hashes are the
same in every process and on every machine (P/D and DP ranks can compare them). Only full
blocks of `request.all_token_ids` are hashed: draft tokens (`request.spec_token_ids`) are
unverified and never enter a hash.

Sliding-window groups page at a divisor of the logical block (a 128-token window uses
128-position pages of a 256-token block). Their page k of logical block i is keyed
`sub_block_key(hash[i], k)`: the logical hash plus the sub-index, no extra hashing. A prefix
hit can only end on a logical boundary anyway (the growing groups page at logical blocks), and
a page is only published once its whole logical block is computed, so every page key is
known exactly when it is needed.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from wideserve.types.request import Request

HASH_BYTES = 32
# Parent of the first block. Fixed (not random) so hashes agree across processes.
NONE_HASH = hashlib.blake2b(b"wideserve/prefix-cache/v1", digest_size=HASH_BYTES).digest()

# (request, logical block index) -> extra key bytes for that block (cache salt, LoRA id, ...).
ExtraKeysFn = Callable[["Request", int], bytes]


def encode_extra_keys(*keys: int | str | bytes | None) -> bytes:
    """Deterministic, unambiguous bytes for a tuple of extra keys (None entries are skipped)."""
    out = bytearray()
    for key in keys:
        if key is None:
            continue
        if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
            raise TypeError(f"extra key must be int, str or bytes, got {type(key).__name__}")
        if isinstance(key, int):
            tag, raw = b"i", key.to_bytes(16, "little", signed=True)
        elif isinstance(key, str):
            tag, raw = b"s", key.encode("utf-8")
        else:
            tag, raw = b"b", key
        out += tag + struct.pack("<I", len(raw)) + raw
    return bytes(out)


def hash_block_tokens(parent: bytes | None, token_bytes: bytes | memoryview,
                      extra_keys: bytes = b"") -> bytes:
    """One link of the chain. `token_bytes` = the block's ids as little-endian int64."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(NONE_HASH if parent is None else parent)
    h.update(struct.pack("<I", len(extra_keys)))
    h.update(extra_keys)
    h.update(token_bytes)
    return h.digest()


def token_bytes(token_ids: list[int] | np.ndarray) -> bytes:
    return np.asarray(token_ids, dtype="<i8").tobytes()


def _int64_bytes(token_ids: list[int] | np.ndarray) -> memoryview:
    """The ids as one little-endian int64 byte buffer: a vectorised cast of an array (the
    request's int32 buffer), a per-token conversion only for a Python list."""
    arr = np.ascontiguousarray(token_ids, dtype="<i8")
    return memoryview(arr).cast("B")


def hash_token_blocks(token_ids: list[int] | np.ndarray, block_size: int,
                      parent: bytes | None = None,
                      extra_keys: bytes | Callable[[int], bytes] = b"") -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `parent`. `extra_keys`: the
    same bytes for every block, or block index (within `token_ids`) -> that block's bytes.

    Equal to chaining hash_block_tokens block by block (tests/kv_cache keeps that as the
    reference); the loop only hoists what is the same for every block: one int64 buffer
    sliced per block (no copies), the length-prefixed extra keys packed once."""
    n_full = len(token_ids) // block_size
    if n_full == 0:
        return []
    raw = _int64_bytes(token_ids[:n_full * block_size])
    step = 8 * block_size
    blake2b = hashlib.blake2b
    out: list[bytes] = []
    parent = NONE_HASH if parent is None else parent
    if callable(extra_keys):
        for i in range(n_full):
            extra = extra_keys(i)
            h = blake2b(parent + struct.pack("<I", len(extra)) + extra, digest_size=HASH_BYTES)
            h.update(raw[i * step:(i + 1) * step])
            parent = h.digest()
            out.append(parent)
        return out
    prefix = struct.pack("<I", len(extra_keys)) + extra_keys
    for i in range(n_full):
        h = blake2b(parent + prefix, digest_size=HASH_BYTES)
        h.update(raw[i * step:(i + 1) * step])
        parent = h.digest()
        out.append(parent)
    return out


def sub_block_key(logical_hash: bytes, sub_index: int) -> bytes:
    """Key of page `sub_index` of a logical block, for groups that page below the block."""
    return logical_hash + struct.pack("<I", sub_index)


class BlockHasher:
    """Extends `request.block_hashes` to cover every full block of `request.all_token_ids`.

    Idempotent and incremental: call it whenever tokens were appended (it costs one length
    check when nothing new is full).
    """

    def __init__(self, block_size: int, extra_keys: ExtraKeysFn | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.extra_keys = extra_keys

    def __call__(self, request: Request, limit: int | None = None) -> list[bytes]:
        """Append the hashes of newly full blocks, up to `limit` blocks in all (None: every
        full block); return them."""
        hashes = request.block_hashes
        bs = self.block_size
        start = len(hashes)
        n_full = len(request.all_token_ids) // bs
        if limit is not None:
            n_full = min(n_full, limit)
        if n_full <= start:
            return []
        extra_keys = self.extra_keys
        if request.images:
            extra_keys = _with_image_keys(extra_keys, bs)
        # A view of the request's int32 buffer: no Python list is sliced or converted.
        new = hash_token_blocks(
            request.token_array()[start * bs:n_full * bs], bs, hashes[-1] if hashes else None,
            (lambda i: extra_keys(request, start + i)) if extra_keys else b"")
        hashes.extend(new)
        return new


def image_block_keys(request: Request, index: int, block_size: int) -> bytes:
    """The extra key of logical block `index` of a request with images: the offset and
    digest of every image span overlapping the block (the block's token ids are the same
    image_token_id for any image), empty for a block without image rows."""
    lo, hi = index * block_size, (index + 1) * block_size
    keys: list[int | bytes] = []
    for im in request.images or ():
        if im.offset < hi and im.offset + im.length > lo:
            keys += [im.offset, im.digest]
    return encode_extra_keys(*keys)


def _with_image_keys(extra_keys: ExtraKeysFn | None, block_size: int) -> ExtraKeysFn:
    def keys(request: Request, index: int) -> bytes:
        own = extra_keys(request, index) if extra_keys is not None else b""
        return own + image_block_keys(request, index, block_size)
    return keys
