"""`LLM(data_parallel_size=N, ...)`: the offline API over N engine-core processes.

One process cannot be N lock-step ranks, so the offline LLM drives N engine-core processes
through the same DPEngineClient the server uses, on a private asyncio loop, behind the small
synchronous surface the LLM needs from an engine (add_request, abort_requests, step,
has_unfinished_requests). `step()` returns whatever outputs arrived (waiting for the first).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any, Sequence

from wideserve.config import EngineConfig
from wideserve.serving.engine_client import EngineDeadError
from wideserve.types.messages import EngineCoreRequest
from wideserve.types.sched_output import EngineCoreOutput
from wideserve.serving.dp_client import DPEngineClient
from wideserve.worker.model_loader import resolve_model_path

OFFLINE_STALL_S = 60.0


class SyncDPEngine:
    def __init__(self, config: EngineConfig, step_timeout_s: float | None = None) -> None:
        self.config = config
        self.model_path: Path = resolve_model_path(config.load.model)
        self.step_timeout_s = step_timeout_s or config.parallel.dp_sync_timeout_s + 30.0
        self._loop = asyncio.new_event_loop()
        self._outputs: list[EngineCoreOutput] = []
        self._arrived = asyncio.Event()
        self._unfinished: set[str] = set()
        # No health endpoint to fail here, and a long lock-step step on a big model is not a
        # hang: declared dead only after OFFLINE_STALL_S of silence.
        self.client = DPEngineClient(config, stale_after_s=OFFLINE_STALL_S,
                                     stall_timeout_s=OFFLINE_STALL_S)
        self.client.on_outputs = self._on_outputs
        self.client.on_dead = lambda reason: self._arrived.set()
        try:
            self.model_info = self._run(self.client.start())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def _on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        self._outputs.extend(outputs)
        for out in outputs:
            if out.finished:
                self._unfinished.discard(out.request_id)
        self._arrived.set()

    def add_request(self, req: EngineCoreRequest) -> None:
        self._unfinished.add(req.request_id)
        self._run(self.client.add_requests([req]))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._run(self.client.abort_requests(list(request_ids)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def step(self) -> list[EngineCoreOutput]:
        if not self._outputs:
            self._run(self._wait())
        outputs, self._outputs = self._outputs, []
        return outputs

    async def _wait(self) -> None:
        # Callbacks left ready by the previous loop run (a reader part-way through draining
        # its socket) run before this coroutine's first step and may already have delivered
        # the outputs - the last ones of the batch, after which none come. Clearing the event
        # then lost that wake-up, and the step waited out its whole timeout (a DEP2 run in
        # CI: every request finished, "no output in 90 s").
        if self._outputs:
            return
        self._arrived.clear()
        if self.client.dead_reason is not None:
            raise EngineDeadError(self.client.dead_reason)
        try:
            await asyncio.wait_for(self._arrived.wait(), self.step_timeout_s)
        except asyncio.TimeoutError:
            self._dump_rank_stacks()
            raise EngineDeadError(f"no output from the data-parallel engines in "
                                  f"{self.step_timeout_s:.0f} s with requests unfinished ("
                                  f"{stall_report(self.client.clients, time.monotonic())}; "
                                  f"{await self._whereabouts()})") from None
        if self.client.dead_reason is not None and not self._outputs:
            raise EngineDeadError(self.client.dead_reason)

    async def _whereabouts(self, limit: int = 8) -> str:
        """Where each unfinished request is: held by its rank (a scheduler that never
        finishes it), or not, and then whether the rank ever received it (else it was lost
        between this client and the rank) and emitted its final output (else it ended there
        without one; if it did, the output was lost on its way back)."""
        async def ask(client: Any, method: str) -> Any:
            try:
                return await client.call_utility(method, 5.0)
            except Exception:  # noqa: BLE001 - a diagnostic: an unanswered rank says so
                return None
        clients = self.client.clients
        known, history = await asyncio.gather(
            asyncio.gather(*(ask(c, "request_ids") for c in clients)),
            asyncio.gather(*(ask(c, "request_history") for c in clients)))
        parts = []
        for rid in sorted(self._unfinished)[:limit]:
            rank = self.client.rank_of(rid)
            parts.append(f"request {rid!r}: " + (
                "owner unknown" if rank is None else
                _where(rid, rank, known[rank], history[rank])))
        more = len(self._unfinished) - limit
        return "; ".join(parts) + (f"; {more} more" if more > 0 else "")

    def _dump_rank_stacks(self) -> None:
        """Ask this node's ranks to print their Python stacks to stderr (DPEngineCore
        registers faulthandler on SIGUSR1): the evidence for why nobody produced output."""
        for client in self.client.clients:
            if client.proc is not None and client.proc.poll() is None:
                try:
                    os.kill(client.proc.pid, signal.SIGUSR1)
                except OSError:
                    pass

    def get_stats(self) -> dict[str, Any]:
        return self._run(self.client.call_utility("get_stats"))

    def check_integrity(self) -> None:
        self._run(self.client.call_utility("check_integrity"))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self.client.shutdown())
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._run(asyncio.gather(*pending, return_exceptions=True))
        finally:
            self._loop.close()


def _where(rid: str, rank: int, held: list[str] | None, history: dict | None) -> str:
    if held is None:
        return f"rank {rank} did not answer"
    if rid in held:
        return f"rank {rank} holds it"
    if not history:
        return f"rank {rank} does not know it"
    if rid not in history["received"]:
        return f"rank {rank} does not know it and never received it"
    if rid in history["ended"]:
        return f"rank {rank} received it and emitted its final output"
    return f"rank {rank} received it and ended it without a final output"


def stall_report(clients: Sequence[Any], now: float) -> str:
    """Each rank's load as its last stats said, and how long ago it was last heard from:
    a rank still heard from with requests that never finish points at the scheduler, one
    long silent at its process or the network."""
    parts = []
    for rank, client in enumerate(clients):
        stats = client.stats or {}
        load = (f"{stats['num_running']} running, {stats['num_waiting']} waiting"
                if "num_running" in stats and "num_waiting" in stats else "no stats yet")
        parts.append(f"rank {rank}: {load}, last heard {now - client.last_heard:.1f} s ago")
    return "; ".join(parts)
