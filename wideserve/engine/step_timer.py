"""Where each engine step's time goes (docs/host_path.md).

Off (`enabled=False`): the step counts are kept (steps, tokens, the tokens-per-step
histogram) and nothing else: no clock read, no event, no synchronisation.

On, the phases are timed on the device's clock so that a phase is billed for the device work
it launched (the forward is not billed to sampling):
- on the CPU (synchronous) the host clock at each mark;
- on CUDA an event recorded on the current stream at each mark, never a synchronisation:
  the device stamps each event when it reaches it. A step's events are read once, when the
  next step starts or when the stats are read (`stats`), by which time the step's sampled
  tokens have been read back, so its events have completed and the read does not wait.
"""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

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


class TimingEvent(Protocol):
    """What StepTimer needs of a device event (torch.cuda.Event with enable_timing)."""

    def record(self) -> None: ...

    def elapsed_time(self, end: Any) -> float:        # milliseconds
        ...

    def synchronize(self) -> None: ...


def cuda_event_factory(device: torch.device) -> Callable[[], TimingEvent]:
    def make() -> TimingEvent:
        return torch.cuda.Event(enable_timing=True)
    return make


class StepTimer:
    def __init__(self, device: torch.device | None = None, enabled: bool = True,
                 event_factory: Callable[[], TimingEvent] | None = None) -> None:
        """device: where the forward runs (None or the CPU: the host clock); enabled: time
        the phases (False: counts only); event_factory: the device's timing events (default
        torch.cuda.Event on CUDA; tests pass fakes)."""
        self.enabled = enabled
        if event_factory is None and device is not None and device.type == "cuda":
            event_factory = cuda_event_factory(device)
        self._events = event_factory if enabled else None
        self._stats = StepStats()
        self._t = 0.0
        self._current: dict[str, float] = {}
        self._marks: list[tuple[str, TimingEvent]] = []       # this step's, on the device
        self._pending: list[tuple[str, TimingEvent]] = []     # a finished step's, unread

    @property
    def stats(self) -> StepStats:
        """The totals, with a finished step's device events folded in first."""
        self._resolve()
        return self._stats

    def start(self) -> None:
        if not self.enabled:
            return
        if self._events is not None:
            self._resolve()
            self._marks = [("", self._record())]
            return
        self._current = dict.fromkeys(PHASES, 0.0)
        self._t = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        if self._events is not None:
            self._marks.append((phase, self._record()))
            return
        now = time.perf_counter()
        self._current[phase] += now - self._t
        self._t = now

    def finish(self, num_tokens: int, num_requests: int) -> None:
        s = self._stats
        if num_tokens == 0:
            self._marks = []
            return      # idle polls are not steps
        s.steps += 1
        s.tokens += num_tokens
        s.requests += num_requests
        s.last_tokens = num_tokens
        s.token_histogram[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
        if not self.enabled:
            return
        if self._events is not None:
            self._pending, self._marks = self._marks, []
            return
        self._add(self._current)

    # ---------------------------------------------------------------------- helpers
    def _record(self) -> TimingEvent:
        assert self._events is not None
        event = self._events()
        event.record()
        return event

    def _resolve(self) -> None:
        """Fold the last finished step's events into the totals (one read per step)."""
        if not self._pending:
            return
        marks, self._pending = self._pending, []
        marks[-1][1].synchronize()         # complete already: the step read its tokens back
        seconds = dict.fromkeys(PHASES, 0.0)
        for (_, begin), (phase, end) in zip(marks, marks[1:]):
            seconds[phase] += begin.elapsed_time(end) / 1e3
        self._add(seconds)

    def _add(self, seconds: dict[str, float]) -> None:
        s = self._stats
        s.last_seconds = seconds
        for k, v in seconds.items():
            s.seconds[k] += v
