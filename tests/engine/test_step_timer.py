"""StepTimer: on an asynchronous device each phase is timed by device events, so the forward's
queued work is billed to the forward, not to sampling, without ever synchronising; off, it
keeps the step counts and touches neither the clock nor the device."""
from __future__ import annotations

import pytest
import torch

from wideserve.engine import step_timer
from wideserve.engine.step_timer import StepTimer


class HostClock:
    """The host clock, moved only by the test: phases are billed exactly what the test says
    elapsed, never what a loaded machine took between two lines."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> HostClock:
    """StepTimer's host clock (and the fake device's) replaced by a HostClock."""
    host = HostClock()
    monkeypatch.setattr(step_timer, "time", host)
    return host


class FakeDevice:
    """A device queue: work launched at host time t finishes at max(t, queue end) + its
    duration; an event is stamped when the queue reaches it."""

    def __init__(self, clock: HostClock) -> None:
        self.clock = clock
        self.end = 0.0
        self.synchronized = 0          # event.synchronize() calls
        self.events = 0

    def launch(self, seconds: float) -> None:
        self.end = max(self.end, self.clock.perf_counter()) + seconds

    def event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.stamp = device, None

    def record(self) -> None:
        self.stamp = max(self.device.clock.perf_counter(), self.device.end)

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.stamp - self.stamp) * 1e3

    def synchronize(self) -> None:
        self.device.synchronized += 1


@pytest.fixture
def no_sync(monkeypatch):
    """torch.cuda.synchronize counted (it must never be called)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(a))
    return calls


def _step(timer: StepTimer, device: FakeDevice, forward_s: float) -> None:
    timer.start()
    timer.mark("schedule")
    timer.mark("prepare")
    device.launch(forward_s)       # the forward launches device work and returns at once
    timer.mark("forward")
    timer.mark("sample")
    timer.mark("output")
    timer.finish(num_tokens=1, num_requests=1)


def test_events_bill_the_forward_without_a_sync(no_sync, clock) -> None:
    device = FakeDevice(clock)
    timer = StepTimer(torch.device("cuda"), event_factory=device.event)
    for _ in range(3):
        _step(timer, device, 0.05)
    assert no_sync == [] and device.synchronized == 2     # steps 1, 2 read at the next start
    took = timer.stats.last_seconds                       # reading the stats reads step 3
    assert device.synchronized == 3 and device.events == 3 * 6
    # The host returns from the launch at once: the queued 50 ms are the forward's, and the
    # sample event (queued behind it) is billed nothing.
    assert took["forward"] == pytest.approx(0.05) and took["sample"] == 0.0
    assert timer.stats.steps == 3 and timer.stats.seconds["forward"] == pytest.approx(0.15)


def test_off_costs_nothing(no_sync, monkeypatch) -> None:
    device = FakeDevice(HostClock())
    clock = []
    fake_time = type("FakeTime", (), {"perf_counter": staticmethod(
        lambda: clock.append(1) or 0.0)})
    monkeypatch.setattr(step_timer, "time", fake_time)
    for dev in (torch.device("cuda"), torch.device("cpu")):
        timer = StepTimer(dev, enabled=False, event_factory=device.event)
        _step(timer, device, 0.0)
        assert timer.stats.steps == 1 and timer.stats.tokens == 1
        assert timer.stats.token_histogram[0] == 1
        assert sum(timer.stats.seconds.values()) == 0.0
    assert clock == [] and device.events == 0 and no_sync == []


def test_host_clock_on_the_cpu(clock) -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    clock.now += 0.02
    timer.mark("forward")
    clock.now += 0.003
    timer.mark("sample")
    timer.finish(num_tokens=2, num_requests=1)
    took = timer.stats.last_seconds
    assert took["forward"] == pytest.approx(0.02) and took["sample"] == pytest.approx(0.003)
    timer.start()
    timer.finish(num_tokens=0, num_requests=0)            # an idle poll is not a step
    assert timer.stats.steps == 1
