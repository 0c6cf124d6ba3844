"""Push transfers: the producer WRITEs a request's pages into blocks the consumer allocated.

The protocol (docs/disaggregation.md, "Push"), the same for every transport:
1. The consumer allocates the request's blocks (as for a pull), then asks the producer to
   push: a `PushRequest` naming the producer's lease (request id, lease id, exact block
   rows), the consumer's and the producer's pages, a random token and its deadline.
2. The producer *claims* the lease (leases.py: only an exact match, once; the blocks stay
   held, the lease cannot expire under the write), checks the source pages are the lease's
   own, posts the write and
   answers "" (accepted) or why not (nothing was written).
3. When the write has landed the consumer receives a notification `OK + token`; a write the
   producer stopped (failed, aborted at the deadline) gives `ERR + token + why`. Either way the
   producer frees the blocks once its write has stopped.
4. A consumer that times out (or whose request was aborted) asks `cancel(token)` until the
   producer says the write has stopped, so its blocks are never freed under a live write. A
   producer that cannot be reached is taken as gone: past the deadline it refuses the push
   (e.g. one that waited in its socket while the producer was stalled) and aborts its own
   write. Not covered: a producer that stalls in the middle of a posted write and resumes
   after the consumer gave up (a one-sided write has no fence the consumer could raise).
"""
from __future__ import annotations

import os

import msgspec
import numpy as np

from wideserve.disagg.layout import GroupPlan
from wideserve.disagg.leases import LeaseRef

TOKEN_BYTES = 16
NOTIFY_OK = b"K"
NOTIFY_ERR = b"E"


class PushRequest(msgspec.Struct, array_like=True):
    consumer: str                 # the consumer's agent name (its engine id)
    token: bytes                  # names this load in the notification and in cancel
    lease: LeaseRef               # the producer's lease, exactly as its handle names it
    local_pages: list[bytes]      # per group, int32 consumer page ids (the destination)
    remote_pages: list[bytes]     # per group, int32 producer page ids (the source)
    # Wall-clock (time.time) deadline: the producer refuses a push it sees later (one that
    # waited in its socket while it was stalled) and aborts a write still running then.
    # Clocks of the two hosts must agree to well under CANCEL_TIMEOUT_S (nixl_worker.py).
    deadline: float
    per_block: bool = False       # one write per page (benchmark) instead of one packed


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)


def pages_to_wire(pages: list[np.ndarray]) -> list[bytes]:
    return [np.ascontiguousarray(p, dtype=np.int32).tobytes() for p in pages]


def pages_from_wire(data: list[bytes], num_groups: int) -> list[np.ndarray]:
    if len(data) != num_groups:
        raise ValueError(f"pages for {len(data)} groups, expected {num_groups}")
    return [np.frombuffer(d, dtype=np.int32) for d in data]


def check_source_pages(groups: list[GroupPlan], rows: list[list[int]],
                       pages: list[np.ndarray], dest: list[np.ndarray]) -> str | None:
    """Why a push of `pages` (producer) into `dest` (consumer) is refused: each group's
    source pages must be non-null pages of the leased request, one destination per page."""
    if len(rows) != len(groups):
        return "the lease holds no block table for this layout"
    for gid, (row, src, dst) in enumerate(zip(rows, pages, dest)):
        if len(src) != len(dst):
            return f"group {gid}: {len(src)} source pages but {len(dst)} destinations"
        held = np.asarray(row, dtype=np.int64)
        if len(src) and (not src.all() or not np.isin(src, held).all()):
            return f"group {gid}: pages outside the request's blocks"
    return None


def notification(ok: bool, token: bytes, why: str = "") -> bytes:
    return (NOTIFY_OK if ok else NOTIFY_ERR) + token + why.encode()


def parse_notification(msg: bytes) -> tuple[bool, bytes, str] | None:
    """(ok, token, why) of a push notification; None for anything else."""
    if len(msg) < 1 + TOKEN_BYTES or msg[:1] not in (NOTIFY_OK, NOTIFY_ERR):
        return None
    return msg[:1] == NOTIFY_OK, msg[1:1 + TOKEN_BYTES], \
        msg[1 + TOKEN_BYTES:].decode(errors="replace")
