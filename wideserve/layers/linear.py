"""Linear projections through weights prepared once for the device's GEMM (docs/cpu_kernels.md).

Two preparations, both derived copies of the module's own parameters (which stay what the
loaders, the state dict and EPLB see):
- fusion: several projections of the same input (q/k/v, gate/up) become one GEMM over their
  weights concatenated on the output axis, one call instead of three;
- packing (CPU, bf16): oneDNN's blocked weight layout (`torch.ops.mkldnn._reorder_linear_weight`).
  A plain `F.linear` in bf16 re-lays its weight out on every call; a packed one does not,
  measured 1.2-1.7x faster on this project's shapes (BENCHMARKS.md, "CPU kernels").
`WeightPack` rebuilds its copy whenever a source changes storage (`.data = ...`, `.to()`) or is
written in place through its version counter (`copy_` by a loader). Writes through `.data`
bypass the version counter: whoever does that calls `invalidate()` (EPLB does).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Dtypes whose packed kernels were measured faster than F.linear on the CPU (bf16 with
# avx512_bf16; fp32 GEMMs already run MKL's packed-free path well, see BENCHMARKS.md).
PACKED_DTYPES = (torch.bfloat16,)


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


def weights_fingerprint(tensors: tuple[torch.Tensor | None, ...]) -> tuple:
    # Inference tensors keep no version counter (and cannot be written outside inference mode).
    return tuple(None if t is None else
                 (t.data_ptr(), 0 if t.is_inference() else t._version, t.dtype, t.device, t.shape)
                 for t in tensors)


class WeightPack:
    """The prepared copy of one or more [out_i, in] weights (and biases), concatenated on
    the output axis in the order given. Not a module: it holds no parameters of its own."""

    __slots__ = ("_key", "_weight", "_bias", "_packed", "_out")

    def __init__(self) -> None:
        self.invalidate()

    def invalidate(self) -> None:
        self._key: tuple | None = None
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None
        self._packed = False
        self._out = 0

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
        self._packed = w.device.type == "cpu" and packing_runs(w.dtype)
        self._weight = prepack(w) if self._packed else w
        self._bias = b
        self._out = w.shape[0]
        self._key = key

    def linear(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
               biases: tuple[torch.Tensor | None, ...] | None = None) -> torch.Tensor:
        """x [..., in] -> [..., sum(out_i)], the same as F.linear over the concatenation."""
        if torch.compiler.is_compiling():
            # Inside a compiled graph the compiler picks the GEMM and fuses the concatenation;
            # the parameters are graph inputs (they may change), never constants.
            biases = biases or (None,) * len(weights)
            ys = [F.linear(x, w, b) for w, b in zip(weights, biases)]
            return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        self._prepare(weights, biases or (None,) * len(weights))
        if self._packed and x.dtype == self._weight.dtype and x.device.type == "cpu":
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1])
            if x2.shape[0] == 0:
                return x.new_empty(*lead, self._out)
            y = packed_linear(x2.contiguous(), self._weight, self._bias)
            return y.view(*lead, y.shape[-1])
        if self._packed:        # an input of another dtype: the plain path on the sources
            return F.linear(x, torch.cat(weights) if len(weights) > 1 else weights[0],
                            self._bias)
        return F.linear(x, self._weight, self._bias)

