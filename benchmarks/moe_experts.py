"""Routed-expert implementations side by side (BENCHMARKS.md, "Routed experts").

Times RoutedExperts.forward for each implementation (`--impls`, default all of EXPERT_IMPLS)
on the expert shapes of the two Qwen3-MoE benchmark models, at decode-like and prefill-like
token counts (`--tokens`), alternating the implementations in one run (the machine is shared and noisy), and
prints the fastest per shape; outputs are checked equal to the loop's.

  PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/moe_experts.py [--dtype bfloat16] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from wideserve.layers.experts import EXPERT_IMPLS, RoutedExperts

SHAPES = {  # name: (experts, top-k, hidden, moe_intermediate)
    "qwen3moe-11m": (8, 2, 256, 256),
    "qwen3moe-653m": (64, 8, 1024, 384),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(shape: str, tokens: int, dtype: torch.dtype, device: torch.device,
        rounds: int, impls: tuple[str, ...]) -> dict[str, float]:
    E, k, d, I = SHAPES[shape]
    torch.manual_seed(0)
    m = RoutedExperts(E, d, I).to(device=device, dtype=dtype)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.05)
        m.down_proj.normal_(0, 0.05)
    x = torch.randn(tokens, d, dtype=dtype, device=device)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(tokens)]).to(device)
    w = torch.rand(tokens, k, device=device)
    times: dict[str, list[float]] = {i: [] for i in impls}
    ref = None
    with torch.inference_mode():
        for _ in range(rounds):
            for impl in impls:          # alternate: noise hits every impl alike
                m.impl = impl
                m._resolved.clear()
                m(x, ids, w)                   # warm
                _sync(device)
                t = time.perf_counter()
                out = m(x, ids, w)
                _sync(device)
                times[impl].append(time.perf_counter() - t)
                if impl == "loop":
                    ref = out
                else:
                    # bf16 paths round at different points: 2% of the output's scale
                    scale = ref.abs().max().item() if tokens else 0.0
                    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * scale)
    return {i: statistics.median(v) * 1e3 for i, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--impls", default=",".join(EXPERT_IMPLS),
                    help="comma-separated; the loop always runs first (the others are checked "
                         "against it)")
    ap.add_argument("--tokens", default="1,16,64,512")
    args = ap.parse_args()
    impls = ("loop",) + tuple(i for i in args.impls.split(",") if i != "loop")
    torch.set_num_threads(1)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    print(f"| shape | tokens | {' | '.join(impls)} (ms, median of {args.rounds}) "
          f"| fastest |")
    print("|---|---|" + "---|" * len(impls) + "---|")
    for shape in SHAPES:
        for tokens in (int(t) for t in args.tokens.split(",")):
            ms = run(shape, tokens, dtype, device, args.rounds, impls)
            best = min(ms, key=ms.get)
            print(f"| {shape} | {tokens} | " + " | ".join(f"{ms[i]:.2f}" for i in impls)
                  + f" | {best} |", flush=True)


if __name__ == "__main__":
    main()
