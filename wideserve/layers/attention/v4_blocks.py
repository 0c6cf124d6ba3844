"""Query blocks: the host-side layout of the batched DeepSeek-V4 attention (v4_batched.py).

A block is up to Q consecutive new queries of one request. Its queries' windows together cover
Lk = Q + W - 1 consecutive positions, so the block gathers those keys once and every query
masks its own band of W; compressed entries are gathered once per block too (one request).
Decode tokens use Q = 1 (a block per token, keys = its window); requests with at least
LONG_QUERY new tokens use Q = LONG_QUERY, so a prefill chunk does a few large matmuls instead of
one tiny matmul and one W-row gather per token. A step has at most these two groups.

Key rows index the window sources of V4Step: [this step's T latents | R * (W-1) cached
latents, W-1 per request, ending just before its first new position | one zero row]. Keys a
query may not read (below lo, at or past the request's end) point at the zero row, so the
gathered values are finite whatever the cache holds there.

Glossary: t = token row in the step, r = request, p = position, u = query slot in a block
(position p0 + u), j = key slot in a block (position p0 - W + 1 + j).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from wideserve.utils.device import to_device

LONG_QUERY = 32     # queries per block for requests with at least this many new tokens


@dataclass(slots=True)
class QueryBlocks:
    """B blocks of Q query slots each (one group of a step)."""

    q_rows: torch.Tensor       # [B, Q] token rows to read (padding repeats the block's first)
    out_rows: torch.Tensor     # [B, Q] token rows to write (padding -> T, a scratch row)
    block_req: torch.Tensor    # [B] request of each block
    q_pos: np.ndarray          # [B, Q] host positions (padding slots run past the request)
    q_valid: np.ndarray        # [B, Q] host bool: a real query (not padding)
    req: np.ndarray            # [B] host request of each block
    first: np.ndarray          # [B] host local index of the block's first query
    identity: bool             # Q == 1 and block b is token b: no gather/scatter of queries

    @property
    def num_blocks(self) -> int:
        return int(self.req.shape[0])

    @property
    def block_q(self) -> int:
        return int(self.q_pos.shape[1])


@dataclass(slots=True)
class WindowKeys:
    """Window keys of one group's blocks for one window size W, plus the sink slot."""

    rows: torch.Tensor         # [B, Lk + 1] rows into the window sources; the last is the zero
                               # row, the sink's slot (its score is set to the sink logit)
    bias: torch.Tensor         # [B, Q, 1, Lk + 1] fp32 0 where query slot u may read key j,
                               # -inf elsewhere; 0 at the sink slot


@dataclass(slots=True)
class BlockEntries:
    """A group's compressed-entry layout for one ratio: every block reads its request's
    entries 0..K-1 (K = the step's most visible), each query masks those it cannot see.
    The mask and the unwritten ids are built only where read, a chunk of blocks at a time:
    whole, the mask is [B, Q, K] fp32 (3 GiB for 8K rows over 96K entries), and index
    sources restricted to candidate blocks never read it."""

    visible: torch.Tensor      # [B, Q] int64 (p + 1) // ratio of each query slot
    most: np.ndarray           # [B] each block's most visible entry count (host)
    width: int                 # K
    _unwritten: tuple[torch.Tensor, np.ndarray] | None = None

    def bias(self, a: int, b: int) -> torch.Tensor:
        """[b-a, Q, K] fp32 of blocks a..b-1: 0 for entries the query sees, -inf otherwise."""
        return self.mask_hidden_(torch.zeros(b - a, self.visible.shape[1], self.width,
                                             device=self.visible.device), a, b)

    def mask_hidden_(self, scores: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """scores [b-a, Q, K] (finite) of blocks a..b-1 with the entries each query cannot see
        set to -inf, in place: `scores + bias(a, b)` without the [b-a, Q, K] bias tensor."""
        ids = torch.arange(self.width, device=self.visible.device)
        return scores.masked_fill_(ids >= self.visible[a:b, :, None], float("-inf"))

    def unwritten(self) -> tuple[torch.Tensor, np.ndarray]:
        """Sorted flat ids (block * K + entry) of entries past each block's most visible (may
        be unwritten), on the device and on the host."""
        if self._unwritten is None:
            host = np.flatnonzero(np.arange(self.width)[None, :] >= self.most[:, None])
            self._unwritten = (to_device(host, self.visible.device), host)
        return self._unwritten


def _bias(allowed: np.ndarray) -> np.ndarray:
    return np.where(allowed, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)


def build_query_blocks(reqs: np.ndarray, block_q: int, qsl: np.ndarray, ctx: np.ndarray,
                       device: torch.device) -> QueryBlocks:
    """Blocks of `block_q` queries for the requests `reqs` (each with >= 1 new token)."""
    Q = block_q
    T = int(qsl[-1])
    S = (qsl[1:] - qsl[:-1])[reqs]
    nb = -(-S // Q)
    req = np.repeat(reqs, nb)                                                 # [B]
    first = (np.arange(int(nb.sum())) - np.repeat(np.cumsum(nb) - nb, nb)) * Q
    local = first[:, None] + np.arange(Q)                                     # [B, Q]
    q_valid = local < (qsl[req + 1] - qsl[req])[:, None]
    q_rows = qsl[req][:, None] + np.where(q_valid, local, first[:, None])
    out_rows = np.where(q_valid, q_rows, T)
    identity = Q == 1 and len(req) == T
    return QueryBlocks(to_device(q_rows, device), to_device(out_rows, device), to_device(req, device),
                       ctx[req][:, None] + local, q_valid, req, first, identity)


def build_token_blocks(tokens: np.ndarray, token_req: np.ndarray, token_pos: np.ndarray,
                       qsl: np.ndarray, device: torch.device) -> QueryBlocks:
    """One block per token (Q = 1) for the token rows `tokens` (ascending)."""
    req = token_req[tokens]
    rows = to_device(tokens[:, None], device)
    return QueryBlocks(rows, rows, to_device(req, device), token_pos[tokens][:, None],
                       np.ones((len(tokens), 1), dtype=bool), req, tokens - qsl[req],
                       len(tokens) == len(token_req))


def build_window_keys(blocks: QueryBlocks, window: int, qsl: np.ndarray, ctx: np.ndarray,
                      lo: np.ndarray, device: torch.device) -> WindowKeys:
    W, Q = window, blocks.block_q
    T, R = int(qsl[-1]), len(ctx)
    req = blocks.req
    c, seq = ctx[req][:, None], (ctx + qsl[1:] - qsl[:-1])[req][:, None]
    key_pos = c + blocks.first[:, None] - (W - 1) + np.arange(Q + W - 1)     # [B, Lk]
    readable = (key_pos >= lo[req][:, None]) & (key_pos < seq)
    in_step = qsl[req][:, None] + key_pos - c
    in_hist = T + req[:, None] * (W - 1) + key_pos - (c - (W - 1))
    zero_row = T + R * (W - 1)
    rows = np.where(readable, np.where(key_pos >= c, in_step, in_hist), zero_row)
    rows = np.concatenate([rows, np.full((len(req), 1), zero_row)], axis=1)
    # Query u sees key slots u .. u + W - 1 of its block (positions p - W + 1 .. p).
    j = np.arange(Q + W - 1)[None, None, :]
    u = np.arange(Q)[None, :, None]
    allowed = readable[:, None, :] & (j >= u) & (j <= u + W - 1)
    allowed = np.concatenate([allowed, np.ones((len(req), Q, 1), dtype=bool)], axis=2)
    return WindowKeys(to_device(rows, device), to_device(_bias(allowed)[:, :, None, :], device))


def build_block_entries(blocks: QueryBlocks, ratio: int, width: int,
                        device: torch.device) -> BlockEntries:
    visible = (blocks.q_pos + 1) // ratio                                     # [B, Q]
    most = np.where(blocks.q_valid, visible, 0).max(axis=1)
    return BlockEntries(to_device(visible, device), most, width)


# ---------------------------------------------------------------------- entry buckets
# Compressed entries are read per block up to the block's own most visible entry, not up to
# the step's longest request: blocks are bucketed by that count (counts within a factor of 2
# share a bucket, padded to its largest), so a step reads less than twice the entries its
# queries can see, however mixed the contexts (docs/deepseek_v4.md, "Batched attention").


@dataclass(frozen=True, slots=True)
class Part:
    """Some blocks of a query group that read compressed entries 0..width-1 (width 0: none).

    `sel` picks them out of the group's per-block tensors: a slice when they are consecutive,
    else a device index tensor; `ids` are the same block ids on the host."""

    sel: slice | torch.Tensor
    ids: np.ndarray
    width: int

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of t [B, ...] for this part's blocks."""
        return take(t, self.sel)

    @property
    def num_blocks(self) -> int:
        return int(self.ids.shape[0])


def take(t: torch.Tensor, sel: "Part | slice | torch.Tensor") -> torch.Tensor:
    """Rows of t [B, ...] picked by a part, a slice or an index tensor."""
    sel = sel.sel if isinstance(sel, Part) else sel
    return t[sel] if isinstance(sel, slice) else t.index_select(0, sel)


def most_visible(blocks: QueryBlocks, ratio: int) -> np.ndarray:
    """[B] host: the most entries any real query of each block sees ((p + 1) // ratio)."""
    return np.where(blocks.q_valid, (blocks.q_pos + 1) // ratio, 0).max(axis=1)


def bucket_widths(counts: np.ndarray, floor: int, own: bool = False) -> np.ndarray:
    """Padded width per block: 0 without entries; else blocks are bucketed by the power of
    two at or above their count, and a bucket's width is its largest count (at least floor).
    So no block reads twice what it needs, and a batch of equal contexts reads no padding.
    own (--batch-invariant): the power of two itself, a width no other block changes (a
    softmax over more -inf columns can round differently)."""
    bucket = np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64)
    if own:
        return np.where(counts > 0, np.maximum(1 << bucket, floor), 0)
    widths = np.zeros_like(counts)
    for b in np.unique(bucket[counts > 0]):
        mine = (bucket == b) & (counts > 0)
        widths[mine] = max(int(counts[mine].max()), floor)
    return widths


def build_parts(widths: np.ndarray, per_block: Callable[[int], int], budget: int,
                device: torch.device) -> list[Part]:
    """Split a group's blocks into parts of one width each (ascending widths), each part
    small enough that per_block(width) * its blocks <= budget (at least one block)."""
    parts = []
    distinct = np.unique(widths)
    for w in distinct:
        ids = np.flatnonzero(widths == w)
        n = max(1, budget // max(1, per_block(int(w))))
        for a in range(0, len(ids), n):
            chunk = ids[a:a + n]
            # One width: consecutive blocks, sliced. Several: always gathered, so that the
            # number of ops depends on the widths present, not on how requests interleave.
            sel = (slice(int(chunk[0]), int(chunk[-1]) + 1) if len(distinct) == 1
                   else to_device(chunk, device))
            parts.append(Part(sel, chunk, int(w)))
    return parts
