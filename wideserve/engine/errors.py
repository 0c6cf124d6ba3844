"""Errors the engine core raises on purpose (no heavy imports: the engine process and the
front end both catch them)."""
from __future__ import annotations


class EngineStateError(RuntimeError):
    """The engine core's state can no longer be trusted; it must not serve more requests."""


class DuplicateRequestError(ValueError):
    """A request id that a live request already has; the live request is left untouched."""
