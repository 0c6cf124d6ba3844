"""The dense linears of one decode step with cold weights (docs/cpu_kernels.md, "Page kicks";
BENCHMARKS.md, session 22).

  PYTHONPATH=. python benchmarks/decode_linears.py [--threads 2] [--rows 64] [--repeats 15]

The 653M benchmark model's decode step runs 17 dense linears (per layer the fused QKV,
1,024 -> 1,536, and the output projection, 1,024 -> 1,024; then the LM head, 1,024 -> 8,192):
59 MB of bf16 weights, each read once a step, which no core's L2 holds. Here each has its own
random weight, packed as the engine packs it, and every pass runs them all in order through
brgemm (`gemm_linear_brgemm`, what the kernel choice picks at these rows on AMX) and the
micro-kernel; the median pass per path, alternating. To compare two commits, run the same
command from a clone of each.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from wideserve.kernels import gemm
from wideserve.kernels.loader import load

HIDDEN, QKV, VOCAB, LAYERS = 1024, 1536, 8192, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load()
    g = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN)] * LAYERS + [(VOCAB, HIDDEN)]
    weights = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes]
    packs = [gemm.pack_linear(w) for w in weights]
    x = torch.randn(args.rows, HIDDEN, generator=g).bfloat16()
    paths = {
        "brgemm": lambda: [gemm.linear_brgemm(x, p, n) for (n, _), p in zip(shapes, packs)],
        "micro-kernel": lambda: [gemm.linear(x, p, n) for (n, _), p in zip(shapes, packs)],
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        f()
    for _ in range(args.repeats):
        for name, f in paths.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    nbytes = sum(w.nbytes for w in weights)
    print(f"{len(shapes)} linears, {nbytes / 1e6:.0f} MB of weights, {args.rows} rows, "
          f"{args.threads} threads")
    print("| path | median ms | min ms | weight GB/s (median) |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {min(ts) * 1e3:.2f} | {nbytes / med / 1e9:.1f} |")


if __name__ == "__main__":
    main()
