"""Batched DeepSeek-V4 attention ops (backend "batched"): every token of every request at once.

Same maths as v4_reference.py (the oracle these are tested against), with a constant number of
torch ops per layer and no host loop over requests or tokens. Queries are grouped into blocks
(v4_blocks.py: one token per block for decode, blocks of LONG_QUERY queries of one request for
prefill chunks; at most two groups per step); only a long prefill is split into a few chunks of
blocks, so no intermediate exceeds CHUNK_ELEMENTS.

Per block of Q queries (one request):
- window: the Q + W - 1 keys its queries' windows cover, gathered once from the window sources
  (V4Step), each query masking its own band of W and what it may not read;
- compressed entries: HCA (and CSA when index_topk covers every visible entry) the request's
  entries 0..K-1 gathered once, each query masking those it cannot see yet; CSA otherwise each
  query's own top-k entries [Q, k] from the indexer;
- one softmax over [window | entries | sink] per head.
Unreadable rows (outside the window, entries not written yet) are gathered through a safe slot
and zeroed with torch.where (or point at an explicit zero row), so a NaN there can never reach
the output: masking a score to -inf is not enough, since 0 * NaN = NaN.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from wideserve.layers.indexer import index_topk
from wideserve.layers.rope import apply_rope
from wideserve.layers.v4_blocks import QueryBlocks
from wideserve.layers.v4_step import V4Step

if TYPE_CHECKING:
    from wideserve.layers.indexer import Indexer
    from wideserve.layers.v4_attention import DeepseekV4Attention

CHUNK_ELEMENTS = 1 << 24    # largest per-chunk intermediate (64 MiB in fp32)


def _chunks(num_tokens: int, per_token: int) -> list[tuple[int, int]]:
    n = max(1, CHUNK_ELEMENTS // max(1, per_token))
    return [(a, min(a + n, num_tokens)) for a in range(0, num_tokens, n)]


def select(indexer: Indexer, x: torch.Tensor, q_res: torch.Tensor, step: V4Step,
           keys_name: str, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Top-k entry ids per query [T, index_topk] (-1 = nothing picked; ties: lowest id), or
    None when index_topk covers every visible entry of every query (attention goes dense).

    Padding entries (ids a query cannot see) score -inf like future ones, so each row is the
    reference's per-request top-k: visible scores are finite and sort first, ties by id.
    """
    T = x.shape[0]
    K = step.entry_width(indexer.ratio)
    if T == 0 or indexer.topk >= K:
        return None
    H, D = indexer.n_heads, indexer.head_dim
    q = apply_rope(indexer.q_b_proj(q_res).view(T, H, D), cos, sin).float()  # [T, H_I, D_I]
    weights = indexer.scorer.weights_proj(x).float() * H ** -0.5              # [T, H_I]
    slots = step.request_entry_slots(keys_name, indexer.ratio)                # [R, K]
    picks = torch.empty(T + 1, indexer.topk, dtype=torch.int64, device=x.device)
    for blocks in step.query_groups():
        Q = blocks.block_q
        ent = step.block_entries(blocks, indexer.ratio)
        for a, b in _chunks(blocks.num_blocks, K * (D + 3 * Q * H)):
            rows = blocks.q_rows[a:b]                                         # [C, Q]
            keys = step.gather_rows(keys_name, slots[blocks.block_req[a:b]],
                                    ent.readable[a:b])                        # [C, K, D_I]
            qb = q[rows].flatten(1, 2)                                        # [C, Q*H_I, D_I]
            scores = torch.relu(torch.bmm(qb, keys.transpose(1, 2))) * D ** -0.5
            scores = scores.view(b - a, Q, H, K) * weights[rows][..., None]
            scores = scores.sum(dim=2)                                        # [C, Q, K]
            visible = ent.visible[a:b, :, None]
            future = ent.ids >= visible
            idx = index_topk(scores.masked_fill(future, float("-inf")), indexer.topk)
            idx = torch.where(idx >= visible, -1, idx)                        # [C, Q, k]
            picks.index_copy_(0, blocks.out_rows[a:b].flatten(), idx.flatten(0, 1))
    return picks[:T]


def attend(attn: DeepseekV4Attention, q: torch.Tensor, kv: torch.Tensor, step: V4Step,
           picks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (this step's latents) -> attention output [T, H, D] fp32."""
    T, H, D = q.shape
    out = torch.empty(T + 1, H, D, dtype=torch.float32, device=q.device)     # + scratch row
    if T == 0:
        return out[:0]
    name = attn.prefix + "window"
    hist_slots, hist_valid = step.window_history(name, attn.window)
    hist = step.gather_rows(name, hist_slots, hist_valid)                     # [R, W-1, D]
    src = torch.cat([kv.float(), hist.flatten(0, 1),
                     torch.zeros(1, D, dtype=torch.float32, device=q.device)])
    qf = q.float()
    for blocks in step.query_groups():
        _attend_group(attn, qf, src, step, blocks, picks, out)
    return out[:T]


def _attend_group(attn: DeepseekV4Attention, q: torch.Tensor, src: torch.Tensor,
                  step: V4Step, blocks: QueryBlocks, picks: torch.Tensor | None,
                  out: torch.Tensor) -> None:
    """Attention of one block group's queries, written into out's rows."""
    H, D = q.shape[1], q.shape[2]
    Q = blocks.block_q
    win = step.window_keys(blocks, attn.window)
    Lk = win.rows.shape[1]
    comp_name = attn.prefix + "compressed"
    ent, slots, K = None, None, 0
    if attn.ratio:
        ent = step.block_entries(blocks, attn.ratio)
        slots = step.request_entry_slots(comp_name, attn.ratio)               # [R, Kmax]
        K = ent.width if picks is None else int(picks.shape[1])
    sinks = attn.sinks.float().view(1, 1, H, 1)
    scale = attn.head_dim ** -0.5
    for a, b in _chunks(blocks.num_blocks, (Lk + K) * (D + 3 * Q * H) + Q * K * D):
        C = b - a
        rows = blocks.q_rows[a:b]
        qb = q[rows]                                                          # [C, Q, H, D]
        keys = src[win.rows[a:b]]                                             # [C, Lk, D]
        scores = torch.bmm(qb.flatten(1, 2), keys.transpose(1, 2)) * scale
        scores = [scores.view(C, Q, H, Lk).masked_fill(~win.valid[a:b, :, None, :],
                                                       float("-inf"))]
        comp = None
        if ent is not None and picks is None:     # every visible entry of the request
            comp = step.gather_rows(comp_name, slots[blocks.block_req[a:b]],
                                    ent.readable[a:b])                        # [C, K, D]
            sc = torch.bmm(qb.flatten(1, 2), comp.transpose(1, 2)).view(C, Q, H, K) * scale
            hidden = ent.ids >= ent.visible[a:b, :, None]                     # [C, Q, K]
            scores.append(sc.masked_fill(hidden[:, :, None, :], float("-inf")))
        elif ent is not None:                     # each query's own top-k entries
            sel = picks[rows]                                                 # [C, Q, k]
            chosen = sel >= 0
            comp = step.gather_rows(comp_name, slots[blocks.block_req[a:b, None, None],
                                                     sel.clamp(min=0)], chosen)  # [C, Q, k, D]
            sc = torch.matmul(qb, comp.transpose(-1, -2)) * scale             # [C, Q, H, k]
            scores.append(sc.masked_fill(~chosen[:, :, None, :], float("-inf")))
        # The sink is one more logit per head that only enlarges the softmax denominator.
        probs = torch.softmax(torch.cat(scores + [sinks.expand(C, Q, H, 1)], dim=-1), dim=-1)
        o = torch.bmm(probs[..., :Lk].reshape(C, Q * H, Lk), keys).view(C, Q, H, D)
        if comp is not None and comp.dim() == 3:
            o = o + torch.bmm(probs[..., Lk:Lk + K].reshape(C, Q * H, K),
                              comp).view(C, Q, H, D)
        elif comp is not None:
            o = o + torch.matmul(probs[..., Lk:Lk + K], comp)
        out.index_copy_(0, blocks.out_rows[a:b].flatten(), o.flatten(0, 1))
