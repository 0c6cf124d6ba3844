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
Masking a score to -inf is not enough to keep an unreadable row (outside the window, an entry
not written yet) out of the output, since 0 * NaN = NaN. So such rows are never gathered as
they are: they point at an explicit zero row, are zeroed (torch.where / index_fill_ on
host-known rows), or read a finite row that is masked (a readable position, entry 0).
"""
from __future__ import annotations

import torch

from wideserve.layers.attention.v4_blocks import QueryBlocks
from wideserve.layers.attention.v4_step import V4AttentionParams, V4Step
from wideserve.layers.indexer import Indexer, index_topk
from wideserve.layers.rope import rotate

CHUNK_ELEMENTS = 1 << 25    # bound on a chunk's main intermediates (128 MiB in fp32)


def _chunks(num_blocks: int, per_block: int) -> list[tuple[int, int]]:
    n = max(1, CHUNK_ELEMENTS // max(1, per_block))
    return [(a, min(a + n, num_blocks)) for a in range(0, num_blocks, n)]


def _rows(x: torch.Tensor, blocks: QueryBlocks, a: int, b: int) -> torch.Tensor:
    """x [T, ...] -> the rows of blocks a..b-1's query slots [b-a, Q, ...]."""
    if blocks.identity:
        return x[a:b, None]
    idx = blocks.q_rows[a:b]
    return x.index_select(0, idx.flatten()).view(*idx.shape, *x.shape[1:])


def _store(out: torch.Tensor, blocks: QueryBlocks, a: int, b: int, rows: torch.Tensor) -> None:
    """rows [b-a, Q, ...] -> out's token rows (padding slots land on the scratch row T)."""
    if blocks.identity:
        out[a:b] = rows[:, 0]
    else:
        out.index_copy_(0, blocks.out_rows[a:b].flatten(), rows.flatten(0, 1))


def select(indexer: Indexer, x: torch.Tensor, q_res: torch.Tensor, step: V4Step,
           keys_name: str, cis: torch.Tensor) -> torch.Tensor | None:
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
    q = rotate(indexer.q_b_proj(q_res).view(T, H, D), cis).float()  # [T, H_I, D_I]
    weights = indexer.scorer.weights_proj(x).float() * H ** -0.5              # [T, H_I]
    picks = torch.empty(T + 1, indexer.topk, dtype=torch.int64, device=x.device)
    for blocks in step.query_groups():
        Q = blocks.block_q
        ent = step.block_entries(blocks, indexer.ratio)
        for a, b in _chunks(blocks.num_blocks, K * (D + 3 * Q * H)):
            C = b - a
            keys = step.gather_block_entries(keys_name, blocks, indexer.ratio, a, b)
            scores = torch.bmm(_rows(q, blocks, a, b).flatten(1, 2), keys.transpose(1, 2))
            scores = torch.relu(scores) * D ** -0.5                           # [C, Q*H_I, K]
            # Weighted sum over heads as one batched matmul: [C*Q, 1, H_I] @ [C*Q, H_I, K].
            w = _rows(weights, blocks, a, b).reshape(C * Q, 1, H)
            scores = torch.bmm(w, scores.view(C * Q, H, K)).view(C, Q, K) + ent.bias[a:b]
            idx = index_topk(scores, indexer.topk)                            # [C, Q, k]
            _store(picks, blocks, a, b, torch.where(idx >= ent.visible[a:b, :, None], -1, idx))
    return picks[:T]


def attend(attn: V4AttentionParams, q: torch.Tensor, kv: torch.Tensor, step: V4Step,
           picks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (this step's latents) -> attention output [T, H, D] fp32."""
    T, H, D = q.shape
    out = torch.empty(T + 1, H, D, dtype=torch.float32, device=q.device)     # + scratch row
    if T == 0:
        return out[:0]
    hist = step.window_history(attn.prefix + "window", attn.window)         # [R*(W-1), D]
    zero = torch.zeros(1, D, dtype=torch.float32, device=q.device)
    if step.plain_decode:
        # One new token per request, no replay: its window is its request's W-1 history rows
        # (each readable or a copy of readable position 0) and itself, in key-slot order.
        R, W = step.num_reqs, attn.window
        keys = torch.cat([hist.view(R, W - 1, D), kv.float()[:, None],
                          zero.expand(R, 1, D)], dim=1)                       # [T, W + 1, D]
        _attend_group(attn, q.float(), keys, step, step.query_groups()[0], picks, out)
        return out[:T]
    src = torch.cat([kv.float(), hist, zero])                                # [T+R*(W-1)+1, D]
    for blocks in step.query_groups():
        _attend_group(attn, q.float(), src, step, blocks, picks, out)
    return out[:T]


def _attend_group(attn: V4AttentionParams, q: torch.Tensor, src: torch.Tensor,
                  step: V4Step, blocks: QueryBlocks, picks: torch.Tensor | None,
                  out: torch.Tensor) -> None:
    """Attention of one block group's queries, written into out's rows. src: the window
    sources, or (plain decode) the window keys themselves [B, Lk + 1, D].

    Keys of a block: [window (Lk) | sink slot (a zero row) | entries (K)]; with per-query
    top-k entries and Q > 1 the entries are scored separately (they differ per query)."""
    H, D = q.shape[1], q.shape[2]
    Q = blocks.block_q
    win = step.window_keys(blocks, attn.window)
    Lk = win.rows.shape[1] - 1
    comp_name = attn.prefix + "compressed"
    dense = bool(attn.ratio) and picks is None
    if picks is not None:
        K = int(picks.shape[1])
        bias = step.padded_bias(blocks, attn.window, K)                      # [B, Q, 1, N]
    elif dense:
        K = step.entry_width(attn.ratio)
        bias = step.dense_bias(blocks, attn.window, attn.ratio)
    else:
        K, bias = 0, win.bias
    for a, b in _chunks(blocks.num_blocks, (Lk + K) * (D + 3 * Q * H) + Q * K * D):
        C = b - a
        qb = _rows(q, blocks, a, b).flatten(1, 2)                             # [C, Q*H, D]
        if src.dim() == 3:
            keys = src[a:b]
        else:
            keys = src.index_select(0, win.rows[a:b].flatten()).view(C, Lk + 1, D)
        if dense:                                   # every entry of the block's request
            keys = torch.cat([keys, step.gather_block_entries(comp_name, blocks, attn.ratio,
                                                              a, b)], dim=1)
        own = None
        if picks is not None:                       # each query's own top-k entries
            sel = _rows(picks, blocks, a, b)                                  # [C, Q, k]
            chosen = sel >= 0
            rows = step.gather_picked(comp_name, attn.ratio, blocks.block_req[a:b], sel,
                                      chosen)                                 # [C, Q, k, D]
            if Q == 1:                              # decode: they are the block's keys too
                keys = torch.cat([keys, rows[:, 0]], dim=1)
            own = (rows, chosen)
        _store(out, blocks, a, b, _softmax_attend(qb, keys, bias[a:b], attn.sinks.float(),
                                                  attn.head_dim ** -0.5, Lk, own))


def _softmax_attend(qb: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor,
                    sinks: torch.Tensor, scale: float, sink_slot: int,
                    own: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """qb [C, Q*H, D], keys = values [C, N, D], bias [C, Q, 1, >= N] (0 / -inf), sinks [H];
    own: per-query entries [C, Q, k, D] and whether each was picked [C, Q, k] (when Q == 1
    they are already the last k keys, only their mask applies) -> [C, Q, H, D].

    The sink slot's key is a zero row whose score is replaced by the sink logit: it enlarges
    the softmax denominator and adds nothing to the output."""
    C, N, D = keys.shape
    Q = bias.shape[1]
    H = qb.shape[1] // Q
    if Q == 1:   # the bias [C, 1, N] broadcasts over the heads: one fused op
        scores = torch.baddbmm(bias[:, 0, :, :N], qb, keys.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(qb, keys.transpose(1, 2)).view(C, Q, H, N) * scale
        scores = scores + bias[..., :N]
    scores = scores.view(C, Q, H, N)
    scores[..., sink_slot] = sinks
    if own is not None:
        rows, chosen = own
        hidden = ~chosen[:, :, None, :]                                       # [C, Q, 1, k]
        if Q == 1:
            scores[..., N - rows.shape[2]:].masked_fill_(hidden, float("-inf"))
        else:
            extra = torch.matmul(qb.view(C, Q, H, D), rows.transpose(-1, -2)) * scale
            scores = torch.cat([scores, extra.masked_fill(hidden, float("-inf"))], dim=-1)
    probs = torch.softmax(scores, dim=-1)                                     # [C, Q, H, N(+k)]
    out = torch.bmm(probs[..., :N].reshape(C, Q * H, N), keys).view(C, Q, H, D)
    if own is not None and Q > 1:
        out = out + torch.matmul(probs[..., N:], own[0])
    return out
