"""Weight streaming on and off (kernels/weight_stream.py; docs/cpu_kernels.md and
BENCHMARKS.md, "Weight streaming"): the fused routed-experts op on the 653M model's expert
shapes (64 experts, top-8, hidden 1,024, width 384, bf16), eight layers of their own (1.2 GB,
past the caches) called in turn as a step calls them, so every call finds its weights cold.

  PYTHONPATH=. python benchmarks/weight_streaming.py [--threads 1] [--rounds 5]

The computing thread is bound to the first CPU this process may use and the helper to the
second (as a served engine and its front end's core). Routing: "uniform" (each token's 8
experts drawn uniformly) and "skewed" (drawn with weight 1/(rank+1)^1.5, as the 653M model
routes random prompt tokens: a few experts take most rows). Per token count and routing, the
median over rounds of the eight calls' total, off and on alternating; outputs compared.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moe_fused_vs_onednn import D, E, TOP_K, fused_layer    # this directory (sys.path[0])
from wideserve.kernels import weight_stream

LAYERS = 8


def routing(tokens: int, kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "uniform":
        probs = torch.ones(E)
    else:
        probs = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        probs = probs[torch.randperm(E, generator=g)]
    ids = torch.stack([torch.multinomial(probs, TOP_K, generator=g) for _ in range(tokens)])
    return ids, torch.rand(tokens, TOP_K, generator=g).softmax(-1)


def bind_compute(threads: int) -> list[int]:
    """Binds this process to its first `threads` CPUs (all of them when it has no more) and
    returns the CPU for the helper: the next one (the last where none is left)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs two CPUs: one computes, the helper streams on the other")
    os.sched_setaffinity(0, cpus[:threads] if threads < len(cpus) else cpus)
    return cpus[threads:threads + 1] or cpus[-1:]


def step(layers, inputs) -> tuple[float, list[torch.Tensor]]:
    t0 = time.perf_counter()
    outs = [m(x, ids, w) for m, (x, ids, w) in zip(layers, inputs)]
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 128, 512, 2048])
    ap.add_argument("--routing", nargs="+", default=["uniform", "skewed"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    helper = bind_compute(a.threads)
    torch.set_num_threads(a.threads)
    layers = []
    for i in range(LAYERS):
        m = fused_layer()
        with torch.no_grad():
            m.gate_up_proj.add_(i * 1e-3)             # distinct weights per layer
        layers.append(m)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "?")
    print(f"# {cpu}; CLDEMOTE {weight_stream.demotes()}; load {os.getloadavg()[0]:.2f}; "
          f"torch {torch.__version__}; {a.threads} thread(s) on CPU {cpus[:a.threads]}, "
          f"helper on CPU {helper}; {LAYERS} layers of 64 experts")
    per_expert = None
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for kind in a.routing:
            for tokens in a.tokens:
                inputs = []
                for _ in range(LAYERS):
                    ids, w = routing(tokens, kind, g)
                    inputs.append((torch.randn(tokens, D, generator=g).bfloat16(), ids, w))
                _, ref = step(layers, inputs)                  # packs the weights once
                if per_expert is None:
                    p = layers[0]._packs
                    per_expert = p.w13[0].nbytes + p.w2[0].nbytes
                mb = sum(ids.unique().numel() for _, ids, _ in inputs) * per_expert / 1e6
                times: dict[bool, list[float]] = {False: [], True: []}
                for r in range(a.rounds):
                    for on in ((False, True) if r % 2 == 0 else (True, False)):
                        if on:
                            weight_stream.start(helper)
                        t, outs = step(layers, inputs)
                        weight_stream.stop()
                        assert all(torch.equal(o, e) for o, e in zip(outs, ref))
                        times[on].append(t)
                off, on_ = (statistics.median(times[k]) for k in (False, True))
                print(f"{kind} {tokens} tokens ({mb:.0f} MB of experts over {LAYERS} layers): "
                      f"off {off * 1e3:.2f} ms ({mb / 1e3 / off:.1f} GB/s), on "
                      f"{on_ * 1e3:.2f} ms ({mb / 1e3 / on_:.1f} GB/s): {off / on_:.2f}x",
                      flush=True)


if __name__ == "__main__":
    main()
