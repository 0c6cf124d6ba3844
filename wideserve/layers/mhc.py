"""Manifold-constrained hyper-connections (mHC), docs/deepseek_v4.md, "Streams and mHC".

The residual is n parallel streams X [T, n, d]. At each site (attention, FFN) a tiny projection
of the RMS-normalised, flattened streams yields
  pre  [T, n]    collapse weights: the sub-block input is sum_j pre_j X_j
  post [T, n]    expand weights: stream k receives post_k * y
  comb [T, n, n] residual mixing, projected to doubly stochastic by Sinkhorn; applied transposed
                 (X'_k = post_k y + sum_j comb[j, k] X_j).
The head collapses the streams once more with its own pre weights (no Sinkhorn).
All parameters are fp32; the maths runs in fp32 and results are cast back to X's dtype.

In a small-batch decode step (`small_scope` on: worker/small_batch.py) a site on bf16
streams runs the fused C++ op instead (kernels/mhc.py: three calls for ~65 torch ops, equal
to fp32 rounding), as the step's small-M GEMMs do (layers/small_m.py): the default mode's
batch-size dependent rounding, never under --batch-invariant, off with the GEMMs.
"""
from __future__ import annotations

import torch
from torch import nn

from wideserve.kernels import mhc as fused
from wideserve.layers.linear import FunctionalLinear, lane_aligned
from wideserve.layers.small_m import GemmScope


def _flat_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, n, d] -> [T, n*d] fp32, unweighted RMS-normalised over all n*d values."""
    flat = x.flatten(1).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., n, n] positive -> approximately doubly stochastic; ends on a column pass."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One mHC site. Parameters (HF names): fn [(2+n)n, n*d], base [(2+n)n], scale [3]."""

    def __init__(self, hc_mult: int, hidden: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        self.n = hc_mult
        self.iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(width, hc_mult * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.mix = FunctionalLinear()     # x @ fn^T in fp32 (invariant under the mode)
        # set by the small-batch path (use_fused_mhc): while on, bf16 sites run fused
        self.small_scope: GemmScope | None = None

    def fused(self, x: torch.Tensor) -> bool:
        """Whether this site runs the fused op on streams x now (a small step, bf16)."""
        scope = self.small_scope
        return scope is not None and scope.on and x.dtype == torch.bfloat16 \
            and fused.supports(x)

    def fused_coefficients(self, x: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """pre, post, comb [T, n] [T, n] [T, n, n] (fp32) through the fused op."""
        return fused.coeffs(x, self.fn.float(), self.base.float(), self.scale.float(),
                            self.iters, self.hc_eps, self.norm_eps)

    def collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """[T, n, d] weighted by pre [T, n] -> [T, d] (fp32 sum, cast to x.dtype)."""
        if self.fused(x):
            return fused.collapse(x, pre)
        return (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)

    def expand(self, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
        """New streams: `hc_expand`, fused in a small step."""
        if self.fused(x):
            return fused.expand(x, post, comb, y)
        return hc_expand(x, post, comb, y)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, n, d] -> post [T, n] fp32, comb [T, n, n] fp32, collapsed [T, d] (x.dtype)."""
        if self.fused(x):
            pre, post, comb = self.fused_coefficients(x)
            return post, comb, fused.collapse(x, pre)
        n = self.n
        mixes = self.mix(_flat_rms(x, self.norm_eps), self.fn, widen_weight=True)  # [T, (2+n)n]
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        s_pre, s_post, s_comb = self.scale.float().unbind(0)
        inv = self.mix.batch_invariant       # sigmoid's bits not by the row's place
        pre = lane_aligned(torch.sigmoid, pre_w * s_pre + pre_b, inv) + self.hc_eps   # [T, n]
        post = 2 * lane_aligned(torch.sigmoid, post_w * s_post + post_b, inv)          # [T, n]
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n),
                             dim=-1) + self.hc_eps                            # [T, n, n]
        comb = sinkhorn(comb, self.iters, self.hc_eps)
        return post, comb, self.collapse(x, pre)


def hc_expand(x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
              y: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, d]: post_k * y + sum_j comb[j, k] * x_j (fp32, cast to x.dtype)."""
    mixed = torch.matmul(comb.transpose(-1, -2), x.float())                   # [T, n, d]
    return (post.unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(x.dtype)


class HyperHead(nn.Module):
    """Final stream collapse. Parameters (HF names): hc_fn [n, n*d], hc_base [n], hc_scale [1]."""

    def __init__(self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.mix = FunctionalLinear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, n, d] -> [T, d] (x.dtype)."""
        mixes = self.mix(_flat_rms(x, self.norm_eps), self.hc_fn, widen_weight=True)  # [T, n]
        pre = lane_aligned(torch.sigmoid, mixes * self.hc_scale.float() + self.hc_base.float(),
                           self.mix.batch_invariant) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


def use_fused_mhc(model: nn.Module, scope: GemmScope | None) -> int:
    """Every mHC site of `model` reads `scope` (None: never fused); how many there are."""
    sites = [m for m in model.modules() if isinstance(m, HyperConnection)]
    for m in sites:
        m.small_scope = scope
    return len(sites)
