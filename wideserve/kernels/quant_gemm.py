"""Grouped expert GEMMs on checkpoint-format (FP8 / MXFP4 / NVFP4) weights: the C++ CPU op
(`csrc/quant_gemm.cpp`) that dequantises a tile of each expert's weight inside the kernel
(docs/cpu_kernels.md, "Quantised experts"). The formats and the torch fallback live in
wideserve/layers/quant.py; this module is only the call.
"""
from __future__ import annotations

import torch

from wideserve.kernels.loader import cpu_ops_available

# The op's format ids.
FMT_FP8 = 0
FMT_MXFP4 = 1
FMT_NVFP4 = 2
DTYPES = (torch.bfloat16, torch.float32)


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the op can run for inputs on `device` in `dtype`."""
    return device.type == "cpu" and dtype in DTYPES and cpu_ops_available()


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def grouped_linear(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                   fmt: int, block: tuple[int, int], halves: int,
                   brgemm_min_rows: int | None = None, portable: bool = False,
                   global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] rows sorted by expert, counts [L] rows per expert, w [L, R, Kb] codes (uint8),
    scale [L, Sr, Sc] (uint8 UE8M0 bytes, E4M3 bytes for NVFP4, or fp32 multipliers)
    -> [N, R] in x.dtype: each expert's rows times its dequantised weight transposed, fp32
    accumulation. `halves` = 2: gate and up halves of R have scale grids of their own
    (layers/quant.py, ExpertFormat). NVFP4: `global_scale` [L, halves] fp32. Experts with at
    least `brgemm_min_rows` rows run through brgemm (bf16; None: none do)."""
    return torch.ops.wideserve.quant_grouped_linear(x, counts, w, scale, fmt, block[0],
                                                    block[1], halves, brgemm_min_rows,
                                                    portable, global_scale)
