"""The callables the kernel choice times (kernels/choice.py; docs/cpu_kernels.md, "Kernel
choice"), one per (family, kernel, shape, rows), and oneDNN's packed linear, which they and
the layers call."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from wideserve.kernels import gemm
from wideserve.kernels import moe as moe_op
from wideserve.kernels import quant_gemm
from wideserve.kernels import sdpa_context
from wideserve.utils.cpu_cache import last_level_cache_bytes

# Buckets up to COLD_ROWS rows (a decode step's) are timed on weights read from memory, as a
# decode step reads them (a served model is far larger than the caches): each candidate
# rotates through copies of its weight, and `evict_caches` overwrites twice the last-level
# cache (at most COLD_BYTES) once the copies are built, so every timed call reads a copy
# that no recent call touched. Timed warm, brgemm beat the micro-kernel by 5-10% on single
# rows of the 653M model's linears on a Zen 4 while the micro-kernel, which prefetches its
# next weight group, was faster in the engine (BENCHMARKS.md, "AMD EPYC Zen 4: brgemm without
# AMX"). At most COLD_MAX_COPIES copies: a bucket's timing calls each candidate at most
# `KernelPolicy.max_reps` + 1 times, so more copies are never read, and building one copy
# per 64 MiB / weight bytes took a tiny weight (a 2 x 128 linear: 131,072 copies) 125 s.
COLD_ROWS = 64
COLD_BYTES = 64 << 20
COLD_MAX_COPIES = 64


# --- oneDNN's packed linear (torch's mkldnn ops) ---

def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] weight -> oneDNN's packed layout (only where onednn_runs(dtype))."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over a prepacked weight; x [N, in] contiguous, N >= 1."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Pools:
    """The weight copies that one shape's candidates are timed on, built once per kernel and
    copy count and shared by every bucket and re-timing of the shape (`KernelChoice._measure`
    holds one per shape): building them anew for each was ~60% of a first start's kernel-choice
    time (9.3 of 15 s for the 653M model's shapes at one thread). The values are random and
    the same for every bucket; the rows' inputs are drawn per call."""

    def __init__(self) -> None:
        self._built: dict[tuple, object] = {}

    def get(self, key: tuple, build: Callable[[], object]) -> object:
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]


def candidate(family: str, kernel: str, shape: tuple[int, ...], rows: int,
              pools: Pools | None = None) -> Callable[[], object]:
    """A call of `kernel` on random bf16 data of the shape (`family` "experts": one expert's
    fused MLP with (I, d) = shape and `rows` routed rows; "quant_experts": the same on codes
    of a checkpoint format, shape (I, d, fmt, block rows, block cols, scale bytes) as
    `quant_shape` makes it; "attention": a fresh causal prefill
    of `rows` tokens with (heads, kv heads, head dim) = shape; "attention_ctx": a chunk of
    `rows` queries after `rows` cached positions). `pools`: where the weight copies come from
    (a fresh one when not given)."""
    g = torch.Generator().manual_seed(rows)
    if family == "attention":
        return _attention_candidate(kernel, *shape, rows, g)
    if family == "attention_ctx":
        return _attention_ctx_candidate(kernel, *shape, rows, g)
    pools = pools or Pools()
    if family == "quant_experts":
        return _quant_experts_candidate(kernel, shape, rows, g, pools)
    n, k = shape
    copies = cold_copies(3 * n * k * 2 if family == "experts" else n * k * 2, rows)
    if family == "experts":
        return _experts_candidate(kernel, n, k, rows, g, copies, pools)
    x = torch.randn(rows, k, generator=g).bfloat16()
    widen = family == "router"
    # one pool per kernel: two kernels on one pool would read the same copy in turn, the
    # second from the caches
    pool = pools.get((kernel, n, k, copies), lambda: _linear_pool(kernel, n, k, copies))
    if kernel == "micro":
        return _rotating(pool, lambda p:
                         torch.ops.wideserve.gemm_linear(x, p, n, None, widen, False))
    if kernel == "brgemm":
        return _rotating(pool, lambda p:
                         torch.ops.wideserve.gemm_linear_brgemm(x, p, n, None, widen))
    if kernel == "onednn":
        return _rotating(pool, lambda p: packed_linear(x, p))
    return _rotating(pool, lambda p: F.linear(x, p))


def _linear_pool(kernel: str, n: int, k: int, copies: int) -> list[torch.Tensor]:
    """`copies` copies of one random [n, k] weight in the layout `kernel` reads."""
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.05).bfloat16()
    if kernel in ("micro", "brgemm"):
        return [gemm.pack_linear(w) for _ in range(copies)]
    if kernel == "onednn":
        return [prepack(w) for _ in range(copies)]
    return [w.clone() for _ in range(copies)]


def cold_bytes() -> int:
    """Twice the last-level cache, at most COLD_BYTES (COLD_BYTES where none is reported)."""
    return min(2 * (last_level_cache_bytes() or COLD_BYTES), COLD_BYTES)


def reads_cold(family: str, rows: int) -> bool:
    """Whether `candidate(family, ..., rows)` reads its weights from memory (a GEMM family's
    decode-sized buckets); `evict_caches` then goes between building and timing."""
    return not family.startswith("attention") and rows <= COLD_ROWS


def cold_copies(weight_bytes: int, rows: int) -> int:
    """Copies of a weight a candidate of `rows` rows rotates through: 1 above COLD_ROWS, else
    enough to exceed `cold_bytes()`, at most COLD_MAX_COPIES (the caches are then cleared by
    `evict_caches`, not by the copies)."""
    if rows > COLD_ROWS:
        return 1
    return max(1, min(-(-cold_bytes() // max(weight_bytes, 1)), COLD_MAX_COPIES))


def evict_caches() -> None:
    """Overwrites `cold_bytes()` of fresh memory, so that the weight copies built before it
    are read from memory by the calls after it."""
    torch.ones(cold_bytes() // 4, dtype=torch.float32)


def _rotating(items: list, call: Callable[[object], object]) -> Callable[[], object]:
    """A candidate that calls `call` on the next of `items` each time (one item: always it)."""
    if len(items) == 1:
        only = items[0]
        return lambda: call(only)
    state = [0]

    def run() -> object:
        state[0] = (state[0] + 1) % len(items)
        return call(items[state[0]])
    return run


def _experts_candidate(kernel: str, inter: int, d: int, rows: int, g: torch.Generator,
                       copies: int, pools: Pools) -> Callable[[], object]:
    """One expert's fused MLP on `rows` rows; with copies > 1 the layer holds that many
    experts and each call routes every row to the next one (its weights read cold)."""
    x = torch.randn(rows, d, generator=g).bfloat16()
    w13, w2 = pools.get(("experts", kernel, inter, d, copies),
                        lambda: _experts_pool(inter, d, copies))
    ids = [torch.full((rows, 1), e, dtype=torch.int64) for e in range(copies)]
    wts = torch.ones(rows, 1, dtype=torch.bfloat16)
    big = 1 if kernel == "brgemm" else None
    return _rotating(ids, lambda i: torch.ops.wideserve.moe_fused_experts(
        x, i, wts, w13, w2, inter, None, False, None, None, big))


def _experts_pool(inter: int, d: int, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused op's packs of `copies` experts with the same random weights."""
    g = torch.Generator().manual_seed(inter * d)
    w13 = (torch.randn(1, 2 * inter, d, generator=g) * 0.05).bfloat16().expand(copies, -1, -1)
    w2 = (torch.randn(1, d, inter, generator=g) * 0.05).bfloat16().expand(copies, -1, -1)
    return moe_op.pack_experts(w13.contiguous(), w2.contiguous())


def quant_shape(inter: int, d: int, fmt: int, block: tuple[int, int],
                scale_bytes: int) -> tuple[int, ...]:
    """The "quant_experts" shape of experts [I, d] held in format `fmt` (kernels/quant_gemm.py
    FMT_*) with scale blocks `block` and scales of `scale_bytes` (1: UE8M0 / E4M3 bytes, 4:
    fp32 multipliers)."""
    return (inter, d, fmt, block[0], block[1], scale_bytes)


def _quant_codes(rows: int, cols: int, halves: int, fmt: int, block: tuple[int, int],
                 scale_bytes: int, copies: int, g: torch.Generator) -> tuple:
    """(codes, scales, global scales or None) of `copies` copies of one random expert's
    [rows, cols] projection in the op's layout (csrc/quant_gemm.cpp). Codes are random bytes
    (FP8: no NaN code); scales sit near 1, inside the range the op's fast paths take (UE8M0
    2^-9..2^0, E4M3 0.5-1.0)."""
    codes = torch.randint(0, 256, (1, rows, cols if fmt == quant_gemm.FMT_FP8 else cols // 2),
                          dtype=torch.uint8, generator=g)
    if fmt == quant_gemm.FMT_FP8:               # no NaN code (e4m3 S.1111.111), as in weights
        codes[(codes & 0x7F) == 0x7F] -= 1
    grid = (1, halves * -(-(rows // halves) // block[0]), -(-cols // block[1]))
    if scale_bytes == 4:
        scale = torch.rand(grid, generator=g) * 2.0 ** -7 + 2.0 ** -9
    elif fmt == quant_gemm.FMT_NVFP4:
        scale = torch.randint(0x30, 0x39, grid, dtype=torch.uint8, generator=g)   # E4M3
    else:
        scale = torch.randint(118, 128, grid, dtype=torch.uint8, generator=g)     # UE8M0
    glob = torch.ones(copies, halves) if fmt == quant_gemm.FMT_NVFP4 else None
    return codes.repeat(copies, 1, 1), scale.repeat(copies, 1, 1), glob


def _quant_experts_candidate(kernel: str, shape: tuple[int, ...], rows: int,
                             g: torch.Generator, pools: Pools) -> Callable[[], object]:
    """One checkpoint-format expert's two projections (gate/up, then down on an activation
    of I values) on `rows` rows through `quant_grouped_linear`: its dot products ("micro")
    or brgemm; with copies > 1 the rows go to the next expert each call (weights cold)."""
    inter, d, fmt, block_rows, block_cols, scale_bytes = shape
    block = (block_rows, block_cols)
    per_value = 1.0 if fmt == quant_gemm.FMT_FP8 else 0.5
    copies = cold_copies(int(3 * inter * d * per_value), rows)
    up, down = pools.get(("quant_experts", kernel, shape, copies), lambda: (
        _quant_codes(2 * inter, d, 2, fmt, block, scale_bytes, copies, g),
        _quant_codes(d, inter, 1, fmt, block, scale_bytes, copies, g)))
    x = torch.randn(rows, d, generator=g).bfloat16()
    act = torch.randn(rows, inter, generator=g).bfloat16()
    big = 1 if kernel == "brgemm" else None
    counts = [torch.zeros(copies, dtype=torch.int64).index_fill_(0, torch.tensor(e), rows)
              for e in range(copies)]

    def call(c: torch.Tensor) -> object:
        quant_gemm.grouped_linear(x, c, up[0], up[1], fmt, block, 2, big, global_scale=up[2])
        return quant_gemm.grouped_linear(act, c, down[0], down[1], fmt, block, 1, big,
                                         global_scale=down[2])
    return _rotating(counts, call)


def _attention_candidate(kernel: str, heads: int, kv_heads: int, head_dim: int, rows: int,
                         g: torch.Generator) -> Callable[[], object]:
    """One request's causal prefill of `rows` tokens: the paged op or the flash kernel over a
    cache holding the step's entries, or SDPA on the step's k/v (the paths
    paged_attention_batched takes)."""
    q = torch.randn(rows, heads, head_dim, generator=g).bfloat16()
    kv = torch.randn(rows, 2, kv_heads, head_dim, generator=g).bfloat16()
    scale = head_dim ** -0.5
    if kernel == "sdpa":
        k, v = kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]
        return lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v,
                                                      is_causal=True, scale=scale,
                                                      enable_gqa=True)
    block = 64
    blocks = -(-rows // block)
    cache = F.pad(kv.reshape(rows, -1), (0, 0, 0, blocks * block - rows)).view(blocks, block, -1)
    table = torch.arange(blocks, dtype=torch.int64)[None]
    if kernel == "flash":
        return lambda: sdpa_context.attend_flash(q, cache, table[0], rows, scale)
    starts = torch.tensor([0, rows], dtype=torch.int64)
    lens = torch.tensor([rows], dtype=torch.int64)
    return lambda: torch.ops.wideserve.paged_attention(q, cache, table, None, starts, lens,
                                                        scale, 0, False)


def _attention_ctx_candidate(kernel: str, heads: int, kv_heads: int, head_dim: int, rows: int,
                             g: torch.Generator) -> Callable[[], object]:
    """A chunk of `rows` queries whose request has `rows` positions cached before it (2*rows
    keys), the cache's blocks shuffled: the C++ op or the flash kernel reading the cache in
    place, or SDPA over the gathered context (the paths paged_attention_batched takes)."""
    block, length = 64, 2 * rows
    blocks = -(-length // block)
    cache = torch.randn(blocks, block, 2 * kv_heads * head_dim, generator=g).bfloat16()
    table = torch.randperm(blocks, generator=g)[None]
    q = torch.randn(rows, heads, head_dim, generator=g).bfloat16()
    scale = head_dim ** -0.5
    if kernel == "sdpa":
        return lambda: sdpa_context.attend_paged(q, cache, table[0], length, scale)
    if kernel == "flash":
        return lambda: sdpa_context.attend_flash(q, cache, table[0], length, scale)
    starts = torch.tensor([0, rows], dtype=torch.int64)
    lens = torch.tensor([length], dtype=torch.int64)
    return lambda: torch.ops.wideserve.paged_attention(q, cache, table, None, starts, lens,
                                                        scale, 0, False)
