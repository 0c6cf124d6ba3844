"""The fused routed-experts op at decode sizes on the 653M model's expert shapes (64 experts,
top-8, hidden 1,024, width 384, bf16): weights cold, as a decode step finds them, and cached.
BENCHMARKS.md, "Zen 4: down tiles of 6 rows".

  PYTHONPATH=. python benchmarks/moe_decode_op.py [--threads 2] [--tokens 16 64 128] [--rounds 7]

- cold: eight layers of their own (1.2 GB on 2 MiB pages, as the engine's packs), called in
  turn as a step calls them; routing uniform at random (64 tokens: ~8 rows an expert, from 1
  to ~20, as the 653M router's 1-21 on random prompts), and, as the pure weight stream beside
  it, one row an expert (8 tokens);
- cached: 8 experts (19 MB, inside a 32 MB L3), every token on all 8: `tokens` rows each.
The layers are the engine's own, called as its decode loop calls them (`RoutedExperts.fused_op`:
the packs on huge pages, the kernel choice's micro-kernel / brgemm split by rows). Median over rounds of ms a call, weights
read GB/s, multiply-adds GMAC/s. To compare two builds, run it from each tree in turn (each
with its own WIDESERVE_KERNELS_CACHE).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch

from wideserve.layers.experts import RoutedExperts

E, TOP_K, D, INTER, LAYERS = 64, 8, 1024, 384, 8
EXPERT_BYTES = 3 * D * INTER * 2
EXPERT_MACS = 3 * D * INTER          # per row


Layer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def modules_of(experts: int, count: int, g: torch.Generator) -> list[RoutedExperts]:
    """`count` expert layers (the fused implementation) of `experts` random experts."""
    out = []
    for _ in range(count):
        m = RoutedExperts(experts, D, INTER).bfloat16()
        with torch.no_grad():
            m.gate_up_proj.normal_(0, 0.05, generator=g)
            m.down_proj.normal_(0, 0.05, generator=g)
        m.impl = "fused"
        out.append(m)
    return out


def layers_of(experts: int, count: int, g: torch.Generator) -> list[Layer]:
    """`count` layers of `experts` random experts, each as the lean decode loop calls it
    (`RoutedExperts.fused_op`, models/lean_decode.py): the op on the layer's packs."""
    out = []
    for m in modules_of(experts, count, g):
        op = m.fused_op(torch.device("cpu"), torch.bfloat16)
        if op is None:
            raise SystemExit("the fused experts op does not run here (no C++ extension?)")
        out.append(op)
    return out


def call(layers: list[Layer], route: tuple[torch.Tensor, ...]) -> float:
    x, ids, w = route
    t0 = time.perf_counter()
    for op in layers:
        op(x, ids, w)
    return (time.perf_counter() - t0) / len(layers)


def line(name: str, seconds: list[float], ids: torch.Tensor) -> str:
    t = statistics.median(seconds)
    gb = torch.unique(ids).numel() * EXPERT_BYTES / t / 1e9
    return (f"{name:28s} {t * 1e3:7.3f} ms  {gb:6.1f} GB/s  "
            f"{ids.numel() * EXPERT_MACS / t / 1e9:6.1f} GMAC/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "?")
    print(f"# {cpu}; {a.threads} thread(s); torch {torch.__version__}; "
          f"load {os.getloadavg()[0]:.2f}")
    cold, cached = layers_of(E, LAYERS, g), layers_of(TOP_K, 1, g)

    def route(tokens: int, experts: int) -> tuple[torch.Tensor, ...]:
        ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)])
        return (torch.randn(tokens, D, generator=g).bfloat16(), ids,
                torch.rand(tokens, TOP_K, generator=g).softmax(-1))

    stream = route(E // TOP_K, E)
    stream[1].copy_(torch.arange(E).view(-1, TOP_K))        # one row an expert
    cases = [("cold, 1 row an expert", cold, stream)]
    cases += [(f"cold, {t} tokens", cold, route(t, E)) for t in a.tokens]
    cases += [(f"cached, {t // TOP_K} rows an expert", cached, route(t // TOP_K, TOP_K))
              for t in a.tokens]
    times: list[list[float]] = [[] for _ in cases]
    with torch.inference_mode():
        for _, layers, r in cases:                       # warm-up: first touches, the pool
            call(layers, r)
        for _ in range(a.rounds):
            for i, (_, layers, r) in enumerate(cases):
                if layers is cached:
                    call(layers, r)
                    times[i].append(statistics.median(call(layers, r) for _ in range(10)))
                else:
                    times[i].append(call(layers, r))
    for (name, _, r), t in zip(cases, times):
        print(line(name, t, r[1]))


if __name__ == "__main__":
    main()
