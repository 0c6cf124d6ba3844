"""Routed experts: SwiGLU MLPs applied to the tokens routed to them.

Glossary: a *logical* expert is what the router picks (0..E-1); a *physical* expert is a slot
in this rank's weight tensors. `logical_to_physical` maps one to the other (identity until
expert parallelism / EPLB place replicas); `expert_load` counts tokens per physical expert
on the device, without a host sync, for EPLB and for the load-skew reports.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        # DeepSeek-V4 clamps the gate from above only and the up projection both ways.
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class RoutedExperts(nn.Module):
    """Weights in the HF layout: gate_up_proj [E, 2I, d] (gate rows first), down_proj [E, d, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.register_buffer("logical_to_physical",
                             torch.arange(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, d]; topk_ids/topk_weights [T, k] (logical ids) -> [T, d]."""
        phys = self.logical_to_physical[topk_ids]                     # [T, k]
        flat = phys.reshape(-1)
        counts = torch.bincount(flat, minlength=self.num_experts)     # [E]
        self.expert_load += counts
        order = torch.argsort(flat, stable=True)
        token_of = order // topk_ids.shape[1]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        weights = topk_weights.reshape(-1)[order].float()
        # One host read of the counts per layer call; loops over experts, never over tokens.
        bounds = torch.cumsum(counts, 0).tolist()
        start = 0
        for e, end in enumerate(bounds):
            if end == start:
                continue
            rows = token_of[start:end]
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(swiglu(gate, up, self.swiglu_limit), self.down_proj[e])
            out.index_add_(0, rows, y.float() * weights[start:end, None])
            start = end
        return out.to(x.dtype)
