"""The flash prefill kernel against torch's SDPA and the C++ paged op (docs/cpu_kernels.md and
BENCHMARKS.md, "Flash prefill"): one request's causal attention on the 653M model's shapes
(16 query heads, 4 KV heads, head dim 64, bf16) read from a paged cache of 16-entry blocks in
shuffled order, as a step reads it.

  PYTHONPATH=. python benchmarks/flash_prefill.py [--threads 1] [--dim 64]

Rows: a fresh prefill of n tokens (SDPA on the step's own k/v, as paged_attention_batched
runs it) and a chunk of n queries after n cached positions (SDPA on the context gathered from
the cache). Per row the median of alternating calls (thread CPU time at one thread, wall time
otherwise), the achieved GFLOP/s of the useful causal products (4 D flops per visible
query-key pair and head) and the flash kernel's speed-up over SDPA. Outputs are compared with
an fp32 reference.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from wideserve.kernels import sdpa_context

HEADS, KV_HEADS, BLOCK = 16, 4, 16


def case(queries: int, context: int, dim: int, g: torch.Generator):
    length = queries + context
    blocks = -(-length // BLOCK)
    cache = torch.randn(blocks, BLOCK, 2 * KV_HEADS * dim, generator=g).bfloat16()
    table = torch.randperm(blocks, generator=g)
    q = torch.randn(queries, HEADS, dim, generator=g).bfloat16()
    return q, cache, table, length


def kernels(q, cache, table, length, dim) -> dict:
    scale = dim ** -0.5
    fns = {"flash": lambda: sdpa_context.attend_flash(q, cache, table, length, scale)}
    if length == q.shape[0]:
        k, v = sdpa_context.gather_context(cache, table, length, KV_HEADS, q.dtype)
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
    else:
        fns["sdpa"] = lambda: sdpa_context.attend_paged(q, cache, table, length, scale)
    starts = torch.tensor([0, q.shape[0]])
    lens = torch.tensor([length])
    fns["own"] = lambda: torch.ops.wideserve.paged_attention(q, cache, table[None], None,
                                                             starts, lens, scale, 0, False)
    return fns


def timed(fns: dict, clock, budget_s: float) -> dict[str, float]:
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        f()
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or len(runs["flash"]) < 5:
        for name, f in fns.items():
            t0 = clock()
            f()
            runs[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds per row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not sdpa_context.flash_compiled():
        raise SystemExit("the flash kernel does not run here (needs AVX512-BF16, bf16 brgemm)")
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    g = torch.Generator().manual_seed(0)
    print(f"heads {HEADS}, kv heads {KV_HEADS}, dim {args.dim}, {args.threads} thread(s), "
          f"{'thread CPU' if args.threads == 1 else 'wall'} time, ms (GFLOP/s)")
    print("| queries | cached | flash | sdpa | own | flash vs sdpa | max err flash / sdpa |")
    print("|---|---|---|---|---|---|---|")
    for queries, context in ((64, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (4096, 0),
                             (128, 128), (512, 512), (1024, 1024), (64, 2048)):
        q, cache, table, length = case(queries, context, args.dim, g)
        fns = kernels(q, cache, table, length, args.dim)
        if queries * length > 1 << 22:
            fns.pop("own")      # scalar per key: minutes at these lengths, far off the others
        want = sdpa_context.attend_paged(q.float(), cache.float(), table, length,
                                         args.dim ** -0.5)
        err = {k: (fns[k]().float().reshape(want.shape) - want).abs().max().item()
               for k in ("flash", "sdpa")}
        t = timed(fns, clock, args.budget)
        pairs = queries * context + queries * (queries + 1) / 2
        flops = 4 * args.dim * HEADS * pairs

        def cell(name: str) -> str:
            if name not in t:
                return "-"
            return f"{t[name] * 1e3:.2f} ({flops / t[name] / 1e9:.0f})"
        print(f"| {queries} | {context} | {cell('flash')} | {cell('sdpa')} | {cell('own')} | "
              f"{t['sdpa'] / t['flash']:.2f}x | {err['flash']:.4f} / {err['sdpa']:.4f} |")


if __name__ == "__main__":
    main()
