"""The GEMM kernel table for a model's shapes (wideserve/kernels/choice.py): which kernel each
of its GEMM families runs per token bucket on this machine, with the measured times, for
`wideserve info --kernels` and the server's startup log."""
from __future__ import annotations

from typing import Iterator, Protocol

import torch
from torch import nn

from wideserve.kernels import describe
from wideserve.kernels.choice import KernelChoice, default_choice
from wideserve.layers.gemm_shapes import AttentionShape, DeclaresGemms, GemmShape


class TableModel(Protocol):
    """What the table reads of a model (models/interface.py CausalLM provides it)."""

    def modules(self) -> Iterator[nn.Module]: ...

    def tied_head_shape(self) -> tuple[int, int] | None: ...


def model_gemm_shapes(model: TableModel) -> list[GemmShape | AttentionShape]:
    """Every distinct GEMM (and paged attention) shape `model` runs: what its layers declare
    (layers/gemm_shapes.py: fused q/k/v and gate/up, routers, routed experts, GQA attention),
    every other nn.Linear as "linear", and a tied LM head."""
    shapes: dict[GemmShape | AttentionShape, None] = {}
    declared: set[int] = set()          # nn.Linear children a declaring layer runs itself
    for m in model.modules():
        if isinstance(m, DeclaresGemms):
            shapes.update(dict.fromkeys(m.gemm_shapes()))
            declared.update(id(c) for c in m.children() if isinstance(c, nn.Linear))
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m) not in declared:
            shapes[GemmShape("linear", m.out_features, m.in_features)] = None
    tied = model.tied_head_shape()          # a head that is the embedding: no nn.Linear
    if tied is not None:
        shapes[GemmShape("linear", *tied)] = None
    return list(shapes)


def _not_chosen(dtype: torch.dtype) -> str:
    return (f"GEMM kernel choice: {str(dtype).removeprefix('torch.')} weights run F.linear / "
            "the fused ops' portable loops (only bf16 is chosen by measurement)")


def plan_model(model: TableModel, dtype: torch.dtype, choice: KernelChoice) -> set[tuple[str, str]]:
    """Plan every GEMM shape of `model` (timing, once per machine, what the disk table lacks:
    what the first forward would otherwise time); returns them as (family, "NxK")."""
    wanted = set()
    for shape in model_gemm_shapes(model):
        if isinstance(shape, AttentionShape):
            for context in (False, True):      # fresh prefills; chunks after a context
                choice.plan_attention(shape.heads, shape.kv_heads, shape.head_dim, dtype,
                                      context)
                wanted.add(("attention_ctx" if context else shape.family, shape.label))
            continue
        choice.plan(shape.family, shape.n, shape.k, dtype, extra=shape.extra)
        wanted.add((shape.family, shape.label))
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
