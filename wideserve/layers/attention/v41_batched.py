"""The batched CSA2 select of DeepSeek-V4.1 attention (kind "v41" of layers/attention/registry.py).

The two-level indexer (v41_attention.py's module docstring): index sources score their keys
and keep top-k entries, a candidate source also keeps per query the best blocks of entries,
and later index sources choose among those candidates only. `select` leaves its picks in the
step's `CSA2State`; attention itself is V4's batched `attend` (v4_batched.py), fed the picks
as [T, k] entry ids. The query-block helpers below are v4_batched's `part_rows` /
`part_store` over chunks of blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from wideserve.layers import kv_quant
from wideserve.layers.attention.v4_batched import CHUNK_ELEMENTS, part_rows, part_store
from wideserve.layers.attention.v4_blocks import QueryBlocks
from wideserve.layers.attention.v4_static import V4DecodeStep, entry_bias
from wideserve.layers.attention.v4_step import V4Step
from wideserve.layers.attention.indexer import index_topk
from wideserve.layers.rope_interleaved import rotate

KEY_CHUNK = 8192    # entries per gather-and-score piece at an index source (_entry_scores)


@dataclass(slots=True)
class CSA2State:
    """What index sources leave for the layers after them within one forward."""

    picks: torch.Tensor | None = None        # [T, k] entry ids (-1 none) or None = dense
    # [T, n] the candidate source's kept block ids per query, ascending, -1 past them
    candidates: torch.Tensor | None = None


def _chunks(num_blocks: int, per_block: int) -> list[tuple[int, int]]:
    n = max(1, CHUNK_ELEMENTS // max(1, per_block))
    return [(a, min(a + n, num_blocks)) for a in range(0, num_blocks, n)]


def _rows(x: torch.Tensor, blocks: QueryBlocks, a: int, b: int) -> torch.Tensor:
    """x [T, ...] -> the rows of blocks a..b-1's query slots [b-a, Q, ...]."""
    return part_rows(x, blocks, slice(a, b))


def _store(out: torch.Tensor, blocks: QueryBlocks, a: int, b: int, rows: torch.Tensor) -> None:
    """rows [b-a, Q, ...] -> out's token rows (padding slots land on the scratch row T)."""
    part_store(out, blocks, slice(a, b), rows)


def _candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                      block_size: int) -> torch.Tensor:
    """scores [C, Q, K] (-inf where not visible), visible [C, Q] -> [C, Q, n] ids of the top
    `topk_blocks` blocks by max score, the newest visible block kept, ascending, -1 past the
    kept ones (n = min(topk_blocks, blocks)). A block's max is one amax over a view."""
    K = scores.shape[-1]
    if K % block_size:
        scores = F.pad(scores, (0, -K % block_size), value=float("-inf"))
    blocks = scores.unflatten(-1, (-1, block_size)).amax(dim=-1)              # [C, Q, nb]
    nb = blocks.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")
    ids = torch.arange(nb, device=scores.device)
    blocks = blocks.masked_fill(ids == newest[..., None], float("inf"))
    top = blocks.topk(min(topk_blocks, nb), dim=-1)
    kept = torch.where(top.values > float("-inf"), top.indices, nb).sort(dim=-1).values
    return kept.masked_fill(kept == nb, -1)


def _candidate_entries(cands: torch.Tensor, block_size: int,
                       visible: torch.Tensor) -> torch.Tensor:
    """Candidate block ids [C, Q, n] -> their visible entry ids [C, Q, n * block_size],
    ascending, -1 elsewhere (a kept block's ids are a prefix: blocks ascend, -1 last)."""
    ids = cands[..., None] * block_size + torch.arange(block_size, device=cands.device)
    ids = ids.flatten(-2)
    return torch.where((ids >= 0) & (ids < visible[..., None]), ids, -1)


def _candidate_mask(cands: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Candidate block ids [C, Q, n] -> [C, Q, width] bool over entries 0..width-1."""
    nb = -(-width // block_size)
    keep = torch.zeros(*cands.shape[:-1], nb + 1, dtype=torch.bool, device=cands.device)
    keep.scatter_(-1, torch.where(cands >= 0, cands, nb), True)
    # Each block's flag over its entries (an expand, not repeat_interleave: no output size
    # to learn from the data).
    keep = keep[..., :nb, None].expand(*keep.shape[:-1], nb, block_size)
    return keep.flatten(-2)[..., :width]


def _index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_h relu(q_h . k) * w_h: q [C, Q, H, D], weights [C, Q, H], keys [C, K, D] (one set
    per block) or [C, Q, K, D] (one per query) -> [C, Q, K]."""
    spec = "cqhd,ckd->cqhk" if keys.dim() == 3 else "cqhd,cqkd->cqhk"
    # relu and the weights in place on the einsum's fresh [C, Q, H, K] (same ops and values;
    # two fewer passes over the largest intermediate of a long prefill's index sources).
    return torch.einsum(spec, q, keys).relu_().mul_(weights[..., None]).sum(dim=2)


def _entry_scores(step: V4Step, keys_name: str, ratio: int, blocks: QueryBlocks, a: int,
                  b: int, q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scores [C, Q, K] of every entry 0..K-1 of the requests of blocks a..b-1, KEY_CHUNK
    entries at a time: a piece's gathered keys are scored while they are still in the CPU's
    cache instead of gathering all K first and reading them back from memory (2.5-4x faster
    at 512K entries on the benchmark machine; same values). Entries no query of a block has
    yet score 0 (their rows may hold stale data or NaN; the caller's bias masks them)."""
    K = step.entry_width(ratio)
    if K <= KEY_CHUNK:
        return _index_scores(q, weights, step.gather_block_entries(keys_name, blocks, ratio,
                                                                   a, b))
    slots = step.request_entry_slots(keys_name, ratio).index_select(0, blocks.block_req[a:b])
    seen = np.where(blocks.q_valid, (blocks.q_pos + 1) // ratio, 0).max(axis=1)[a:b]
    written = torch.from_numpy(seen).to(q.device)[:, None, None]             # [C, 1, 1]
    parts = []
    for k0 in range(0, K, KEY_CHUNK):
        piece = slots[:, k0:k0 + KEY_CHUNK]
        n = piece.shape[1]
        keys = step.read_rows(keys_name, piece.flatten()).view(*piece.shape, -1)  # [C, n, D]
        scores = _index_scores(q, weights, keys)                              # [C, Q, n]
        if int(seen.min()) < k0 + n:      # a score from an unwritten row may be NaN: zero it
            ids = torch.arange(k0, k0 + n, device=q.device)
            scores = torch.where(ids < written, scores, 0.0)
        parts.append(scores)
    return torch.cat(parts, dim=-1)


def _candidate_scores(step: V4Step, keys_name: str, ratio: int, block_req: torch.Tensor,
                      q: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Scores [C, Q, n] of each query's own candidate entries ids [C, Q, n] (-1: -inf). Each
    query gathers its own keys, so a long-query block is scored a few query slots at a time
    to keep the gathered keys within CHUNK_ELEMENTS."""
    C, Q, n = ids.shape
    H, D = q.shape[2], q.shape[3]
    chosen = ids >= 0
    per = max(1, CHUNK_ELEMENTS // max(1, C * n * (D + 3 * H)))
    parts = []
    for u in range(0, Q, per):
        keys = step.gather_picked(keys_name, ratio, block_req, ids[:, u:u + per],
                                  chosen[:, u:u + per])                       # [C, q, n, D]
        parts.append(_index_scores(q[:, u:u + per], weights[:, u:u + per], keys))
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return scores.masked_fill(~chosen, float("-inf"))


def select(indexer: Any, x: torch.Tensor, q_res: torch.Tensor, step: V4Step,
                keys_name: str, cis: torch.Tensor, ratio: int, state: CSA2State,
                candidate_source: bool, use_candidates: bool, topk_blocks: int,
                block_size: int) -> None:
    """Top-k entry ids per query into state.picks (None: every visible entry, dense), and the
    candidate blocks into state.candidates at the candidate source.

    An index source after the candidate source scores only the entries of its queries'
    candidate blocks (at most topk_blocks * block_size, gathered per query) when they are
    fewer than the visible entries: the same picks as scoring every entry and masking the
    others (candidates ascend, so ties still go to the lowest entry id), but work bounded by
    the candidate budget instead of the context."""
    T = x.shape[0]
    K = step.entry_width(ratio)
    dense = indexer.topk >= K and not use_candidates and not step.batch_invariant
    if T == 0 or (dense and not candidate_source):
        state.picks = None
        return
    H, D = indexer.n_heads, indexer.head_dim
    q = rotate(indexer.wq_b(q_res).view(T, H, D), cis)
    q = kv_quant.fake_quant(q, "mxfp4").float()                               # [T, H, D]
    weights = indexer.weights_proj(x).float() * (D ** -0.5 * H ** -0.5)       # [T, H]
    k = indexer.topk if step.batch_invariant else min(indexer.topk, K)
    picks = torch.full((T + 1, k), -1, dtype=torch.int64, device=x.device)
    cands = (torch.full((T + 1, min(topk_blocks, -(-K // block_size))), -1,
                        dtype=torch.int64, device=x.device) if candidate_source else None)
    width = state.candidates.shape[1] * block_size if use_candidates else K
    restricted = width < K
    for blocks in step.query_groups():
        Q = blocks.block_q
        ent = step.block_entries(blocks, ratio)
        per_block = Q * width * (D + 3 * H) if restricted else K * (D + 3 * Q * H)
        for a, b in _chunks(blocks.num_blocks, per_block):
            qb, wb = _rows(q, blocks, a, b), _rows(weights, blocks, a, b)
            ids = None
            if restricted:
                ids = _candidate_entries(_rows(state.candidates, blocks, a, b), block_size,
                                         ent.visible[a:b])                    # [C, Q, n*bs]
                scores = _candidate_scores(step, keys_name, ratio, blocks.block_req[a:b],
                                           qb, wb, ids)
            else:
                scores = _entry_scores(step, keys_name, ratio, blocks, a, b, qb, wb)
                scores = ent.mask_hidden_(scores, a, b)                       # [C, Q, K]
                if candidate_source:
                    _store(cands, blocks, a, b, _candidate_blocks(
                        scores, ent.visible[a:b], topk_blocks, block_size))
                elif use_candidates:
                    mask = _candidate_mask(_rows(state.candidates, blocks, a, b), block_size, K)
                    scores = scores.masked_fill(~mask, float("-inf"))
            idx = index_topk(scores, min(k, scores.shape[-1]))                # [C, Q, <= k]
            ok = scores.gather(-1, idx) > float("-inf")
            if ids is not None:
                idx = ids.gather(-1, idx)
            got = torch.where(ok, idx, -1)
            _store(picks, blocks, a, b, F.pad(got, (0, k - got.shape[-1]), value=-1))
    if candidate_source:
        state.candidates = cands[:T]
    state.picks = None if dense else picks[:T]


def select_decode(indexer: Any, x: torch.Tensor, q_res: torch.Tensor, step: V4DecodeStep,
                  keys_name: str, cis: torch.Tensor, ratio: int, state: CSA2State,
                  candidate_source: bool, use_candidates: bool, topk_blocks: int,
                  block_size: int) -> None:
    """`select` for a decode batch on the capturable path (v4_static.py): the same picks,
    with every shape fixed by the batch size and K, the entries a block-table row holds
    (`V4DecodeStep.entry_capacity`) instead of the step's most visible. Each row is a block
    of one query ([R, 1, ...] in the helpers above)."""
    R = x.shape[0]
    K = step.entry_capacity(keys_name)
    dense = indexer.topk >= K and not use_candidates
    if dense and not candidate_source:
        state.picks = None
        return
    H, D = indexer.n_heads, indexer.head_dim
    q = rotate(indexer.wq_b(q_res).view(R, H, D), cis)
    q = kv_quant.fake_quant(q, "mxfp4").float()[:, None]                      # [R, 1, H, D]
    weights = (indexer.weights_proj(x).float() * (D ** -0.5 * H ** -0.5))[:, None]
    k = min(indexer.topk, K)
    visible = step.visible(ratio)[:, None]                                    # [R, 1]
    width = state.candidates.shape[1] * block_size if use_candidates else K
    ids = None
    if width < K:       # only the candidates' entries, gathered per query
        ids = _candidate_entries(state.candidates[:, None], block_size, visible)
        scores = _candidate_scores(step, keys_name, ratio, None, q, weights, ids)
    else:
        scores = step.score_entries(keys_name, ratio, torch.float32,
                                    lambda keys: _index_scores(q, weights, keys))
        scores = scores + entry_bias(step.entry_slots(keys_name, ratio)[1])[:, None]
        if candidate_source:
            state.candidates = _candidate_blocks(scores, visible, topk_blocks, block_size)[:, 0]
        elif use_candidates:
            mask = _candidate_mask(state.candidates[:, None], block_size, K)
            scores = scores.masked_fill(~mask, float("-inf"))
    idx = index_topk(scores, min(k, scores.shape[-1]), cpu_op=False)          # [R, 1, <= k]
    ok = scores.gather(-1, idx) > float("-inf")
    if ids is not None:
        idx = ids.gather(-1, idx)
    got = torch.where(ok, idx, -1)
    state.picks = None if dense else F.pad(got, (0, k - got.shape[-1]), value=-1)[:, 0]
