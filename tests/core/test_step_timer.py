"""StepTimer: on an asynchronous device each phase waits for the device before the clock is
read, so the forward's queued work is billed to the forward, not to sampling."""
from __future__ import annotations

import time

from wideserve.engine.step_timer import StepTimer


def test_sync_runs_before_each_clock_read() -> None:
    queued: list[float] = []

    def sync() -> None:            # a device that finishes queued work only when waited on
        while queued:
            time.sleep(queued.pop())

    timer = StepTimer(sync=sync)
    timer.start()
    queued.append(0.05)            # the forward launches 50 ms of device work and returns
    timer.mark("forward")
    timer.mark("sample")
    timer.finish(num_tokens=1, num_requests=1)
    took = timer.stats.last_seconds
    assert took["forward"] >= 0.05 and took["sample"] < 0.05
