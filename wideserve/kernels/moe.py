"""The fused routed-experts CPU op (`csrc/moe.cpp`): weight packing and the call.

`pack_experts` lays each expert's weights out for the kernel once (a derived copy, rebuilt by
`RoutedExperts` when the weights change): every [N, K] matrix is cut into groups of g blocks
of 16 output rows, each group stored as [K/P, g, 16, P] (P = 2 bf16 inputs per 32-bit lane for
`vdpbf16ps`, 1 for fp32) so a register tile streams it in order; up groups pair gate block j
with up block j so the SwiGLU of a block runs where it is produced. The intermediate width is
padded to 16 and the hidden one to 64 with zero weights (padded activations are exactly 0).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from wideserve.kernels.gemm import fast_path_compiled, pack_panels  # noqa: F401 (re-exported)

LANES = 16
DTYPES = (torch.bfloat16, torch.float32)


def pack_experts(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, d] (gate rows first), down [E, d, I] -> (w13, w2) for the op: w13 in
    groups (gate block j, up block j), w2 in groups of 4 blocks."""
    E, two_i, d = gate_up.shape
    inter = two_i // 2
    pad = -inter % LANES
    with torch.no_grad():
        gate, up = gate_up.detach().split(inter, dim=1)
        gate, up = F.pad(gate, (0, 0, 0, pad)), F.pad(up, (0, 0, 0, pad))
        ip = inter + pad
        blocks = torch.stack([gate.reshape(E, ip // LANES, LANES, d),
                              up.reshape(E, ip // LANES, LANES, d)], dim=2)
        w13 = pack_panels(blocks.reshape(E, 2 * ip, d), group=2)
        w2 = pack_panels(F.pad(down.detach(), (0, pad)), group=4)
    return w13, w2


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  w13: torch.Tensor, w2: torch.Tensor, intermediate: int,
                  limit: float | None, portable: bool = False,
                  expert_map: torch.Tensor | None = None,
                  expert_load: torch.Tensor | None = None,
                  brgemm_min_rows: int | None = None,
                  schedule: str | None = None) -> torch.Tensor:
    """x [T, d]; topk_ids [T, k] physical experts; topk_weights [T, k] -> [T, d] in x.dtype:
    sum_j w[t, j] * swiglu-MLP_{ids[t, j]}(x[t]), accumulated in fp32.
    expert_map [E, 1]: topk_ids are logical, mapped to their one physical slot in the op;
    expert_load [L] int64: incremented in place by the rows each physical expert received;
    brgemm_min_rows: experts with at least this many rows run their GEMMs through brgemm
    (bf16, not portable; None: none do);
    schedule: how the threads share the experts, "columns" (each a share of every expert's
    output columns) or "experts" (whole experts from a shared counter; bf16 on the
    AVX512-BF16 micro-kernel only), the same outputs bit for bit; None: the op's choice
    (csrc/moe_by_expert.h)."""
    return torch.ops.wideserve.moe_fused_experts(x, topk_ids, topk_weights, w13, w2,
                                                 intermediate, limit, portable, expert_map,
                                                 expert_load, brgemm_min_rows, schedule)
