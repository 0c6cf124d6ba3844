"""StepTimer: on an asynchronous device each phase is timed by device events, so the forward's
queued work is billed to the forward, not to sampling, without ever synchronising; off, it
keeps the step counts and touches neither the clock nor the device."""
from __future__ import annotations

import time

import pytest
import torch

from wideserve.engine import step_timer
from wideserve.engine.step_timer import StepTimer


class FakeDevice:
    """A device queue: work launched at host time t finishes at max(t, queue end) + its
    duration; an event is stamped when the queue reaches it."""

    def __init__(self) -> None:
        self.end = 0.0
        self.synchronized = 0          # event.synchronize() calls
        self.events = 0

    def launch(self, seconds: float) -> None:
        self.end = max(self.end, time.perf_counter()) + seconds

    def event(self) -> FakeEvent:
        self.events += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.stamp = device, None

    def record(self) -> None:
        self.stamp = max(time.perf_counter(), self.device.end)

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


def test_events_bill_the_forward_without_a_sync(no_sync) -> None:
    device = FakeDevice()
    timer = StepTimer(torch.device("cuda"), event_factory=device.event)
    for _ in range(3):
        _step(timer, device, 0.05)
    assert no_sync == [] and device.synchronized == 2     # steps 1, 2 read at the next start
    took = timer.stats.last_seconds                       # reading the stats reads step 3
    assert device.synchronized == 3 and device.events == 3 * 6
    assert took["forward"] >= 0.0499 and took["sample"] < 0.01
    assert timer.stats.steps == 3 and timer.stats.seconds["forward"] >= 0.1499


def test_off_costs_nothing(no_sync, monkeypatch) -> None:
    device = FakeDevice()
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


def test_host_clock_on_the_cpu() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.02)
    timer.mark("forward")
    timer.mark("sample")
    timer.finish(num_tokens=2, num_requests=1)
    took = timer.stats.last_seconds
    assert took["forward"] >= 0.02 and took["sample"] < 0.02
    timer.start()
    timer.finish(num_tokens=0, num_requests=0)            # an idle poll is not a step
    assert timer.stats.steps == 1
