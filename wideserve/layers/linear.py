"""Linear projections through weights prepared once for the device's GEMM (docs/cpu_kernels.md).

Two preparations, both derived copies of the module's own parameters (which stay what the
loaders, the state dict and EPLB see):
- fusion: several projections of the same input (q/k/v, gate/up) become one GEMM over their
  weights concatenated on the output axis, one call instead of three;
- packing (CPU, bf16): which GEMM kernel runs is chosen per token-count bucket by measurement
  on this machine (wideserve/kernels/choice.py: the extension's AVX512-BF16 micro-kernel,
  brgemm on AMX/AVX512 over the same packed copy, oneDNN on its own packed copy, or plain
  F.linear), and the weight is held in the layouts the chosen kernels read - one, wherever a
  single layout serves every bucket within 10% of the fastest.
`WeightPack` rebuilds its copy whenever a source changes storage (`.data = ...`, `.to()`) or is
written in place through its version counter (`copy_` by a loader), or torch's thread count
changes (the choice is per thread count). Writes through `.data` bypass the version counter:
whoever does that calls `invalidate()` (EPLB does).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from wideserve.kernels import gemm
from wideserve.kernels.loader import cpu_ops_available
from wideserve.kernels.choice import (BUCKETS, KernelChoice, bucket_of, default_choice,
                                      onednn_runs, packed_linear, prepack)

__all__ = ["WeightPack", "GemmCall", "InvariantLinear", "FunctionalLinear", "use_invariant_linears",
           "packed_linear", "prepack", "packing_runs",
           "cpu_kernel_runs", "weights_fingerprint"]

# Dtypes packed at all on the CPU (bf16: fp32 GEMMs already run MKL's packed-free path well).
PACKED_DTYPES = (torch.bfloat16,)


def cpu_kernel_runs(dtype: torch.dtype, enabled: bool = True) -> bool:
    """Whether the extension's bf16 GEMM kernels (micro-kernel, brgemm) can run for `dtype`;
    enabled: the pack's switch (WeightPack.cpu_kernel)."""
    return enabled and dtype in PACKED_DTYPES and gemm.fast_path_compiled()


@functools.cache
def packing_runs(dtype: torch.dtype) -> bool:
    """Whether this build packs and runs oneDNN linear weights of `dtype` on the CPU."""
    return dtype in PACKED_DTYPES and onednn_runs(dtype)


def tensor_version(t: torch.Tensor) -> int:
    """In-place writes so far; inference tensors keep no version counter (and cannot be
    written outside inference mode)."""
    return 0 if t.is_inference() else t._version


def weights_fingerprint(tensors: tuple[torch.Tensor | None, ...]) -> tuple:
    # A list comprehension: this runs for every prepared linear of every step.
    return tuple([None if t is None else
                  (t.data_ptr(), tensor_version(t), t.dtype, t.device, t.shape)
                  for t in tensors])


# --- the kernels, one signature: (x [M, K] 2-D, weight, bias, out features, widen) -> y ---

def _micro(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int,
           widen: bool) -> torch.Tensor:
    return torch.ops.wideserve.gemm_linear(x, w, n, b, widen, False)


def _brgemm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int,
            widen: bool) -> torch.Tensor:
    return torch.ops.wideserve.gemm_linear_brgemm(x, w, n, b, widen)


def _onednn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int,
            widen: bool) -> torch.Tensor:
    y = x.new_empty(0, n) if x.shape[0] == 0 else packed_linear(x.contiguous(), w, b)
    return y.float() if widen else y


def _torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, n: int,
           widen: bool) -> torch.Tensor:
    y = F.linear(x, w, b)
    return y.float() if widen else y


KERNEL_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "micro": _micro, "brgemm": _brgemm, "onednn": _onednn, "torch": _torch}


class GemmCall(NamedTuple):
    """One bucket's GEMM: fn(x, weight, bias, out, widen) -> x @ W^T + bias."""

    kernel: str
    fn: Callable[..., torch.Tensor]
    weight: torch.Tensor
    bias: torch.Tensor | None
    out: int

    def __call__(self, x: torch.Tensor, widen: bool = False) -> torch.Tensor:
        return self.fn(x, self.weight, self.bias, self.out, widen)


# The layout each packed kernel reads (the others read the weight as loaded).
_LAYOUT = {"micro": "panel", "brgemm": "panel", "onednn": "onednn"}


class WeightPack:
    """The prepared copy of one or more [out_i, in] weights (and biases), concatenated on
    the output axis in the order given, and the GEMM per token-count bucket. Not a module: it
    holds no parameters of its own. `choice`: the kernel table (default: the process's).
    cpu_kernel: False takes the extension's kernels (micro, brgemm) off the table (A/B runs,
    tests/cuda_paths.py; the policy, KernelPolicy / WIDESERVE_GEMM, is the way to force a
    kernel); set per model from the engine's KernelConfig (CausalLM.apply_kernel_config).
    batch_invariant (KernelConfig.batch_invariant): one row-invariant kernel (choice.
    INVARIANT_KERNELS) for every token count, fp32 weights too (F.linear's MKL path rounds a
    row differently at 1-5 rows than in a larger call), so a row's result never depends on
    the rows beside it."""

    __slots__ = ("_key", "_calls", "_plain", "_choice", "_out", "cpu_kernel", "batch_invariant")

    def __init__(self, choice: KernelChoice | None = None, cpu_kernel: bool = True,
                 batch_invariant: bool = False) -> None:
        self._choice = choice
        self.cpu_kernel = cpu_kernel
        self.batch_invariant = batch_invariant
        self.invalidate()

    def invalidate(self) -> None:
        self._key: tuple | None = None
        self._calls: tuple[GemmCall, ...] = ()
        self._plain = True
        self._out = 0

    @property
    def kind(self) -> str:
        """"gemm" (the extension's packed layout is held), "onednn" (only oneDNN's) or
        "plain" (the weight as loaded, F.linear)."""
        kernels = self.kernels
        if any(k in ("micro", "brgemm") for k in kernels):
            return "gemm"
        return "onednn" if "onednn" in kernels else "plain"

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernel per bucket (choice.BUCKETS) of the last preparation."""
        return tuple(c.kernel for c in self._calls)

    def _prepare(self, weights: tuple[torch.Tensor, ...],
                 biases: tuple[torch.Tensor | None, ...], family: str) -> None:
        key = (weights_fingerprint(weights + biases), family, torch.get_num_threads(),
               self.cpu_kernel, self.batch_invariant)
        if key == self._key:
            return
        w = weights[0].detach() if len(weights) == 1 else torch.cat([t.detach() for t in weights])
        b = None
        if any(t is not None for t in biases):
            b = torch.cat([torch.zeros(t.shape[0], dtype=w.dtype, device=w.device)
                           if bi is None else bi.detach() for t, bi in zip(weights, biases)])
        plan = ("torch",) * len(BUCKETS)
        allowed: tuple[str, ...] = ()
        if w.device.type == "cpu" and w.dtype in PACKED_DTYPES:
            ext = cpu_kernel_runs(w.dtype, self.cpu_kernel)
            allowed = tuple(k for k, ok in (("micro", ext), ("brgemm", ext),
                                            ("onednn", packing_runs(w.dtype)),
                                            ("torch", family != "router")) if ok)
        if set(allowed) - {"torch"}:        # something to choose (no probe otherwise)
            choice = self._choice or default_choice()
            mode = {"invariant": True} if self.batch_invariant else {}
            plan = tuple(k or "torch" for k in choice.plan(family, w.shape[0], w.shape[1],
                                                            w.dtype, allowed, **mode))
        elif self.batch_invariant and w.device.type == "cpu" and w.dtype == torch.float32 \
                and self.cpu_kernel and cpu_ops_available():
            plan = ("micro",) * len(BUCKETS)    # its fp32 loop: one order for every row
        # The same weights re-planned (another thread count: utils/thread_governor.py) keep
        # the layouts already packed; only a layout the new plan adds is built.
        held = {_LAYOUT[c.kernel]: c.weight for c in self._calls if c.kernel in _LAYOUT} \
            if self._key is not None and self._key[0] == key[0] else {}
        layouts: dict[str, torch.Tensor] = {}
        if "micro" in plan or "brgemm" in plan:
            layouts["panel"] = held["panel"] if "panel" in held else gemm.pack_linear(w)
        if "onednn" in plan:
            layouts["onednn"] = held["onednn"] if "onednn" in held else prepack(w)
        self._calls = tuple(GemmCall(k, KERNEL_FNS[k], layouts[_LAYOUT[k]] if k in _LAYOUT
                                     else w, b, w.shape[0]) for k in plan)
        self._plain = plan == ("torch",) * len(BUCKETS)
        self._out = w.shape[0]
        self._key = key

    def gemm_call(self, weights: tuple[torch.Tensor, ...],
                  biases: tuple[torch.Tensor | None, ...], dtype: torch.dtype,
                  rows: int) -> GemmCall | None:
        """The GEMM `linear` runs for a CPU input of `dtype` with `rows` rows, prepared as
        `linear` prepares it; None where `linear` would not run a packed kernel
        (models/lean_decode.py calls it directly)."""
        self._prepare(weights, biases, "qkv" if len(weights) > 1 else "linear")
        call = self._calls[bucket_of(rows)]
        if self._plain or call.weight.dtype != dtype:
            return None
        return call

    def gemm_pack(self, weights: tuple[torch.Tensor, ...],
                  biases: tuple[torch.Tensor | None, ...], dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
        """(weight in the extension's packed layout, bias, out features) for a router's
        `moe_route` (family "router"), prepared as `route` prepares it; None where `route`
        would not run the op (models/qwen3_moe/model.py)."""
        self._prepare(weights, biases, "router")
        call = next((c for c in self._calls if c.kernel in ("micro", "brgemm")), None)
        if call is None or call.weight.dtype != dtype:
            return None
        return call.weight, call.bias, call.out

    def route_brgemm(self, rows: int) -> bool:
        """Whether `moe_route` computes the logits of `rows` rows through brgemm (the router
        family's choice; after `gemm_pack` or `route` prepared the pack)."""
        return self._calls[bucket_of(rows)].kernel == "brgemm"

    def linear(self, x: torch.Tensor, weights: tuple[torch.Tensor, ...],
               biases: tuple[torch.Tensor | None, ...] | None = None,
               widen: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., sum(out_i)], the same as F.linear over the concatenation;
        `widen`: returned as fp32 (the same values, F.linear(...).float(); one pass on the
        C++ paths)."""
        if torch.compiler.is_compiling():
            # Inside a compiled graph the compiler picks the GEMM and fuses the concatenation;
            # the parameters are graph inputs (they may change), never constants.
            biases = biases or (None,) * len(weights)
            ys = [F.linear(x, w, b) for w, b in zip(weights, biases)]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
            return y.float() if widen else y
        self._prepare(weights, biases or (None,) * len(weights),
                      "qkv" if len(weights) > 1 else "linear")
        x2 = x.reshape(-1, x.shape[-1])
        call = self._calls[bucket_of(x2.shape[0])]
        if not self._plain and x.dtype == call.weight.dtype and x.device.type == "cpu":
            y = call.fn(x2, call.weight, call.bias, call.out, widen)
            return y.view(*x.shape[:-1], y.shape[-1])
        if not self._plain:      # an input of another dtype: the plain path on the sources
            y = F.linear(x, torch.cat(weights) if len(weights) > 1 else weights[0], call.bias)
        else:
            y = F.linear(x, call.weight, call.bias)
        return y.float() if widen and y.dtype != torch.float32 else y

    def route(self, x: torch.Tensor, weights: tuple[torch.Tensor], top_k: int,
              renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A softmax top-k router over the projection `weights` (one [E, in] weight) in one
        C++ op, where the extension's kernels apply: (ids [T, k] int64, weights [T, k] in
        x.dtype) as the torch router computes them; None where they do not (the caller runs
        the torch path)."""
        if torch.compiler.is_compiling() or x.device.type != "cpu":
            return None
        if torch.is_grad_enabled() and (x.requires_grad or weights[0].requires_grad):
            return None
        packed = self.gemm_pack(weights, (None,), x.dtype)
        if packed is None or x.dim() != 2:
            return None
        return gemm.route(x, packed[0], packed[2], top_k, renormalize,
                          brgemm=self.route_brgemm(x.shape[0]))


def _packable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether an invariant WeightPack runs `x @ w^T` (what F.linear would): a CPU input of
    the weight's dtype (bf16 or fp32), outside autograd (the packed kernels have no
    backward)."""
    return (x.device.type == "cpu" and x.dtype == w.dtype and w.dim() == 2
            and x.dtype in (torch.bfloat16, torch.float32) and x.shape[-1] > 0
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)))


class InvariantLinear(nn.Linear):
    """An `nn.Linear` under --batch-invariant (KernelConfig.batch_invariant) in a model whose
    projections are plain modules (DeepSeek-V4/V4.1): its forward runs through a WeightPack
    in invariant mode (one row-invariant kernel for every row count; oneDNN's and MKL's
    GEMMs round a row differently depending on how many rows share the call, tests/kernels/
    test_batch_invariant_kernels.py). Made from an nn.Linear in place by
    `use_invariant_linears`, chosen once at load: the module keeps its parameters, names,
    hooks and every reference to it (a class swap, as torch.nn.utils.parametrize does)."""

    _pack: WeightPack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _packable(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return self._pack.linear(x, (self.weight,), (self.bias,))


def use_invariant_linears(model: nn.Module, on: bool,
                          choice: KernelChoice | None = None) -> None:
    """Turn every plain `nn.Linear` of `model` into an InvariantLinear (on) or back (off);
    CausalLM.apply_kernel_config calls it with KernelConfig.batch_invariant."""
    for m in model.modules():
        if on and type(m) is nn.Linear:
            m.__class__ = InvariantLinear
            m._pack = WeightPack(choice, batch_invariant=True)
        elif not on and type(m) is InvariantLinear:
            m.__class__ = nn.Linear
            del m._pack


# ATen's CPU elementwise loops run vector code over whole groups of two vectors and scalar code
# on the rest of the flat buffer; a transcendental (the exp in sigmoid and softplus) rounds
# differently in the two, so an element's bits followed where its row fell in the step (the last
# rows of a [T, k] tensor with k a few experts or mHC streams take the scalar code). With each row
# padded to a multiple of this (2 x 16 fp32 lanes on AVX-512, twice that spare), none does.
LANE_ROW = 64


def lane_aligned(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor,
                 invariant: bool) -> torch.Tensor:
    """fn(z) for an elementwise fn over z [..., k]; `invariant` (--batch-invariant, on the
    CPU): computed on rows padded to LANE_ROW elements, so every element takes ATen's vector
    code whatever the number of rows (one thread per engine: a split over threads can still
    cut a group)."""
    k = z.shape[-1]
    if not invariant or z.device.type != "cpu" or k % LANE_ROW == 0:
        return fn(z)
    return fn(F.pad(z, (0, -k % LANE_ROW)))[..., :k]


class FunctionalLinear:
    """The GEMM of a functional call site: a module's product with a weight it does not
    hold as an nn.Linear, often widened to fp32 per call (mHC's mixes `x @ fn.float()^T`,
    an fp32 router, DSpark's draft logits over the target's LM head). `F.linear` by default;
    under --batch-invariant (`batch_invariant`, set by CausalLM.apply_kernel_config like a
    WeightPack's) through a WeightPack in invariant mode, where the fp32 copy of a bf16
    weight is made once per version of the weight (a copy per call would be a new tensor,
    so packed again on every call), like WeightPack's fingerprint. One weight per site."""

    __slots__ = ("batch_invariant", "cpu_kernel", "_choice", "_pack", "_wide")

    def __init__(self, choice: KernelChoice | None = None) -> None:
        self._choice = choice           # the kernel table (default: the process's)
        self.batch_invariant = False
        self.cpu_kernel = True
        self._pack: WeightPack | None = None
        self._wide: tuple[tuple, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor,
                 widen_weight: bool = False) -> torch.Tensor:
        """x [..., in] @ weight^T; widen_weight: against `weight.float()` (x fp32)."""
        if not self.batch_invariant or torch.compiler.is_compiling():
            return F.linear(x, weight.float() if widen_weight else weight)
        w = self._widened(weight) if widen_weight and weight.dtype != torch.float32 else weight
        if not _packable(x, w):
            return F.linear(x, w)
        if self._pack is None or self._pack.cpu_kernel != self.cpu_kernel:
            self._pack = WeightPack(self._choice, self.cpu_kernel, batch_invariant=True)
        return self._pack.linear(x, (w,))

    def _widened(self, p: torch.Tensor) -> torch.Tensor:
        key = weights_fingerprint((p,))
        if self._wide is None or self._wide[0] != key:
            self._wide = (key, p.detach().float())
            if self._pack is not None:     # a new copy may reuse the old one's address
                self._pack.invalidate()
        return self._wide[1]
