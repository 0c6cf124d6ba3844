"""The paged attention op at the 653M model's decode shape over growing contexts
(docs/cpu_kernels.md, "Paged attention"; BENCHMARKS.md, "Zen 4: decode attention, prefetches
over every score pass").

  OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/paged_attention_contexts.py [--threads 2]
      [--contexts 200 1000 4000] [--block-size 64] [--repeats 30]

64 requests, 16 q / 4 KV heads, head dim 64, bf16; every request's blocks drawn at random
from one pool (as an engine's allocator leaves them after a while), each call writing the
step's entry and attending (`paged_attention_write`, as the engine calls it). Prints the
best-of-`--repeats` wall time per call, the attention's multiply-adds per second and the KV
bytes read per second. A/B of two trees: run this file with PYTHONPATH set to each.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from wideserve.kernels.loader import load

REQUESTS, HEADS, KV_HEADS, DIM = 64, 16, 4, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 1000, 4000])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    load()
    g = torch.Generator().manual_seed(0)
    bs = a.block_size
    for ctx in a.contexts:
        per_request = (ctx + bs - 1) // bs
        blocks = REQUESTS * per_request + 8
        cache = torch.randn(blocks, bs, 2 * KV_HEADS * DIM, generator=g).bfloat16()
        table = torch.randperm(blocks, generator=g)[:REQUESTS * per_request]
        table = table.view(REQUESTS, per_request)
        q = torch.randn(REQUESTS, HEADS, DIM, generator=g).bfloat16()
        k = torch.randn(REQUESTS, KV_HEADS, DIM, generator=g).bfloat16()
        qsl = torch.arange(REQUESTS + 1)
        lens = torch.full((REQUESTS,), ctx)
        slots = table[:, (ctx - 1) // bs] * bs + (ctx - 1) % bs

        def call() -> torch.Tensor:
            return torch.ops.wideserve.paged_attention_write(
                q, k, k, cache, slots, table, None, qsl, lens, DIM ** -0.5, 0, False)

        for _ in range(3):
            call()
        best = float("inf")
        for _ in range(a.repeats):
            t = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - t)
        macs = REQUESTS * HEADS * ctx * DIM * 2
        kv = REQUESTS * ctx * 2 * KV_HEADS * DIM * 2
        print(f"context {ctx}: {best * 1e6:.0f} us, {macs / best / 1e9:.1f} GMAC/s, "
              f"{kv / best / 1e9:.1f} GB/s of KV ({a.threads} threads, block {bs})")


if __name__ == "__main__":
    main()
