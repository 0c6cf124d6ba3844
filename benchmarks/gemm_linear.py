"""The dense GEMMs of a Qwen3-MoE decode step side by side (BENCHMARKS.md, "Small-M GEMMs"):
the C++ micro-kernel (`torch.ops.wideserve.gemm_linear`, wideserve/kernels/csrc/linear.cpp)
against oneDNN over a prepacked weight (the previous CPU default) and a plain `F.linear`, on
the linear shapes of the two benchmark models (qkv, o_proj, router, LM head) at decode-like
and prefill-like row counts, and the router as one op (`moe_route`) against the torch router
(linear + softmax + topk + renormalisation + cast). Alternates the paths in one run (the
machine is shared); outputs are checked against an fp32 reference.

  PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/gemm_linear.py [--rows 1,16,64,256,2048] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from wideserve.kernels import gemm
from wideserve.kernels.loader import build
from wideserve.layers.linear import packed_linear, prepack

MODELS = {  # name: hidden, q heads, kv heads, head dim, experts, top-k, vocab
    "qwen3moe-11m": (256, 4, 2, 64, 8, 2, 8192),
    "qwen3moe-653m": (1024, 16, 4, 64, 64, 8, 8192),
}


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """linear name -> (out N, in K)."""
    d, hq, hkv, hd, E, _, V = MODELS[model]
    return {"qkv": ((hq + 2 * hkv) * hd, d), "o_proj": (d, hq * hd), "router": (E, d),
            "lm_head": (V, d)}


def _time(fn, rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6


def linears(model: str, rows: int, rounds: int) -> None:
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in shapes(model).items():
        x = torch.randn(rows, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        ours, onednn = gemm.pack_linear(w), prepack(w)
        ref = F.linear(x.float(), w.float())
        scale = ref.abs().max().item()
        paths = {"kernel": lambda: gemm.linear(x, ours, N),
                 "onednn": lambda: packed_linear(x, onednn),
                 "F.linear": lambda: F.linear(x, w)}
        for fn in paths.values():
            torch.testing.assert_close(fn().float(), ref, rtol=2e-2, atol=2e-2 * scale)
        times = {p: [] for p in paths}
        for _ in range(3):                       # alternate: noise hits every path alike
            for p, fn in paths.items():
                times[p].append(_time(fn, rounds))
        us = {p: min(v) for p, v in times.items()}
        macs = rows * N * K
        print(f"| {model} | {name} [{rows}, {K}] x [{N}, {K}] | "
              + " | ".join(f"{us[p]:.1f}" for p in paths)
              + f" | {macs / us['kernel'] / 1e3:.0f} | {us['onednn'] / us['kernel']:.2f}x |",
              flush=True)


def router(model: str, rows: int, rounds: int) -> None:
    d, _, _, _, E, k, _ = MODELS[model]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, d, generator=g).bfloat16()
    w = (torch.randn(E, d, generator=g) * 0.05).bfloat16()
    ours, onednn = gemm.pack_linear(w), prepack(w)

    def torch_router():
        probs = F.softmax(packed_linear(x, onednn), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)
        return ids, (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)

    def fused():
        return gemm.route(x, ours, E, k, True)

    same = (fused()[0] == torch_router()[0]).all(dim=1).float().mean().item()
    times = {"fused": [], "torch": []}
    for _ in range(3):
        times["fused"].append(_time(fused, rounds))
        times["torch"].append(_time(torch_router, rounds))
    f, t = min(times["fused"]), min(times["torch"])
    print(f"| {model} | router [{rows}, {d}] -> top-{k} of {E} | {f:.1f} | {t:.1f} | "
          f"{t / f:.2f}x | {same:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64,256,2048")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both paths)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    build()
    rows = [int(r) for r in args.rows.split(",")]
    print("| model | linear [M, K] x [N, K] | kernel | oneDNN packed | F.linear (us, best of 3 "
          f"medians of {args.rounds}) | kernel GMAC/s | oneDNN / kernel |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for m in rows:
            linears(model, m, args.rounds)
    print("\n| model | router | fused op (us) | torch router (us) | speedup | same ids |")
    print("|---|---|---|---|---|---|")
    for model in args.models.split(","):
        for m in rows:
            router(model, m, args.rounds)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
