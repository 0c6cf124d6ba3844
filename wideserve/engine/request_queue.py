"""Waiting queues for the scheduler: FCFS (arrival order, fair across client requests) and
PRIORITY ((priority, arrival), fair across client requests within a priority).

Both support what the scheduler needs: peek/pop the head, add a new request at its place,
put a preempted request back at the front (FCFS) or at its key's place (PRIORITY: a lower
`priority` value runs first, ties by arrival), and remove aborted requests.
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from typing import Iterator, Protocol

from wideserve.types.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """First come, first served across client requests, round-robin within.

    One client request may carry thousands of sequences (prompts x n); plain FCFS over
    sequences would admit all of them before a later request's first one. Sequences are
    queued per group (`Request.group_id`, default the request itself) and admission takes
    the head of the group that waited longest since its last admission: a group goes to
    the back of the order after each admission, a new group joins at the back. With one
    sequence per group this is exactly arrival order. Preempted requests resume first, in
    arrival order (FCFS preempts the latest-admitted first, so prepending in preemption
    order keeps them sorted)."""

    def __init__(self) -> None:
        self._resumed: deque[Request] = deque()
        self._groups: OrderedDict[str, deque[Request]] = OrderedDict()  # admission order
        self._len = 0

    @staticmethod
    def _group(request: Request) -> str:
        return request.group_id if request.group_id is not None else request.request_id

    def add(self, request: Request) -> None:
        key = self._group(request)
        queue = self._groups.get(key)
        if queue is None:
            queue = self._groups[key] = deque()
        queue.append(request)
        self._len += 1

    def prepend(self, request: Request) -> None:
        self._resumed.appendleft(request)
        self._len += 1

    def peek(self) -> Request:
        if self._resumed:
            return self._resumed[0]
        return self._groups[next(iter(self._groups))][0]

    def pop(self) -> Request:
        self._len -= 1
        if self._resumed:
            return self._resumed.popleft()
        key, queue = next(iter(self._groups.items()))
        request = queue.popleft()
        if queue:
            self._groups.move_to_end(key)       # its next sequence waits for the others
        else:
            del self._groups[key]
        return request

    def remove(self, request: Request) -> None:
        if request in self._resumed:
            self._resumed.remove(request)
        else:
            key = self._group(request)
            queue = self._groups.get(key)
            if queue is None or request not in queue:
                raise ValueError(f"request {request.request_id!r} is not in the waiting queue")
            queue.remove(request)
            if not queue:
                del self._groups[key]
        self._len -= 1

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """In admission order (what successive pops would return)."""
        yield from self._resumed
        queues = [list(q) for q in self._groups.values()]
        for depth in range(max(map(len, queues), default=0)):
            for q in queues:
                if depth < len(q):
                    yield q[depth]


class PriorityQueue:
    """(priority, turn, arrival): a lower `priority` value runs first; within a priority,
    the k-th waiting sequence of a client request (`group_id`: the prompts x n of one call)
    has turn k, so one request's many sequences take turns with every other request's
    instead of all being admitted first (they share one arrival time). With one sequence
    per request this is exactly (priority, arrival)."""

    def __init__(self) -> None:
        # The counter breaks exact ties by insertion order so Request objects are never
        # compared.
        self._heap: list[tuple[int, int, float, int, Request]] = []
        self._counter = itertools.count()
        self._turns: dict[str, int] = {}        # group -> turns handed out
        self._waiting: dict[str, int] = {}      # group -> sequences in the queue

    @staticmethod
    def _group(request: Request) -> str:
        return request.group_id if request.group_id is not None else request.request_id

    def _push(self, request: Request, turn: int) -> None:
        key = self._group(request)
        self._waiting[key] = self._waiting.get(key, 0) + 1
        heapq.heappush(self._heap, (request.priority, turn, request.arrival_time,
                                    next(self._counter), request))

    def _left(self, request: Request) -> None:
        key = self._group(request)
        self._waiting[key] -= 1
        if not self._waiting[key]:              # forget the group once none of it waits
            del self._waiting[key]
            self._turns.pop(key, None)

    def add(self, request: Request) -> None:
        key = self._group(request)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        self._push(request, turn)

    def prepend(self, request: Request) -> None:
        # A preempted request goes first within its priority (turn 0), ties by arrival.
        self._push(request, 0)

    def peek(self) -> Request:
        return self._heap[0][4]

    def pop(self) -> Request:
        request = heapq.heappop(self._heap)[4]
        self._left(request)
        return request

    def remove(self, request: Request) -> None:
        # Aborts are rare: an O(n) rebuild keeps the hot path (push/pop) a plain heap.
        kept = [e for e in self._heap if e[4] is not request]
        if len(kept) == len(self._heap):
            raise ValueError(f"request {request.request_id!r} is not in the waiting queue")
        heapq.heapify(kept)
        self._heap = kept
        self._left(request)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[4] for e in sorted(self._heap, key=lambda e: e[:4]))


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"SchedulerConfig.policy must be 'fcfs' or 'priority', got {policy!r}")
