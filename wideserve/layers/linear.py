"""Linear projections through weights prepared once for the device's GEMM (docs/cpu_kernels.md).

Two preparations, both derived copies of the module's own parameters (which stay what the
loaders, the state dict and EPLB see):
- fusion: several projections of the same input (q/k/v, gate/up) become one GEMM over their
  weights concatenated on the output axis, one call instead of three;
- packing (CPU, bf16): a plain `F.linear` in bf16 re-lays its weight out on every call; a
  weight packed once does not. Where the C++ extension's AVX512-BF16 micro-kernel is compiled
  the weight is packed for it (wideserve/kernels/gemm.py: `gemm_linear`, the same kernel the
  fused experts run); it matches oneDNN at large batches and wins at decode sizes and narrow
  outputs (a router's 8 logits: 2.6x), BENCHMARKS.md "Small-M GEMMs". Elsewhere the weight
  is packed for oneDNN (`torch.ops.mkldnn._reorder_linear_weight`), measured 1.2-1.7x faster
  than F.linear on this project's shapes (BENCHMARKS.md, "CPU kernels").
`WeightPack` rebuilds its copy whenever a source changes storage (`.data = ...`, `.to()`) or is
written in place through its version counter (`copy_` by a loader). Writes through `.data`
bypass the version counter: whoever does that calls `invalidate()` (EPLB does).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from wideserve.kernels import gemm

# Dtypes whose packed kernels were measured faster than F.linear on the CPU (bf16 with
# avx512_bf16; fp32 GEMMs already run MKL's packed-free path well, see BENCHMARKS.md).
PACKED_DTYPES = (torch.bfloat16,)
USE_CPU_KERNEL = True      # the C++ micro-kernel where it is compiled (False: oneDNN; A/B runs)


def cpu_kernel_runs(dtype: torch.dtype) -> bool:
    """Whether `WeightPack` packs `dtype` weights for the C++ GEMM micro-kernel (bf16, where
    its AVX512-BF16 path is compiled; without it the portable loop is slower than oneDNN)."""
    return USE_CPU_KERNEL and dtype in PACKED_DTYPES and gemm.fast_path_compiled()


@functools.cache
def packing_runs(dtype: torch.dtype) -> bool:
    """Whether this build packs and runs oneDNN linear weights of `dtype` on the CPU (a tiny
    probe checked against F.linear)."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 32, generator=g).to(dtype)
        x = torch.randn(3, 32, generator=g).to(dtype)
        got = packed_linear(x, prepack(w))
        return bool(torch.equal(got, F.linear(x, w)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> oneDNN's packed layout (only where packing_runs(dtype))."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a prepacked weight; x [N, in] contiguous, N >= 1."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def tensor_version(t: torch.Tensor) -> int:
    """In-place writes so far; inference tensors keep no version counter (and cannot be
    written outside inference mode)."""
    return 0 if t.is_inference() else t._version


def weights_fingerprint(tensors: tuple[torch.Tensor | None, ...]) -> tuple:
    # A list comprehension: this runs for every prepared linear of every step.
    return tuple([None if t is None else
                  (t.data_ptr(), tensor_version(t), t.dtype, t.device, t.shape)
                  for t in tensors])


class WeightPack:
    """The prepared copy of one or more [out_i, in] weights (and biases), concatenated on
    the output axis in the order given. Not a module: it holds no parameters of its own."""

    __slots__ = ("_key", "_weight", "_bias", "_kind", "_out")

    def __init__(self) -> None:
        self.invalidate()

    def invalidate(self) -> None:
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._kind = "plain"      # "gemm" (C++ micro-kernel), "onednn" (packed) or "plain"
        self._out = 0

    @property
    def kind(self) -> str:
        return self._kind

    def _prepare(self, weights: tuple[torch.Tensor, ...],
                 biases: tuple[torch.Tensor | None, ...]) -> None:
        key = weights_fingerprint(weights + biases)
        if key == self._key:
            return
        w = weights[0].detach() if len(weights) == 1 else torch.cat([t.detach() for t in weights])
        b = None
        if any(t is not None for t in biases):
            b = torch.cat([torch.zeros(t.shape[0], dtype=w.dtype, device=w.device)
                           if bi is None else bi.detach() for t, bi in zip(weights, biases)])
        cpu = w.device.type == "cpu"
        if cpu and cpu_kernel_runs(w.dtype):
            self._kind, self._weight = "gemm", gemm.pack_linear(w)
        elif cpu and packing_runs(w.dtype):
            self._kind, self._weight = "onednn", prepack(w)
        else:
            self._kind, self._weight = "plain", w
        self._bias = b
        self._out = w.shape[0]
        self._key = key

    def gemm_pack(self, weights: tuple[torch.Tensor, ...],
                  biases: tuple[torch.Tensor | None, ...], dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
        """(packed weight, fp32-able bias or None, out features) as `linear` hands them to the
        C++ micro-kernel for a CPU input of `dtype`, prepared as `linear` prepares them; None
        where `linear` would not run the kernel (models/lean_decode.py calls it directly)."""
        self._prepare(weights, biases)
        if self._kind != "gemm" or self._weight.dtype != dtype:
            return None
        return self._weight, self._bias, self._out

    def linear(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
               biases: tuple[torch.Tensor | None, ...] | None = None,
               widen: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., sum(out_i)], the same as F.linear over the concatenation;
        `widen`: returned as fp32 (the same values, F.linear(...).float(); one pass on the
        C++ path)."""
        if torch.compiler.is_compiling():
            # Inside a compiled graph the compiler picks the GEMM and fuses the concatenation;
            # the parameters are graph inputs (they may change), never constants.
            biases = biases or (None,) * len(weights)
            ys = [F.linear(x, w, b) for w, b in zip(weights, biases)]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
            return y.float() if widen else y
        self._prepare(weights, biases or (None,) * len(weights))
        if self._kind != "plain" and x.dtype == self._weight.dtype and x.device.type == "cpu":
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1])
            if self._kind == "gemm":
                y = gemm.linear(x2, self._weight, self._out, self._bias, widen)
            elif x2.shape[0] == 0:
                y = x.new_empty(0, self._out)
            else:
                y = packed_linear(x2.contiguous(), self._weight, self._bias)
            y = y.view(*lead, y.shape[-1])
        elif self._kind != "plain":   # an input of another dtype: the plain path on the sources
            y = F.linear(x, torch.cat(weights) if len(weights) > 1 else weights[0], self._bias)
        else:
            y = F.linear(x, self._weight, self._bias)
        return y.float() if widen and y.dtype != torch.float32 else y

    def route(self, x: torch.Tensor, weights: tuple[torch.Tensor], top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A softmax top-k router over the projection `weights` (one [E, in] weight) in one
        C++ op, where the micro-kernel path applies: (ids [T, k] int64, weights [T, k] in
        x.dtype) as the torch router computes them; None where it does not (the caller runs
        the torch path)."""
        if torch.compiler.is_compiling() or x.device.type != "cpu":
            return None
        if torch.is_grad_enabled() and (x.requires_grad or weights[0].requires_grad):
            return None
        self._prepare(weights, (None,))
        if self._kind != "gemm" or x.dtype != self._weight.dtype or x.dim() != 2:
            return None
        return gemm.route(x, self._weight, self._out, top_k, renormalize)
