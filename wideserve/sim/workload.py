"""Workloads for the simulator: fixed lengths, or the project's AgentX-style sessions.

A request is (input tokens, output tokens, prefix-cached input tokens). The agentic source
runs `bench/agentic.py`'s generator (the same sessions `wideserve bench gen-agentic` writes)
and takes each request's prefix hit from its block ids: the leading blocks its session has
already sent (an ideal per-session prefix cache, as `trace_stats` counts it).
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimRequest:
    input_len: int
    output_len: int
    cached: int = 0


def fixed(input_len: int, output_len: int) -> Iterator[SimRequest]:
    if input_len < 1 or output_len < 1:
        raise ValueError("fixed workload needs --input-len and --output-len >= 1")
    while True:
        yield SimRequest(input_len, output_len)


def agentic(preset: str = "full", scale: float = 1.0, seed: int = 0,
            sessions: int = 32) -> Iterator[SimRequest]:
    """Requests of `sessions` generated sessions in session order, cycled forever."""
    from wideserve.bench.agentic import AgenticParams, generate_session, iter_requests
    p = AgenticParams.preset(preset, scale=scale)
    reqs: list[SimRequest] = []
    for i in range(sessions):
        seen: set[int] = set()
        for _kind, r in iter_requests(generate_session(p, seed, i)):
            ids = r["hash_ids"]
            hit = 0
            while hit < len(ids) and ids[hit] in seen:
                hit += 1
            seen.update(ids)
            cached = min(hit * p.block_size, r["in"] - 1)
            reqs.append(SimRequest(int(r["in"]), max(1, int(r["out"])), max(0, cached)))
    while True:
        yield from reqs
