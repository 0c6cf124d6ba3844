"""Lightning indexer of CSA layers (docs/deepseek_v4.md, "Lightning indexer").

Its compressor (inherited) writes indexer keys K_I [D_I] per compressed entry, exactly like the
CSA main compressor at width D_I. Per query p and visible entry w < (p+1)//m:
  score(p, w) = sum_h wgt_h(p) * ReLU(q_I[p, h] . K_I[w]) * D_I^-1/2
  with wgt = weights_proj(x) * H_I^-1/2,
and the query attends to the top `index_topk` visible entries. Ties break deterministically:
the lowest entry index wins (a stable sort), so a full prefill, chunked prefill and decode pick
the same entries (random weights make many scores exactly 0). The selection itself is an
attention-backend op (`select` in v4_reference.py / v4_batched.py).
"""
from __future__ import annotations

import torch
from torch import nn

from wideserve.kernels import deepselect
from wideserve.layers.attention.compressor import Compressor


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last axis; equal values: lowest index first."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


SORT_BELOW = 2048    # index_topk sorts rows shorter than this (fewer ops), else uses topk


def index_topk(scores: torch.Tensor, k: int, cpu_op: bool = True) -> torch.Tensor:
    """The same indices in the same order as `stable_topk_indices` (scores without NaN); rows
    of SORT_BELOW or more use DeepSelect (`cpu_op`, where its C++ op runs) or the keyed
    torch.topk instead of a full sort. The static decode step (v4_static.py) passes
    cpu_op=False: it is the path CUDA takes, which a C++ CPU op must never stand in for.

    Why equal: the stable descending sort orders (score, index) pairs by score, then by index.
    Each pair is mapped to one int64 key that is strictly monotone in that order: the high 32
    bits are the float's bits made order-preserving as a signed int (negative floats have their
    magnitude bits flipped; -0.0 is first turned into +0.0 because the sort ties them), the low
    32 bits are (n-1-index). Keys are unique, so topk's unspecified tie order never matters and
    its k largest, sorted, are exactly the first k of the stable sort.
    """
    n = scores.shape[-1]
    if n < SORT_BELOW:
        return stable_topk_indices(scores, k)
    if not cpu_op:
        return deepselect.keyed_topk(scores, k)
    return keyed_topk(scores, k)


def keyed_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`index_topk`'s long-row path: DeepSelect (kernels/deepselect.py: a radix select in C++,
    the keyed torch.topk described above where the op does not run), same picks and order."""
    return deepselect.topk(scores, k)


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
        # None: the index scores' q.k runs in the model dtype (measured as accurate as the
        # rest of a bf16 model: docs/deepseek_v4.md, "Attention precision"); a dtype forces it.
        self.dtype_override: torch.dtype | None = None
        # False: the batched backend scores with its torch loop even where the fused CPU op
        # runs (v4_batched.select; tests and benchmarks compare the two).
        self.use_cpu_kernel = True

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the index scores' q.k runs in (v4_batched.compute_dtype)."""
        return self.dtype_override or self.q_b_proj.weight.dtype
