"""Waiting queues for the scheduler: FCFS (arrival order) and PRIORITY ((priority, arrival)).

Both support what the scheduler needs: peek/pop the head, add a new request at its place,
put a preempted request back at the front (FCFS) or at its key's place (PRIORITY: a lower
`priority` value runs first, ties by arrival), and remove aborted requests.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterator, Protocol

from wideserve.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        # Preempted requests go back to the front: FCFS preempts the latest-admitted first, so
        # prepending in preemption order keeps the queue in arrival order.
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        # The counter breaks exact (priority, arrival) ties by insertion order so Request
        # objects are never compared.
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time,
                                    next(self._counter), request))

    def prepend(self, request: Request) -> None:
        # A preempted request keeps its (priority, arrival) key, which puts it ahead of every
        # later arrival of the same priority.
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # Aborts are rare: an O(n) rebuild keeps the hot path (push/pop) a plain heap.
        kept = [e for e in self._heap if e[3] is not request]
        if len(kept) == len(self._heap):
            raise ValueError(f"request {request.request_id!r} is not in the waiting queue")
        heapq.heapify(kept)
        self._heap = kept

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"SchedulerConfig.policy must be 'fcfs' or 'priority', got {policy!r}")
