"""`bench serve` for request datasets (random, shared-prefix): warmup, then the timed run at a
fixed concurrency and/or request rate (Poisson arrivals), with a progress bar and a stop event
(Ctrl-C) that ends the run early and keeps what finished.

One concurrency point = warmup requests (excluded), a /metrics scrape, the profiled requests,
another scrape; the point's result is `compute_metrics` plus the server-side deltas.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from wideserve.bench.client import ServeTarget, send_request
from wideserve.bench.datasets import BenchRequest
from wideserve.bench.latency_metrics import RequestRecord, compute_metrics, server_metric_deltas
from wideserve.bench.prometheus import scrape


@dataclass(slots=True)
class PointResult:
    concurrency: int | None
    request_rate: float
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    server_before: dict[str, float] | None = None
    server_after: dict[str, float] | None = None
    interrupted: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self, num_gpus: int) -> dict[str, Any]:
        out = {"max_concurrency": self.concurrency, "request_rate": self.request_rate,
               "interrupted": self.interrupted, **self.extra}
        out.update(compute_metrics(self.records, num_gpus, self.wall_s))
        if self.server_before is not None and self.server_after is not None:
            out["server"] = server_metric_deltas(self.server_before, self.server_after)
        else:
            out["server"] = {"prefix_cache_hit_rate": None, "spec_decode": None,
                             "note": "no /metrics endpoint"}
        return out

    def samples(self) -> dict[str, list[float]]:
        ok = [r for r in self.records if r.phase == "profiling" and r.ok]
        return {"ttft_s": [round(r.ttft, 6) for r in ok],
                "e2el_s": [round(r.e2el, 6) for r in ok],
                "tpot_s": [round(t, 6) for t in (r.tpot for r in ok) if t is not None],
                "itl_s": [round(g, 6) for r in ok for g in r.itls]}


def _arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Poisson process gaps (seconds); rate inf = all at once."""
    if math.isinf(rate):
        return [0.0] * n
    return np.random.default_rng(seed).exponential(1.0 / rate, size=n).tolist()


async def _run_batch(client: Any, target: ServeTarget, requests: list[BenchRequest],
                     concurrency: int | None, rate: float, seed: int, phase: str,
                     stop: asyncio.Event, on_done: Callable[[], None] | None
                     ) -> list[RequestRecord]:
    limit = asyncio.Semaphore(concurrency or len(requests) or 1)
    records: list[RequestRecord] = []

    async def one(req: BenchRequest) -> None:
        async with limit:
            if stop.is_set():
                return
            rec = await send_request(client, target, req, phase=phase)
            records.append(rec)
            if on_done:
                on_done()

    tasks: list[asyncio.Task] = []
    for req, gap in zip(requests, _arrival_gaps(len(requests), rate, seed)):
        if gap:
            try:
                await asyncio.wait_for(stop.wait(), gap)
            except asyncio.TimeoutError:
                pass
        if stop.is_set():
            break
        tasks.append(asyncio.create_task(one(req)))
    waiter = asyncio.create_task(stop.wait())
    pending = set(tasks)
    while pending and not stop.is_set():
        done, pending = await asyncio.wait(pending | {waiter},
                                           return_when=asyncio.FIRST_COMPLETED)
        pending.discard(waiter)
    for t in pending:
        t.cancel()                    # interrupted: in-flight requests are dropped, not errors
    await asyncio.gather(*pending, return_exceptions=True)
    waiter.cancel()
    return records


async def run_point(client: Any, target: ServeTarget, requests: list[BenchRequest],
                    warmups: list[BenchRequest], concurrency: int | None, rate: float,
                    seed: int, stop: asyncio.Event, progress: bool = True) -> PointResult:
    from tqdm.auto import tqdm

    point = PointResult(concurrency, rate)
    if warmups:
        await _run_batch(client, target, warmups, concurrency, math.inf, seed, "warmup",
                         stop, None)
    point.server_before = await scrape(client, target.base_url)
    label = f"conc {concurrency}" if concurrency else f"rate {rate}"
    bar = tqdm(total=len(requests), desc=f"bench serve ({label})", disable=not progress,
               leave=False)
    t0 = time.perf_counter()
    try:
        point.records = await _run_batch(client, target, requests, concurrency, rate, seed,
                                         "profiling", stop, lambda: bar.update(1))
    finally:
        bar.close()
    point.wall_s = time.perf_counter() - t0
    point.server_after = await scrape(client, target.base_url)
    point.interrupted = stop.is_set()
    return point
