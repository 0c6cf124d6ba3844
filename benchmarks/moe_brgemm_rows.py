"""The fused routed-experts op at a brgemm threshold against the micro-kernel alone
(docs/cpu_kernels.md, "Routed experts"; BENCHMARKS.md, "AMD EPYC Zen 4: brgemm without AMX").

  PYTHONPATH=. python benchmarks/moe_brgemm_rows.py [--threads 2] [--tokens 64 256]
      [--min-rows none 2 5] [--layers 8] [--experts 8 --top-k 1]

The 653M benchmark model's expert shapes (hidden 1,024, intermediate 384), `--layers` distinct
layers of random bf16 packs on huge pages (8 x 64 experts = 1.2 GB: read from memory, as in a
decode step; `--experts 8 --top-k 1 --layers 1` keeps them in the caches). Per token count the
thresholds (`brgemm_min_rows`; "none": the micro-kernel for every expert) alternate, each one's
best of `--repeats` passes over the layers kept.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from wideserve.kernels import moe as moe_op
from wideserve.kernels.loader import load
from wideserve.kv_cache.host_memory import on_huge_pages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--min-rows", nargs="+", default=["none", "2", "5"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load()
    e, h, i = a.experts, a.hidden, a.intermediate
    g = torch.Generator().manual_seed(0)
    packs = []
    for _ in range(a.layers):
        w13, w2 = moe_op.pack_experts((torch.randn(e, 2 * i, h, generator=g) * 0.02).bfloat16(),
                                      (torch.randn(e, h, i, generator=g) * 0.02).bfloat16())
        packs.append((on_huge_pages(w13, "benchmark packs"), on_huge_pages(w2, "benchmark packs")))
    weight_bytes = sum(t.nbytes for p in packs for t in p)
    variants = {m: None if m == "none" else int(m) for m in a.min_rows}
    print(f"{a.threads} threads, {a.layers} layers x {e} experts ({weight_bytes / 1e6:,.0f} MB), "
          f"top-{a.top_k}\n")
    print("| tokens | " + " | ".join(f"min rows {m}: ms (GMAC/s)" for m in variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for tokens in a.tokens:
        x = torch.randn(tokens, h, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(e, generator=g)[:a.top_k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, a.top_k, generator=g), -1).bfloat16()

        def run(min_rows: int | None) -> None:
            for w13, w2 in packs:
                moe_op.fused_experts(x, ids, w, w13, w2, i, None, brgemm_min_rows=min_rows)
        best = {m: float("inf") for m in variants}
        for m, rows in variants.items():
            run(rows)                                            # warm: kernels, pages
        for _ in range(a.repeats):
            for m, rows in variants.items():
                t = time.perf_counter()
                run(rows)
                best[m] = min(best[m], time.perf_counter() - t)
        macs = tokens * a.top_k * 3 * h * i * a.layers
        print(f"| {tokens} | " + " | ".join(f"{best[m] * 1e3:.2f} ({macs / best[m] / 1e9:.0f})"
                                             for m in variants) + " |")


if __name__ == "__main__":
    main()
