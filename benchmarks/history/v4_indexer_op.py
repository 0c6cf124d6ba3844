"""The fused V4 indexer op alone (BENCHMARKS.md, "DeepSeek-V4: decode step time at 2K vs 32K
context"): one CSA layer's decode call for 4 requests x 8,192 visible entries (32K positions,
ratio 4), the benchmark model's indexer shape (8 heads x 64, bf16), top-512. Five caches of
4 MiB each are used in turn (more than the L2, like five CSA layers of a step), with table
blocks of 64 entries either scattered at random over the cache or in order.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/history/v4_indexer_op.py
"""
from __future__ import annotations

import time

import torch

from wideserve.kernels.loader import build
from wideserve.kernels.v4_indexer import indexer_topk

T, H, D, EPB, ENTRIES, K, LAYERS, SPARE = 4, 8, 64, 64, 8192, 512, 5, 77


def per_call_ms(caches, q, w, rows, visible, calls: int = 10) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        for cache, table in caches:
            indexer_topk(q, w, cache, table, rows, visible, EPB, K)
    return (time.perf_counter() - t) / calls / len(caches) * 1000


def main() -> None:
    torch.set_num_threads(1)
    build()
    g = torch.Generator().manual_seed(0)
    nblk = ENTRIES // EPB
    q = torch.randn(T, H, D, generator=g).bfloat16()
    w = torch.randn(T, H, generator=g)
    rows, visible = torch.arange(T), torch.full((T,), ENTRIES)
    caches = [torch.randn((T * nblk + SPARE) * EPB, D, generator=g).bfloat16()
              for _ in range(LAYERS)]
    layouts = {"scattered": [torch.randperm(T * nblk + SPARE, generator=g)[:T * nblk]
                             .view(T, nblk).contiguous() for _ in caches],
               "in order": [torch.arange(T * nblk).view(T, nblk) for _ in caches]}
    for name, tables in layouts.items():
        pairs = list(zip(caches, tables))
        per_call_ms(pairs, q, w, rows, visible, 2)                       # warm-up
        best = min(per_call_ms(pairs, q, w, rows, visible) for _ in range(3))
        print(f"table blocks {name}: {best:.3f} ms per layer call "
              f"({T} x {ENTRIES} entries, {H} heads x {D}, top-{K})")


if __name__ == "__main__":
    main()
