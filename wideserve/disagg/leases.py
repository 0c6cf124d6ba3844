"""The producer's leases: which finished requests' blocks it still holds for a consumer.

Shared by the scheduler half (grants leases, frees blocks) and the worker half (answers a
consumer's release from its side-channel thread), hence the lock. The release answer is what
makes a pull trustworthy: the consumer counts a load as done only when the producer confirms
it still held the blocks when the pull finished, so a lease that expired mid-pull (and whose
blocks may already hold another request's KV) fails the load instead of serving bad KV.
"""
from __future__ import annotations

import threading
import time


class LeaseTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: dict[str, float] = {}      # request id -> monotonic deadline
        self._released: list[str] = []             # released by a consumer, to free

    def grant(self, request_id: str, lease_s: float) -> None:
        with self._lock:
            self._deadline[request_id] = time.monotonic() + lease_s

    def release(self, request_id: str) -> bool:
        """A consumer is done with the request: True if the blocks were held until now."""
        with self._lock:
            deadline = self._deadline.pop(request_id, None)
            if deadline is None:
                return False
            self._released.append(request_id)
            return time.monotonic() < deadline

    def take_released(self) -> list[str]:
        with self._lock:
            out, self._released = self._released, []
            return out

    def take_expired(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [rid for rid, d in self._deadline.items() if d <= now]
            for rid in expired:
                del self._deadline[rid]
            return expired

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadline) + len(self._released)
