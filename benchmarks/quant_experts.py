"""Routed experts kept in checkpoint format (BENCHMARKS.md, "Quantised experts").

1. GEMM: one V4.1-Flash expert's projections (gate/up 4608 x 5120, down 5120 x 2304) on
   MXFP4, FP8 (128 x 128; UE8M0 scales as DeepSeek, fp32 as Qwen3 FP8) and NVFP4 (ModelOpt)
   weights, x [M, K] bf16 for M in --rows: the C++ op that dequantises per tile inside the
   kernel (`quant_grouped_linear`: dot products, and brgemm from the row count the kernel
   choice measured for the format on this machine; both forced too) against
   dequantise-then-GEMM (the whole weight to bf16 in torch, then F.linear: what a per-call
   dequantising path costs), and the GEMM on a resident bf16 copy (what dequantising at load
   bought, at 4x the memory). Alternated in one run, median of --rounds; outputs checked
   equal within bf16 rounding.
2. Memory: a V4.1-Flash-shaped MoE layer (d 5120, I 2304; --experts of the 384, the bytes per
   expert are what matter) held in checkpoint format with dummy weights, after a forward:
   parameter bytes and the process's RSS growth against the checkpoint's bytes for the same
   experts (codes + scales as stored), and what the dequantise-at-load path held (bf16 + the
   fused kernel's packed copy).
3. Decode (`--decode`): the op as RoutedExperts calls it at decode sizes, on 8 experts of
   each projection per call, every expert `--rows` rows, the weights read from memory (the
   call rotates through copies of them over 256 MiB, as a decode step finds its experts):
   ms a call, the median of --rounds passes, and the codes' bytes read per second. To compare
   two builds run it from each tree (each tree's sources build their own library).

  PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/quant_experts.py [--json out.json]
      [--formats mxfp4 fp8 fp8_f32 nvfp4] [--memory-only] [--decode]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

from wideserve.kernels import quant_gemm
from wideserve.kernels.loader import build
from wideserve.kernels.candidates import quant_shape
from wideserve.kernels.choice import default_choice
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.quant import ExpertFormat, expert_format
from wideserve.worker.model_loader import _parameters_on_meta

HIDDEN, INTER = 5120, 2304          # V4.1-Flash (tests/data/deepseek-v41-flash/config.json)
PROJECTIONS = {"gate_up": (2 * INTER, HIDDEN, 2), "down": (HIDDEN, INTER, 1)}
FORMATS = {"mxfp4": expert_format("fp4"), "fp8": expert_format("fp8", (128, 128)),
           "fp8_f32": expert_format("fp8", (128, 128), scale_dtype="fp32"),
           "nvfp4": expert_format("nvfp4")}


def _rss() -> int:
    """Resident bytes after glibc returns freed heap pages (temporaries are not residents)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _codes(fmt: ExpertFormat, L: int, rows: int, cols: int, halves: int, seed: int):
    """Random dense weights quantised (per expert, so no large dense tensor at once)."""
    g = torch.Generator().manual_seed(seed)
    parts = [fmt.quantize(torch.randn(1, rows, cols, generator=g) / math.sqrt(cols), halves)
             for _ in range(L)]
    glob = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), glob


def brgemm_rows(fmt: ExpertFormat) -> int | None:
    """The fewest rows an expert of this format runs brgemm at, as the engine's layer picks
    it (the kernel choice "quant_experts", timed once per machine and cached)."""
    shape = quant_shape(INTER, HIDDEN, fmt.op_id, fmt.block, fmt.scale_bytes)
    return default_choice().brgemm_from("quant_experts", INTER, HIDDEN, torch.bfloat16,
                                        extra=shape[2:])


def gemm(fmt: ExpertFormat, proj: str, m: int, rounds: int) -> dict[str, float]:
    rows, cols, halves = PROJECTIONS[proj]
    codes, scale, glob = _codes(fmt, 1, rows, cols, halves, seed=1)
    g0 = None if glob is None else glob[0]
    x = torch.randn(m, cols).to(torch.bfloat16)
    counts = torch.tensor([m])

    def kernel(big: int | None) -> torch.Tensor:
        return quant_gemm.grouped_linear(x, counts, codes, scale, fmt.op_id, fmt.block, halves,
                                         big, global_scale=glob)

    dense = fmt.dequantize(codes[0], scale[0], halves, torch.bfloat16, g0)   # the old copy
    ways = {
        "in-kernel": lambda: kernel(brgemm_rows(fmt)),
        "in-kernel dots": lambda: kernel(None),
        "in-kernel brgemm": lambda: kernel(1),
        "dequant+GEMM": lambda: F.linear(x, fmt.dequantize(codes[0], scale[0], halves,
                                                           torch.bfloat16, g0)),
        "bf16 resident": lambda: F.linear(x, dense),
    }
    want = ways["dequant+GEMM"]().float()
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(rounds):
        for name, fn in ways.items():          # alternate: the machine's noise hits all alike
            t0 = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - t0)
            torch.testing.assert_close(out.float(), want, rtol=2 ** -7, atol=2e-3)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def decode(fmt: ExpertFormat, proj: str, m: int, rounds: int, experts: int = 8,
           pool_bytes: int = 256 << 20) -> float:
    """ms a call of `experts` experts x m rows each, the weights cold (module docstring)."""
    rows, cols, halves = PROJECTIONS[proj]
    codes, scale, glob = _codes(fmt, experts, rows, cols, halves, seed=1)
    pool = [(codes.clone(), scale.clone())
            for _ in range(max(2, pool_bytes // (codes.numel() * codes.element_size())))]
    x = torch.randn(m * experts, cols, generator=torch.Generator().manual_seed(m)).bfloat16()
    counts = torch.tensor([m] * experts)
    big = brgemm_rows(fmt)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c, s in pool:
            quant_gemm.grouped_linear(x, counts, c, s, fmt.op_id, fmt.block, halves,
                                      big, global_scale=glob)
        times.append((time.perf_counter() - t0) / len(pool))
    return statistics.median(times) * 1e3


def memory(fmt: ExpertFormat, experts: int) -> dict[str, float]:
    before = _rss()
    with _parameters_on_meta():         # as the loader builds it: no dense copy, ever
        layer = RoutedExperts(experts, HIDDEN, INTER, swiglu_limit=10.0)
        layer.keep_checkpoint_format(fmt)
    for name, p in list(layer.named_parameters()):
        setattr(layer, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                requires_grad=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():               # dummy weights: random codes (no FP8 NaN code), scales
        for p in (layer.gate_up_proj, layer.down_proj):         # 2^-7 .. 2^-4 (E4M3: 2^-6..)
            p.copy_(torch.randint(0, 256, p.shape, generator=g, dtype=torch.uint8) & 0xFE)
        for p in (layer.gate_up_proj_scale, layer.down_proj_scale):
            if p.dtype == torch.float32:
                p.copy_(torch.rand(p.shape, generator=g) * 2 ** -5)
            else:
                lo = 0x08 if fmt.scale_dtype == "e4m3" else 120
                p.copy_(torch.randint(lo, lo + 4, p.shape, generator=g, dtype=torch.uint8))
        for name, p in layer.named_parameters():
            if name.endswith("_global"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    layer.expert_load.zero_()
    x = torch.randn(64, HIDDEN).to(torch.bfloat16)
    k = min(6, experts)                 # V4.1-Flash routes 6 of 384
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(64)])
    with torch.inference_mode():
        layer(x, ids, torch.rand(64, k).to(torch.bfloat16))
    params = sum(p.numel() * p.element_size() for p in layer.parameters())
    values = experts * 3 * HIDDEN * INTER
    # The checkpoint's tensors per expert: w1, w3 [I, d] and w2 [d, I] codes, each with its
    # own scale grid (and NVFP4 global scale; worker/weights.py reads exactly these).

    def per(r: int, c: int) -> int:
        return (r * fmt.packed_cols(c) + math.prod(fmt.scale_shape(r, c)) * fmt.scale_bytes
                + 4 * fmt.has_global)
    checkpoint = experts * (2 * per(INTER, HIDDEN) + per(HIDDEN, INTER))
    return {"experts": experts, "values": values, "checkpoint_bytes": checkpoint,
            "param_bytes": params, "rss_growth_bytes": _rss() - before,
            "param_ratio": params / checkpoint, "rss_ratio": (_rss() - before) / checkpoint,
            "dequantised_at_load_ratio": values * 2 * 2 / checkpoint}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--memory-only", action="store_true")
    ap.add_argument("--decode", action="store_true",
                    help="only the decode-size timing on cold weights (3. above)")
    args = ap.parse_args()
    build()
    formats = {name: FORMATS[name] for name in args.formats}
    if args.decode:
        print(f"threads {torch.get_num_threads()}; 8 experts a call, weights cold; ms a call "
              f"(median of {args.rounds}) and GB/s of codes")
        for name, fmt in formats.items():
            for proj, (rows, cols, halves) in PROJECTIONS.items():
                nbytes = 8 * rows * fmt.packed_cols(cols)
                for m in args.rows:
                    ms = decode(fmt, proj, m, args.rounds)
                    print(f"{name} {proj} {m} rows: {ms:.2f} ms, {nbytes / ms / 1e6:.1f} GB/s",
                          flush=True)
        return
    result: dict = {"threads": torch.get_num_threads(), "gemm": [], "memory": {}}
    print(f"threads {torch.get_num_threads()}; times in ms (median of {args.rounds})")
    print("| format | projection | M | in-kernel | dots only | brgemm only | dequant+GEMM | "
          "speed-up | bf16 resident (no dequant) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, fmt in formats.items() if not args.memory_only else ():
        for proj in PROJECTIONS:
            for m in args.rows:
                t = gemm(fmt, proj, m, args.rounds)
                result["gemm"].append({"format": name, "proj": proj, "M": m, **t})
                print(f"| {name} | {proj} | {m} | {t['in-kernel']:.2f} | "
                      f"{t['in-kernel dots']:.2f} | {t['in-kernel brgemm']:.2f} | "
                      f"{t['dequant+GEMM']:.2f} | {t['dequant+GEMM'] / t['in-kernel']:.1f}x | "
                      f"{t['bf16 resident']:.2f} |",
                      flush=True)
    memory(next(iter(formats.values())), 1)     # one-time process costs (op, thread pool)
    for name, fmt in formats.items():
        mem = memory(fmt, args.experts)
        result["memory"][name] = mem
        print(f"memory {name}: {mem['experts']} experts, checkpoint "
              f"{mem['checkpoint_bytes'] / 2**20:.1f} MiB, parameters "
              f"{mem['param_bytes'] / 2**20:.1f} MiB ({mem['param_ratio']:.4f}x), RSS growth "
              f"{mem['rss_growth_bytes'] / 2**20:.1f} MiB ({mem['rss_ratio']:.3f}x); "
              f"dequantised at load: {mem['dequantised_at_load_ratio']:.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
