"""Packed expert weights on 2 MiB pages against 4 KiB pages (kv_cache/host_memory.py
`on_huge_pages`; BENCHMARKS.md, "Packed experts on huge pages"): the fused routed-experts op
on the 653M model's expert shapes (64 experts, top-8, hidden 1,024, width 384, bf16) at decode
and prefill token counts, one layer's weights (151 MB, past the caches) read per call.

  PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/moe_huge_pages.py [--threads 1] [--rounds 5]

One RoutedExperts; its packs as the layer builds them (on huge pages where THP allows) and a
copy of them on ordinary 4 KiB pages (`clone`: torch's allocator does not advise huge pages),
swapped in and out, alternating per round; median wall ms per call and the GB/s of the active
experts' weights. Prints the machine's THP mode and how much of each copy is on huge pages.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moe_fused_vs_onednn import D, E, TOP_K, fused_layer    # this directory (sys.path[0])
from wideserve.kv_cache.host_memory import huge_page_bytes, thp_mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    m = fused_layer()
    x0 = torch.randn(1, D).bfloat16()
    with torch.inference_mode():
        m(x0, torch.zeros(1, TOP_K, dtype=torch.int64) + torch.arange(TOP_K),
          torch.full((1, TOP_K), 1 / TOP_K))
    pack = m._packs
    huge = (pack.w13, pack.w2)
    small = tuple(t.clone() for t in huge)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"# {cpu}; THP {thp_mode()}; load {os.getloadavg()[0]:.2f}; torch "
          f"{torch.__version__}; {a.threads} thread(s)")
    for name, ts in (("huge", huge), ("4k", small)):
        total = sum(t.numel() * t.element_size() for t in ts)
        print(f"# {name}: {sum(huge_page_bytes(t) for t in ts) / total:.0%} of "
              f"{total / 1e6:.0f} MB on huge pages")
    per_expert = sum(t[0].numel() * t.element_size() for t in huge)
    for tokens in a.tokens:
        x = torch.randn(tokens, D).bfloat16()
        ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(tokens)])
        wts = torch.rand(tokens, TOP_K).softmax(-1)
        gb = per_expert * ids.unique().numel() / 1e9
        reps = 30 if tokens < 1024 else 6
        times: dict[str, list[float]] = {"huge": [], "4k": []}
        with torch.inference_mode():
            outs = {}
            for r in range(a.rounds):
                for name, ts in ((("huge", huge), ("4k", small)) if r % 2 == 0
                                 else (("4k", small), ("huge", huge))):
                    pack.w13, pack.w2 = ts
                    outs[name] = m(x, ids, wts)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        m(x, ids, wts)
                    times[name].append((time.perf_counter() - t0) / reps)
            assert torch.equal(outs["huge"], outs["4k"])
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{tokens} tokens ({gb * 1e3:.0f} MB of experts): huge {med['huge'] * 1e3:.2f} ms "
              f"({gb / med['huge']:.1f} GB/s), 4k {med['4k'] * 1e3:.2f} ms "
              f"({gb / med['4k']:.1f} GB/s): {med['4k'] / med['huge']:.2f}x", flush=True)
    pack.w13, pack.w2 = huge


if __name__ == "__main__":
    main()
