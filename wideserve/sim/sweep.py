"""Sweep layouts and keep the Pareto frontier: throughput per GPU vs P90 tokens/s per user
(the axes InferenceMAX and the recipe's charts use). A layout is on the frontier when no
other layout is at least as good on both axes and better on one."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from wideserve.sim.eplb import EplbSettings
from wideserve.sim.simulator import Layout, SimResult, Simulation


def layouts(base: Layout, deps: list[int], batches: list[int], mtps: list[int],
            eplb: list[bool], prefill: list[int]) -> Iterator[Layout]:
    for dep, b, k, e, p in itertools.product(deps, batches, mtps, eplb, prefill):
        yield replace(base, dep=dep, batch=b, mtp_k=k,
                      eplb=replace(base.eplb, enabled=e) if e else EplbSettings(),
                      pd=replace(base.pd, prefill_instances=p))


def run_sweep(make: Callable[[Layout], Simulation], grid: list[Layout], steps: int
              ) -> list[SimResult]:
    return [make(lay).run(steps) for lay in grid]


def pareto(results: list[SimResult]) -> list[SimResult]:
    def dominated(a: SimResult) -> bool:
        return any(b.tok_s_per_gpu >= a.tok_s_per_gpu and b.p90_user_tok_s >= a.p90_user_tok_s
                   and (b.tok_s_per_gpu > a.tok_s_per_gpu or b.p90_user_tok_s > a.p90_user_tok_s)
                   for b in results)
    return sorted((r for r in results if not dominated(r)), key=lambda r: r.p90_user_tok_s)


def label(lay: Layout) -> str:
    return (f"DEP{lay.dep} b{lay.batch} mtp{lay.mtp_k} eplb{'on' if lay.eplb.enabled else 'off'}"
            f" P{lay.pd.prefill_instances}")


def table(results: list[SimResult], frontier: list[SimResult]) -> list[str]:
    on = {id(r) for r in frontier}
    lines = [f"{'layout':34s} {'tok/s/GPU':>10s} {'P50 user':>9s} {'P90 user':>9s} "
             f"{'step ms':>8s} {'TTFT p50':>9s} {'$/Mtok':>7s}  frontier"]
    for r in sorted(results, key=lambda r: -r.tok_s_per_gpu):
        ttft = f"{r.ttft_p50_s:.2f}s" if r.ttft_p50_s is not None else "-"
        usd = f"{r.usd_per_mtok:.3f}" if r.usd_per_mtok is not None else "-"
        lines.append(f"{label(r.layout):34s} {r.tok_s_per_gpu:10.0f} {r.p50_user_tok_s:9.1f} "
                     f"{r.p90_user_tok_s:9.1f} {r.step_ms:8.2f} {ttft:>9s} {usd:>7s}  "
                     f"{'*' if id(r) in on else ''}")
    return lines


def plot(results: list[SimResult], frontier: list[SimResult], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter([r.p90_user_tok_s for r in results], [r.tok_s_per_gpu for r in results],
               s=12, c="0.6", label="layouts")
    ax.plot([r.p90_user_tok_s for r in frontier], [r.tok_s_per_gpu for r in frontier],
            "o-", c="C3", label="Pareto frontier")
    for r in frontier:
        ax.annotate(label(r.layout), (r.p90_user_tok_s, r.tok_s_per_gpu), fontsize=6)
    ax.set_xlabel("P90 tokens/s per user")
    ax.set_ylabel("output tokens/s per GPU")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
