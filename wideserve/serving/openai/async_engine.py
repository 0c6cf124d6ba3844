"""Request streams on top of the engine-core client: what the HTTP handlers consume.

`AsyncEngine.generate()` registers a request with the OutputProcessor (detokenisation, stop
strings, n fan-out), submits its children to the engine core and yields one `StreamItem` per
wake-up. Outputs are routed on the event loop as they arrive; a consumer that falls behind
gets the deltas of several steps merged into one item, so a slow client never makes the
server buffer per-step objects or send more chunks than it can read.

Whoever stops iterating before the end (client gone, handler cancelled) aborts the request:
its children are aborted in the core, whose KV blocks are then freed.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from wideserve.serving.arrivals import ArrivalCounter
from wideserve.serving.engine_client import EngineCoreClient, EngineDeadError
from wideserve.serving.output_processor import CompletionDelta, OutputProcessor, child_request_id
from wideserve.serving.openai.server_metrics import ServerMetrics
from wideserve.types.outputs import RequestOutput
from wideserve.types.multimodal import ImageInput
from wideserve.types.sampling_params import SamplingParams
from wideserve.text.tokenizer import Tokenizer


class RequestFailed(RuntimeError):
    """The engine rejected or failed the request; the message says why. `internal` is True
    when the fault is the server's (a failed engine step, an output it could not process),
    not the request's."""

    def __init__(self, message: str, internal: bool = False) -> None:
        super().__init__(message)
        self.internal = internal


@dataclass(slots=True)
class StreamItem:
    output: RequestOutput                   # cumulative state (texts, ids, metrics)
    deltas: dict[int, CompletionDelta]      # child index -> what is new since the last item
    finished: bool


@dataclass(slots=True)
class _Stream:
    arrival: float
    pending: list[StreamItem] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: BaseException | None = None
    last_token_time: float | None = None
    errors: dict[int, str] = field(default_factory=dict)   # child index -> engine message
    internal_error: str | None = None       # a server-side fault: the request fails whole

    def push(self, item: StreamItem) -> None:
        self.pending.append(item)
        self.event.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.event.set()

    async def wait(self) -> None:
        """Until there is something to hand out: items, or an error. The state is checked
        before waiting, not only the event: an output and a failure that both arrive while
        the consumer is busy set the event once, and the consumer takes the items first;
        waiting on the (cleared) event after that would never see the failure."""
        while not self.pending and self.error is None:
            await self.event.wait()
            self.event.clear()
        self.event.clear()


def _merge(items: list[StreamItem]) -> StreamItem:
    if len(items) == 1:
        return items[0]
    deltas: dict[int, CompletionDelta] = {}
    for item in items:
        for idx, d in item.deltas.items():
            prev = deltas.get(idx)
            if prev is None:
                deltas[idx] = CompletionDelta(d.index, d.text, list(d.token_ids),
                                              list(d.logprobs) if d.logprobs else None,
                                              d.finish_reason, d.stop_reason)
                continue
            prev.text += d.text
            prev.token_ids.extend(d.token_ids)
            if d.logprobs:
                prev.logprobs = (prev.logprobs or []) + list(d.logprobs)
            prev.finish_reason, prev.stop_reason = d.finish_reason, d.stop_reason
    return StreamItem(items[-1].output, deltas, items[-1].finished)


class AsyncEngine:
    def __init__(self, client: EngineCoreClient, tokenizer: Tokenizer,
                 metrics: ServerMetrics | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.processor = OutputProcessor(tokenizer)
        # Generation requests received and not yet submitted (serving/arrivals.py; counted
        # by ArrivalMiddleware): each submission tells the engine how many are behind it.
        self.arrivals = ArrivalCounter()
        self._streams: dict[str, _Stream] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}
        client.on_outputs = self._on_outputs
        client.on_dead = self._on_dead

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int = 0,
                       arrival_time: float | None = None,
                       group_id: str | None = None,
                       images: list[ImageInput] | None = None) -> AsyncIterator[StreamItem]:
        """Yield merged StreamItems until the request finishes; raises EngineDeadError if the
        engine dies, RequestFailed if the engine rejects it, ValueError for a bad request.
        `group_id`: the client request this is part of (fair admission across them)."""
        ok, why = self.client.health()      # dead, or silent past the heartbeat timeout
        if not ok:
            raise EngineDeadError(why)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        core_requests = self.processor.add_request(request_id, prompt, prompt_token_ids,
                                                   params, arrival_time=arrival,
                                                   priority=priority, group_id=group_id,
                                                   images=images)
        stream = _Stream(arrival)
        self._streams[request_id] = stream
        for i, req in enumerate(core_requests):
            self._child_to_parent[req.request_id] = (request_id, i)
        finished = False
        outcome = "abort"
        try:
            await self.client.add_requests(core_requests, pending=self.arrivals.submitting())
            if self.metrics is not None:
                self.metrics.observe_request_start(len(prompt_token_ids), params)
            while not finished:
                await stream.wait()
                if stream.pending:
                    item = _merge(stream.pending)
                    stream.pending = []
                    finished = item.finished
                    if finished and stream.internal_error is not None:
                        raise RequestFailed(stream.internal_error, internal=True)
                    if finished and stream.errors and \
                            all(not c.token_ids for c in item.output.outputs):
                        raise RequestFailed(next(iter(stream.errors.values())))
                    yield item
                elif stream.error is not None:
                    raise stream.error
        except EngineDeadError:
            outcome = "error"
            raise
        finally:
            self._forget(request_id)
            if not finished:
                await self._abort(request_id, outcome)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _abort(self, request_id: str, outcome: str) -> None:
        child_ids = self.processor.abort_request(request_id)
        for cid in child_ids:
            self._child_to_parent.pop(cid, None)
        if self.metrics is not None:
            self.metrics.observe_finish(outcome, None)
        try:
            await self.client.abort_requests(child_ids)
        except EngineDeadError:
            pass

    # ------------------------------------------------------------------ engine callbacks

    def _on_outputs(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        for out in outputs:
            if out.error is not None and out.request_id in self._child_to_parent:
                parent_id, index = self._child_to_parent[out.request_id]
                stream = self._streams.get(parent_id)
                if stream is not None:
                    stream.errors[index] = out.error
                    if out.internal_error and stream.internal_error is None:
                        stream.internal_error = out.error
        processed = self.processor.process_outputs(outputs, now)
        self._fail_unprocessable(processed.failed)
        for ro in processed.request_outputs:
            stream = self._streams.get(ro.request_id)
            deltas = processed.deltas.get(ro.request_id, [])
            if ro.finished:
                for co in ro.outputs:
                    self._child_to_parent.pop(child_request_id(ro.request_id, co.index,
                                                        len(ro.outputs)), None)
            if stream is None:
                continue
            self._observe(stream, ro, deltas, now)
            stream.push(StreamItem(ro, {d.index: d for d in deltas}, ro.finished))
        if processed.reqs_to_abort:
            asyncio.get_running_loop().create_task(
                self._abort_quietly(processed.reqs_to_abort))

    def _fail_unprocessable(self, failed: dict[str, str]) -> None:
        """Requests whose output could not be processed fail alone (the processor has
        forgotten them and queued their children's aborts); the rest keep streaming."""
        for parent_id, why in failed.items():
            for cid in [c for c, (p, _) in self._child_to_parent.items() if p == parent_id]:
                del self._child_to_parent[cid]
            stream = self._streams.get(parent_id)
            if stream is not None:
                stream.fail(RequestFailed(why, internal=True))

    async def _abort_quietly(self, child_ids: list[str]) -> None:
        try:
            await self.client.abort_requests(child_ids)
        except EngineDeadError:
            pass

    def _observe(self, stream: _Stream, ro: RequestOutput, deltas: list[CompletionDelta],
                 now: float) -> None:
        m = self.metrics
        if m is None:
            return
        new = sum(len(d.token_ids) for d in deltas)
        if new:
            if stream.last_token_time is None:
                m.observe_tokens(new, None, now - stream.arrival)
            else:
                m.observe_tokens(new, now - stream.last_token_time, None)
            stream.last_token_time = now
        if ro.finished:
            reasons = {co.finish_reason for co in ro.outputs}
            outcome = next((r for r in ("error", "abort", "length", "stop") if r in reasons),
                           "stop")
            m.observe_cached(ro.num_cached_tokens)
            m.observe_finish(outcome, now - stream.arrival)
            m.observe_request_done(ro)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with `error` (the engine died; the server is stopping)."""
        for stream in self._streams.values():
            stream.fail(error)

    def _on_dead(self, reason: str) -> None:
        self.fail_all(EngineDeadError(reason))


