"""Qwen3-MoE: the Qwen3 decoder with routed-expert MLPs on its sparse layers.

Router: softmax over experts in fp32, top-k, optionally renormalised (`norm_topk_prob`).
A layer is sparse when it is not in `mlp_only_layers` and (i + 1) % decoder_sparse_step == 0;
the others use a dense MLP of `intermediate_size`. The experts are `RoutedExperts` (HF fused
layout gate_up_proj [E, 2I, d], down_proj [E, d, I], logical->physical map, load counters).
Checkpoints load from either the transformers-5 fused names (`mlp.experts.gate_up_proj`) or the
per-expert names of the released checkpoints (`mlp.experts.{e}.gate_proj.weight`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from wideserve.layers.experts import RoutedExperts
from wideserve.layers.gemm_shapes import AttentionShape, DeclaresGemms, GemmShape
from wideserve.layers.linear import WeightPack
from wideserve.models.lean_decode import LeanMLP, hooked
from wideserve.models.llama.model import (DecoderForCausalLM, DenseMLP, LlamaConfig, _common_fields,
                                          _copy_checked, _qwen_sliding)

_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass(slots=True)
class Qwen3MoeConfig(LlamaConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, config_json: dict) -> Qwen3MoeConfig:
        d = config_json
        bias = bool(d.get("attention_bias", False))
        experts = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)
        cfg = cls(**_common_fields(d, default_head_dim=None),
                  **_qwen_sliding(d, all_layers=True),
                  qkv_bias=bias, o_bias=bias, qk_norm=True,
                  num_experts=experts,
                  num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
                  moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
                  norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                  decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                  mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
        if cfg.num_experts and not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ValueError(f"config: num_experts_per_tok {cfg.num_experts_per_tok} must be in "
                             f"[1, num_experts={cfg.num_experts}]")
        if cfg.num_experts and cfg.hidden_act != "silu":
            raise ValueError(f"config: Qwen3-MoE experts support hidden_act 'silu' only, "
                             f"got {cfg.hidden_act!r}")
        return cfg

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


class TopKRouter(nn.Module, DeclaresGemms):
    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.top_k = top_k
        self.renormalize = renormalize
        self._pack = WeightPack()

    def gemm_shapes(self) -> list[GemmShape | AttentionShape]:
        """The router logits, through its WeightPack (widened to fp32)."""
        return [GemmShape("router", *self.weight.shape)]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (topk_ids [T, k] int64, topk_weights [T, k] in x.dtype)."""
        routed = self._pack.route(x, (self.weight,), self.top_k, self.renormalize)
        if routed is not None:       # the C++ op: all of the below in one pass per row
            return routed
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._pack.linear(x, (self.weight,))                              # [T, E]
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                               cfg.norm_topk_prob)
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        return self.experts(x, ids, weights)                                       # [T, d]

    def lean_mlp(self, device: torch.device, dtype: torch.dtype) -> LeanMLP | None:
        """This block's forward as the two C++ ops it runs on the CPU (router, fused
        experts), with the arguments `forward` would pass for inputs on `device` in `dtype`;
        None where `forward` would run anything else (models/lean_decode.py)."""
        gate, experts = self.gate, self.experts
        if hooked(self, gate, experts) or torch.is_grad_enabled():
            return None
        router = gate._pack.gemm_pack((gate.weight,), (None,), dtype)
        fused = experts.fused_op(device, dtype)
        invariant = experts.invariant_fn(device, dtype)     # --batch-invariant's expert path
        if router is None or (fused is None and invariant is None):
            return None
        packed, _, num_experts = router
        top_k, renormalize = gate.top_k, gate.renormalize
        ops = torch.ops.wideserve
        brgemm = gate._pack.route_brgemm       # the logits' kernel per row count

        def mlp(x: torch.Tensor) -> torch.Tensor:
            ids, weights = ops.moe_route(x, packed, num_experts, top_k, renormalize, False,
                                         brgemm(x.shape[0]))
            if invariant is not None:
                return invariant(x, ids, weights)
            return fused(x, ids, weights)
        return mlp


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    config_class = Qwen3MoeConfig

    def __init__(self, config: Qwen3MoeConfig, attention_backend: str | None = None) -> None:
        super().__init__(config, attention_backend)
        # Per-expert checkpoint slices seen so far, per fused parameter: a parameter counts as
        # loaded once all of its slices arrived (possibly over several load_weights calls).
        self._expert_slices: dict[str, set[tuple[int, str]]] = {}

    def _make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        if c.is_moe_layer(layer_idx):
            return SparseMoeBlock(c)
        return DenseMLP(c.hidden_size, c.intermediate_size, c.hidden_act)

    def compile_forward(self) -> bool:
        # Pick each expert layer's implementation now, eagerly (it probes the build), so
        # the traced forward only reads the choice.
        for m in self.modules():
            if isinstance(m, RoutedExperts):
                m.resolved_impl(m.down_proj.device, m.down_proj.dtype)
        return super().compile_forward()

    def decode_capturable(self, device: torch.device) -> bool:
        """The dense decoder's condition, and every routed-expert layer on "grouped_mm" (no
        host sync: layers/experts.py), with no expert-parallel dispatcher or one whose decode
        exchange is capturable (the padded one: layers/ep_dispatch.py)."""
        return super().decode_capturable(device) and all(
            (m.ep is None or m.ep.capturable)
            and m.resolved_impl(device, m.down_proj.dtype) == "grouped_mm"
            for m in self.modules() if isinstance(m, RoutedExperts))

    def param_counts(self) -> tuple[int, int]:
        total = sum(p.numel() for p in self.parameters())
        c = self.config
        routed = 0
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                experts = layer.mlp.experts
                routed += experts.gate_up_proj.numel() + experts.down_proj.numel()
        active_routed = routed * c.num_experts_per_tok // max(c.num_experts, 1)
        return total, total - routed + active_routed

    def _load_special(self, name: str, tensor: torch.Tensor,
                      params: dict[str, nn.Parameter]) -> str | None:
        m = _PER_EXPERT.match(name)
        if m is None:
            return None
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        target = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r}: layer has no routed experts")
        param = params[target]
        if not 0 <= expert < param.shape[0]:
            raise ValueError(f"checkpoint tensor {name!r}: expert {expert} out of range "
                             f"[0, {param.shape[0]})")
        inter = self.config.moe_intermediate_size
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter),
                "down_proj": slice(None)}[proj]
        _copy_checked(param[expert, rows], tensor, name)
        seen = self._expert_slices.setdefault(target, set())
        seen.add((expert, proj))
        parts = 1 if proj == "down_proj" else 2
        return target if len(seen) == parts * param.shape[0] else ""
