"""Arrivals after idle (engine/engine_proc.py): an idle engine woken by a request takes the
ones that follow it within `arrival_gap_ms` (at most `arrival_wait_max_ms`) before it steps,
so a burst shares one prefill step; a busy engine never waits. Driven in-process with a fake
clock and a fake input socket whose messages arrive at scripted times, so nothing here
depends on real timing."""
from __future__ import annotations

from typing import Any

import pytest
import zmq

from wideserve.engine import engine_proc
from wideserve.engine.engine_proc import EngineLoop


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic


class _Frame:
    def __init__(self, data: bytes) -> None:
        self.bytes = data


class _Socket:
    """Messages that reach the socket at scripted times (seconds after the start)."""

    def __init__(self, clock: _Clock, arrivals_ms: list[float]) -> None:
        self.clock = clock
        self.pending = [(clock.now + ms / 1000, str(i).encode()) for i, ms in
                        enumerate(sorted(arrivals_ms))]
        self.polls: list[int] = []

    def _ready(self) -> bool:
        return bool(self.pending) and self.pending[0][0] <= self.clock.now

    def poll(self, timeout_ms: int) -> bool:
        self.polls.append(timeout_ms)
        if self._ready():
            return True
        if self.pending and self.pending[0][0] - self.clock.now <= timeout_ms / 1000:
            self.clock.now = self.pending[0][0]
            return True
        self.clock.now += timeout_ms / 1000
        return False

    def getsockopt(self, opt: int) -> int:
        assert opt == zmq.EVENTS
        return zmq.POLLIN if self._ready() else 0

    def recv(self, flags: int, copy: bool) -> _Frame:
        return _Frame(self.pending.pop(0)[1])

    def close(self, linger: int = 0) -> None:
        pass


class _Engine:
    """Each step serves every request it holds in one go (a prefill that finishes them) and
    takes `step_ms`; like EngineCore, a step that finished requests owes one bookkeeping
    step (unfinished, but nothing live)."""

    def __init__(self, loop_ref: list[EngineLoop], steps: int,
                 running: list[bytes] | None = None, step_ms: float = 0.0) -> None:
        self.loop_ref, self.steps_left, self.step_ms = loop_ref, steps, step_ms
        self.held: list[bytes] = list(running or [])
        self.owed = False
        self.steps: list[list[bytes]] = []
        self.step_at: list[float] = []

    def add_request(self, req: bytes) -> None:
        self.held.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.held) or self.owed

    def has_live_requests(self) -> bool:
        return bool(self.held)

    def step(self) -> list[Any]:
        self.owed = bool(self.held)
        if not self.held:
            return []                           # the bookkeeping step: not counted
        self.steps.append(self.held)
        self.step_at.append(engine_proc.time.monotonic())
        engine_proc.time.now += self.step_ms / 1000     # type: ignore[attr-defined]
        self.held = []
        self.steps_left -= 1
        if self.steps_left == 0:
            self.loop_ref[0].running = False
        return []

    def get_stats(self) -> dict[str, Any]:
        return {}


@pytest.fixture
def make_loop(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(engine_proc, "time", clock)
    made: list[EngineLoop] = []

    def make(arrivals_ms: list[float], gap_ms: float, max_ms: float, steps: int = 1,
             running: list[bytes] | None = None, step_ms: float = 0.0,
             pending: list[int] | None = None) -> tuple[EngineLoop, _Engine, _Socket]:
        ref: list[EngineLoop] = []
        engine = _Engine(ref, steps, running, step_ms)
        lp = EngineLoop(engine, f"ipc://{tmp_path}/in{len(made)}",
                        f"ipc://{tmp_path}/out{len(made)}", None)
        made.append(lp)
        ref.append(lp)
        lp.set_arrival_window(gap_ms, max_ms)
        lp.in_sock.close(linger=0)
        sock = _Socket(clock, arrivals_ms)
        lp.in_sock = sock                       # type: ignore[assignment]
        if pending is None:
            lp._handle = engine.add_request     # type: ignore[method-assign]
        else:                                   # message i says the front end holds pending[i]
            def handle(data: bytes) -> None:
                lp.front_pending = pending[int(data)]
                engine.add_request(data)
            lp._handle = handle                 # type: ignore[method-assign]
        lp.send = lambda msg: None              # type: ignore[method-assign]
        return lp, engine, sock
    yield make, clock
    for lp in made:
        lp.close()


def test_a_burst_after_idle_shares_one_step(make_loop):
    make, _ = make_loop
    # Four requests sent together reach the engine up to 2.5 ms apart.
    lp, engine, _ = make([0.0, 1.0, 1.5, 2.5], gap_ms=2.0, max_ms=30.0)
    lp.run()
    assert [len(s) for s in engine.steps] == [4]


def test_window_off_steps_with_the_first_arrival_alone(make_loop):
    make, _ = make_loop
    lp, engine, _ = make([0.0, 1.0, 1.5, 2.5], gap_ms=0.0, max_ms=30.0, steps=2)
    lp.run()
    assert len(engine.steps[0]) == 1            # the behaviour the window removes


def test_a_quiet_gap_ends_the_wait(make_loop):
    make, clock = make_loop
    lp, engine, _ = make([0.0, 1.0, 20.0], gap_ms=3.0, max_ms=30.0, steps=2)
    start = clock.now
    lp.run()
    assert engine.steps == [[b"0", b"1"], [b"2"]]
    # The first step started one gap after the second arrival, not at the cap.
    assert engine.step_at[0] - start == pytest.approx(0.004)


def test_the_wait_is_capped_however_many_keep_coming(make_loop):
    make, clock = make_loop
    arrivals = [2.0 * i for i in range(100)]    # one every 2 ms for 200 ms
    lp, engine, _ = make(arrivals, gap_ms=3.0, max_ms=9.0)
    start = clock.now
    lp.run()
    assert engine.steps[0] == [str(i).encode() for i in range(5)]   # 0-8 ms
    assert engine.step_at[0] - start == pytest.approx(0.009)


def test_a_busy_engine_does_not_wait(make_loop):
    make, _ = make_loop
    # A request is already running; a new one arrives 1 ms later.
    lp, engine, sock = make([1.0], gap_ms=5.0, max_ms=30.0, steps=1, running=[b"r"])
    lp.run()
    assert engine.steps == [[b"r"]]             # stepped at once, without the arrival
    assert sock.polls == []                     # and never blocked on the socket


def test_an_engine_that_only_owes_bookkeeping_counts_as_idle(make_loop):
    make, clock = make_loop
    # The last running request finishes in a 5 ms step; a burst of two arrives during it
    # (2 ms) and just after (6 ms): both share the next step, which starts one gap later.
    lp, engine, _ = make([2.0, 6.0], gap_ms=3.0, max_ms=30.0, steps=2, running=[b"r"],
                         step_ms=5.0)
    start = clock.now
    lp.run()
    assert engine.steps == [[b"r"], [b"0", b"1"]]
    assert engine.step_at[1] - start == pytest.approx(0.009)


def test_a_lone_request_with_nobody_behind_it_steps_at_once(make_loop):
    make, clock = make_loop
    # Concurrency 1: the front end holds nothing behind each request: no gap is waited out.
    lp, engine, _ = make([0.0, 50.0], gap_ms=3.0, max_ms=30.0, steps=2, step_ms=5.0,
                         pending=[0, 0])
    start = clock.now
    lp.run()
    assert engine.steps == [[b"0"], [b"1"]]
    assert [t - start for t in engine.step_at] == pytest.approx([0.0, 0.050])


def test_a_burst_waits_for_what_the_front_end_holds_and_no_longer(make_loop):
    make, clock = make_loop
    # Four requests; the front end says 3, 2, 1, 0 are behind them as each is submitted, the
    # last one 5 ms after the first (more than one gap): all four share one step, which
    # starts at the last submission, not a gap after it.
    lp, engine, _ = make([0.0, 1.0, 3.0, 5.0], gap_ms=3.0, max_ms=30.0, pending=[3, 2, 1, 0])
    start = clock.now
    lp.run()
    assert engine.steps == [[b"0", b"1", b"2", b"3"]]
    assert engine.step_at[0] - start == pytest.approx(0.005)


def test_the_wait_for_held_requests_is_still_capped(make_loop):
    make, clock = make_loop
    # The front end says one more is coming, but it never does (it failed before
    # submission): the engine waits at most one gap without an arrival.
    lp, engine, _ = make([0.0, 40.0], gap_ms=3.0, max_ms=30.0, steps=2, pending=[1, 0])
    start = clock.now
    lp.run()
    assert engine.steps == [[b"0"], [b"1"]]
    assert engine.step_at[0] - start == pytest.approx(0.003)


def test_several_waiting_at_a_wake_with_none_behind_step_at_once(make_loop):
    make, clock = make_loop
    # Two requests queued while the engine finished its last step; nothing behind them.
    lp, engine, _ = make([2.0, 3.0], gap_ms=3.0, max_ms=30.0, steps=2, running=[b"r"],
                         step_ms=5.0, pending=[1, 0])
    start = clock.now
    lp.run()
    assert engine.steps == [[b"r"], [b"0", b"1"]]
    assert engine.step_at[1] - start == pytest.approx(0.005)


def test_bad_window_values_are_refused():
    from sched_harness import make_kv_manager

    from wideserve.config import SchedulerConfig
    from wideserve.engine.scheduler import Scheduler
    for bad in ({"arrival_gap_ms": -1.0}, {"arrival_wait_max_ms": float("nan")}):
        with pytest.raises(ValueError, match="arrival_gap_ms"):
            Scheduler(SchedulerConfig(**bad), make_kv_manager(8, 4), 64)



def test_flags_reach_the_config_and_bad_values_name_the_flag(capsys):
    import argparse

    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    sched = engine_config_from_args(parser.parse_args(
        ["m", "--arrival-gap-ms", "0.5", "--arrival-wait-max-ms", "0"])).scheduler
    assert (sched.arrival_gap_ms, sched.arrival_wait_max_ms) == (0.5, 0.0)
    default = engine_config_from_args(parser.parse_args(["m"])).scheduler
    assert default.arrival_gap_ms > 0 and default.arrival_wait_max_ms > 0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["m", "--arrival-gap-ms", bad])
        assert "--arrival-gap-ms" in capsys.readouterr().err
