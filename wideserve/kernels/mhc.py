"""The fused mHC site (`csrc/mhc.cpp`): coefficients, collapse and expand in one call each,
for the small-batch decode path (layers/mhc.py `HyperConnection.small_scope`;
docs/cpu_kernels.md, "Fused mHC"). The coefficients equal the torch form to fp32 rounding;
the collapse and V4.1's elementwise expand equal it bit for bit."""
from __future__ import annotations

import torch

from wideserve.kernels.loader import cpu_ops_available


def supports(x: torch.Tensor) -> bool:
    """Whether the ops run for streams x: a CPU tensor [T, n, d] in fp32 or bf16, no autograd,
    the extension built."""
    return (x.device.type == "cpu" and x.dim() == 3 and x.dtype in (torch.bfloat16,
                                                                     torch.float32)
            and not (torch.is_grad_enabled() and x.requires_grad) and cpu_ops_available())


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def coeffs(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, hc_eps: float, norm_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, n, d] -> pre [T, n], post [T, n], comb [T, n, n] (fp32; Sinkhorn applied)."""
    return torch.ops.wideserve.mhc_coeffs(x, fn, base, scale, iters, hc_eps, norm_eps)


@torch.compiler.disable
def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x [T, n, d], pre [T, n] -> sum_j pre_j x_j [T, d] in x's dtype."""
    return torch.ops.wideserve.mhc_collapse(x, pre)


@torch.compiler.disable
def expand(x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           y: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, d]: post_k y + sum_j comb[j, k] x_j, in x's dtype."""
    return torch.ops.wideserve.mhc_expand(x, post, comb, y)
