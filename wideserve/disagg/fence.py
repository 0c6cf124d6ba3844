"""Fencing: a decode instance frees a given-up load's blocks only once no write of it can land.

A load the consumer gives up (timeout, abort) may still have a transfer writing into its
blocks: a push whose producer stalled (SIGSTOP, a long GC or swap pause, a hung host) after
posting its one-sided WRITE, or before posting it with the push request already accepted;
a pull whose own READ is still in flight. Freeing those blocks would let the late write
corrupt whatever request gets them next. So the load fails at once (the request recomputes
or fails, `kv_load_failure_policy`), but its blocks go to quarantine
(KVCacheManager.quarantine: held, never published, counted in the integrity check and the
connector metrics) until a fence is reached:
- push: the producer answers `cancel` that the write has stopped (its NIXL handles reached
  DONE or ERR and were released; the producer refuses the token from then on, so a push
  request still on its way is refused too), or it sends the write's notification, or a
  different incarnation of the producer answers (a restarted process: the old one is gone),
  or its side-channel port refuses connections (no process listens: it has exited);
- pull: the consumer's own READ handles reached DONE or ERR.
A producer that never answers keeps its loads' blocks quarantined (bounded by the loads that
were in flight to it: no new load starts from a producer with an open fence); the fence is
asked again every FENCE_RETRY_S, with one call in flight per producer.
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from wideserve.disagg.nixl_push import try_release, xfer_states
from wideserve.disagg.params import RemoteKV

logger = logging.getLogger(__name__)

FENCE_RETRY_S = 0.5


@dataclass(slots=True)
class Fence:
    fence_id: str
    engine: str                     # the producer's engine id
    remote: RemoteKV                # where its side channel listens
    incarnation: bytes              # the producer process the push went to
    token: bytes = b""              # push: the write's token
    handles: list[Any] = field(default_factory=list)   # pull: the consumer's own READs
    since: float = field(default_factory=time.monotonic)


# (tokens) -> (stopped per token, the answering producer's incarnation); raises when the
# producer cannot be reached.
CancelCall = Callable[[RemoteKV, list[bytes]], tuple[list[bool], bytes]]


def port_refuses(host: str, port: int, timeout_s: float) -> bool:
    """True when nothing listens at host:port (connection refused): the producer process
    that served its side channel there has exited. A stopped or hung process still has
    the kernel accept connections for it, so this never mistakes a stall for an exit."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False                # unreachable host or timeout: not known to be gone


class FenceTable:
    """The consumer's quarantined loads, by fence id, and the calls that end them."""

    def __init__(self, agent: Any, pool: ThreadPoolExecutor, cancel: CancelCall,
                 timeout_s: float) -> None:
        self.agent = agent
        self.pool = pool
        self.cancel = cancel
        self.timeout_s = timeout_s
        self.fences: dict[str, Fence] = {}
        self._calls: dict[str, Future] = {}        # engine -> its fence call in flight
        self._next_try: dict[str, float] = {}      # engine -> when to ask again

    def add(self, fence: Fence, why: str) -> str:
        self.fences[fence.fence_id] = fence
        logger.warning(
            "KV load from prefill instance %s given up (%s) with its %s not known to have "
            "stopped: its blocks stay quarantined until %s; no new loads from that instance "
            "until then (they fall back as kv_load_failure_policy says)", fence.engine, why,
            "write" if fence.token else "read",
            "it confirms the write stopped (or restarts, or exits)" if fence.token
            else "the read completes or fails")
        return fence.fence_id

    def blocks_loads_from(self, engine: str) -> int:
        """Open fences of loads from this producer (no new load starts from it meanwhile)."""
        return sum(f.engine == engine for f in self.fences.values())

    @property
    def tokens(self) -> dict[bytes, str]:
        return {f.token: fid for fid, f in self.fences.items() if f.token}

    def stopped(self, fence_ids: list[str], why: str) -> list[str]:
        for fid in fence_ids:
            f = self.fences.pop(fid)
            logger.info("quarantined KV load from %s released after %.1fs: %s", f.engine,
                        time.monotonic() - f.since, why)
        return fence_ids

    def saw_incarnation(self, engine: str, incarnation: bytes) -> list[str]:
        """A producer answered a handshake as `incarnation`: pushes to older ones are over."""
        old = [fid for fid, f in self.fences.items() if f.engine == engine and f.token
               and f.incarnation != incarnation]
        return self.stopped(old, "the prefill instance restarted")

    def poll(self) -> list[str]:
        """Fence ids reached since the last call."""
        now = time.monotonic()
        done = self._poll_reads()
        by_engine: dict[str, list[Fence]] = {}
        for f in self.fences.values():
            if f.token:
                by_engine.setdefault(f.engine, []).append(f)
        for engine, fences in by_engine.items():
            call = self._calls.get(engine)
            if call is None:
                if now >= self._next_try.get(engine, 0.0):
                    r = fences[0].remote
                    tokens = [f.token for f in fences]
                    self._calls[engine] = self.pool.submit(self._ask, r, tokens)
                continue
            if not call.done():
                continue
            del self._calls[engine]
            self._next_try[engine] = now + FENCE_RETRY_S
            done += self._answered(fences, call.result())
        for engine in [e for e in self._next_try if e not in by_engine]:
            del self._next_try[engine]
        return done

    def _poll_reads(self) -> list[str]:
        done = []
        for fid, f in self.fences.items():
            if f.handles and "PROC" not in xfer_states(self.agent, f.handles):
                f.handles = [h for h in f.handles if not try_release(self.agent, h)]
                if not f.handles:
                    done.append(fid)
        return self.stopped(done, "its read stopped")

    def _ask(self, r: RemoteKV, tokens: list[bytes]) -> tuple[str, list[bool], bytes]:
        """("answer", stopped per token, incarnation), or ("gone" | "silent", [], b"")."""
        try:
            stopped, incarnation = self.cancel(r, tokens)
            return "answer", stopped, incarnation
        except Exception:  # noqa: BLE001 - no answer: stalled, partitioned or exited
            gone = port_refuses(r.remote_host, r.remote_port, self.timeout_s)
            return ("gone" if gone else "silent"), [], b""

    def _answered(self, fences: list[Fence], answer: tuple[str, list[bool], bytes]
                  ) -> list[str]:
        kind, stopped, incarnation = answer
        if kind == "gone":
            return self.stopped([f.fence_id for f in fences if f.fence_id in self.fences],
                                "the prefill instance has exited (its port refuses)")
        if kind != "answer":
            return []
        ended = [f.fence_id for f, s in zip(fences, stopped)
                 if f.fence_id in self.fences and (s or f.incarnation != incarnation)]
        return self.stopped(ended, "the prefill instance confirmed the write stopped")
