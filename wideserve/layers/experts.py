"""Routed experts: SwiGLU MLPs applied to the tokens routed to them.

Glossary: a *logical* expert is what the router picks (0..E-1); a *physical* expert is a slot
in the weight tensors (`num_local_experts` rows on this rank). `logical_to_physical` [E, W]
lists each logical expert's replicas (identity, W = 1, until expert parallelism / EPLB place
replicas; `replica_count` [E] says how many are valid) and the router's choice is spread over
them (`parallel/eplb/replicas.py`); `expert_load` counts routed rows per physical expert on
the device, without a host sync (a scatter into a fixed-size tensor, `count_rows`: bincount
sizes its output from the data), for EPLB and the load-skew reports.

Fused path (docs/moe.md): the T*k (token, expert) rows are sorted by physical expert, both
projections run as grouped GEMMs over the contiguous per-expert segments, and the rows are
weighted and summed back per token. Three implementations of the grouped SwiGLU MLP, picked
per device and dtype (`EXPERT_IMPLS`, chosen by measurement in BENCHMARKS.md, "Routed experts"):
- "grouped_mm": torch._grouped_mm with per-expert row offsets (a cumsum of the counts): no
  host sync, no data-dependent shape, CUDA-graph capturable (docs/cuda_graphs.md).
- "padded": one bmm over experts padded to the largest segment (one host read of its size).
- "packed": one matmul pair per non-empty expert through weights prepacked for oneDNN
  (layers/linear.py), the default on the CPU where packing runs for the dtype (bf16): the
  plain kernels re-lay every expert's weight out on each call. Its host read of the counts
  costs nothing on the CPU; it holds a second, packed copy of the expert weights.
- "fused": the C++ CPU op (wideserve/kernels/csrc/moe.cpp): gather, both GEMMs, SwiGLU and the
  weighted sum per token in one call over weights prepacked for it (AVX512-BF16 where the
  build has it); the CPU default in bf16 where that fast path is compiled. No sort, no
  per-expert Python, no host read. Each expert's GEMMs run on the micro-kernel or, from the
  row count the kernel choice measured brgemm faster at (wideserve/kernels/choice.py,
  family "experts"), on brgemm (AMX where present) over the same packed weights. With
  KernelConfig.lossless_experts (`--lossless-experts`, bf16 on AMX) the packs are held in
  a lossless 12-bit form instead (kernels/lossless.py: 3/4 of the bytes a decode step
  streams, decoded in the op; outputs equal brgemm's on the bf16 packs bit for bit).
- "loop": one matmul pair per non-empty expert (one host read of the counts): the readable
  reference the others are tested against.
- "quant": experts kept in the checkpoint's format (`keep_checkpoint_format`: FP8 block-scaled
  codes with UE8M0 or fp32 scales, MXFP4 codes with UE8M0 scales, NVFP4 codes with E4M3 scales
  and fp32 global scales; layers/quant.py ExpertFormat; no dense copy exists).
  Rows are sorted as above and both projections run as grouped GEMMs that dequantise a tile of
  each expert's weight inside the kernel (kernels/quant_gemm.py, C++ on the CPU); elsewhere
  (CUDA, no compiler) FP8 goes through torch._scaled_mm where the device has it, else each
  expert with rows is dequantised per call and dropped (layers/quant.py).
With expert parallelism, `ep` (default None) is the dispatcher that moves rows to the ranks
owning their experts and calls `grouped_mlp` there.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from wideserve.parallel.eplb.replicas import count_rows, map_to_physical
from wideserve.kernels import lossless
from wideserve.kernels import moe as moe_op
from wideserve.kernels import quant_gemm
from wideserve.kernels.candidates import quant_shape
from wideserve.kernels.choice import KernelChoice, default_choice
from wideserve.kernels.loader import cpu_ops_available
from wideserve.layers.expert_packs import CodedPack, ExpertPacks, FusedPack
from wideserve.layers.gemm_shapes import AttentionShape, DeclaresGemms, GemmShape
from wideserve.layers.linear import packed_linear, packing_runs
from wideserve.layers.quant import ExpertFormat, dequant_grouped_linear, scaled_mm_grouped_linear

logger = logging.getLogger(__name__)

EXPERT_IMPLS = ("grouped_mm", "padded", "packed", "fused", "loop")
# Device type -> the implementation measured fastest there (fallbacks apply where the C++ op
# cannot run (fused -> packed), the build cannot pack the dtype (packed -> grouped_mm) or run
# torch._grouped_mm for it (-> padded)). On the CPU "fused" is the default only where its
# AVX512-BF16 path is compiled and the weights are bf16 (measured, BENCHMARKS.md "Fused routed
# experts"); elsewhere the CPU default is "packed".
DEFAULT_EXPERT_IMPL = {"cpu": "fused", "cuda": "grouped_mm"}
FUSED_DEFAULT_DTYPES = (torch.bfloat16,)
FALLBACK_EXPERT_IMPL = "padded"
# The CPU default packs only experts at least this large (hidden x intermediate elements):
# below it the per-expert Python loop costs more than the re-layout it saves (measured on the
# 11M model's 256 x 256 experts; the 653M model's 1024 x 384 ones gain, BENCHMARKS.md).
PACKED_MIN_ELEMENTS = 1 << 18


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    if limit is not None:
        # DeepSeek-V4 clamps the gate from above only and the up projection both ways.
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@torch.compiler.disable      # a probe that may raise: never traced
def _grouped_mm_runs(device: torch.device, dtype: torch.dtype, hidden: int,
                     intermediate: int) -> bool:
    """Whether this build runs torch._grouped_mm for `dtype` on `device` with these widths:
    a tiny probe for the dtype, and the kernel's rule that every row stride (hidden, 2I and
    I elements) is a multiple of 16 bytes (bf16 with I = 12 fails it)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    itemsize = torch.empty((), dtype=dtype).element_size()
    if any(w * itemsize % 16 for w in (hidden, 2 * intermediate, intermediate)):
        return False
    try:
        a = torch.zeros(16, 16, device=device, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([8, 16], device=device, dtype=torch.int32)
        torch._grouped_mm(a, b.transpose(1, 2), offs=offs)
        return True
    except (RuntimeError, NotImplementedError, TypeError, AssertionError):
        return False        # AssertionError: a torch built without the device (CUDA)


class RoutedExperts(nn.Module, DeclaresGemms):
    """Weights in the HF layout: gate_up_proj [L, 2I, d] (gate rows first), down_proj [L, d, I]
    with L = num_local_experts physical slots."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 swiglu_limit: float | None = None, num_local_experts: int | None = None,
                 impl: str | None = None) -> None:
        super().__init__()
        if impl is not None and impl not in EXPERT_IMPLS:
            raise ValueError(f"expert impl {impl!r}: choose one of {list(EXPERT_IMPLS)}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts
        self.swiglu_limit = swiglu_limit
        self.impl = impl                 # None: DEFAULT_EXPERT_IMPL for the device
        self.ep: Any = None              # expert-parallel dispatcher (wideserve/distributed)
        self._resolved: dict[tuple[str, torch.dtype], str] = {}
        self._packs: ExpertPacks | FusedPack | None = None   # derived copies of the weights
        self._coded: CodedPack | None = None    # the fused path's packs coded (`lossless`)
        self.kernel_choice: KernelChoice | None = None           # None: the process's table
        self.hidden, self.intermediate = hidden, intermediate
        self.weight_format: ExpertFormat | None = None   # None: dense weights in the load dtype
        # checkpoint-format experts: (threads, input dtype) -> the fewest rows an expert runs
        # brgemm at (kernel choice "quant_experts"; None: never)
        self._quant_brgemm: dict[tuple[int, torch.dtype], int | None] = {}
        # KernelConfig.batch_invariant (CausalLM.apply_kernel_config): every (token, pick) row
        # through its expert alone, one kernel whatever the expert's row count (`_invariant`)
        self.batch_invariant = False
        # KernelConfig.lossless_experts (worker/lossless_choice.py decides "auto"): the fused
        # path's packs coded in 12 bits where the coded op runs (`_coded_runs`); not in the
        # batch-invariant mode, nor with `ep`
        self.lossless = False
        self._coded_refused = False          # the one warning where it cannot run was given
        L = self.num_local_experts
        self.gate_up_proj = nn.Parameter(torch.empty(L, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(L, hidden, intermediate))
        self.register_buffer("logical_to_physical",
                             torch.arange(num_experts, dtype=torch.int64)[:, None],
                             persistent=False)
        self.register_buffer("replica_count", torch.ones(num_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("replica_offset", torch.zeros((), dtype=torch.int64),
                             persistent=False)
        self.register_buffer("expert_load", torch.zeros(L, dtype=torch.int64),
                             persistent=False)

    def gemm_shapes(self) -> list[GemmShape | AttentionShape]:
        """The grouped expert GEMM, named by (intermediate, hidden); for experts kept in the
        checkpoint's format, by the format too (`quant_shape`)."""
        if self.weight_format is not None:
            return [GemmShape("quant_experts", self.intermediate, self.hidden,
                              self._quant_shape()[2:])]
        return [GemmShape("experts", self.intermediate, self.hidden)]

    def _quant_shape(self) -> tuple[int, ...]:
        fmt = self.weight_format
        assert fmt is not None
        return quant_shape(self.intermediate, self.hidden, fmt.op_id, fmt.block,
                           fmt.scale_bytes)

    def quant_brgemm_rows(self, dtype: torch.dtype) -> int | None:
        """Checkpoint-format experts with at least this many rows of `dtype` inputs run
        their dequantised tiles through brgemm (AMX tiles, or AVX512-BF16 dot products),
        fewer through the op's own dot products: the kernel choice's measured crossover for
        this format and shape at the current thread count (BENCHMARKS.md, "Quantised experts:
        NVFP4 in registers, the brgemm threshold measured"); None for inputs the op's brgemm
        does not take (fp32)."""
        key = (torch.get_num_threads(), dtype)
        if key not in self._quant_brgemm:
            choice = self.kernel_choice or default_choice()
            self._quant_brgemm[key] = choice.brgemm_from(
                "quant_experts", self.intermediate, self.hidden, dtype,
                extra=self._quant_shape()[2:])
        return self._quant_brgemm[key]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, d]; topk_ids/topk_weights [T, k] (logical ids) -> [T, d]."""
        if (self.ep is None and self.batch_invariant and self.weight_format is None
                and _fused_runs(x.device, x.dtype)):
            return self._invariant(x, topk_ids, topk_weights)
        if self.ep is None and self.resolved_impl(x.device, x.dtype) == "fused":
            return self._fused(x, topk_ids, topk_weights)
        phys = map_to_physical(topk_ids, self.logical_to_physical, self.replica_count,
                               self.replica_offset)                           # [T, k]
        flat = phys.reshape(-1)
        load = count_rows(flat, self.expert_load.shape[0])
        self.expert_load += load
        if self.ep is not None:
            return self.ep.forward(self, x, phys, topk_weights)
        T, k = phys.shape
        order = torch.argsort(flat, stable=True)                   # rows sorted by expert
        ys = self._sorted_mlp(x.index_select(0, order // k), load)
        y = torch.empty_like(ys).index_copy_(0, order, ys).view(T, k, x.shape[1])  # token order
        return combine(y, topk_weights).to(x.dtype)

    def grouped_mlp(self, x_rows: torch.Tensor, slot_ids: torch.Tensor,
                    padded: bool = False) -> torch.Tensor:
        """x_rows [N, d], slot_ids [N] int64 local physical experts -> [N, d]: each row
        through its expert's (unweighted) SwiGLU MLP. padded: slot id num_local_experts marks
        a padding row of a fixed-capacity exchange (layers/ep_dispatch.py); its output is
        unspecified. Sorted last, it lies past the last segment, which "grouped_mm" skips
        without a host read; the other implementations read the counts anyway, so they run
        on the valid rows only (one more read)."""
        L = self.num_local_experts
        if (self.batch_invariant and self.weight_format is None
                and _fused_runs(x_rows.device, x_rows.dtype)):
            if not padded:
                return self._rows_mlp(x_rows, slot_ids)
            ys = torch.zeros_like(x_rows)          # padding rows: unspecified, left zero
            keep = slot_ids < L                    # the CPU only: a host-side mask is free
            ys[keep] = self._rows_mlp(x_rows[keep], slot_ids[keep])
            return ys
        order = torch.argsort(slot_ids, stable=True)
        counts = count_rows(slot_ids, L + 1 if padded else L)[:L]
        xs = x_rows.index_select(0, order)
        if padded and self.resolved_impl(xs.device, xs.dtype) != "grouped_mm":
            valid = int(counts.sum())
            ys = torch.zeros_like(xs)
            ys[:valid] = self._sorted_mlp(xs[:valid], counts)
        else:
            ys = self._sorted_mlp(xs, counts)
        return torch.empty_like(ys).index_copy_(0, order, ys)

    def keep_checkpoint_format(self, fmt: ExpertFormat) -> None:
        """Hold the weights as the checkpoint stores them: gate_up_proj / down_proj become uint8
        codes [L, 2I, packed(d)] / [L, d, packed(I)] with scales gate_up_proj_scale /
        down_proj_scale as stored and, for NVFP4, fp32 global scales gate_up_proj_global [L, 2]
        / down_proj_global [L, 1] (ExpertFormat). Every one of them has the physical slots as
        dim 0, so expert sharding and EPLB moves carry them together. Call before the
        parameters are filled (on meta in the loader, so no dense copy is ever allocated);
        they are then uninitialised."""
        L, device = self.num_local_experts, self.down_proj.device
        if fmt.kind != "fp8" and (self.hidden % 2 or self.intermediate % 2):
            raise ValueError(f"{fmt.kind.upper()} experts need even hidden and intermediate "
                             "sizes")
        two_i, d, inter = 2 * self.intermediate, self.hidden, self.intermediate

        def param(*shape: int, dtype: torch.dtype = torch.uint8) -> nn.Parameter:
            return nn.Parameter(torch.empty(L, *shape, dtype=dtype, device=device),
                                requires_grad=False)
        sdt = fmt.scale_torch_dtype
        self.gate_up_proj = param(two_i, fmt.packed_cols(d))
        self.gate_up_proj_scale = param(*fmt.scale_shape(two_i, d, halves=2), dtype=sdt)
        self.down_proj = param(d, fmt.packed_cols(inter))
        self.down_proj_scale = param(*fmt.scale_shape(d, inter), dtype=sdt)
        if fmt.has_global:
            self.gate_up_proj_global = param(2, dtype=torch.float32)
            self.down_proj_global = param(1, dtype=torch.float32)
        self.weight_format = fmt
        self._packs = self._coded = None
        self._resolved.clear()

    def dense_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [L, 2I, d], down [L, d, I]) in `dtype`: the weights as stored, or the
        checkpoint-format ones dequantised (a full copy: tests and tools only)."""
        fmt = self.weight_format
        if fmt is None:
            return self.gate_up_proj.to(dtype), self.down_proj.to(dtype)
        return (fmt.dequantize(self.gate_up_proj, self.gate_up_proj_scale, 2, dtype,
                               self._global("gate_up_proj")),
                fmt.dequantize(self.down_proj, self.down_proj_scale, 1, dtype,
                               self._global("down_proj")))

    def _global(self, leaf: str) -> torch.Tensor | None:
        """The NVFP4 global scales of a projection [L, halves], None for other formats."""
        fmt = self.weight_format
        return getattr(self, f"{leaf}_global") if fmt is not None and fmt.has_global else None

    def _invariant(self, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
        """--batch-invariant: the expert-parallel path's arithmetic on one rank (each pick's
        row through its expert, rounded to x.dtype, then `combine`), so one process, DEP ranks
        and any batch mix give a token the same bits. The fused op's own weighted sum rounds
        once over all picks, which the EP path cannot reproduce."""
        T, k = ids.shape
        table = self.logical_to_physical
        if table.shape[1] == 1:         # one replica each: the op maps ids and counts load
            y = self._rows_mlp(x.repeat_interleave(k, dim=0), ids.reshape(-1), table,
                               self.expert_load)
        else:
            phys = map_to_physical(ids, table, self.replica_count, self.replica_offset)
            flat = phys.reshape(-1)
            self.expert_load += count_rows(flat, self.expert_load.shape[0])
            y = self._rows_mlp(x.repeat_interleave(k, dim=0), flat)
        return combine(y.view(T, k, x.shape[1]), weights).to(x.dtype)

    def _rows_mlp(self, x_rows: torch.Tensor, slots: torch.Tensor,
                  expert_map: torch.Tensor | None = None,
                  expert_load: torch.Tensor | None = None) -> torch.Tensor:
        """x_rows [N, d], slots [N] physical experts (logical with `expert_map`) -> [N, d]
        in x's dtype: the fused op with one pick of weight 1 per row (1 * y is exact; rounded
        once), its GEMM kernel the same for every row count (the invariant plan of
        `_fused_pack`)."""
        if x_rows.shape[0] == 0:
            return x_rows.clone()
        w13, w2, inter = self._fused_pack()
        ones = torch.ones(x_rows.shape[0], 1, dtype=x_rows.dtype, device=x_rows.device)
        return moe_op.fused_experts(x_rows, slots[:, None], ones, w13, w2, inter,
                                    self.swiglu_limit, expert_map=expert_map,
                                    expert_load=expert_load,
                                    brgemm_min_rows=self._packs.brgemm_min_rows)

    def weights_changed(self) -> None:
        """Call after writing the expert weights through `.data` (which the version counter
        misses): the packed copies are rebuilt on the next forward."""
        self._packs = None
        self._coded = None

    def resolved_impl(self, device: torch.device, dtype: torch.dtype) -> str:
        key = (device.type, dtype)
        if key not in self._resolved:
            self._resolved[key] = self._resolve(device, dtype)
        return self._resolved[key]

    def _resolve(self, device: torch.device, dtype: torch.dtype) -> str:
        if self.weight_format is not None:
            return "quant"
        hidden, intermediate = self.hidden, self.intermediate
        impl = self.impl or DEFAULT_EXPERT_IMPL.get(device.type, FALLBACK_EXPERT_IMPL)
        if impl == "fused":
            if self.impl is None:
                usable = dtype in FUSED_DEFAULT_DTYPES and _fused_runs(device, dtype) \
                    and moe_op.fast_path_compiled()
            else:
                usable = _fused_runs(device, dtype)
                if not usable:
                    logger.warning("fused experts cannot run on %s for %s: using the torch "
                                   "path", device.type, dtype)
            if usable:
                return "fused"
            impl = "packed"
        small = self.impl is None and hidden * intermediate < PACKED_MIN_ELEMENTS
        if impl == "packed" and (small or not (device.type == "cpu" and packing_runs(dtype))):
            impl = "grouped_mm"
        if impl == "grouped_mm" and not _grouped_mm_runs(device, dtype, hidden, intermediate):
            impl = FALLBACK_EXPERT_IMPL
        return impl

    def _fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The C++ op on logical ids: with one replica per expert it maps them itself (else
        map_to_physical spreads them first); it adds each expert's rows to expert_load."""
        table = self.logical_to_physical
        if table.shape[1] != 1:
            ids = map_to_physical(ids, table, self.replica_count, self.replica_offset)
            table = None
        if self._coded_runs(x.dtype):
            return lossless.fused_experts(x, ids, weights, self._coded_pack(),
                                          self.down_proj.shape[2], self.swiglu_limit,
                                          expert_map=table, expert_load=self.expert_load)
        w13, w2, inter = self._fused_pack()
        return moe_op.fused_experts(x, ids, weights, w13, w2, inter, self.swiglu_limit,
                                    expert_map=table, expert_load=self.expert_load,
                                    brgemm_min_rows=self._packs.brgemm_min_rows)

    def _coded_runs(self, dtype: torch.dtype) -> bool:
        """Whether the fused path runs on losslessly coded packs: asked for, bf16, not in the
        batch-invariant mode, and the coded op runs here on these widths (else one warning
        and the bf16 packs)."""
        if not self.lossless or dtype != torch.bfloat16 or self.batch_invariant:
            return False
        usable = lossless.available() and lossless.fits(self.hidden, self.intermediate)
        if not usable and not self._coded_refused:
            self._coded_refused = True
            logger.warning("--lossless-experts: %s; the experts stay in bf16",
                           "the coded op needs AMX-BF16 and the extension's AVX512-BF16 "
                           "build" if not lossless.available() else
                           f"hidden {self.hidden} / intermediate {self.intermediate} are "
                           f"not multiples of 32")
        return usable

    def _coded_pack(self) -> lossless.CodedExperts:
        """The coded packs, rebuilt when the weights changed (layers/linear.py's rule)."""
        w1, w2 = self.gate_up_proj, self.down_proj
        if self._coded is None or not self._coded.current(w1, w2):
            self._coded = CodedPack(w1, w2)
        return self._coded.coded

    def coded_usable(self, dtype: torch.dtype) -> bool:
        """Whether `lossless` would run this layer on coded packs for CPU inputs in `dtype`
        (worker/lossless_choice.py): the fused path on bf16 weights as loaded, no `ep`, not
        batch-invariant, and the coded op runs here on these widths."""
        cpu = torch.device("cpu")
        return (dtype == torch.bfloat16 and self.gate_up_proj.dtype == torch.bfloat16
                and self.gate_up_proj.device.type == "cpu" and self.ep is None
                and not self.batch_invariant and self.weight_format is None
                and self.resolved_impl(cpu, dtype) == "fused" and lossless.available()
                and lossless.fits(self.hidden, self.intermediate))

    def pack_bytes(self) -> int:
        """Bytes of the expert weights in bf16: about what the fused op's packs hold."""
        return 2 * (self.gate_up_proj.numel() + self.down_proj.numel())

    def drop_unused_packs(self) -> None:
        """Free the fused path's packs of the form `lossless` does not run (after both were
        timed, worker/lossless_choice.py)."""
        if self.lossless:
            if isinstance(self._packs, FusedPack):
                self._packs = None
        else:
            self._coded = None

    def _fused_pack(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(w13, w2, intermediate width) in the fused op's layout, rebuilt when the weights
        changed (layers/linear.py's rule); the brgemm threshold follows the thread count."""
        w1, w2 = self.gate_up_proj, self.down_proj
        if not isinstance(self._packs, FusedPack) or not self._packs.current(w1, w2):
            self._packs = FusedPack(w1, w2)
        packs = self._packs
        threads = (torch.get_num_threads(), self.batch_invariant)
        if packs.threads != threads:
            packs.threads = threads
            packs.brgemm_min_rows = None
            if w1.dtype == torch.bfloat16:
                choice = self.kernel_choice or default_choice()
                mode = {"invariant": True} if self.batch_invariant else {}
                packs.brgemm_min_rows = choice.brgemm_from("experts", w2.shape[2],
                                                           w2.shape[1], w1.dtype, **mode)
        return packs.w13, packs.w2, w2.shape[2]

    def invariant_fn(self, device: torch.device, dtype: torch.dtype
                     ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """--batch-invariant: the function `forward` runs for an input on `device` in `dtype`
        (x, logical ids, weights) -> [T, d], where it is the mode's per-row path; None
        otherwise (models/lean_decode.py: the lean decode path in the mode)."""
        if (self.ep is None and self.batch_invariant and self.weight_format is None
                and _fused_runs(device, dtype)):
            return self._invariant
        return None

    def fused_op(self, device: torch.device, dtype: torch.dtype
                 ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The fused op as `forward` would call it for an input on `device` in `dtype`, a
        function of (x, logical ids, weights); None where `forward` would not call it on
        logical ids as they are (another implementation, an `ep` dispatcher, replicas, the
        batch-invariant mode). models/lean_decode.py."""
        if self.ep is not None or self.resolved_impl(device, dtype) != "fused" \
                or self.logical_to_physical.shape[1] != 1 or self.batch_invariant:
            return None
        table, load, limit = self.logical_to_physical, self.expert_load, self.swiglu_limit
        ops = torch.ops.wideserve
        if self._coded_runs(dtype):
            coded = self._coded_pack()
            args = coded.w13.args() + coded.w2.args()
            inter = self.down_proj.shape[2]
            return lambda x, ids, w: ops.moe_fused_experts_lossless(
                x, ids, w, *args, inter, limit, table, load)
        w13, w2, inter = self._fused_pack()
        big = self._packs.brgemm_min_rows
        return lambda x, ids, w: ops.moe_fused_experts(x, ids, w, w13, w2, inter, limit, False,
                                                       table, load, big)

    def _sorted_mlp(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """xs [N, d] sorted by expert, counts [L] rows per expert -> [N, d] in xs.dtype."""
        if xs.shape[0] == 0:
            return xs.clone()
        w1, w2 = self.gate_up_proj, self.down_proj
        impl = self.resolved_impl(xs.device, xs.dtype)
        if impl == "quant":
            gate, up = self._quant_linear(xs, counts, w1, self.gate_up_proj_scale, 2,
                                          self._global("gate_up_proj")).chunk(2, -1)
            return self._quant_linear(swiglu(gate, up, self.swiglu_limit), counts, w2,
                                      self.down_proj_scale, 1, self._global("down_proj"))
        if impl == "grouped_mm":
            mlp = grouped_mm_mlp if xs.dtype == torch.bfloat16 else _grouped_mm_mlp_eager
            return mlp(xs, counts, w1, w2, self.swiglu_limit)
        if impl == "padded":
            return padded_mlp(xs, counts, w1, w2, self.swiglu_limit)
        if impl == "packed":
            if not isinstance(self._packs, ExpertPacks) or not self._packs.current(w1, w2):
                self._packs = ExpertPacks(w1, w2)
            return packed_mlp(xs, counts, self._packs, self.swiglu_limit)
        return loop_mlp(xs, counts, w1, w2, self.swiglu_limit)

    def _quant_linear(self, x: torch.Tensor, counts: torch.Tensor, codes: torch.Tensor,
                      scale: torch.Tensor, halves: int,
                      global_scale: torch.Tensor | None) -> torch.Tensor:
        """One grouped projection on checkpoint-format weights (sorted rows, counts [L])."""
        fmt = self.weight_format
        assert fmt is not None
        if quant_gemm.available(x.device, x.dtype):
            # --batch-invariant: every row on the per-row dot products (None: no brgemm), whose
            # result does not depend on how many rows the expert has
            min_rows = None if self.batch_invariant else self.quant_brgemm_rows(x.dtype)
            return quant_gemm.grouped_linear(x, counts, codes, scale, fmt.op_id, fmt.block,
                                             halves, min_rows, global_scale=global_scale)
        if fmt.kind == "fp8" and _scaled_mm_runs(x.device):
            return scaled_mm_grouped_linear(x, counts, codes, scale, fmt, halves)
        return dequant_grouped_linear(x, counts, codes, scale, fmt, halves, global_scale)


@torch.compiler.disable      # a device query: never traced
def _scaled_mm_runs(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs FP8 with row-wise scales on `device` (CUDA compute
    capability 8.9 / 9.0 and newer); torch.cuda is only touched for a CUDA device."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _fused_runs(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in moe_op.DTYPES and cpu_ops_available()


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, k, d] expert outputs, weights [T, k] -> [T, d] fp32 weighted sum."""
    return torch.bmm(weights.float().unsqueeze(1), y.float()).squeeze(1)


def loop_mlp(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
             limit: float | None) -> torch.Tensor:
    """The reference: one matmul pair per non-empty expert (one host read of the counts)."""
    out = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gate, up = F.linear(xs[start:start + n], w1[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(swiglu(gate, up, limit), w2[e])
            start += n
    return out


@torch.compiler.disable      # eager inside a compiled forward: its packed ops are opaque there
def packed_mlp(xs: torch.Tensor, counts: torch.Tensor, packs: ExpertPacks,
               limit: float | None) -> torch.Tensor:
    """loop_mlp through the packed weights; the activation runs once over all rows."""
    segments = [(e, n) for e, n in enumerate(counts.tolist()) if n]
    bounds = [0]
    for _, n in segments:
        bounds.append(bounds[-1] + n)
    h = torch.cat([packed_linear(xs[bounds[i]:bounds[i + 1]], packs.w1[e])
                   for i, (e, _) in enumerate(segments)])
    a = swiglu(*h.chunk(2, dim=-1), limit)
    return torch.cat([packed_linear(a[bounds[i]:bounds[i + 1]], packs.w2[e])
                      for i, (e, _) in enumerate(segments)])


def grouped_mm_mlp(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, limit: float | None) -> torch.Tensor:
    """Both projections as torch._grouped_mm over the segments (no host sync)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    gate, up = torch._grouped_mm(xs, w1.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(swiglu(gate, up, limit), w2.transpose(1, 2), offs=offs)


# Eager inside a compiled forward unless bf16: torch._grouped_mm's shape function accepts bf16
# only, while the CPU kernel also runs fp32. In bf16 it is traced (a capturable forward,
# docs/cuda_graphs.md).
_grouped_mm_mlp_eager = torch.compiler.disable(grouped_mm_mlp)


def padded_mlp(xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
               limit: float | None) -> torch.Tensor:
    """Experts padded to the largest segment C: two bmm over [L, C, .] (one host read of C)."""
    L, N = counts.shape[0], xs.shape[0]
    cap = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(L, device=xs.device), counts, output_size=N)
    slot = expert * cap + torch.arange(N, device=xs.device) - starts[expert]      # [N]
    padded = xs.new_zeros(L * cap, xs.shape[1]).index_copy_(0, slot, xs).view(L, cap, -1)
    gate, up = torch.bmm(padded, w1.transpose(1, 2)).chunk(2, dim=-1)             # [L, C, I]
    out = torch.bmm(swiglu(gate, up, limit), w2.transpose(1, 2))                  # [L, C, d]
    return out.view(L * cap, -1).index_select(0, slot)
