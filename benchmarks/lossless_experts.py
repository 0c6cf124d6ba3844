"""The fused routed-experts op on lossless 12-bit weights against the bf16 packs with brgemm
(docs/cpu_kernels.md, "Lossless 12-bit expert weights"; BENCHMARKS.md).

  PYTHONPATH=. python benchmarks/lossless_experts.py [--threads 2] [--tokens 64 512 2048]

The 653M benchmark model's expert shapes (64 experts, hidden 1,024, intermediate 384, top-8),
`--layers` distinct layers of random bf16 weights (1.2 GB at 8: no cache holds them, as in a
decode step), both forms on huge pages; per token count, each form's best of `--repeats` passes
over every layer, the two alternating. Prints a markdown table: ms for the layers, the bf16
bytes per second that is (what the bf16 op would need to read that fast), and the ratio.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from wideserve.kernels import lossless
from wideserve.kernels import moe as moe_op
from wideserve.kernels.loader import load
from wideserve.kv_cache.host_memory import on_huge_pages


def cpu_model() -> str:
    """lscpu's "Model name" (BENCHMARKS.md's rule: every figure names its CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def layers(count: int, experts: int, inter: int, hidden: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    plain, coded = [], []
    for _ in range(count):
        packs = moe_op.pack_experts(
            (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).bfloat16(),
            (torch.randn(experts, hidden, inter, generator=g) * 0.02).bfloat16())
        c = lossless.encode_experts(*packs)
        plain.append(tuple(on_huge_pages(t, "benchmark packs") for t in packs))
        coded.append(lossless.CodedExperts(*(
            dataclasses.replace(m, data=on_huge_pages(m.data, "benchmark coded packs"))
            for m in (c.w13, c.w2))))
    return plain, coded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load()
    if not lossless.available():
        raise SystemExit("the coded op does not run here (needs AMX-BF16 and the extension's "
                         "AVX512-BF16 build)")
    plain, coded = layers(a.layers, a.experts, a.intermediate, a.hidden)
    bf16_bytes = sum(t.nbytes for p in plain for t in p)
    coded_bytes = sum(c.nbytes for c in coded)
    exceptions = sum(m.exceptions.numel() for c in coded for m in (c.w13, c.w2))
    print(f"{cpu_model()}, {a.threads} threads; {a.layers} "
          f"layers: bf16 packs {bf16_bytes / 1e6:,.0f} MB, coded {coded_bytes / 1e6:,.0f} MB "
          f"({coded_bytes / bf16_bytes:.3f}), exceptions {exceptions / (bf16_bytes / 2):.1e} "
          f"of the values\n")
    print("| tokens | bf16 + brgemm ms | lossless ms | bf16 GB/s equiv. | lossless | ratio |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for tokens in a.tokens:
        x = torch.randn(tokens, a.hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(a.experts, generator=g)[:a.top_k]
                           for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, a.top_k, generator=g), -1).bfloat16()
        runs = {
            "bf16": lambda: [moe_op.fused_experts(x, ids, w, w13, w2, a.intermediate, None,
                                                  brgemm_min_rows=1) for w13, w2 in plain],
            "lossless": lambda: [lossless.fused_experts(x, ids, w, c, a.intermediate, None)
                                 for c in coded],
        }
        best = {name: float("inf") for name in runs}
        for name, f in runs.items():
            f()                                                   # warm: tiles, pages
        for _ in range(a.repeats):
            for name, f in runs.items():
                t = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t)
        gbs = {k: bf16_bytes / v / 1e9 for k, v in best.items()}
        print(f"| {tokens} | {best['bf16'] * 1e3:.1f} | {best['lossless'] * 1e3:.1f} | "
              f"{gbs['bf16']:.1f} | {gbs['lossless']:.1f} | "
              f"**{best['bf16'] / best['lossless']:.2f}x** |")


if __name__ == "__main__":
    main()
