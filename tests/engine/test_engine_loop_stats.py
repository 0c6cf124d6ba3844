"""When the engine-core loop sends its stats: changed stats reach the front end within
STATS_INTERVAL_S even when the step had no outputs (a DP rank's dummy steps) or the engine
went idle right after, and never more often than that while busy. Driven in-process with a
fake clock and a recording `send`, so nothing here depends on timing."""
from __future__ import annotations

from typing import Any

import pytest

from wideserve.engine import engine_proc
from wideserve.engine.engine_proc import STATS_INTERVAL_S, EngineLoop


class _Engine:
    def __init__(self) -> None:
        self.stats_calls = 0

    def get_stats(self) -> dict[str, Any]:
        self.stats_calls += 1
        return {"n": self.stats_calls}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def loop(tmp_path, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(engine_proc, "time", clock)
    lp = EngineLoop(_Engine(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", None,
                    heartbeat_s=1.0)
    sent: list[Any] = []
    lp.send = lambda msg: (sent.append(msg), setattr(lp, "last_sent", clock.now))
    yield lp, sent, clock
    lp.close()


def test_first_stats_go_out_at_once_then_at_most_every_interval(loop):
    lp, sent, clock = loop
    lp.emit([])                              # nothing sent yet: the first stats go now
    assert [m.stats for m in sent] == [{"n": 1}]
    lp.stats_dirty = True                    # a step ran, with no outputs (a dummy step)
    clock.now += STATS_INTERVAL_S / 2
    lp.emit([])
    assert len(sent) == 1                    # too soon: nothing to send
    clock.now += STATS_INTERVAL_S
    lp.emit([])
    assert [m.stats for m in sent] == [{"n": 1}, {"n": 2}] and not lp.stats_dirty
    clock.now += STATS_INTERVAL_S * 2
    lp.emit([])                              # unchanged stats wait for the heartbeat
    assert len(sent) == 2
    clock.now += 1.0
    lp.emit([])
    assert len(sent) == 3 and sent[-1].stats == {"n": 3}


def test_outputs_carry_stats_when_due_and_idle_wait_shrinks_until_sent(loop):
    lp, sent, clock = loop
    lp.emit([])
    lp.stats_dirty = True
    clock.now += STATS_INTERVAL_S / 2
    lp.emit(["out"])                         # outputs always go; their stats only when due
    assert sent[-1].outputs == ["out"] and sent[-1].stats is None
    assert lp.stats_dirty
    # Idle now: the loop must wake within the interval to send the last step's stats.
    assert lp.idle_wait_ms() == int(STATS_INTERVAL_S * 1000)
    clock.now += STATS_INTERVAL_S
    lp.emit([])
    assert sent[-1].stats == {"n": 2} and not lp.stats_dirty
    assert lp.idle_wait_ms() == 1000         # then a heartbeat's wait


def test_a_lent_core_is_in_the_stats_and_on_metrics(loop):
    """With the front end's core lendable (utils/thread_governor.py), the stats carry the
    engine's thread count and switches, and /metrics exports them."""
    from wideserve.serving.openai.server_metrics import ServerMetrics
    from wideserve.utils.thread_governor import CpuTimes, ThreadGovernor
    lp, sent, clock = loop
    lp.emit([])
    assert "torch_threads" not in sent[-1].stats              # no governor: no such keys
    counters = CpuTimes(0.0, 0.0)
    lp.governor = ThreadGovernor(1, 2, [0, 1], lambda n: None, read=lambda: counters,
                                 clock=lambda: clock.now)
    clock.now += 1.0
    lp.governor.tick()                                        # a quiet window: lent
    lp.stats_dirty = True
    clock.now += STATS_INTERVAL_S
    lp.emit([])
    stats = sent[-1].stats
    assert (stats["torch_threads"], stats["thread_switches"]) == (2, 1)
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert 'wideserve:engine_torch_threads{model_name="m"} 2.0' in text
    assert 'wideserve:engine_thread_switches_total{model_name="m"} 1.0' in text
