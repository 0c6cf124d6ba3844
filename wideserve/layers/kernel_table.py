"""The GEMM kernel table for a model's shapes (wideserve/kernels/choice.py): which kernel each
of its GEMM families runs per token bucket on this machine, with the measured times, for
`wideserve info --kernels` and the server's startup log."""
from __future__ import annotations

from typing import Iterator, Protocol

import torch
from torch import nn

from wideserve.kernels import describe
from wideserve.kernels.choice import KernelChoice, default_choice
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.linear import WeightPack

_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class TableModel(Protocol):
    """What the table reads of a model (models/interface.py CausalLM provides it)."""

    def modules(self) -> Iterator[nn.Module]: ...

    def tied_head_shape(self) -> tuple[int, int] | None: ...


def model_gemm_shapes(model: TableModel) -> list[tuple[str, int, int]]:
    """(family, N, K) of every distinct packed GEMM `model` runs: fused q/k/v and gate/up
    ("qkv"), routers whose logits go through a WeightPack ("router"), the routed experts
    (N = intermediate, K = hidden), the other linears and an LM head ("linear"); and the
    paged GQA attention layers ("attention": N = heads, K = kv heads * 100000 + head dim)."""
    shapes: dict[tuple[str, int, int], None] = {}
    fused: set[int] = set()
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            shapes[("experts", m.down_proj.shape[2], m.down_proj.shape[1])] = None
            continue
        for names in _FUSED:
            parts = [getattr(m, n, None) for n in names]
            if all(isinstance(p, nn.Linear) for p in parts):
                shapes[("qkv", sum(p.out_features for p in parts), parts[0].in_features)] = None
                fused.update(id(p) for p in parts)
        if all(isinstance(getattr(m, a, None), int)
               for a in ("num_heads", "num_kv_heads", "head_dim")) and hasattr(m, "backend"):
            shapes[("attention", m.num_heads, m.num_kv_heads * 100000 + m.head_dim)] = None
        weight = getattr(m, "weight", None)
        if isinstance(getattr(m, "_pack", None), WeightPack) and weight is not None:
            shapes[("router", weight.shape[0], weight.shape[1])] = None
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in fused:
            shapes[("linear", m.out_features, m.in_features)] = None
    tied = model.tied_head_shape()          # a head that is the embedding: no nn.Linear
    if tied is not None:
        shapes[("linear", *tied)] = None
    return list(shapes)


def _not_chosen(dtype: torch.dtype) -> str:
    return (f"GEMM kernel choice: {str(dtype).removeprefix('torch.')} weights run F.linear / "
            "the fused ops' portable loops (only bf16 is chosen by measurement)")


def plan_model(model: TableModel, dtype: torch.dtype, choice: KernelChoice) -> set[tuple[str, str]]:
    """Plan every GEMM shape of `model` (timing, once per machine, what the disk table lacks:
    what the first forward would otherwise time); returns them as (family, "NxK")."""
    wanted = set()
    for family, n, k in model_gemm_shapes(model):
        if family == "attention":       # (heads, kv heads * 100000 + head dim)
            kv, hd = divmod(k, 100000)
            for context in (False, True):      # fresh prefills; chunks after a context
                choice.plan_attention(n, kv, hd, dtype, context)
                wanted.add(("attention_ctx" if context else family, f"{n}x{kv}x{hd}"))
        else:
            choice.plan(family, n, k, dtype)
            wanted.add((family, f"{n}x{k}"))
    return wanted


def kernel_table_lines(model: TableModel, dtype: torch.dtype,
                       choice: KernelChoice | None = None) -> list[str]:
    """The kernel per family and bucket for `model`'s shapes in `dtype`, every candidate's
    time (`wideserve info --kernels`), as text lines."""
    choice = choice or default_choice()
    if dtype != torch.bfloat16:
        return [_not_chosen(dtype)]
    wanted = {shape for _, shape in plan_model(model, dtype, choice)}
    return [line for line in choice.describe()
            if not line.startswith("  ") or line.split()[1] in wanted]


def kernel_summary(model: TableModel, dtype: torch.dtype, device: str,
                   choice: KernelChoice | None = None) -> list[str]:
    """The kernels of a loaded model in a few lines (the server's startup block): the build
    serving `device`, then the kernel per token bucket for each of the model's shapes and its
    measured time."""
    lines = [describe(device)]
    if not device.startswith("cpu"):
        return lines
    if dtype != torch.bfloat16:
        return lines + [_not_chosen(dtype)]
    choice = choice or default_choice()
    return lines + choice.summary(plan_model(model, dtype, choice))
