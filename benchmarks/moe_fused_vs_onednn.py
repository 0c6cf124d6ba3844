"""The fused routed-experts op against per-expert oneDNN GEMMs on the 653M model's expert
shapes (64 experts, top-8, hidden 1024, expert width 384; bf16, one thread): is the
grouped GEMM the fastest way to run routed experts at decode (16-64 tokens: 2-8 rows per
expert) and prefill (2,048 tokens) sizes on this machine? (BENCHMARKS.md, "Intel Xeon:
session 11".)

  PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/moe_fused_vs_onednn.py [--tokens 2048 256 64 16]

"fused": RoutedExperts on the C++ op (routing, gather, SwiGLU, scatter and the weighted sum
inside, each expert's weights read once per call; kernels per expert row count from the
kernel choice). "onednn": per expert, the rows gathered, `mkldnn._linear_pointwise` on
weights packed once (AMX where present), SwiGLU, the down GEMM, index_add of the weighted
rows. "flinear": the same with F.linear. Median of 7 alternating rounds, on the thread's CPU
time (a shared machine's other processes' time slices do not count); GFLOP/s of the routed
rows' GEMMs; outputs checked close to the fused op's. "peak": bf16 `torch.mm` of 2,048 x 2,048 x
2,048 (oneDNN, AMX where present) in the same run, on the same clock: the machine's measured
matmul peak the fused op's GFLOP/s are read against.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from wideserve.kernels.timing import matmul_peak_gmacs
from wideserve.layers.experts import RoutedExperts

E, TOP_K, D, INTER = 64, 8, 1024, 384


def fused_layer() -> RoutedExperts:
    """One 653M MoE layer's routed experts, random bf16 weights (seed 0), on the fused op."""
    torch.manual_seed(0)
    m = RoutedExperts(E, D, INTER).bfloat16()
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.05)
        m.down_proj.normal_(0, 0.05)
    m.impl = "fused"
    return m


def per_expert(x, ids, wts, w13, w2, linear):
    out = torch.zeros(x.shape[0], D, dtype=torch.float32)
    flat = ids.flatten()
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=E).tolist()
    start = 0
    for e, c in enumerate(counts):
        if c == 0:
            continue
        picks = order[start:start + c]
        start += c
        tokens = picks // TOP_K
        gate, up = linear(x.index_select(0, tokens), w13[e]).chunk(2, -1)
        y = linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y.float() * wts.flatten()[picks, None])
    return out.bfloat16()


def mm_peak(rounds: int) -> float:
    """GFLOP/s of a large bf16 torch.mm on this thread (the best of `rounds`)."""
    return 2 * matmul_peak_gmacs(repeats=rounds, clock="cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 256, 64, 16])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    m = fused_layer()
    w13, w2 = m.gate_up_proj.detach(), m.down_proj.detach()
    packed13 = [torch.ops.mkldnn._reorder_linear_weight(w13[e].contiguous(), None)
                for e in range(E)]
    packed2 = [torch.ops.mkldnn._reorder_linear_weight(w2[e].contiguous(), None)
               for e in range(E)]

    def onednn(a, w):
        return torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], "")

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"# {cpu}; load {os.getloadavg()[0]:.2f}; torch {torch.__version__}; 1 thread")
    peak = mm_peak(args.rounds)
    print(f"peak: bf16 torch.mm 2048^3 {peak:.0f} GFLOP/s", flush=True)
    for tokens in args.tokens:
        x = torch.randn(tokens, D).bfloat16()
        ids = torch.stack([torch.randperm(E)[:TOP_K] for _ in range(tokens)])
        wts = torch.rand(tokens, TOP_K).softmax(-1)
        fns = {"fused": lambda: m(x, ids, wts),
               "onednn": lambda: per_expert(x, ids, wts, packed13, packed2, onednn),
               "flinear": lambda: per_expert(x, ids, wts, w13, w2, F.linear)}
        with torch.inference_mode():
            ref = fns["fused"]().float()
            for name, fn in fns.items():
                err = (fn().float() - ref).abs().max().item()
                assert err <= 0.02 * ref.abs().max().item(), (name, err)
            times = {n: [] for n in fns}
            for r in range(args.rounds):
                for name in list(fns)[r % 3:] + list(fns)[:r % 3]:
                    t0 = time.thread_time()
                    fns[name]()
                    times[name].append(time.thread_time() - t0)
        flops = 2 * tokens * TOP_K * 3 * D * INTER
        cells = [f"{n} {statistics.median(v) * 1e3:.1f} ms "
                 f"({flops / statistics.median(v) / 1e9:.0f} GFLOP/s)" for n, v in times.items()]
        fused = flops / statistics.median(times["fused"]) / 1e9
        print(f"{tokens} tokens: " + "; ".join(cells) + f"; fused at {fused / peak:.0%} of peak",
              flush=True)


if __name__ == "__main__":
    main()
