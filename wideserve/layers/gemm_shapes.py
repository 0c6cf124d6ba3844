"""What a layer declares about the GEMMs it runs, for the kernel choice (kernels/choice.py)
and its table (layers/kernel_table.py).

A layer that runs GEMMs through the chosen kernels (a `WeightPack`, the routed experts' fused
op) subclasses `DeclaresGemms` and lists them in `gemm_shapes()`: all of them, those of its own
`nn.Linear` children included (it packs their weights; q/k/v fused into one GEMM is one
shape). Any other `nn.Linear` is a plain "linear" GEMM of its own. The table walks a model's
modules and reads nothing else of them: no attribute names.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

GemmFamily = Literal["linear", "qkv", "router", "experts", "quant_experts"]


@dataclass(frozen=True, slots=True)
class GemmShape:
    """One GEMM: y [M, n] = x [M, k] @ W^T for any token count M. `family` picks the kernel
    candidates and the timing (kernels/choice.py FAMILY_KERNELS): "qkv" is a fused projection
    (q/k/v or gate/up), "router" widens its logits to fp32, "experts" is the routed experts'
    grouped GEMM (n = intermediate, k = hidden), "quant_experts" the same on weights kept in
    a checkpoint's format, `extra` naming the format (kernels/candidates.py quant_shape)."""

    family: GemmFamily
    n: int
    k: int
    extra: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        return "x".join(map(str, (self.n, self.k) + self.extra))


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """A paged GQA attention layer's shape (its kernel is chosen like a GEMM's)."""

    heads: int
    kv_heads: int
    head_dim: int

    family = "attention"

    @property
    def label(self) -> str:
        return f"{self.heads}x{self.kv_heads}x{self.head_dim}"


class DeclaresGemms(ABC):
    """A layer that runs its GEMMs through the chosen kernels (mixed into an nn.Module)."""

    @abstractmethod
    def gemm_shapes(self) -> list[GemmShape | AttentionShape]:
        """Every GEMM (and paged attention) this layer runs, its nn.Linear children's too."""
