"""Lightning indexer of CSA layers (reference/model-arch.md §3.7).

Its compressor (inherited) writes indexer keys K_I [D_I] per compressed entry, exactly like the
CSA main compressor at width D_I. Per query p and visible entry w < (p+1)//m:
  score(p, w) = sum_h wgt_h(p) * ReLU(q_I[p, h] . K_I[w]) * D_I^-1/2
  with wgt = weights_proj(x) * H_I^-1/2,
and the query attends to the top `index_topk` visible entries. Ties break deterministically:
the lowest entry index wins (a stable sort), so a full prefill, chunked prefill and decode pick
the same entries (random weights make many scores exactly 0).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from wideserve.layers.compressor import Compressor
from wideserve.layers.rope import apply_rope

if TYPE_CHECKING:
    from wideserve.layers.v4_attention import V4Step


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last axis; equal values: lowest index first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


class IndexerScorer(nn.Module):
    """Holds weights_proj (HF name `scorer.weights_proj`)."""

    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, n_heads, bias=False)


class Indexer(Compressor):
    """HF names under `compressor.indexer.`: kv_proj, gate_proj, position_bias, kv_norm,
    q_b_proj, scorer.weights_proj."""

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int,
                 topk: int, eps: float) -> None:
        super().__init__(hidden, head_dim, ratio, overlap=True, eps=eps)
        self.n_heads = n_heads
        self.topk = topk
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.scorer = IndexerScorer(hidden, n_heads)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, step: V4Step, keys_name: str,
               cos: torch.Tensor, sin: torch.Tensor, query_block: int
               ) -> list[torch.Tensor | None]:
        """Per request: top-k entry ids [S_r, k] (-1 = nothing picked), or None when every
        visible entry is picked anyway (index_topk >= entries), so attention can go dense.

        x [T, d] (attention input), q_res [T, r_q]; cos/sin: compress table at the positions.
        """
        T = x.shape[0]
        q = self.q_b_proj(q_res).view(T, self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin).float()                                   # [T, H_I, D_I]
        weights = self.scorer.weights_proj(x).float() * self.n_heads ** -0.5  # [T, H_I]
        scale = self.head_dim ** -0.5
        out: list[torch.Tensor | None] = []
        for r in range(step.num_reqs):
            qs, qe = step.token_range(r)
            n_entries = int(step.seq[r]) // self.ratio
            if qe == qs or self.topk >= n_entries:
                out.append(None)
                continue
            keys = step.read_entries(keys_name, r, n_entries).float()         # [C, D_I]
            picks = []
            for a in range(qs, qe, query_block):
                b = min(a + query_block, qe)
                scores = torch.relu(torch.einsum("shd,cd->shc", q[a:b], keys)) * scale
                scores = (scores * weights[a:b, :, None]).sum(dim=1)          # [S, C]
                visible = (step.positions[a:b] + 1) // self.ratio              # [S]
                future = torch.arange(n_entries, device=x.device)[None, :] >= visible[:, None]
                idx = stable_topk_indices(scores.masked_fill(future, float("-inf")), self.topk)
                picks.append(torch.where(idx >= visible[:, None], -1, idx))
            out.append(torch.cat(picks))
        return out
