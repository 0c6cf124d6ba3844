"""Expert routing load and the project's own EPLB policy, inside the simulator.

The routing statistic is a per-layer share of routed rows per logical expert ([L, E], rows
sum to 1): a Zipf-like synthetic (`parallel/eplb/synthetic.py`, the generator the policy's
tests and benchmarks use) or a recorded load (an engine's EPLB window, a trace). Every
`interval` steps the load recorded over the first `window` steps after the last rebalance is
handed to `distributed/eplb/policy.rebalance` (the code the engine runs), which returns the
new placement; between rebalances each rank receives the rows its slots' experts draw.
Target and draft models each get their own EplbState.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from wideserve.parallel.eplb import policy
from wideserve.parallel.eplb.synthetic import SkewedLoad


def zipf_shares(layers: int, experts: int, skew: float, seed: int = 0) -> np.ndarray:
    return SkewedLoad(layers=layers, experts=experts, skew=skew, seed=seed).shares()


@dataclass(slots=True)
class EplbSettings:
    enabled: bool = False
    interval: int = 3000           # steps between rebalances
    window: int = 1000             # steps of load recorded after each rebalance
    redundant: int = 0             # extra physical slots per layer


class EplbState:
    def __init__(self, shares: np.ndarray, ranks: int, settings: EplbSettings,
                 seed: int = 0) -> None:
        self.shares = np.asarray(shares, dtype=np.float64)
        self.layers, self.experts = self.shares.shape
        self.ranks, self.s = ranks, settings
        slots = self.experts + (settings.redundant if settings.enabled else 0)
        if slots % ranks:
            raise ValueError(f"{slots} physical experts do not split over {ranks} ranks "
                             f"(set the EPLB redundant experts so experts + redundant is a "
                             f"multiple of the DEP size)")
        self.slots = slots
        self.phy2log = policy.identity_placement(self.layers, self.experts, slots)
        self.window_load = np.zeros_like(self.shares)
        self.rng = np.random.default_rng(seed)
        self.rebalances = 0
        self.history: list[tuple[int, float]] = [(0, self.balancedness())]

    def rank_rows(self, total_rows: float) -> np.ndarray:
        """[L, R] expected rows per rank this step under the current placement."""
        return policy.rank_loads(self.shares * total_rows, self.phy2log,
                                 self.ranks).numpy()

    def balancedness(self) -> float:
        return policy.balancedness(policy.rank_loads(self.shares, self.phy2log, self.ranks))

    def after_step(self, step: int, total_rows: float) -> None:
        """Record this step's routed rows (a multinomial draw) and rebalance on schedule."""
        if not self.s.enabled:
            return
        since = step % self.s.interval
        if since < self.s.window and total_rows > 0:
            n = int(round(total_rows))
            self.window_load += np.stack([self.rng.multinomial(n, row) for row in self.shares])
        if since == self.s.interval - 1:
            new = policy.rebalance(self.window_load, self.slots, self.ranks)
            self.phy2log = policy.align_to_current(new, self.phy2log, self.ranks)
            self.window_load[:] = 0
            self.rebalances += 1
            self.history.append((step + 1, self.balancedness()))


def eplb_schedule(steps: int, interval: int | None, window: int | None
                  ) -> tuple[int, int, str | None]:
    """(interval, window, warning): defaults sized to the run (the first rebalance comes after
    `interval` steps, so an interval >= --steps never rebalances)."""
    if steps < 1:
        raise ValueError("--steps must be >= 1")
    interval = interval if interval is not None else max(2, steps // 4)
    window = window if window is not None else max(1, interval // 3)
    if interval < 1 or window < 1:
        raise ValueError("--eplb-interval and --eplb-window must be >= 1")
    if window > interval:
        raise ValueError(f"--eplb-window ({window}) must not exceed --eplb-interval "
                         f"({interval})")
    warn = None
    if interval >= steps:
        warn = (f"warning: --eplb-interval {interval} >= --steps {steps}: EPLB never "
                f"rebalances in this run (EPLB on = the identity placement)")
    return interval, window, warn
