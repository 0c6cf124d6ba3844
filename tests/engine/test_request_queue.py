"""Waiting queues: FCFS keeps arrival order with preempted requests at the front; PRIORITY
orders by (priority, arrival) whatever the insertion order."""
from __future__ import annotations

import pytest

from wideserve.engine.request_queue import FCFSQueue, PriorityQueue, make_request_queue
from wideserve.types.request import Request
from wideserve.types.sampling_params import SamplingParams


def _req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, [1, 2], SamplingParams(), arrival_time=arrival, priority=priority)


def _drain(q) -> list[str]:
    out = []
    while len(q):
        assert q.peek() is q.peek()
        out.append(q.pop().request_id)
    return out


def test_fcfs_order_prepend_remove():
    q = FCFSQueue()
    reqs = {r: _req(r) for r in "abcd"}
    for r in "abc":
        q.add(reqs[r])
    q.prepend(reqs["d"])
    q.remove(reqs["b"])
    assert [r.request_id for r in q] == ["d", "a", "c"]
    assert _drain(q) == ["d", "a", "c"]


def test_priority_order_prepend_remove():
    q = PriorityQueue()
    specs = [("a", 2, 1.0), ("b", 0, 3.0), ("c", 0, 2.0), ("d", 1, 0.0), ("e", 0, 2.0)]
    reqs = {rid: _req(rid, p, t) for rid, p, t in specs}
    for rid in "abcd":
        q.add(reqs[rid])
    q.prepend(reqs["e"])          # ties with c on (priority, arrival): insertion order after c
    q.remove(reqs["d"])
    assert [r.request_id for r in q] == ["c", "e", "b", "a"]
    with pytest.raises(ValueError, match="not in the waiting queue"):
        q.remove(reqs["d"])
    assert _drain(q) == ["c", "e", "b", "a"]


def test_make_request_queue():
    assert isinstance(make_request_queue("fcfs"), FCFSQueue)
    assert isinstance(make_request_queue("priority"), PriorityQueue)
    with pytest.raises(ValueError, match="policy"):
        make_request_queue("lifo")


def _child(rid: str, group: str, priority: int = 0, arrival: float = 0.0) -> Request:
    r = _req(rid, priority, arrival)
    r.group_id = group
    return r


def test_priority_takes_turns_across_client_requests_within_a_priority():
    """A request with many sequences (n=8, one arrival time) does not hold every later
    request of its priority behind all of them: each request's k-th sequence has turn k.
    A higher priority still goes first, and a preempted one resumes first."""
    q = PriorityQueue()
    for i in range(8):
        q.add(_child(f"a{i}", "A", arrival=1.0))
    q.add(_child("b0", "B", arrival=2.0))
    q.add(_child("c0", "C", arrival=3.0))
    q.add(_child("urgent", "U", priority=-1, arrival=4.0))
    assert [q.pop().request_id for _ in range(5)] == ["urgent", "a0", "b0", "c0", "a1"]
    # A's admitted sequences still count: a newcomer goes before A's third.
    q.add(_child("d0", "D", arrival=5.0))
    assert q.pop().request_id == "d0"
    q.prepend(_child("resumed", "R", arrival=0.5))
    assert q.peek().request_id == "resumed"
    assert len(q) == len(list(q)) == 7
    assert _drain(q) == ["resumed"] + [f"a{i}" for i in range(2, 8)]
