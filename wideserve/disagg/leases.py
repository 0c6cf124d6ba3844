"""The producer's leases: which finished requests' blocks it still holds for a consumer.

Shared by the scheduler half (grants leases, frees blocks) and the worker half (answers a
consumer's release or push request from its side-channel thread), hence the lock.

A lease is bound to what was exported: a random lease id (in the signed handle, params.py)
and the exact block rows (per KV cache group) and prompt length of the request. A consumer
names all of it (`LeaseRef`) to release or push; anything that does not match a held lease
exactly is refused and counted, and the lease is served once: release or claim ends it.
- `refused_mismatch`: the request is held but the lease id or the block rows differ (a
  forged or tampered handle: somebody asked for blocks the lease does not own). The lease
  stays intact for its real holder.
- `refused_unknown`: no such lease (already served, expired, or never granted). A consumer
  whose load failed after its confirm also lands here (its early release finds nothing).

Pull: before it READs, the consumer *opens* the lease (`open`: exact match, once; a lease
opened cannot be opened or claimed again), so a second pull of the same handle, from any
decode instance, is refused before a byte moves. The release answer is what makes a pull
trustworthy: the consumer counts a load as done only when the producer confirms that the
lease was opened and still held when the pull finished, so a lease that expired mid-pull
(and whose blocks may already hold another request's KV) fails the load instead of serving
bad KV.

Push: a consumer's push request *claims* the lease before anything is written: a claimed
request never expires (its blocks stay held) until the producer's write has stopped
(`finish_claim`), so the producer never WRITEs from blocks it has already freed. The claim
returns the request's block rows, against which the producer checks the requested pages.
"""
from __future__ import annotations

import hmac
import os
import threading
import time
from dataclasses import dataclass

import msgspec


class LeaseRef(msgspec.Struct, array_like=True):
    """What a consumer names to release or push a lease: all of it, exactly as exported."""

    request_id: str
    lease: str                      # the lease id from the signed handle
    rows: list[list[int]]           # per KV cache group, the exported block table row
    num_tokens: int                 # prompt positions the producer computed


@dataclass(slots=True)
class _Lease:
    lease: str
    rows: list[list[int]]
    num_tokens: int
    deadline: float                 # monotonic


def new_lease_id() -> str:
    return os.urandom(16).hex()


class LeaseTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, _Lease] = {}          # request id -> its lease
        self._claimed: set[str] = set()            # being pushed: held until the write stops
        self._opened: dict[str, _Lease] = {}       # being pulled: held until released/expired
        self._released: list[str] = []             # released by a consumer, to free
        self.refused_mismatch = 0
        self.refused_unknown = 0

    def grant(self, request_id: str, lease_s: float, rows: list[list[int]],
              num_tokens: int = 0) -> str:
        """Hold `rows` for a consumer; returns the lease id that names them."""
        lease = new_lease_id()
        with self._lock:
            self._held[request_id] = _Lease(lease, [list(r) for r in rows], num_tokens,
                                            time.monotonic() + lease_s)
        return lease

    def _take(self, ref: LeaseRef) -> _Lease | None:
        """The lease `ref` names exactly, removed from the table (served once); None, counted,
        for anything else. Call with the lock held."""
        held = self._held.get(ref.request_id)
        if held is None:
            self.refused_unknown += 1
            return None
        if not self._matches(held, ref):
            return None
        del self._held[ref.request_id]
        return held

    def _matches(self, held: _Lease, ref: LeaseRef) -> bool:
        if hmac.compare_digest(held.lease.encode(), ref.lease.encode()) \
                and held.rows == ref.rows and held.num_tokens == ref.num_tokens:
            return True
        self.refused_mismatch += 1
        return False

    def _refusal(self, ref: LeaseRef) -> str:
        if ref.request_id in self._held:
            return "the handle does not match the lease (wrong lease id or block ids)"
        return "this instance no longer held the blocks (lease expired or already served)"

    def open(self, ref: LeaseRef) -> str:
        """A consumer is about to pull: "" when `ref` names a held lease exactly (from now on
        it cannot be opened or claimed again; `release` confirms the pull), else why not."""
        with self._lock:
            held = self._take(ref)
            if held is None:
                return self._refusal(ref)
            if time.monotonic() >= held.deadline:
                self._released.append(ref.request_id)      # expired: free it now
                return "this instance no longer held the blocks (lease expired)"
            self._opened[ref.request_id] = held
            return ""

    def release(self, ref: LeaseRef) -> bool:
        """A consumer is done with the lease (pulled, or gave up): its blocks are freed. True
        only for an opened lease whose blocks were held until now: the pull's confirmation."""
        with self._lock:
            opened = self._opened.get(ref.request_id)
            if opened is not None:
                if not self._matches(opened, ref):
                    return False
                del self._opened[ref.request_id]
                self._released.append(ref.request_id)
                return time.monotonic() < opened.deadline
            if self._take(ref) is not None:         # never opened: given up, not pulled
                self._released.append(ref.request_id)
            return False

    def claim(self, ref: LeaseRef) -> tuple[list[list[int]] | None, str]:
        """A consumer asks for a push: (the lease's block rows, ""), held until
        `finish_claim`; (None, why) when refused (gone, expired, or not this lease)."""
        with self._lock:
            held = self._take(ref)
            if held is None:
                return None, self._refusal(ref)
            if time.monotonic() >= held.deadline:
                self._released.append(ref.request_id)      # expired: free it now
                return None, "this instance no longer held the blocks (lease expired)"
            self._claimed.add(ref.request_id)
            return held.rows, ""

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
            expired = []
            for table in (self._held, self._opened):
                gone = [rid for rid, held in table.items() if held.deadline <= now]
                for rid in gone:
                    del table[rid]
                expired += gone
            return expired

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {"leases_refused_mismatch": self.refused_mismatch,
                    "leases_refused_unknown": self.refused_unknown}

    def __len__(self) -> int:
        with self._lock:
            return len(self._held) + len(self._opened) + len(self._claimed) + \
                len(self._released)
