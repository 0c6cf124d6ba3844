"""The fused experts op's two schedules side by side (csrc/moe_by_expert.h; BENCHMARKS.md,
"Zen 4: the decode experts by whole experts"): the 653M model's expert shapes (64 experts,
top-8, hidden 1,024, width 384, bf16), eight cold layers on the engine's packs, routing
uniform at random, the op as the engine calls it (the kernel choice's brgemm threshold) with
schedule "columns" and with the op's own choice ("experts" wherever every expert is on the
micro-kernel), in random order each round. Before each round a 2-thread `sum` over 256 MiB
reads the host's bandwidth (a shared host's moves within minutes); the rounds are binned by
it. One JSON line a round to --out, then per bin the median ms a layer call of each side and
the median of the paired ratios.

  PYTHONPATH=. python benchmarks/moe_schedule_ab.py [--threads 2] [--tokens 64] [--seconds 120]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_decode_op import D, E, TOP_K, modules_of  # noqa: E402

from wideserve.kernels import moe as moe_op  # noqa: E402

SIDES = ("columns", None)


def packs(layer_count: int, g: torch.Generator) -> list[tuple]:
    """(w13, w2, intermediate, brgemm threshold) of `layer_count` layers of random experts,
    the packs and threshold RoutedExperts.fused_op hands the op."""
    out = []
    for m in modules_of(E, layer_count, g):
        w13, w2, inter = m._fused_pack()
        out.append((w13, w2, inter, m._packs.brgemm_min_rows))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    layers = packs(8, g)
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(a.tokens)])
    x = torch.randn(a.tokens, D, generator=g).bfloat16()
    w = torch.rand(a.tokens, TOP_K, generator=g).softmax(-1)
    src, rng, rounds = torch.ones(256 << 18), random.Random(1), []

    def call(schedule: str | None) -> float:
        t0 = time.perf_counter()
        for w13, w2, inter, big in layers:
            moe_op.fused_experts(x, ids, w, w13, w2, inter, None, False, None, None, big,
                                 schedule)
        return (time.perf_counter() - t0) / len(layers)

    out = open(a.out, "a") if a.out else None
    with torch.inference_mode():
        assert torch.equal(*(moe_op.fused_experts(x, ids, w, *layers[0][:3], None, False, None,
                                                  None, layers[0][3], s) for s in SIDES))
        for s in SIDES:
            call(s)
        end = time.time() + a.seconds
        while time.time() < end:
            bw = 0.0
            for _ in range(3):
                t = time.perf_counter()
                src.sum()
                bw = max(bw, src.nbytes / (time.perf_counter() - t) / 1e9)
            res = {}
            for s in rng.sample(SIDES, 2):
                res[str(s)] = statistics.median(call(s) for _ in range(3)) * 1e3
            rounds.append({"bw": round(bw, 1), "columns": res["columns"], "auto": res["None"]})
            if out:
                print(json.dumps(rounds[-1]), file=out, flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    print(f"# {cpu}; {a.threads} thread(s); {a.tokens} tokens; load {os.getloadavg()[0]:.2f}")
    for name, rs in (("< 40 GB/s", [r for r in rounds if r["bw"] < 40]),
                     (">= 40 GB/s", [r for r in rounds if r["bw"] >= 40])):
        if rs:
            col = statistics.median(r["columns"] for r in rs)
            auto = statistics.median(r["auto"] for r in rs)
            ratio = statistics.median(r["auto"] / r["columns"] for r in rs)
            print(f"{name}: {len(rs)} rounds, columns {col:.3f} ms, op's choice {auto:.3f} ms a "
                  f"layer call, paired ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
