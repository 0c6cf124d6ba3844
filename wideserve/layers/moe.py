"""DeepSeek-V4 MoE block: router, routed experts, one shared expert (reference §3.8).

Router scores s = act(x W_gate^T) with act in {sqrtsoftplus, sigmoid, softmax}, in fp32.
- `moe` (TopKRouter): experts = top-k of s + e_score_correction_bias (the bias only selects).
- `hash_moe` (HashRouter): experts = tid2eid[token id], a frozen [vocab, k] table.
Weights w = s[experts], renormalised w / (sum w + 1e-20) unless the scoring is softmax (the
official rule; HF renormalises always but cannot build softmax routers at all), then times
routed_scaling_factor. Output = sum_k w_k expert_k(x) + shared(x); both use the clamped SwiGLU.
Routed experts live in `RoutedExperts` (logical->physical map, per-expert load counters).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wideserve.layers.experts import RoutedExperts, swiglu
from wideserve.layers.linear import FunctionalLinear, lane_aligned


def router_scores(logits: torch.Tensor, scoring_func: str, invariant: bool = False
                  ) -> torch.Tensor:
    """invariant (--batch-invariant): the elementwise scores on lane-aligned rows
    (layers/linear.py lane_aligned), so a token's scores do not depend on its row."""
    if scoring_func == "sqrtsoftplus":
        return lane_aligned(F.softplus, logits, invariant).sqrt()
    if scoring_func == "sigmoid":
        return lane_aligned(torch.sigmoid, logits, invariant)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


class _RouterBase(nn.Module):
    def __init__(self, num_experts: int, hidden: int, top_k: int, scoring_func: str,
                 routed_scaling_factor: float) -> None:
        super().__init__()
        self.top_k = top_k
        self.scoring_func = scoring_func
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.logits = FunctionalLinear()          # fp32 x @ weight^T (invariant in the mode)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return router_scores(self.logits(x.float(), self.weight, widen_weight=True),
                             self.scoring_func, self.logits.batch_invariant)

    def finish(self, scores: torch.Tensor, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        weights = scores.gather(1, ids)
        if self.scoring_func != "softmax":
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class TopKRouter(_RouterBase):
    """HF names: weight [E, d], e_score_correction_bias [E] (fp32 buffer)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(self.weight.shape[0], dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> expert ids [T, k] int64, weights [T, k] fp32."""
        s = self.scores(x)                                                    # [T, E]
        ids = torch.topk(s + self.e_score_correction_bias, self.top_k, dim=-1).indices
        return self.finish(s, ids)


class HashRouter(_RouterBase):
    """HF names: weight [E, d], tid2eid [vocab, k] int64 buffer."""

    def __init__(self, num_experts: int, hidden: int, top_k: int, scoring_func: str,
                 routed_scaling_factor: float, vocab_size: int) -> None:
        super().__init__(num_experts, hidden, top_k, scoring_func, routed_scaling_factor)
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int64))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.finish(self.scores(x), self.tid2eid[input_ids].long())


class SharedExpert(nn.Module):
    """HF names: gate_proj, up_proj, down_proj (biases only when mlp_bias)."""

    def __init__(self, hidden: int, intermediate: int, limit: float, bias: bool) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class DeepseekV4MoE(nn.Module):
    """HF names under `mlp.`: gate.*, experts.{gate_up_proj, down_proj}, shared_experts.*."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 scoring_func: str, routed_scaling_factor: float, swiglu_limit: float,
                 hash_routed: bool, vocab_size: int, mlp_bias: bool = False) -> None:
        super().__init__()
        self.hash_routed = hash_routed
        if hash_routed:
            self.gate: _RouterBase = HashRouter(num_experts, hidden, top_k, scoring_func,
                                                routed_scaling_factor, vocab_size)
        else:
            self.gate = TopKRouter(num_experts, hidden, top_k, scoring_func,
                                   routed_scaling_factor)
        self.experts = RoutedExperts(num_experts, hidden, intermediate, swiglu_limit)
        self.shared_experts = SharedExpert(hidden, intermediate, swiglu_limit, mlp_bias)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [T, d], input_ids [T] -> [T, d]."""
        ids, weights = self.gate(x, input_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
