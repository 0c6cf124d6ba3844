"""Timing kernel candidates against each other (kernels/choice.py; docs/cpu_kernels.md,
"Kernel choice by measurement"): interleaved rounds on a clock that, at one torch thread,
counts only this thread's CPU time, so a shared machine's other processes do not bias it."""
from __future__ import annotations

import time
from typing import Callable

import torch


def clock_of(name: str) -> Callable[[], float]:
    """The clock timings read: "cpu" the calling thread's CPU time (at one torch thread every
    timed call runs on it, and time slices given to other processes of a shared machine do
    not count), "wall" perf_counter, "auto" cpu where torch runs one thread."""
    if name == "auto":
        name = "cpu" if torch.get_num_threads() == 1 else "wall"
    return time.thread_time if name == "cpu" else time.perf_counter


def time_interleaved(fns: dict[str, Callable[[], object]], min_reps: int, max_reps: int,
                     min_time_s: float, clock: str = "auto") -> dict[str, list[float]]:
    """Seconds of each call of each fn: every round calls all fns once, starting one further
    along each round, until `min_reps` rounds and `min_time_s` in all, or `max_reps` rounds."""
    now = clock_of(clock)
    for fn in fns.values():
        fn()                                   # warm: first-call setup, caches
    names = list(fns)
    samples: dict[str, list[float]] = {c: [] for c in names}
    spent, reps = 0.0, 0
    while reps < max_reps and (reps < min_reps or spent < min_time_s):
        for j in range(len(names)):
            c = names[(reps + j) % len(names)]
            t0 = now()
            fns[c]()
            dt = now() - t0
            samples[c].append(dt)
            spent += dt
        reps += 1
    return samples


def matmul_peak_gmacs(n: int = 2048, repeats: int = 5, clock: str = "auto") -> float:
    """The machine's measured bf16 matmul peak at torch's current thread count: GMAC/s (1e9
    multiply-adds a second) of the best of `repeats` `torch.mm` of n^3 (oneDNN; AMX where
    present), after one untimed call. What the benchmarks compare kernels and steps against."""
    now = clock_of(clock)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).bfloat16()
    b = torch.randn(n, n, generator=g).bfloat16()
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = now()
        torch.mm(a, b)
        best = min(best, now() - t)
    return n ** 3 / best / 1e9
