"""The producer's leases: which finished requests' blocks it still holds for a consumer.

Shared by the scheduler half (grants leases, frees blocks) and the worker half (answers a
consumer's release or push request from its side-channel thread), hence the lock.

Pull: the release answer is what makes a pull trustworthy: the consumer counts a load as
done only when the producer confirms it still held the blocks when the pull finished, so a
lease that expired mid-pull (and whose blocks may already hold another request's KV) fails
the load instead of serving bad KV.

Push: a consumer's push request *claims* the lease before anything is written: a claimed
request never expires (its blocks stay held) until the producer's write has stopped
(`finish_claim`), so the producer never WRITEs from blocks it has already freed. The claim
returns the request's block rows, against which the producer checks the requested pages.
"""
from __future__ import annotations

import threading
import time


class LeaseTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deadline: dict[str, float] = {}      # request id -> monotonic deadline
        self._rows: dict[str, list[list[int]]] = {}  # request id -> its block rows
        self._claimed: set[str] = set()            # being pushed: held until the write stops
        self._released: list[str] = []             # released by a consumer, to free

    def grant(self, request_id: str, lease_s: float,
              rows: list[list[int]] | None = None) -> None:
        with self._lock:
            self._deadline[request_id] = time.monotonic() + lease_s
            self._rows[request_id] = rows or []

    def release(self, request_id: str) -> bool:
        """A consumer is done with the request: True if the blocks were held until now."""
        with self._lock:
            deadline = self._deadline.pop(request_id, None)
            if deadline is None:
                return False
            self._rows.pop(request_id, None)
            self._released.append(request_id)
            return time.monotonic() < deadline

    def claim(self, request_id: str) -> list[list[int]] | None:
        """A consumer asks for a push: the request's block rows, held until `finish_claim`;
        None when the lease is gone (expired, released or never granted)."""
        with self._lock:
            deadline = self._deadline.pop(request_id, None)
            rows = self._rows.pop(request_id, None)
            if deadline is None:
                return None
            if time.monotonic() >= deadline:
                self._released.append(request_id)      # expired: free it now
                return None
            self._claimed.add(request_id)
            return rows or []

    def finish_claim(self, request_id: str) -> None:
        """The push of a claimed request has stopped (done, failed or aborted): free it."""
        with self._lock:
            if request_id in self._claimed:
                self._claimed.discard(request_id)
                self._released.append(request_id)

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
                self._rows.pop(rid, None)
            return expired

    @property
    def num_claimed(self) -> int:
        with self._lock:
            return len(self._claimed)

    def __len__(self) -> int:
        with self._lock:
            return len(self._deadline) + len(self._claimed) + len(self._released)
