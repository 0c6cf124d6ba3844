"""Host noise from a measured distribution: preemptions as a Poisson process.

Calibration times a fixed small host task many times. Samples near the median are the task;
a sample more than twice the median was interrupted (the OS ran something else). From those:
rate = interruptions per second of running, and the measured delays (sample - median). A
stretch of L seconds of host work then suffers Poisson(rate * L) interruptions, each a delay
drawn from the measured ones. Lock-step ranks meet at every collective: each meeting costs
every rank max_r X_r - mean_r X_r beyond a lone rank's own noise (which its measured costs
already contain).
"""
from __future__ import annotations

import numpy as np


class HostNoise:
    def __init__(self, samples: list[float] | np.ndarray) -> None:
        s = np.asarray(samples, dtype=np.float64)
        if s.size == 0:
            s = np.zeros(1)
        base = float(np.median(s))
        hit = s > 2 * base if base > 0 else np.zeros_like(s, dtype=bool)
        self.rate = float(hit.sum() / max(s.sum(), 1e-12))
        self.delays = (s[hit] - base) if hit.any() else np.zeros(1)

    def draw(self, length_s: float, shape: tuple[int, ...], rng: np.random.Generator
             ) -> np.ndarray:
        """Total delay of each of `shape` independent stretches of `length_s` host work."""
        n = rng.poisson(self.rate * max(length_s, 0.0), shape)
        if not n.any():
            return np.zeros(shape)
        out = np.zeros(shape)
        for idx in zip(*np.nonzero(n)):
            out[idx] = rng.choice(self.delays, n[idx]).sum()
        return out

    def lockstep_wait(self, points: int, segment_s: float, ranks: int,
                      rng: np.random.Generator) -> float:
        """Expected-by-draw extra wait of `points` meetings of `ranks` lock-step ranks."""
        if ranks <= 1 or points <= 0:
            return 0.0
        x = self.draw(segment_s, (points, ranks), rng)
        return float((x.max(axis=1) - x.mean(axis=1)).sum())
