"""DeepSelect top-k (kernels/deepselect.py, csrc/deepselect.cpp) against torch.topk on
indexer-shaped score rows: the prefill indexer's top-k of DeepSeek-V4.1-Flash (index_topk 512
over n compressed entries; the candidate source's 2,048 blocks at k = 2048 too).

Rows: `--rows` query rows of n scores each, as a prefill block gives them: sums over 32 heads
of ReLU'd products times head weights (many exact zeros), -inf past each row's visible
entries (n/2..n, causal). Paths, timed alternately in one process (median of --reps):
- torch.topk: the plain float top-k (torch's own tie order: not the consumer's order);
- keyed: the previous `index_topk` path for long rows (int64 keys, then torch.topk);
- deepselect: the C++ op (AVX512 passes), and its portable passes.
Every path's picks are checked equal to the keyed path's (torch.topk's set by value).

  PYTHONPATH=. python benchmarks/v41_deepselect.py [--rows 64] [--reps 15] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch

from wideserve.kernels import deepselect, loader


def index_rows(rows: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    heads = 32
    w = torch.rand(heads, generator=g)
    s = torch.zeros(rows, n)
    for h in range(heads):           # one head at a time: no [rows, n, heads] temporary
        s += torch.randn(rows, n, generator=g).relu_() * w[h]
    visible = torch.randint(n // 2, n + 1, (rows,), generator=g)
    return s.masked_fill(torch.arange(n) >= visible[:, None], float("-inf"))


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in
                  subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
                  if ln.startswith("Model name")), platform.processor())
    flags = loader.cpu_flags()
    isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
                   if f in flags)
    return f"{model}; flags {isa}; load {os.getloadavg()[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="8192,32768,131072")
    ap.add_argument("--ks", default="512,2048")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loader.build()
    print(f"# {machine()}; torch {torch.__version__}; threads {args.threads}; "
          f"kernels {loader.load().variant}; rows {args.rows}")
    print("| n | k | torch.topk ms | keyed (before) ms | deepselect ms | portable ms | "
          "vs torch.topk | vs keyed |")
    print("|---|---|---|---|---|---|---|---|")
    for n in map(int, args.sizes.split(",")):
        s = index_rows(args.rows, n)
        for k in map(int, args.ks.split(",")):
            ref = deepselect.keyed_topk(s, k)
            assert torch.equal(deepselect.select(s, k), ref)
            assert torch.equal(deepselect.select(s, k, portable=True), ref)
            assert torch.equal(s.gather(-1, ref), torch.topk(s, k).values)
            paths = {"topk": lambda: torch.topk(s, k, dim=-1),
                     "keyed": lambda: deepselect.keyed_topk(s, k),
                     "deepselect": lambda: deepselect.select(s, k),
                     "portable": lambda: deepselect.select(s, k, portable=True)}
            times = {name: [] for name in paths}
            for _ in range(args.reps):                  # alternate: load drifts hit all alike
                for name, fn in paths.items():
                    times[name] += timed(fn, 1)
            ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            print(f"| {n} | {k} | {ms['topk']:.2f} | {ms['keyed']:.2f} | "
                  f"{ms['deepselect']:.2f} | {ms['portable']:.2f} | "
                  f"{ms['topk'] / ms['deepselect']:.2f}x | {ms['keyed'] / ms['deepselect']:.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
