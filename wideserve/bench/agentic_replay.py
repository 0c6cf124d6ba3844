"""Replay Weka traces against a server the AgentX way (docs/benchmarking.md, "Replay rules").

- Closed loop: N lanes, each replaying one session tree (main turns + subagent children) at a
  time; a finished tree hands its lane the next trace (FIFO, restarting at turn 0).
- Prompts are rebuilt from `hash_ids`: block id b of trace T is always the same 64 (block_size)
  words, so shared blocks are byte-identical and, with a word-per-token vocabulary
  (datasets.WordVocab), exactly block_size tokens. Every play prepends its own cache-bust marker
  `[rid:<12 hex>]` + blank line to the (single) user message: plays never share KV, turns and
  subagents within a play do.
- `max_tokens` = the recorded `out`, `ignore_eos`, streaming chat completions.
- Timing is end-to-start: a request is sent `think_time` after the previous one of its stream
  finished (subagents join before the parent's next turn), capped per gap (`trace_gap_cap_s`,
  InferenceX 300 s) and by a whole-system idle cap (`idle_cap_s`, 10 s: when nothing is in
  flight, all pending timers shift so the next one fires within the cap). `time_scale`
  multiplies think times (1.0 = as recorded; < 1 only to fit short CPU runs).
- Warmup: each lane's first trace starts at t* uniform in [start_min, start_max] of its
  duration, after a max_tokens=1 primer that replays the last main turn before t* (subagent
  groups spawned before t* are skipped: a simplification of AIPerf's per-stream primers); each
  lane then sends `warmup_per_lane` more requests as warmup. Profiling starts when every lane
  has finished its warmup and lasts `duration_s`; requests are not started after it ends.
"""
from __future__ import annotations

import asyncio
import math
import secrets
import time
import zlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from wideserve.bench.client import ServeTarget, send_request
from wideserve.bench.datasets import BenchRequest, WordVocab
from wideserve.bench.latency_metrics import RequestRecord


@dataclass(slots=True)
class ReplayOptions:
    concurrency: int
    duration_s: float
    warmup_per_lane: int = 10
    start_min: float = 0.25
    start_max: float = 0.75
    trace_gap_cap_s: float = 300.0
    idle_cap_s: float = 10.0
    time_scale: float = 1.0
    drain_timeout_s: float = 120.0
    min_output_tokens: int = 1
    seed: int = 42


class BlockText:
    """Deterministic text per (trace, block id): block_size words; a partial (tail) block is
    the first n words of its block."""

    def __init__(self, words: WordVocab, seed: int, block_size: int) -> None:
        self.words, self.seed, self.block_size = words, seed, block_size
        self._cache: dict[tuple[str, int], tuple[np.ndarray, str]] = {}

    def _block(self, trace_id: str, block_id: int) -> tuple[np.ndarray, str]:
        key = (trace_id, block_id)
        hit = self._cache.get(key)
        if hit is None:
            rng = np.random.default_rng([self.seed, zlib.crc32(trace_id.encode()), block_id])
            picks = rng.integers(0, len(self.words.texts), size=self.block_size)
            hit = self._cache[key] = (picks, self.words.join(picks))
        return hit

    def prompt(self, trace_id: str, hash_ids: list[int], n_tokens: int) -> str:
        """The first n_tokens words of the blocks hash_ids (ceil(n / block_size) of them)."""
        parts = []
        for j, b in enumerate(hash_ids):
            n = min(self.block_size, n_tokens - j * self.block_size)
            if n <= 0:
                break
            picks, text = self._block(trace_id, int(b))
            parts.append(text if n == self.block_size else self.words.join(picks[:n]))
        return "".join(parts)


class ReplayClock:
    """Sleeps with the whole-system idle cap: while nothing is in flight, every pending wake-up
    is pulled earlier so the soonest fires within idle_cap_s."""

    def __init__(self, idle_cap_s: float) -> None:
        self.idle_cap_s = idle_cap_s
        self.inflight = 0
        self._pending: dict[int, float] = {}
        self._next = 0
        self._wake = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            return
        token = self._next
        self._next += 1
        self._pending[token] = time.perf_counter() + seconds
        self._maybe_shift()
        try:
            while (remaining := self._pending[token] - time.perf_counter()) > 0:
                wake = self._wake
                try:
                    await asyncio.wait_for(wake.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            del self._pending[token]

    def begin(self) -> None:
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        self._maybe_shift()

    def _maybe_shift(self) -> None:
        if self.inflight or not self._pending or math.isinf(self.idle_cap_s):
            return
        excess = min(self._pending.values()) - (time.perf_counter() + self.idle_cap_s)
        if excess > 0:
            for k in self._pending:
                self._pending[k] -= excess
            self._wake.set()
            self._wake = asyncio.Event()


@dataclass(slots=True)
class _Turn:
    main: dict[str, Any]
    children: list[dict[str, Any]]


def trace_turns(trace: dict[str, Any]) -> list[_Turn]:
    """Main requests with the subagent entries that follow each (spawned after it)."""
    turns: list[_Turn] = []
    for r in trace["requests"]:
        if r.get("type") == "subagent":
            if turns:                  # no preceding parent turn: dropped, as AIPerf does
                turns[-1].children.append(r)
        else:
            turns.append(_Turn(r, []))
    return turns


class _Lane:
    __slots__ = ("index", "warmup_left")

    def __init__(self, index: int, warmup: int) -> None:
        self.index, self.warmup_left = index, warmup


class Replayer:
    """Runs the closed loop; `records` holds every finished request (warmup included)."""

    def __init__(self, client: Any, target: ServeTarget, traces: list[dict[str, Any]],
                 text: BlockText, opts: ReplayOptions, stop: asyncio.Event) -> None:
        traces = [t for t in traces if trace_turns(t)]
        if not traces:
            raise ValueError("no traces with a main request to replay")
        self.client, self.target, self.traces = client, target, traces
        self.text, self.opts, self.stop = text, opts, stop
        self.records: list[RequestRecord] = []
        self.clock = ReplayClock(opts.idle_cap_s)
        self.rng = np.random.default_rng(opts.seed)
        self.profiling = asyncio.Event()
        self.closed = False
        self.profile_start: float | None = None
        self.profile_end: float | None = None
        self.sessions_started = 0
        self.sessions_completed = 0
        self._next_trace = 0
        self._lanes_warm = 0

    # ---------------------------------------------------------------- driver
    async def run(self, progress: bool = True,
                  on_start: Callable[[], Awaitable[None]] | None = None) -> None:
        """Warmup, profiling for duration_s (on_start runs as it begins), drain, stop."""
        from tqdm.auto import tqdm

        lanes = [asyncio.create_task(self._lane(_Lane(i, self.opts.warmup_per_lane)))
                 for i in range(self.opts.concurrency)]
        stop_wait = asyncio.create_task(self.stop.wait())
        prof_wait = asyncio.create_task(self.profiling.wait())
        await asyncio.wait({stop_wait, prof_wait}, return_when=asyncio.FIRST_COMPLETED)
        if not self.stop.is_set() and on_start is not None:
            await on_start()
        if not self.stop.is_set():
            bar = tqdm(total=int(self.opts.duration_s), desc="agentic replay (s)",
                       disable=not progress, leave=False)
            end = time.perf_counter() + self.opts.duration_s
            while (left := end - time.perf_counter()) > 0 and not self.stop.is_set():
                await asyncio.wait({stop_wait}, timeout=min(1.0, left))
                bar.n = int(self.opts.duration_s - max(left - 1.0, 0.0))
                bar.set_postfix(requests=len(self.records), refresh=True)
            bar.close()
        self.closed = True
        self.profile_end = time.perf_counter()
        self.profiling.set()                       # release lanes still waiting for it
        drain_end = time.perf_counter() + (0.0 if self.stop.is_set()
                                           else self.opts.drain_timeout_s)
        while self.clock.inflight and time.perf_counter() < drain_end:
            await asyncio.sleep(0.05)
        for t in lanes + [stop_wait, prof_wait]:
            t.cancel()
        await asyncio.gather(*lanes, stop_wait, prof_wait, return_exceptions=True)

    @property
    def profile_seconds(self) -> float:
        if self.profile_start is None or self.profile_end is None:
            return 0.0
        return self.profile_end - self.profile_start

    # ---------------------------------------------------------------- lanes
    async def _lane(self, lane: _Lane) -> None:
        if lane.warmup_left == 0:
            self._lane_warm()
        first = True
        while not self.closed:
            trace = self.traces[self._next_trace % len(self.traces)]
            self._next_trace += 1
            marker = f"[rid:{secrets.token_hex(6)}]\n\n"
            turns = trace_turns(trace)
            start = 0
            if first and turns:
                start = self._start_turn(turns)
                if start > 0:
                    await self._send(lane, trace, marker, turns[start - 1].main, primer=True)
            first = False
            self.sessions_started += 1
            await self._play(lane, trace, marker, turns, start)
            if not self.closed:
                self.sessions_completed += 1

    def _start_turn(self, turns: list[_Turn]) -> int:
        last = turns[-1].main
        duration = float(last["t"]) + float(last.get("api_time", 0.0))
        t_star = self.rng.uniform(self.opts.start_min, self.opts.start_max) * duration
        k = next((i for i, t in enumerate(turns) if float(t.main["t"]) >= t_star),
                 len(turns) - 1)
        return k

    async def _play(self, lane: _Lane, trace: dict[str, Any], marker: str,
                    turns: list[_Turn], start: int) -> None:
        for k in range(start, len(turns)):
            if k > 0:
                await self.clock.sleep(self._gap(turns[k].main))
            if self.closed:
                return
            await self._send(lane, trace, marker, turns[k].main)
            if turns[k].children:
                await asyncio.gather(*(self._child(lane, trace, marker, c)
                                       for c in turns[k].children))

    async def _child(self, lane: _Lane, trace: dict[str, Any], marker: str,
                     entry: dict[str, Any]) -> None:
        for j, r in enumerate(entry.get("requests", [])):
            if j > 0:
                await self.clock.sleep(self._gap(r))
            if self.closed:
                return
            await self._send(lane, trace, marker, r, session=entry.get("agent_id"))

    def _gap(self, r: dict[str, Any]) -> float:
        think = float(r.get("think_time") or 0.0)
        return min(think, self.opts.trace_gap_cap_s) * self.opts.time_scale

    # ---------------------------------------------------------------- requests
    async def _phase(self, lane: _Lane, primer: bool) -> str | None:
        if self.closed:
            return None
        if primer:
            return "warmup"
        if lane.warmup_left > 0:
            lane.warmup_left -= 1
            if lane.warmup_left == 0:
                self._lane_warm()
            return "warmup"
        await self.profiling.wait()
        return None if self.closed else "profiling"

    def _lane_warm(self) -> None:
        self._lanes_warm += 1
        if self._lanes_warm == self.opts.concurrency and not self.profiling.is_set():
            self.profile_start = time.perf_counter()
            self.profiling.set()

    async def _send(self, lane: _Lane, trace: dict[str, Any], marker: str, r: dict[str, Any],
                    primer: bool = False, session: str | None = None) -> None:
        phase = await self._phase(lane, primer)
        if phase is None:
            return
        text = self.text.prompt(str(trace.get("id", "")), r["hash_ids"], int(r["in"]))
        out = max(int(r["out"]), self.opts.min_output_tokens)
        req = BenchRequest([], out, messages=[{"role": "user", "content": marker + text}],
                           num_prompt_tokens=int(r["in"]))
        self.clock.begin()
        try:
            rec = await send_request(self.client, self.target, req, phase=phase,
                                     max_tokens=1 if primer else None,
                                     session=f"{trace.get('id')}:{session or 'main'}")
        finally:
            self.clock.end()
        self.records.append(rec)
