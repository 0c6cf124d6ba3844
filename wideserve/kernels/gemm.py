"""Small-M GEMMs on the CPU (`csrc/linear.cpp`, micro-kernel `csrc/gemm.h`): weight packing
and the calls (docs/cpu_kernels.md, "Linear layers").

`pack_panels` lays an [N, K] weight (or a stack [E, N, K]) out once for the micro-kernel: cut
into groups of g blocks of 16 output rows, each group stored as [K/P, g, 16, P] (P = 2 bf16
inputs per 32-bit lane for `vdpbf16ps`, 1 for fp32), zero-padded to whole groups and pairs, so
a register tile reads its group as one sequential stream. The packed copy is derived state:
callers rebuild it when the source changes (layers/linear.py `WeightPack`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from wideserve.kernels.loader import cpu_ops_available

LANES = 16
DTYPES = (torch.bfloat16, torch.float32)


def pair_width(dtype: torch.dtype) -> int:
    return 2 if dtype == torch.bfloat16 else 1


def pack_panels(w: torch.Tensor, group: int) -> torch.Tensor:
    """[E, N, K] -> [E, ceil(N / 16g), ceil(K/P), g, 16, P] (g = group blocks), zero-padded;
    a 2-D [N, K] weight gives the same without the leading E."""
    if w.dim() == 2:
        return pack_panels(w[None], group)[0]
    pair = pair_width(w.dtype)
    E, N, K = w.shape
    with torch.no_grad():
        w = F.pad(w.detach(), (0, -K % pair, 0, -N % (LANES * group)))
        groups, kp = w.shape[1] // (LANES * group), w.shape[2] // pair
        return w.reshape(E, groups, group, LANES, kp, pair).permute(0, 1, 4, 2, 3,
                                                                    5).contiguous()


def linear_group(out_features: int) -> int:
    """Blocks of 16 outputs per packed group: 4 (a 6 x 64 register tile), fewer for N <= 32
    so a router's 8 or 16 logits do not pay for 64."""
    return 1 if out_features <= LANES else 2 if out_features <= 2 * LANES else 4


def pack_linear(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the packed layout `linear` / `route` take."""
    return pack_panels(w, linear_group(w.shape[0]))


def fast_path_compiled() -> bool:
    """Whether the AVX512-BF16 micro-kernel was compiled on this machine (else portable C++)."""
    return cpu_ops_available() and bool(torch.ops.wideserve.moe_fast_path_compiled())


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None, widen: bool = False,
           portable: bool = False) -> torch.Tensor:
    """x [M, K] -> x @ W^T + bias [M, N] in x.dtype, accumulated in fp32 and rounded once;
    `widen`: the same values returned as fp32 (F.linear(x, W, b).float() in one pass)."""
    return torch.ops.wideserve.gemm_linear(x, packed, out_features, bias, widen, portable)


@torch.compiler.disable
def route(x: torch.Tensor, packed: torch.Tensor, experts: int, top_k: int,
          renormalize: bool, portable: bool = False,
          brgemm: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router in one op: logits (rounded to x.dtype; through brgemm where
    `brgemm`, bf16), fp32 softmax, top-k, optional renormalisation -> (ids [T, k] int64,
    weights [T, k] in x.dtype)."""
    return torch.ops.wideserve.moe_route(x, packed, experts, top_k, renormalize, portable,
                                         brgemm)


@torch.compiler.disable
def linear_brgemm(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None, widen: bool = False) -> torch.Tensor:
    """`linear` through torch's brgemm (oneDNN's ukernel: AMX where present) on the same
    packed weight, bf16 only (csrc/brgemm.cpp)."""
    return torch.ops.wideserve.gemm_linear_brgemm(x, packed, out_features, bias, widen)
