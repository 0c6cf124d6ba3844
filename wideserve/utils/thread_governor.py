"""The spare cores of a thread plan lent to its engine while nothing else uses them
(docs/cpu_kernels.md, "Threads"): `LLM()`'s in-process engine (the core left to the caller's
other work) and a single served engine (the core kept for its front end).

An automatic plan (utils/threads.py) keeps a core for other work: `LLM()` runs one torch
thread fewer than the cores, a served engine leaves one to its front end. An OpenMP team as
wide as the machine loses most of its speed as soon as another process wants a core (its
threads wait at every barrier for the one that was descheduled), while one thread fewer costs
up to 1/N on an idle machine. On 2 cores of a Zen 5 the second thread is worth 1.5-1.8x
offline when idle, and beside a busy process it makes the engine 1.5-2.2x slower than one
thread (BENCHMARKS.md, "Zen 5: the spare core lent while idle"). The governor takes the
better of both: between engine steps, at most every `interval_s`, it reads how much CPU time
the other processes took on the plan's CPUs (/proc/stat's busy time less this process's own,
/proc/self/stat); it runs the full count once they took less than `raise_below` of a CPU
over `raise_after` readings in a row, and the plan's count as soon as they take `lower_at`
or more. Each take-back doubles the quiet readings the next loan waits for (work that comes
and goes is not chased), unless the loan lasted `settle_windows`. What it changes is torch's
thread count (and a bound plan's CPUs: `ThreadPlan.set_count`): layers keyed on the count
re-plan from their cached kernel tables and keep their packed weights (layers/linear.py).

Off where the spare core has another use or the count must not move (engine/spare_core.py):
a count that was set (`--threads`, `threads=`, OMP_NUM_THREADS), data-parallel ranks, the
weight-streaming helper on that core, batch-invariant mode (a bucket's kernel may differ
between counts, and with it the last bits), one core, or no /proc (then `CpuTimes.read`
returns None and the plan's count stays).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# /proc/stat's per-CPU columns that count as busy: user nice system idle iowait irq softirq
# steal (guest time is already inside user). Steal counts as another's work: a vCPU the host
# took away stalls a team's barrier as a descheduled thread does.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """Cumulative CPU seconds: all processes on the watched CPUs, and this process alone."""
    busy_s: float
    own_s: float

    @staticmethod
    def read(cpus: Sequence[int], proc: Path = Path("/proc")) -> "CpuTimes | None":
        """The counters now, None where /proc cannot be read (not Linux, a sandbox)."""
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        want = {f"cpu{c}" for c in cpus}
        try:
            busy = 0
            for line in (proc / "stat").read_text().splitlines():
                name, _, rest = line.partition(" ")
                if name in want:
                    cols = rest.split()
                    busy += sum(int(cols[i]) for i in _BUSY_COLUMNS if i < len(cols))
            # fields after the command's closing parenthesis: utime is the 12th, stime 13th
            own = (proc / "self" / "stat").read_text().rpartition(")")[2].split()
            return CpuTimes(busy / tick, (int(own[11]) + int(own[12])) / tick)
        except (OSError, ValueError, IndexError):
            return None


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    interval_s: float = 0.25     # the shortest reading window (clock ticks are 10 ms)
    lower_at: float = 0.3        # others' CPUs in a window that take the spare core back
    raise_below: float = 0.15    # others' CPUs in a window under which it may be lent ...
    raise_after: int = 1         # ... after this many such windows in a row, doubled at each
    raise_after_max: int = 16    # take-back up to this (work that comes and goes is not
                                 # chased: each wrong loan costs a window at the slow speed)
    settle_windows: int = 20     # a loan that lasted this many windows: its take-back
                                 # starts over at raise_after


class ThreadGovernor:
    """Runs `high` torch threads while the other processes leave the spare CPU idle, `low`
    otherwise (module doc). `tick()` is called between engine steps."""

    def __init__(self, low: int, high: int, cpus: Sequence[int],
                 set_threads: Callable[[int], None],
                 config: GovernorConfig | None = None,
                 read: Callable[[], CpuTimes | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 since: "tuple[float, CpuTimes | None] | None" = None) -> None:
        """`set_threads`: runs a count (ThreadPlan.set_count). `since`: (clock, counters)
        where the first window starts (`reading_now()` taken
        before the engine loaded: the first step then decides on the whole load's window);
        default now."""
        if not 1 <= low < high:
            raise ValueError(f"a governor needs 1 <= low < high, got {low}, {high}")
        self.low, self.high = low, high
        self.config = config or GovernorConfig()
        # CPUs a full team leaves free (SMT siblings): others may use them without
        # descheduling a thread of ours.
        self._headroom = max(0, len(cpus) - high)
        self._read = read or (lambda: CpuTimes.read(cpus))
        self._set = set_threads
        self._clock = clock
        self.threads = low
        self.switches = 0
        self._quiet = 0                     # quiet windows in a row at `low`
        self._lent = 0                      # windows in a row at `high`
        self._need = self.config.raise_after
        self._last = since if since is not None else (clock(), self._read())

    def tick(self) -> int:
        """Reads the counters once a window has passed; returns the thread count to run."""
        now = self._clock()
        start, before = self._last
        if now - start < self.config.interval_s:
            return self.threads
        after = self._read()
        self._last = (now, after)
        if before is None or after is None:
            return self.threads
        others = max(0.0, (after.busy_s - before.busy_s) - (after.own_s - before.own_s))
        self._decide(others / (now - start) - self._headroom)
        return self.threads

    def first_window(self, sleep: Callable[[float], None] = time.sleep) -> int:
        """Completes the first window (sleeping what is left of `interval_s`: only where the
        engine loaded faster than that) and decides on it, so that the first step already
        runs the count it says."""
        left = self.config.interval_s - (self._clock() - self._last[0])
        if left > 0:
            sleep(left)
        return self.tick()

    def _decide(self, others: float) -> None:
        cfg = self.config
        if others >= cfg.lower_at:
            self._quiet = 0
            if self.threads == self.high:     # a loan that lasted starts a new episode
                self._need = cfg.raise_after if self._lent >= cfg.settle_windows else \
                    min(2 * self._need, cfg.raise_after_max)
                self._switch(self.low, others)
        elif self.threads == self.high:
            self._lent += 1
        elif others < cfg.raise_below:
            self._quiet += 1
            if self._quiet >= self._need:
                self._lent = 0
                self._switch(self.high, others)
        else:
            self._quiet = 0

    def _switch(self, threads: int, others: float) -> None:
        if threads == self.threads:
            return
        self._set(threads)
        self.threads = threads
        self.switches += 1
        logger.info("threads: %d (other processes used %.2f CPUs of the last window)",
                    threads, max(0.0, others))


def reading_now(cpus: Sequence[int]) -> tuple[float, CpuTimes | None]:
    """A window's start for `ThreadGovernor(since=...)`, on the default clock and counters."""
    return time.monotonic(), CpuTimes.read(cpus)
