"""Cost of one operation: collectives (latency-bandwidth model) and compute (roofline on a
described GPU, measured tables on a calibrated machine).

Collectives, with alpha = per-message latency, beta = bytes/s per link direction, n ranks,
m bytes per rank (standard alpha-beta model, Thakur et al. 2005):
- ring all-reduce:               2(n-1) * alpha + 2 (n-1)/n * m / beta
- recursive-doubling all-reduce: ceil(log2 n) * (alpha + m / beta)
- all-to-all (pairwise):         (n-1) * alpha + (n-1)/n * m / beta
- all-to-all (concurrent, GPU):   alpha + (n-1)/n * m / beta
The per-step DP "shape" sync is a tiny all-reduce, so its latency term is all that matters:
2(n-1) messages for a ring against log2 n for recursive doubling.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from wideserve.sim.hardware import Hardware


def allreduce_s(ranks: int, nbytes: float, alpha: float, beta: float, algo: str) -> float:
    if ranks <= 1:
        return 0.0
    if algo == "ring":
        return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes / beta
    if algo in ("rd", "recursive_doubling"):
        return math.ceil(math.log2(ranks)) * (alpha + nbytes / beta)
    raise ValueError(f"all-reduce algorithm must be ring or rd, got {algo!r}")


def alltoall_s(ranks: int, nbytes: float, alpha: float, beta: float,
               concurrent: bool = False) -> float:
    """nbytes: what one rank sends in total (its share to itself stays local). Pairwise
    exchange pays the latency once per peer; a switched GPU fabric written by one kernel to
    every peer at once (NVSwitch, DeepEP-style) pays it once."""
    if ranks <= 1:
        return 0.0
    return (1 if concurrent else ranks - 1) * alpha + (ranks - 1) / ranks * nbytes / beta


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through measured points; linear extrapolation past the ends
    (measured costs grow with shape: never extrapolated below the first point's cost)."""
    if len(xs) == 1:
        return float(ys[0]) * max(x, 1e-12) / max(xs[0], 1e-12)
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(y, float(ys[0]) if x >= xs[0] else y0 * x / x0)


def roofline_s(hw: Hardware, flops: float, nbytes: float, dtype: str, kernels: int = 1) -> float:
    """max(compute, memory) at peak, plus the gap between dependent kernels."""
    return max(flops / hw.peak(dtype), nbytes / hw.mem_bytes_per_s) + kernels * hw.kernel_gap_s
