"""Small-M GEMMs for plain `nn.Linear` modules, on the small-batch decode path only
(worker/small_batch.py; docs/host_path.md, "The small-batch decode path").

DeepSeek-V4 / V4.1 run their projections as plain `nn.Linear` modules
(`CausalLM.functional_gemms`): `F.linear`, which in bf16 on the CPU is oneDNN, ~60-80 us a
call at one row where the kernel table's small-M kernel (kernels/choice.py: the AVX512-BF16
micro-kernel) takes a few us, and a batch-1 V4 step makes ~50 of them (plus the grouped
output projection's bf16 `bmm`, as slow). `use_small_m_linears` turns those modules into
`SmallMLinear`s (a class swap, as layers/linear.py's InvariantLinear: parameters, names and
hooks kept) that, while their `GemmScope` is on (a small-batch step), run the kernel the
table chose for their row count over a packed copy of the weight, the call kept per row
count: no fingerprint per call, since weights do not change while serving (the path is off
with EPLB) and `SmallMLinear.forget` drops them. Outside a small step, and for inputs the
table does not pack (fp32, another device, autograd, no rows), they are plain `F.linear`.

Rounding: the same kernel the table runs for that many rows everywhere else; against the
standard path's oneDNN GEMM it differs in ~1 value in 10^4-10^5 by one bf16 ulp, which can
flip a greedy token on a near tie. That is the batch-size dependence docs/cpu_kernels.md
documents for the default mode (whose guarantee is fp32 greedy equality; fp32 inputs run
F.linear here), so the path uses them by default (LoadConfig.small_batch_gemms,
--no-small-batch-gemms to keep F.linear) and never under --batch-invariant.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from wideserve.layers.linear import FunctionalLinear, GemmCall, WeightPack


class GemmScope:
    """Whether the step running now is a small-batch step (what SmallMLinear reads)."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False


class SmallMLinear(nn.Linear):
    """An nn.Linear that, inside a small-batch step (`scope.on`), runs the kernel table's
    GEMM for its row count over a packed copy of its weight, kept per row count; F.linear
    otherwise. Made from an nn.Linear in place by `use_small_m_linears`."""

    _small_scope: GemmScope
    # its cpu_kernel is the GEMM switch (KernelConfig.cpu_gemm, set by apply_kernel_config
    # like every WeightPack's); the grouped GEMMs follow it too
    _small_pack: WeightPack
    _small_calls: dict[int, GemmCall | None]
    # grouped_linear: per row count, one GEMM per group of the weight's rows
    _small_groups: dict[tuple[int, int], list[GemmCall] | None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._small_scope.on:
            x2 = x.reshape(-1, x.shape[-1])
            rows = x2.shape[0]
            call = self._small_calls.get(rows, False)
            if call is False:
                call = self._small_calls[rows] = self._gemm(x2)
            if call is not None:
                y = call.fn(x2, call.weight, call.bias, call.out, False)
                return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, self.bias)

    def _runs(self, x2: torch.Tensor) -> bool:
        return x2.device.type == "cpu" and x2.shape[0] > 0 and not (
            torch.is_grad_enabled() and (x2.requires_grad or self.weight.requires_grad))

    def _gemm(self, x2: torch.Tensor) -> GemmCall | None:
        """The table's packed GEMM for x2's rows (WeightPack.gemm_call), or None where
        F.linear runs."""
        if not self._runs(x2):
            return None
        return self._small_pack.gemm_call((self.weight,), (self.bias,), x2.dtype, x2.shape[0])

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor | None:
        """x [g, T, in/g] times group i's block of rows of the weight ([g, out/g, in/g]) ->
        [g, T, out/g] (the bmm of a grouped projection: V4's o_a) through the kept small-M
        GEMMs, or None where the caller's bmm runs (not a small step, or not packed)."""
        if not self._small_scope.on or self.bias is not None:
            return None
        rows = x.shape[1]
        key = (groups, rows)
        calls = self._small_groups.get(key, False)
        if calls is False:
            calls = self._small_groups[key] = self._group_gemms(x[0], groups)
        if calls is None:
            return None
        return torch.stack([c.fn(x[i], c.weight, None, c.out, False)
                            for i, c in enumerate(calls)])

    def _group_gemms(self, x2: torch.Tensor, groups: int) -> list[GemmCall] | None:
        if not self._runs(x2):
            return None
        w = self.weight.view(groups, -1, x2.shape[-1])
        calls = [WeightPack(cpu_kernel=self._small_pack.cpu_kernel).gemm_call(
            (w[i],), (None,), x2.dtype, x2.shape[0]) for i in range(groups)]
        return None if any(c is None for c in calls) else calls

    def forget(self) -> None:
        """Drop the kept GEMMs and packed copies (rebuilt at the next small step)."""
        self._small_calls, self._small_groups = {}, {}
        self._small_pack = WeightPack(cpu_kernel=self._small_pack.cpu_kernel)


def grouped_linear(linear: nn.Linear, x: torch.Tensor, groups: int) -> torch.Tensor:
    """x [g, T, in/g] through `linear`'s weight split into g blocks of rows (block i for
    group i) -> [g, T, out/g]: one bmm, or the small-M GEMMs in a small-batch step."""
    if type(linear) is SmallMLinear:
        y = linear.grouped(x, groups)
        if y is not None:
            return y
    w = linear.weight.view(groups, -1, x.shape[-1])
    return torch.bmm(x, w.transpose(1, 2))


def use_small_m_linears(model: nn.Module, scope: GemmScope | None) -> list[SmallMLinear]:
    """Every plain nn.Linear of `model` becomes a SmallMLinear reading `scope` (None: back
    to nn.Linear). The packs follow the model's GEMM switch (KernelConfig.cpu_gemm, which
    CausalLM.apply_kernel_config set on its FunctionalLinears before this runs)."""
    if scope is None:
        for m in model.modules():
            if type(m) is SmallMLinear:
                m.__class__ = nn.Linear
                del m._small_scope, m._small_pack, m._small_calls, m._small_groups
        return []
    cpu_gemm = next((v.cpu_kernel for m in model.modules() for v in vars(m).values()
                     if isinstance(v, (WeightPack, FunctionalLinear))), True)
    swapped = []
    for m in model.modules():
        if type(m) in (nn.Linear, SmallMLinear):       # (a path enabled again: rebound)
            m.__class__ = SmallMLinear
            m._small_scope, m._small_pack = scope, WeightPack(cpu_kernel=cpu_gemm)
            m.forget()
            swapped.append(m)
    return swapped
