"""Requests the front end holds but has not yet handed to the engine (engine/engine_proc.py,
"Arrivals after idle").

An idle engine woken by a request can step with it at once or wait for the ones right behind
it, so that a burst shares one prefill step. Only the front end knows whether any are behind
it: a generation request is counted from the moment the ASGI app receives it (before its body
is read, parsed and tokenised) until its requests are submitted, or it ends without that
(an error, a client gone). Every submission carries the count of the others still held, and
the engine waits only while that count says more are coming, so one client at a time (no one
held) never waits.

A request of the same client that arrives in its own task: ASGI servers start one task per
request as soon as its headers are parsed, so the requests of a burst are all counted by the
time the first of them is submitted. The ticket travels in a context variable, which
Starlette's streaming task and FastAPI's handler inherit from the middleware's task.
"""
from __future__ import annotations

import contextvars
from typing import Any

# POST routes that submit generation requests to the engine.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses",
                              "/v1/messages"})


class _Ticket:
    __slots__ = ("counter", "open")

    def __init__(self, counter: ArrivalCounter) -> None:
        self.counter, self.open = counter, True

    def close(self) -> None:
        if self.open:
            self.open = False
            self.counter.held -= 1


_TICKET: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar(
    "wideserve_arrival_ticket", default=None)


class ArrivalCounter:
    """How many generation requests the front end holds that it has not submitted."""

    def __init__(self) -> None:
        self.held = 0

    def enter(self) -> _Ticket:
        self.held += 1
        ticket = _Ticket(self)
        _TICKET.set(ticket)
        return ticket

    def submitting(self) -> int:
        """The current request is being submitted: it is no longer held. Returns how many
        others still are (what the engine may wait for)."""
        ticket = _TICKET.get()
        if ticket is not None and ticket.counter is self:
            ticket.close()
        return max(self.held, 0)


class ArrivalMiddleware:
    """Pure ASGI: counts a generation request from its first byte to its submission (or its
    end, whichever comes first); touches neither the body nor the response."""

    def __init__(self, app: Any, counter: ArrivalCounter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" \
                or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        ticket = self.counter.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.close()
