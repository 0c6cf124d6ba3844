"""The producer's half of NIXL push (protocol: push.py): WRITEs into consumers' blocks.

The side-channel handlers post the WRITE themselves (the agent runs with strict thread
synchronisation), so a push starts as soon as the consumer asks, not at the producer's next
engine step, which may be a long prefill away. The engine thread's `poll` only watches the
writes: one that reached DONE or ERR ends the claim (the blocks are freed at the next step).

Fencing (fence.py): a one-sided write cannot be recalled for sure once posted, so a write
the consumer cancelled (or that ran past its deadline) is let finish and counts as stopped
only when its handles are DONE or ERR and released; `cancel` answers per token whether that
is so, with this process's incarnation. A token once answered "stopped" is remembered
(`TOMBSTONE_S`, longer than the side channel accepts a message for), so a push request that
was overtaken by its cancel, or that waited in the socket while this process was stalled, is
refused when it arrives: no write starts after the consumer was told none would.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from wideserve.disagg.layout import KVLayout, descriptor_indices, descriptor_table, region_bases
from wideserve.disagg.leases import LeaseTable
from wideserve.disagg.push import PushRequest, check_source_pages, notification, pages_from_wire
from wideserve.disagg.side_channel import MAX_SKEW_S

logger = logging.getLogger(__name__)

# The push refusal that tells a consumer to send its hello again (this side dropped it).
UNKNOWN_CONSUMER = "unknown decode instance (no hello)"
# How long a stopped (or cancelled-before-arrival) token is refused: a push request older
# than 2 * MAX_SKEW_S (sent before its cancel) fails the side channel's timestamp check.
TOMBSTONE_S = 2 * MAX_SKEW_S + 10.0


class CancelReply(msgspec.Struct, array_like=True):
    stopped: list[bool]             # per token: no write of it is (or will be) in flight
    incarnation: bytes              # this producer process (fence.py)


def xfer_states(agent: Any, handles: list[Any]) -> list[str]:
    """NIXL states of transfer handles ("PROC", "DONE", "ERR"); a handle whose check raises
    (e.g. the remote disconnected) counts as "ERR": it is over."""
    states = []
    for h in handles:
        try:
            states.append(agent.check_xfer_state(h))
        except Exception:  # noqa: BLE001 - nixl raises its own error types
            states.append("ERR")
    return states


def try_release(agent: Any, handle: Any) -> bool:
    """Release a NIXL transfer handle; False while it is still in flight and cannot be
    aborted (the caller keeps it and retries later)."""
    try:
        agent.release_xfer_handle(handle)
        return True
    except Exception:  # noqa: BLE001 - still in flight and not abortable: retry later
        return False


@dataclass(slots=True)
class _Consumer:
    agent_name: str
    dlist: Any
    base: np.ndarray
    num_blocks: list[int]


@dataclass(slots=True)
class _Write:
    req: PushRequest
    deadline: float
    handles: list[Any] = field(default_factory=list)
    cancelled: bool = False
    # Zombie handles (refused to release) keep the claim: the blocks stay held until released.
    stuck: list[Any] = field(default_factory=list)
    why: str = ""                   # how it ended, once it has


class PushProducer:
    def __init__(self, agent: Any, layout: KVLayout, leases: LeaseTable, local_dlist: Any,
                 mem: str, info: bytes, info_type: type, incarnation: bytes) -> None:
        self.agent = agent
        self.layout = layout
        self.leases = leases
        self.local_dlist = local_dlist
        self.mem = mem
        self._info, self._info_type = info, info_type
        self._lock = threading.Lock()
        self.consumers: dict[str, _Consumer] = {}
        self.writes: dict[bytes, _Write] = {}            # token -> write in flight
        self.stopped: dict[bytes, float] = {}            # token -> when answered "stopped"
        self.incarnation = incarnation
        self.num_pushed = 0
        self.num_refused_stopped = 0                     # push requests after their cancel

    def handlers(self) -> dict[str, Any]:
        return {"hello": self._serve_hello, "push": self._serve_push,
                "cancel": self._serve_cancel}

    # ------------------------------------------------------- side-channel thread
    def _serve_hello(self, body: bytes) -> bytes:
        info = msgspec.msgpack.decode(body, type=self._info_type)
        if info.fingerprint != self.layout.fingerprint:
            raise ValueError("the decode instance's KV layout differs from this one's")
        with self._lock:
            if any(w.req.consumer == info.agent_name for w in self.writes.values()):
                raise ValueError("writes to this decode instance are still in flight; retry")
            self._drop(info.agent_name)
            name = self.agent.add_remote_agent(info.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            dlist = self.agent.prep_xfer_dlist(name, descriptor_table(info.regions), self.mem)
            nb = [n for _, _, n, _ in info.regions]
            self.consumers[info.agent_name] = _Consumer(name, dlist, region_bases(nb), nb)
        return self._info

    def _serve_push(self, body: bytes) -> bytes:
        """"" once the write is posted, else why it was refused (nothing written)."""
        req = msgspec.msgpack.decode(body, type=PushRequest)
        with self._lock:
            if req.token in self.stopped or req.token in self.writes:
                self.num_refused_stopped += req.token in self.stopped
                return msgspec.msgpack.encode("the decode instance had cancelled this push")
        budget = req.deadline - time.time()
        if budget <= 0:     # the consumer has given up (or will have, before we are done)
            return msgspec.msgpack.encode("the decode instance's deadline had passed")
        rows, why = self.leases.claim(req.lease)
        if rows is None:
            return msgspec.msgpack.encode(why)
        try:
            why = self._post(req, rows, budget)
        except Exception as e:  # noqa: BLE001 - nixl raises its own error types
            why = f"the write failed to start: {e}"
        if why:
            self.leases.finish_claim(req.lease.request_id)
        return msgspec.msgpack.encode(why)

    def _post(self, req: PushRequest, rows: list[list[int]], budget_s: float) -> str:
        groups = self.layout.groups
        src_pages = pages_from_wire(req.remote_pages, len(groups))
        dst_pages = pages_from_wire(req.local_pages, len(groups))
        why = check_source_pages(groups, rows, src_pages, dst_pages)
        if why:
            return why
        with self._lock:
            peer = self.consumers.get(req.consumer)
            if peer is None:
                return UNKNOWN_CONSUMER
            for g, dst in zip(groups, dst_pages):
                if len(dst) and int(dst.max()) >= min(peer.num_blocks[r] for r in g.regions):
                    return "destination block ids out of range"
            src = descriptor_indices(groups, self.layout.base, src_pages)
            dst = descriptor_indices(groups, peer.base, dst_pages)
            w = _Write(req, time.monotonic() + budget_s)
            chunks = [(src[i:i + 1], dst[i:i + 1]) for i in range(len(src))] \
                if req.per_block else [(src, dst)]
            # Packed: the notification rides on the write. Per block: sent when all are done.
            notif = b"" if req.per_block else notification(True, req.token)
            self.writes[req.token] = w
            for s, d in chunks:
                h = self.agent.make_prepped_xfer("WRITE", self.local_dlist, s, peer.dlist, d,
                                                 notif_msg=notif)
                w.handles.append(h)
                if self.agent.transfer(h) == "ERR":
                    w.cancelled = True         # poll stops it and ends the claim
                    break
        return ""

    def _serve_cancel(self, body: bytes) -> bytes:
        """Per token: True once no write of it is in flight, nor can start (the token is
        refused from now on); a write still in flight is cancelled and answers False."""
        tokens = msgspec.msgpack.decode(body, type=list[bytes])
        now = time.monotonic()
        with self._lock:
            self.stopped = {t: at for t, at in self.stopped.items() if now - at < TOMBSTONE_S}
            answer = []
            for token in tokens:
                w = self.writes.get(token)
                if w is not None:
                    w.cancelled = True
                else:
                    self.stopped[token] = now
                answer.append(w is None)
            return msgspec.msgpack.encode(CancelReply(answer, self.incarnation))

    # -------------------------------------------------------------- engine thread
    def poll(self) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self.stopped) > 4096:
                self.stopped = {t: at for t, at in self.stopped.items()
                                if now - at < TOMBSTONE_S}
            for token, w in list(self.writes.items()):
                why = self._check(w, now)
                if why is None:
                    continue
                if w.stuck:
                    w.stuck = [h for h in w.stuck if not try_release(self.agent, h)]
                    if w.stuck:
                        continue
                del self.writes[token]
                self.stopped[token] = now
                self.leases.finish_claim(w.req.lease.request_id)
                if why == "ok":
                    self.num_pushed += 1
                    if w.req.per_block:
                        self._notify(w, True, "")
                else:       # also tells a consumer that gave up: its fence (fence.py)
                    self._notify(w, False, why)

    def _check(self, w: _Write, now: float) -> str | None:
        """None while writing, "ok", or why it stopped (its handles then released). A write
        in flight is never abandoned, even when cancelled: it may not be recallable."""
        if w.why:
            return w.why
        states = xfer_states(self.agent, w.handles)
        if "PROC" in states:
            return None
        if "ERR" in states:
            why = "the write failed (the decode instance is gone?)"
        elif w.cancelled:
            why = "cancelled"
        elif now > w.deadline:
            why = "the write ran past the decode side's deadline"
        else:
            why = "ok"
        for h in w.handles:
            if not try_release(self.agent, h):
                w.stuck.append(h)
        w.handles = []
        if why.startswith("the write failed") and not any(
                o.req.consumer == w.req.consumer and o is not w for o in self.writes.values()):
            self._drop(w.req.consumer)
        w.why = why
        return why

    def _notify(self, w: _Write, ok: bool, why: str) -> None:
        peer = self.consumers.get(w.req.consumer)
        if peer is None:
            return
        try:
            self.agent.send_notif(peer.agent_name, notification(ok, w.req.token, why))
        except Exception as e:  # noqa: BLE001 - the consumer's timeout covers it
            logger.info("push notification to %s failed: %s", peer.agent_name, e)

    def _drop(self, consumer: str) -> None:
        peer = self.consumers.pop(consumer, None)
        if peer is None:
            return
        try:
            self.agent.release_dlist_handle(peer.dlist)
            self.agent.remove_remote_agent(peer.agent_name)
        except Exception:  # noqa: BLE001 - a dead peer may refuse; its next hello redoes it
            logger.warning("could not remove NIXL consumer %s", peer.agent_name)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self.writes)

    def close(self) -> None:
        """Shutdown (the process is going away: its writes with it)."""
        with self._lock:
            for w in self.writes.values():
                for h in w.handles:
                    try_release(self.agent, h)
            self.writes.clear()
