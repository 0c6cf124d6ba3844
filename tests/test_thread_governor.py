"""The governor lending LLM()'s spare core while no other process uses it
(wideserve/utils/thread_governor.py): its readings of /proc and its decisions."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from wideserve.utils.thread_governor import CpuTimes, GovernorConfig, ThreadGovernor

TICK = os.sysconf("SC_CLK_TCK")


def _proc(tmp_path: Path, cpus: dict[int, list[int]], utime: int, stime: int) -> Path:
    lines = ["cpu  " + " ".join(["999"] * 10)]            # the all-CPU line is not summed
    lines += [f"cpu{c} " + " ".join(map(str, cols)) for c, cols in cpus.items()]
    (tmp_path / "stat").write_text("\n".join(lines) + "\nintr 1 2 3\n")
    (tmp_path / "self").mkdir(exist_ok=True)
    fields = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30
    # a command name with spaces and a parenthesis, as /proc writes it
    (tmp_path / "self" / "stat").write_text("4242 (py (x) y) " + " ".join(fields) + "\n")
    return tmp_path


def test_counters_sum_the_watched_cpus_busy_columns(tmp_path: Path) -> None:
    # user nice system idle iowait irq softirq steal guest guest_nice
    proc = _proc(tmp_path, {0: [10, 1, 5, 500, 7, 2, 3, 4, 0, 0],
                            1: [20, 0, 0, 100, 0, 0, 0, 0, 0, 0],
                            2: [1000, 0, 0, 0, 0, 0, 0, 0, 0, 0]}, utime=12, stime=3)
    got = CpuTimes.read([0, 1], proc)
    assert got == CpuTimes((10 + 1 + 5 + 2 + 3 + 4 + 20) / TICK, 15 / TICK)


def test_counters_missing_give_none(tmp_path: Path) -> None:
    assert CpuTimes.read([0], tmp_path / "absent") is None
    (tmp_path / "stat").write_text("cpu0 1 2 3\n")
    assert CpuTimes.read([0], tmp_path) is None                 # no self/stat


def test_real_counters_grow_with_this_process_work() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    first = CpuTimes.read(cpus)
    assert first is not None
    x = 0
    for i in range(3_000_000):                                    # ~0.1-0.3 s of CPU
        x += i
    second = CpuTimes.read(cpus)
    assert second is not None and second.own_s > first.own_s
    assert second.busy_s - first.busy_s >= second.own_s - first.own_s - 2 / TICK


class Fake:
    """A clock and counters the test moves: each `window(others, own)` is one interval."""

    def __init__(self) -> None:
        self.now, self.busy, self.own = 0.0, 0.0, 0.0
        self.set: list[int] = []
        self.none = False

    def clock(self) -> float:
        return self.now

    def read(self) -> CpuTimes | None:
        return None if self.none else CpuTimes(self.busy, self.own)

    def window(self, others: float, own: float = 1.0, seconds: float = 0.5) -> None:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds


def _governor(fake: Fake, cpus: int = 2, **cfg: int) -> ThreadGovernor:
    return ThreadGovernor(1, 2, list(range(cpus)), fake.set.append,
                          GovernorConfig(**cfg),  # type: ignore[arg-type]
                          read=fake.read, clock=fake.clock)


def test_lends_after_a_quiet_window_and_takes_back_at_once() -> None:
    fake = Fake()
    gov = _governor(fake)
    fake.window(0.05)
    assert gov.tick() == 2 and fake.set == [2]
    fake.window(0.6)                          # another process takes most of a CPU
    assert gov.tick() == 1 and fake.set == [2, 1]
    fake.window(1.0)
    assert gov.tick() == 1 and fake.set == [2, 1]        # no call where nothing changes
    assert gov.switches == 2


def test_each_take_back_doubles_the_wait_until_a_loan_settles() -> None:
    fake = Fake()
    gov = _governor(fake, raise_after_max=4, settle_windows=3)
    waits = []
    for _ in range(4):                        # work that comes and goes
        quiet = 0
        while gov.threads == 1:
            fake.window(0.0)
            gov.tick()
            quiet += 1
        waits.append(quiet)
        fake.window(1.0)
        gov.tick()
    assert waits == [1, 2, 4, 4]
    while gov.threads == 1:
        fake.window(0.0)
        gov.tick()
    for _ in range(3):                        # a loan that lasts
        fake.window(0.0)
        gov.tick()
    fake.window(1.0)
    gov.tick()
    fake.window(0.0)
    assert gov.tick() == 2                    # back to one quiet window


def test_between_the_thresholds_nothing_moves_and_quiet_restarts() -> None:
    fake = Fake()
    gov = _governor(fake, raise_after=2)
    fake.window(0.0)
    gov.tick()
    fake.window(0.2)                          # between raise_below and lower_at
    assert gov.tick() == 1
    fake.window(0.0)
    assert gov.tick() == 1                    # the quiet count started again
    fake.window(0.0)
    assert gov.tick() == 2
    fake.window(0.2)
    assert gov.tick() == 2                    # and a lent core stays lent


def test_reads_once_a_window() -> None:
    fake = Fake()
    gov = _governor(fake)
    reads = []
    gov._read = lambda: reads.append(1) or fake.read()     # type: ignore[method-assign]
    for _ in range(5):
        fake.now += gov.config.interval_s / 6        # steps shorter than a window
        gov.tick()
    assert reads == []
    fake.window(0.0, seconds=gov.config.interval_s / 3)     # past the window
    gov.tick()
    assert reads == [1]


def test_own_work_is_not_others() -> None:
    fake = Fake()
    gov = _governor(fake)
    for _ in range(3):
        fake.window(0.0, own=2.0)             # this process on both CPUs
        gov.tick()
    assert gov.threads == 2


def test_cpus_a_full_team_leaves_free_are_headroom() -> None:
    fake = Fake()                             # 4 CPUs (SMT siblings), a team of 2
    gov = _governor(fake, cpus=4)
    fake.window(1.9)
    assert gov.tick() == 2                    # others fit on the two CPUs left over
    fake.window(2.5)
    assert gov.tick() == 1


def test_the_first_window_is_completed_and_decided() -> None:
    fake = Fake()
    gov = _governor(fake)
    slept: list[float] = []

    def sleep(seconds: float) -> None:       # the engine loaded in a fifth of a window
        slept.append(seconds)
        fake.window(0.0, seconds=seconds)
    fake.window(0.0, seconds=gov.config.interval_s / 5)
    assert gov.first_window(sleep) == 2
    assert slept == [pytest.approx(gov.config.interval_s * 4 / 5)]
    slow = _governor(fake)                    # a load longer than a window: no sleep
    fake.window(0.0, seconds=2 * gov.config.interval_s)
    assert slow.first_window(sleep) == 2 and len(slept) == 1


def test_unreadable_counters_keep_the_plans_count() -> None:
    fake = Fake()
    fake.none = True
    gov = _governor(fake)
    for _ in range(4):
        fake.window(0.0)
        assert gov.tick() == 1
    assert fake.set == []


def test_bad_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="low < high"):
        ThreadGovernor(2, 2, [0, 1], print)
    with pytest.raises(ValueError, match="low < high"):
        ThreadGovernor(0, 2, [0, 1], print)
