"""RMS norms (computed in fp32, cast back).

`rms_norm` is the readable torch reference. `fast_rms_norm` / `add_rms_norm` are what the
decoder stack calls: on the CPU (fp32 / bf16, no autograd, not under torch.compile) they run
the C++ kernels of wideserve/kernels/csrc/norm.cpp, one pass per row instead of ~8 small torch
ops (docs/cpu_kernels.md, "Norms and greedy argmax"); elsewhere they are the reference.
"""
from __future__ import annotations

import torch
from torch import nn

from wideserve.kernels.loader import cpu_ops_available
from wideserve.layers.linear import tensor_version

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = xf * weight.float()
    return xf.to(dtype)


def cpu_kernel_applies(x: torch.Tensor, weight: torch.Tensor | None,
                       enabled: bool = True) -> bool:
    """Whether the C++ norm op may stand in for the torch path for this call; enabled: the
    caller's switch (RMSNorm.cpu_kernel; False: the torch path, for A/B runs and the CUDA-path
    tests). The cheap attribute checks first: this runs twice per layer of every step
    (docs/host_path.md)."""
    if not (enabled and x.is_cpu and x.dtype in KERNEL_DTYPES):
        return False
    if torch.is_grad_enabled() and (x.requires_grad
                                    or (weight is not None and weight.requires_grad)):
        return False       # no autograd formula: training keeps the torch path
    if torch.compiler.is_compiling():
        return False       # the ops have no fake kernels: a compiled graph keeps the torch path
    return cpu_ops_available()


def fast_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  kernel_weight: torch.Tensor | None = None) -> torch.Tensor:
    """rms_norm, by the C++ op where it applies; `kernel_weight`: the same weight in fp32
    (what the op computes with; else it converts `weight` on every call)."""
    if cpu_kernel_applies(x, weight):
        return torch.ops.wideserve.rms_norm(x, weight if kernel_weight is None else kernel_weight,
                                            eps)
    return rms_norm(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor | None,
                 eps: float, kernel_weight: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add and the next norm, fused on the CPU."""
    if delta.dtype == h.dtype and cpu_kernel_applies(h, weight) and not delta.requires_grad:
        return torch.ops.wideserve.add_rms_norm(
            h, delta, weight if kernel_weight is None else kernel_weight, eps)
    s = h + delta
    return s, rms_norm(s, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # The C++ ops on the CPU (False: the torch path); set per model from the engine's
        # KernelConfig (CausalLM.apply_kernel_config).
        self.cpu_kernel = True
        # derived: (source tensor, data_ptr, version, fp32 copy); see fp32_weight
        self._fp32: tuple[torch.Tensor, int, int, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def fp32_weight(self) -> torch.Tensor:
        """The weight in fp32 for the C++ ops, converted once (a bf16 weight cost a ~15 us
        conversion per call), rebuilt when the parameter changes: another tensor or storage
        (`.data = ...`, `.to()`) or an in-place write (its version counter), as
        layers/linear.py's WeightPack checks."""
        w = self.weight
        if w.dtype == torch.float32:
            return w
        c = self._fp32
        if c is None or c[0] is not w or c[1] != w.data_ptr() or c[2] != tensor_version(w):
            c = self._fp32 = (w, w.data_ptr(), tensor_version(w), w.detach().float())
        return c[3]

    def fast(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernel_applies(x, self.weight, self.cpu_kernel):
            return torch.ops.wideserve.rms_norm(x, self.fp32_weight(), self.eps)
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, h: torch.Tensor, delta: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """add_rms_norm with this norm's weight (one C++ pass on the CPU)."""
        if delta.dtype == h.dtype and not delta.requires_grad \
                and cpu_kernel_applies(h, self.weight, self.cpu_kernel):
            return torch.ops.wideserve.add_rms_norm(h, delta, self.fp32_weight(), self.eps)
        s = h + delta
        return s, rms_norm(s, self.weight, self.eps)

