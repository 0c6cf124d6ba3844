"""Batched DeepSeek-V4 attention ops (backend "batched"): every token of every request at once.

Same maths as v4_reference.py (the oracle these are tested against), with a number of torch ops
per layer that grows with the entry buckets present, never with the requests or tokens.
Queries are grouped into blocks (v4_blocks.py: one token per block for decode, blocks of
LONG_QUERY queries of one request for prefill chunks; at most two groups per step), and a
group's blocks into parts (V4Step.entry_parts): by entry bucket, and a long prefill into a few
parts so that no intermediate exceeds CHUNK_ELEMENTS (docs/deepseek_v4.md, "Batched attention").

Per block of Q queries (one request):
- window: the Q + W - 1 keys its queries' windows cover, gathered once from the window sources
  (V4Step), each query masking its own band of W and what it may not read;
- compressed entries: HCA (and CSA when index_topk covers every visible entry) the request's
  entries 0..n-1 (n: the block's most visible, padded to its bucket's width), each query
  masking those it cannot see yet; CSA otherwise each query's own top-k entries [Q, k];
- one softmax over [window | entries | sink] per head.
Products run in compute_dtype (the model dtype), scores and the softmax in fp32
(docs/deepseek_v4.md, "Attention precision").
Masking a score to -inf is not enough to keep an unreadable row (outside the window, an entry
not written yet) out of the output, since 0 * NaN = NaN. So such rows are never gathered as
they are: they point at an explicit zero row, are zeroed (torch.where on the picks), or read a
finite row that is masked (a readable position, the block's last visible entry, entry 0).
"""
from __future__ import annotations

import torch

from wideserve.kernels import v4_attend
from wideserve.kernels import v4_indexer as indexer_op
from wideserve.layers.attention.v4_blocks import Part, QueryBlocks, take
from wideserve.layers.attention.v4_step import V4AttentionParams, V4Step
from wideserve.layers.attention.indexer import Indexer, index_topk
from wideserve.layers.rope_interleaved import rotate

CHUNK_ELEMENTS = 1 << 25    # bound on a chunk's main intermediates (128 MiB in fp32)


def part_rows(x: torch.Tensor, blocks: QueryBlocks, sel: Part | slice) -> torch.Tensor:
    """x [T, ...] -> the rows of the selected blocks' query slots [P, Q, ...]."""
    if blocks.identity:
        return take(x, sel)[:, None]
    idx = take(blocks.q_rows, sel)
    return x.index_select(0, idx.flatten()).view(*idx.shape, *x.shape[1:])


def part_store(out: torch.Tensor, blocks: QueryBlocks, sel: Part | slice,
                rows: torch.Tensor) -> None:
    """rows [P, Q, ...] -> out's token rows (padding slots land on the scratch row T)."""
    sel = sel.sel if isinstance(sel, Part) else sel
    if blocks.identity and isinstance(sel, slice):
        out[sel] = rows[:, 0]
    else:
        out.index_copy_(0, take(blocks.out_rows, sel).flatten(), rows.flatten(0, 1))


def select(indexer: Indexer, x: torch.Tensor, q_res: torch.Tensor, step: V4Step,
           keys_name: str, cis: torch.Tensor) -> torch.Tensor | None:
    """Top-k entry ids per query [T, index_topk] (-1 = nothing picked; ties: lowest id), or
    None when index_topk covers every visible entry of every query (attention goes dense).

    Blocks are scored in buckets of similar entry counts (V4Step.entry_parts, at least
    index_topk wide); padding entries (ids a query cannot see) score -inf like future ones, so
    each row is the reference's per-request top-k: visible scores are finite and sort first,
    ties by id. Blocks without entries pick nothing. On the CPU the fused op
    (wideserve/kernels/v4_indexer.py) does the same per token without gathering the keys;
    this loop is its readable reference (`Indexer.use_cpu_kernel = False` forces it)."""
    T = x.shape[0]
    K = step.entry_width(indexer.ratio)
    if T == 0 or (indexer.topk >= K and not step.batch_invariant):
        return None
    H, D, k = indexer.n_heads, indexer.head_dim, indexer.topk
    dt = compute_dtype(indexer)
    q = rotate(indexer.q_b_proj(q_res).view(T, H, D), cis).to(dt)    # [T, H_I, D_I]
    weights = indexer.scorer.weights_proj(x).float() * H ** -0.5              # [T, H_I]
    flat, view = step.flat_cache(keys_name)
    if indexer.use_cpu_kernel and indexer_op.supports(dt, flat):
        # Scored in place in the paged cache, one pass per token (csrc/v4_indexer.cpp).
        return indexer_op.indexer_topk(q, weights * D ** -0.5, flat, view.block_table,
                                       step.token_rows(view), step.token_visible(indexer.ratio),
                                       view.entries_per_block, k)
    picks = torch.full((T + 1, k), -1, dtype=torch.int64, device=x.device)
    for blocks in step.query_groups():
        Q = blocks.block_q
        for part in step.entry_parts(blocks, indexer.ratio, k, 0, D + 3 * Q * H,
                                     CHUNK_ELEMENTS):
            if not part.width:
                continue                                # no entries yet: nothing to pick
            P = part.num_blocks
            keys = step.gather_part_entries(keys_name, blocks, part, indexer.ratio, dt)
            scores = torch.bmm(part_rows(q, blocks, part).flatten(1, 2), keys.transpose(1, 2))
            scores = torch.relu(scores.float()) * D ** -0.5                   # [P, Q*H_I, N]
            # Weighted sum over heads as one batched matmul: [P*Q, 1, H_I] @ [P*Q, H_I, N].
            w = part_rows(weights, blocks, part).reshape(P * Q, 1, H)
            scores = torch.bmm(w, scores.view(P * Q, H, part.width)).view(P, Q, part.width)
            scores = scores + step.part_entry_bias(blocks, part, indexer.ratio)
            idx = index_topk(scores, k)                                       # [P, Q, k]
            visible = part.take(step.block_visible(blocks, indexer.ratio))
            part_store(picks, blocks, part, torch.where(idx >= visible[..., None], -1, idx))
    return picks[:T]


def compute_dtype(layer: V4AttentionParams | Indexer) -> torch.dtype:
    """The dtype a layer's q.k and p.v products run in: its declared `compute_dtype`
    (DeepseekV4Attention and Indexer: the model dtype unless overridden; DeepseekV41Attention:
    fp32). Scores
    always leave the product as fp32: masks, sinks, softmax and top-k run in fp32
    (docs/deepseek_v4.md, "Attention precision")."""
    return layer.compute_dtype


def attend(attn: V4AttentionParams, q: torch.Tensor, kv: torch.Tensor, step: V4Step,
           picks: torch.Tensor | None) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (this step's latents) -> attention output [T, H, D] in
    compute_dtype(attn)."""
    return _attend(attn, q, kv, step, picks)


def _attend(attn: V4AttentionParams, q: torch.Tensor, kv: torch.Tensor, step: V4Step,
            picks: torch.Tensor | None) -> torch.Tensor:
    T, H, D = q.shape
    dt = compute_dtype(attn)
    out = torch.empty(T + 1, H, D, dtype=dt, device=q.device)                # + scratch row
    if T == 0:
        return out[:0]
    hist = step.window_history(attn.prefix + "window", attn.window, dt)     # [R*(W-1), D]
    zero = torch.zeros(1, D, dtype=dt, device=q.device)
    if step.plain_decode:
        # One new token per request, no replay: its window is its request's W-1 history rows
        # (each readable or a copy of readable position 0) and itself, in key-slot order.
        R, W = step.num_reqs, attn.window
        keys = torch.cat([hist.view(R, W - 1, D), kv.to(dt)[:, None],
                          zero.expand(R, 1, D)], dim=1)                       # [T, W + 1, D]
        _attend_group(attn, q.to(dt), keys, step, step.query_groups()[0], picks, out)
        return out[:T]
    src = torch.cat([kv.to(dt), hist, zero])                                 # [T+R*(W-1)+1, D]
    for blocks in step.query_groups(attend=True):
        _attend_group(attn, q.to(dt), src, step, blocks, picks, out)
    return out[:T]


ENTRY_FLOOR = 16    # narrowest entry bucket of dense attention (a few wasted columns at most)


def _attend_group(attn: V4AttentionParams, q: torch.Tensor, src: torch.Tensor,
                  step: V4Step, blocks: QueryBlocks, picks: torch.Tensor | None,
                  out: torch.Tensor) -> None:
    """Attention of one block group's queries, written into out's rows. src: the window
    sources, or (plain decode) the window keys themselves [B, Lk + 1, D].

    Keys of a block: [window (Lk) | sink slot (a zero row) | entries]. Dense (HCA, or CSA
    when index_topk covers every entry): the entries 0..width-1 of its bucket (a part).
    Sparse: each query's own top-k entries; with Q > 1 they are scored separately (they
    differ per query)."""
    H, D = q.shape[1], q.shape[2]
    Q = blocks.block_q
    win = step.window_keys(blocks, attn.window)
    Lk = win.rows.shape[1] - 1
    comp_name = attn.prefix + "compressed"
    dense = bool(attn.ratio) and picks is None
    k = 0 if picks is None else int(picks.shape[1])
    ratio = attn.ratio if dense else 0
    per_entry = D + 3 * Q * H
    for part in step.entry_parts(blocks, ratio, ENTRY_FLOOR, (Lk + k) * per_entry + Q * k * D,
                                 per_entry, CHUNK_ELEMENTS):
        P = part.num_blocks
        qb = part_rows(q, blocks, part).flatten(1, 2)                        # [P, Q*H, D]
        if src.dim() == 3:
            keys = part.take(src)
        else:
            keys = src.index_select(0, part.take(win.rows).flatten()).view(P, Lk + 1, D)
        if part.width:                               # the block's entries 0..width-1
            keys = torch.cat([keys, step.gather_part_entries(comp_name, blocks, part,
                                                             attn.ratio, q.dtype)], dim=1)
        own = None
        if picks is not None:                       # each query's own top-k entries
            rows, chosen = step.shared_picked(
                comp_name, picks, (id(blocks), int(part.ids[0]), int(part.ids[-1]), part.width, q.dtype),
                lambda: _gather_picked(step, comp_name, attn.ratio, blocks, part, picks,
                                       q.dtype))                 # [P, Q, k, D], [P, Q, k]
            if Q == 1:                              # decode: they are the block's keys too
                keys = torch.cat([keys, rows[:, 0]], dim=1)
            own = (rows, chosen)
        bias = step.part_bias(blocks, part, attn.window, ratio, k)
        fn = (_invariant_attend if step.invariant_rows_op and v4_attend.supports(qb, keys)
              else _softmax_attend)
        part_store(out, blocks, part, fn(qb, keys, bias, attn.sinks.float(),
                                         attn.head_dim ** -0.5, Lk, own))


def _invariant_attend(qb: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor,
                      sinks: torch.Tensor, scale: float, sink_slot: int,
                      own: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """_softmax_attend's contract through the layout-independent C++ op (--batch-invariant,
    kernels/v4_attend.py): a query's bits are the same in a block of LONG_QUERY queries, in
    a one-query block and in a decode step."""
    N = keys.shape[1]
    cols = bias[:, :, 0, :N]                                                  # [C, Q, N]
    if own is not None and bias.shape[1] == 1:      # picks already the last k keys: mask them
        k = own[1].shape[2]
        cols = torch.cat([cols[..., :N - k],
                          cols[..., N - k:].masked_fill(~own[1], float("-inf"))], dim=-1)
        own = None
    return v4_attend.attend_rows(qb, keys, cols, sinks, scale, sink_slot, own)


def _gather_picked(step: V4Step, name: str, ratio: int, blocks: QueryBlocks, part: Part,
                   picks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries picks [T, k] chooses for `part`'s query slots -> ([P, Q, k, D], chosen)."""
    sel = part_rows(picks, blocks, part)                                     # [P, Q, k]
    chosen = sel >= 0
    return step.gather_picked(name, ratio, part.take(blocks.block_req), sel, chosen,
                              dtype), chosen


def _softmax_attend(qb: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor,
                    sinks: torch.Tensor, scale: float, sink_slot: int,
                    own: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """qb [C, Q*H, D], keys = values [C, N, D], bias [C, Q, 1, >= N] (0 / -inf), sinks [H];
    own: per-query entries [C, Q, k, D] and whether each was picked [C, Q, k] (when Q == 1
    they are already the last k keys, only their mask applies) -> [C, Q, H, D].

    The products run in qb's dtype; scores, masks, sinks and the softmax in fp32, the
    probabilities go back to qb's dtype for p.v. The sink slot's key is a zero row whose score
    is replaced by the sink logit: it enlarges the denominator and adds nothing to the output."""
    C, N, D = keys.shape
    Q = bias.shape[1]
    H = qb.shape[1] // Q
    if Q == 1 and qb.dtype == torch.float32:   # bias [C, 1, N] broadcasts over heads: fused
        scores = torch.baddbmm(bias[:, 0, :, :N], qb, keys.transpose(1, 2), alpha=scale)
    else:
        scores = torch.bmm(qb, keys.transpose(1, 2)).float().view(C, Q, H, N) * scale
        scores = scores + bias[..., :N]
    scores = scores.view(C, Q, H, N)
    scores[..., sink_slot] = sinks
    if own is not None:
        rows, chosen = own
        hidden = ~chosen[:, :, None, :]                                       # [C, Q, 1, k]
        if Q == 1:
            scores[..., N - rows.shape[2]:].masked_fill_(hidden, float("-inf"))
        else:
            extra = torch.matmul(qb.view(C, Q, H, D), rows.transpose(-1, -2)).float() * scale
            scores = torch.cat([scores, extra.masked_fill(hidden, float("-inf"))], dim=-1)
    probs = torch.softmax(scores, dim=-1).to(qb.dtype)                       # [C, Q, H, N(+k)]
    out = torch.bmm(probs[..., :N].reshape(C, Q * H, N), keys).view(C, Q, H, D)
    if own is not None and Q > 1:
        out = out + torch.matmul(probs[..., N:], own[0])
    return out
