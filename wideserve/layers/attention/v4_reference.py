"""Reference DeepSeek-V4 attention ops (backend "reference"): the readable oracle.

One request at a time (a host loop per request, never per token), queries in blocks of
QUERY_BLOCK; each block reads exactly the window latents and compressed entries its queries may
see (docs/deepseek_v4.md, "Attention" to "Lightning indexer"). The batched backend (v4_batched.py) is tested against
these.
"""
from __future__ import annotations

import torch

from wideserve.layers.attention.v4_step import V4AttentionParams, V4Step
from wideserve.layers.attention.indexer import Indexer, stable_topk_indices
from wideserve.layers.rope_interleaved import rotate

QUERY_BLOCK = 256   # queries per attention block: bounds the score tensor on long prefills

Picks = list  # per request: [S_r, k] entry ids (-1 = nothing) or None (dense)


def select(indexer: Indexer, x: torch.Tensor, q_res: torch.Tensor, step: V4Step,
           keys_name: str, cis: torch.Tensor) -> Picks:
    """Per request: top-k entry ids [S_r, k] (-1 = nothing picked), or None when every
    visible entry is picked anyway (index_topk >= entries), so attention can go dense.

    x [T, d] (attention input), q_res [T, r_q]; cis: compress-table rotation at the positions.
    """
    T = x.shape[0]
    q = indexer.q_b_proj(q_res).view(T, indexer.n_heads, indexer.head_dim)
    q = rotate(q, cis).float()                                       # [T, H_I, D_I]
    weights = indexer.scorer.weights_proj(x).float() * indexer.n_heads ** -0.5  # [T, H_I]
    scale = indexer.head_dim ** -0.5
    out: Picks = []
    for r in range(step.num_reqs):
        qs, qe = step.token_range(r)
        n_entries = int(step.seq[r]) // indexer.ratio
        if qe == qs or indexer.topk >= n_entries:
            out.append(None)
            continue
        keys = step.read_entries(keys_name, r, n_entries).float()             # [C, D_I]
        picks = []
        for a in range(qs, qe, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, qe)
            scores = torch.relu(torch.einsum("shd,cd->shc", q[a:b], keys)) * scale
            scores = (scores * weights[a:b, :, None]).sum(dim=1)              # [S, C]
            visible = (step.positions[a:b] + 1) // indexer.ratio              # [S]
            future = torch.arange(n_entries, device=x.device)[None, :] >= visible[:, None]
            idx = stable_topk_indices(scores.masked_fill(future, float("-inf")), indexer.topk)
            picks.append(torch.where(idx >= visible[:, None], -1, idx))
        out.append(torch.cat(picks))
    return out


def attend(attn: V4AttentionParams, q: torch.Tensor, kv: torch.Tensor, step: V4Step,
           picks: Picks | None) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (this step's latents) -> attention output [T, H, D] fp32."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for r in range(step.num_reqs):
        qs, qe = step.token_range(r)
        if qe > qs:
            out[qs:qe] = _attend_request(attn, q, kv, step, r,
                                         None if picks is None else picks[r])
    return out


def _attend_request(attn: V4AttentionParams, q: torch.Tensor, kv: torch.Tensor,
                    step: V4Step, r: int, picks: torch.Tensor | None) -> torch.Tensor:
    """Attention of request r's new queries -> [S, H, D] fp32."""
    qs, qe = step.token_range(r)
    ctx, seq = int(step.ctx[r]), int(step.seq[r])
    W = attn.window
    # Window latents the request's queries can see: cached [lo, ctx) + this step's rows.
    lo = max(int(step.lo[r]), ctx - W + 1)
    win_keys = torch.cat([step.read_positions(attn.prefix + "window", r, lo, ctx).float(),
                          kv[qs:qe].float()])                                  # [K, D]
    win_pos = torch.arange(lo, seq, device=q.device)
    comp = None
    if attn.ratio:
        comp = step.read_entries(attn.prefix + "compressed", r, seq // attn.ratio).float()
    out = []
    for a in range(qs, qe, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, qe)
        # Keys this block's window can reach: positions [first query - W + 1, last query].
        k0 = max(lo, ctx + (a - qs) - W + 1) - lo
        k1 = ctx + (b - qs) - lo
        blk_picks = None if picks is None else picks[a - qs:b - qs]
        out.append(_attend_block(attn, q[a:b].float(), step.positions[a:b], win_keys[k0:k1],
                                 win_pos[k0:k1], comp, blk_picks))
    return torch.cat(out)


def _attend_block(attn: V4AttentionParams, q: torch.Tensor, pos: torch.Tensor,
                  keys: torch.Tensor, kpos: torch.Tensor, comp: torch.Tensor | None,
                  picks: torch.Tensor | None) -> torch.Tensor:
    """q [S, H, D] at positions pos [S]; window keys [K, D] at kpos [K]; -> [S, H, D]."""
    scale = attn.head_dim ** -0.5
    logits = [torch.einsum("shd,kd->shk", q, keys) * scale]
    see = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - attn.window)
    masks = [see]
    values = [keys]
    if comp is not None and comp.shape[0] > 0:
        if picks is None:   # dense over visible entries (HCA, or CSA with k >= entries)
            visible = (pos + 1) // attn.ratio
            ent = torch.arange(comp.shape[0], device=q.device)
            logits.append(torch.einsum("shd,cd->shc", q, comp) * scale)
            masks.append(ent[None, :] < visible[:, None])
            values.append(comp)
        else:               # sparse: each query's own top-k entries
            sel = comp[picks.clamp(min=0)]                                    # [S, k, D]
            logits.append(torch.einsum("shd,skd->shk", q, sel) * scale)
            masks.append(picks >= 0)
            values.append(sel)
    S, H = q.shape[0], q.shape[1]
    scores = torch.cat([lg.masked_fill(~m[:, None, :], float("-inf"))
                        for lg, m in zip(logits, masks)]
                       + [attn.sinks.float().view(1, H, 1).expand(S, H, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.zeros_like(q)
    start = 0
    for v in values:
        n = v.shape[-2]
        p = probs[..., start:start + n]
        out = out + (torch.einsum("shk,kd->shd", p, v) if v.dim() == 2
                     else torch.einsum("shk,skd->shd", p, v))
        start += n
    return out
