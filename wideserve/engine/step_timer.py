"""Where each engine step's time goes (docs/host_path.md).

On an asynchronous device (CUDA) the timer synchronises before reading the clock, so a
phase is billed for the device work it launched (the forward is not billed to sampling).
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

PHASES = ("schedule", "prepare", "forward", "sample", "output")
# Upper bounds of the tokens-per-step histogram: vLLM's vllm:iteration_tokens_total buckets.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class StepStats:
    """Totals since start; divide by `steps` for means."""

    steps: int = 0
    tokens: int = 0
    requests: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    last_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    last_tokens: int = 0
    # Steps per ITERATION_TOKEN_BUCKETS bucket (not cumulative; the last one is +Inf).
    token_histogram: list[int] = field(
        default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))


class StepTimer:
    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        """sync: waits for the device's queued work (None on synchronous devices)."""
        self.sync = sync
        self.stats = StepStats()
        self._t = 0.0
        self._current: dict[str, float] = {}

    def start(self) -> None:
        self._current = dict.fromkeys(PHASES, 0.0)
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self._current[phase] += now - self._t
        self._t = now

    def finish(self, num_tokens: int, num_requests: int) -> None:
        s = self.stats
        if num_tokens == 0:
            return      # idle polls are not steps
        s.steps += 1
        s.tokens += num_tokens
        s.requests += num_requests
        s.last_tokens = num_tokens
        s.token_histogram[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        s.last_seconds = self._current
        for k, v in self._current.items():
            s.seconds[k] += v
