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
    finishes it), unknown to it (lost on the way, or ended without its final output), or a
    rank that did not answer."""
    async def ids(held):
        if held is None:
            raise RuntimeError("timed out")
        return held

    def rank(held):
        return SimpleNamespace(call_utility=lambda method, timeout: ids(held))

    owners = {"a": 0, "b": 1, "c": 1, "d": 2}
    engine = object.__new__(SyncDPEngine)
    engine._unfinished = {"a", "b", "c", "d", "e"}
    engine.client = SimpleNamespace(clients=[rank(["a"]), rank(["c", "x"]), rank(None)],
                                    rank_of=owners.get)
    assert asyncio.run(engine._whereabouts()) == (
        "request 'a': rank 0 holds it; request 'b': rank 1 does not know it; "
        "request 'c': rank 1 holds it; request 'd': rank 2 did not answer; "
        "request 'e': owner unknown")
    assert asyncio.run(engine._whereabouts(limit=2)).endswith("; 3 more")
