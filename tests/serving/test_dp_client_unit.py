"""The offline DP engine's stall report: what `LLM(data_parallel_size=N)` says when no rank
produced output in time (each rank's last known load and how long ago it was heard)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from wideserve.serving.dp_offline import SyncDPEngine, stall_report


def test_stall_report_names_each_ranks_load_and_silence():
    clients = [SimpleNamespace(stats={"num_running": 2, "num_waiting": 1}, last_heard=95.0),
               SimpleNamespace(stats={}, last_heard=40.0)]
    assert stall_report(clients, 100.0) == (
        "rank 0: 2 running, 1 waiting, last heard 5.0 s ago; "
        "rank 1: no stats yet, last heard 60.0 s ago")


def test_a_stall_names_each_unfinished_request_and_whether_its_rank_holds_it():
    """The stall error says where each request is: held by its rank (a scheduler that never
    finishes it); not held, and then never received (lost on the way in), received and
    answered (its final output lost on the way back) or received and ended without an answer;
    or a rank that did not answer."""
    async def answer(value):
        if value is None:
            raise RuntimeError("timed out")
        return value

    def rank(held, received=(), ended=()):
        replies = {"request_ids": held,
                   "request_history": None if held is None else
                   {"received": list(received), "ended": list(ended)}}
        return SimpleNamespace(call_utility=lambda method, timeout: answer(replies[method]))

    owners = {"a": 0, "b": 1, "c": 1, "d": 2, "f": 1, "g": 1}
    engine = object.__new__(SyncDPEngine)
    engine._unfinished = {"a", "b", "c", "d", "e", "f", "g"}
    engine.client = SimpleNamespace(
        clients=[rank(["a"]), rank(["c", "x"], received=["c", "f", "g", "x"], ended=["g"]),
                 rank(None)],
        rank_of=owners.get)
    assert asyncio.run(engine._whereabouts()) == (
        "request 'a': rank 0 holds it; "
        "request 'b': rank 1 does not know it and never received it; "
        "request 'c': rank 1 holds it; request 'd': rank 2 did not answer; "
        "request 'e': owner unknown; "
        "request 'f': rank 1 received it and ended it without a final output; "
        "request 'g': rank 1 received it and emitted its final output")
    assert asyncio.run(engine._whereabouts(limit=2)).endswith("; 5 more")


def test_outputs_delivered_before_the_wait_starts_are_not_waited_for():
    """A callback left ready by the previous loop run (a socket reader part-way through its
    drain) runs before step()'s wait begins and delivers the batch's last outputs: step()
    returns them at once instead of clearing the wake-up and waiting out its timeout."""
    engine = object.__new__(SyncDPEngine)
    engine._loop = asyncio.new_event_loop()
    engine._outputs, engine._unfinished = [], {"r"}
    engine._arrived = asyncio.Event()
    engine.step_timeout_s = 2.0
    engine.client = SimpleNamespace(dead_reason=None, clients=[], rank_of=lambda rid: None)
    engine._dump_rank_stacks = lambda: None
    last = SimpleNamespace(request_id="r", finished=True)
    try:
        engine._loop.call_soon(engine._on_outputs, [last])
        assert engine.step() == [last]
        assert not engine.has_unfinished_requests()
    finally:
        engine._loop.close()


def test_a_dp_rank_remembers_what_it_received_and_answered(monkeypatch):
    """DPEngineCore.request_history: every request id handed to the rank, and those it
    answered (a final output from a step, or a refusal the loop sends at once); a duplicate
    id gets no answer, so it is received but not answered."""
    from collections import deque

    import numpy as np

    from wideserve.engine import dp_engine
    from wideserve.engine.engine_core import EngineCore
    from wideserve.engine.errors import DuplicateRequestError
    from wideserve.types.sched_output import EngineCoreOutput

    def add(self, req):
        if req.request_id == "bad":
            raise ValueError("prompt too long")
        if req.request_id == "dup":
            raise DuplicateRequestError("in use")

    monkeypatch.setattr(EngineCore, "add_request", add)
    core = object.__new__(dp_engine.DPEngineCore)
    core._received, core._ended = deque(maxlen=3), deque(maxlen=3)
    for rid in ("ok", "bad", "dup"):
        try:
            core.add_request(SimpleNamespace(request_id=rid))
        except ValueError:
            pass
    assert core.request_history() == {"received": ["ok", "bad", "dup"], "ended": ["bad"]}
    # A lock-step iteration records the final outputs it returns (not the partial ones).
    rows = np.zeros((2, 3), dtype=np.int64)
    rows[:, dp_engine.HAS_WORK] = 1
    core.sync = SimpleNamespace(exchange=lambda *a: rows)
    core.dispatcher = SimpleNamespace(finish_step=lambda: None)
    core.eplb, core.dp = None, dp_engine.DPStepStats()
    core.scheduler = SimpleNamespace(num_running=1, num_waiting=0)
    monkeypatch.setattr(dp_engine.DPEngineCore, "has_unfinished_requests", lambda self: True)
    monkeypatch.setattr(dp_engine.DPEngineCore, "step", lambda self: [
        EngineCoreOutput("ok", [5], finish_reason="length"), EngineCoreOutput("p", [6])])
    assert len(core.dp_step(stop=False)) == 2
    assert core.request_history()["ended"] == ["bad", "ok"]
    assert core.request_history()["received"] == ["ok", "bad", "dup"]
