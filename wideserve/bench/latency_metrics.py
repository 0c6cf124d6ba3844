"""Serving-benchmark metrics, exactly as the field defines them (docs/benchmarking.md, "Metrics").

Per request (successful, profiling phase only):
- TTFT = first streamed content - send; E2EL = last streamed chunk - send.
- TPOT = (E2EL - TTFT) / (OSL - 1), only for OSL > 1 (vLLM). This is also AIPerf's per-request
  "inter_token_latency", which InferenceX reports as ITL/TPOT for AgentX.
- ITL = every gap between consecutive content chunks, pooled over all requests (vLLM); with
  speculative decoding several tokens share a chunk, so compare TPOT, not ITL.
- E2E-normalised interactivity (AgentX's x-axis): r_i = E2EL_i / OSL_i; interactivity_q =
  1 / percentile_q(r). P90 is the slow tail (p90 of seconds per token, then inverted).
Aggregate:
- duration = max(request end) - min(request start) over those requests (AgentX);
  throughput = tokens / duration; ISL counts cached prefix tokens; per GPU = / num_gpus.
- percentiles: numpy linear interpolation (k = (n - 1) p / 100).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

PERCENTILES = (50, 75, 90, 95, 99)


@dataclass(slots=True)
class RequestRecord:
    """Client-side timings of one request, in seconds on one monotonic clock."""

    start: float
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)   # each content chunk's arrival
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None        # usage.prompt_tokens_details.cached_tokens
    error: str | None = None
    context_overflow: bool = False
    phase: str = "profiling"                # or "warmup"
    session: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1] - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]


def distribution(values: Sequence[float] | np.ndarray,
                 percentiles: Iterable[int] = PERCENTILES) -> dict[str, float | None]:
    """mean, std, min, max and linear-interpolated percentiles (None for an empty sample)."""
    a = np.asarray(values, dtype=np.float64)
    keys = ["mean", "std", "min", "max"] + [f"p{p}" for p in percentiles]
    if a.size == 0:
        return dict.fromkeys(keys, None)
    out: dict[str, float | None] = {"mean": float(a.mean()), "std": float(a.std()),
                                    "min": float(a.min()), "max": float(a.max())}
    for p in percentiles:
        out[f"p{p}"] = float(np.percentile(a, p, method="linear"))
    return out


def e2e_interactivity(e2els: Sequence[float], osls: Sequence[int],
                      percentiles: Iterable[int] = (50, 90)) -> dict[str, float | None]:
    """1 / percentile_q(E2EL_i / OSL_i) tokens/s/user (requests with OSL >= 1)."""
    r = np.asarray([e / o for e, o in zip(e2els, osls) if o >= 1], dtype=np.float64)
    out: dict[str, float | None] = {}
    for q in percentiles:
        v = float(np.percentile(r, q, method="linear")) if r.size else 0.0
        out[f"p{q}"] = 1.0 / v if v > 0 else None
    return out


def _inverse(stats: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (1.0 / v if v else None) for k, v in stats.items()
            if k in ("mean", "p50", "p90", "p99")}


def compute_metrics(records: Sequence[RequestRecord], num_gpus: int = 1,
                    wall_s: float | None = None) -> dict[str, Any]:
    """Everything `bench serve` reports from client-side records (profiling phase only)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    prof = [r for r in records if r.phase == "profiling"]
    ok = [r for r in prof if r.ok]
    failed = [r for r in prof if not r.ok]
    overflows = sum(r.context_overflow for r in prof)
    isl = sum(r.prompt_tokens for r in ok)
    osl = sum(r.output_tokens for r in ok)
    duration = (max(r.chunk_times[-1] for r in ok) - min(r.start for r in ok)) if ok else 0.0

    def per(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    itls = [g for r in ok for g in r.itls]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    m: dict[str, Any] = {
        "num_requests": len(prof), "completed": len(ok), "failed": len(failed),
        "error_rate": len(failed) / len(prof) if prof else 0.0,
        "context_overflows": overflows,
        "context_overflow_rate": overflows / len(prof) if prof else 0.0,
        "errors": _error_summary(failed),
        "duration_s": duration, "wall_s": wall_s,
        "total_input_tokens": isl, "total_output_tokens": osl,
        "request_throughput": per(len(ok)),
        "input_throughput": per(isl), "output_throughput": per(osl),
        "total_token_throughput": per(isl + osl),
        "ttft_s": distribution([r.ttft for r in ok]),
        "tpot_s": distribution(tpots),
        "itl_s": distribution(itls),
        "e2el_s": distribution([r.e2el for r in ok]),
        "isl": distribution([r.prompt_tokens for r in ok]),
        "osl": distribution([r.output_tokens for r in ok]),
        "e2e_interactivity_tok_s_user": e2e_interactivity([r.e2el for r in ok],
                                                           [r.output_tokens for r in ok]),
        "tpot_interactivity_tok_s_user": _inverse(distribution(tpots)),
        "client_cached_prompt_fraction": (sum(cached) / sum(r.prompt_tokens for r in ok
                                                            if r.cached_tokens is not None)
                                          if cached and isl else None),
        "num_gpus": num_gpus,
    }
    m["per_gpu"] = {k: m[k] / num_gpus for k in ("request_throughput", "input_throughput",
                                                  "output_throughput", "total_token_throughput")}
    return m


def _error_summary(failed: Sequence[RequestRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in failed:
        key = (r.error or "no content streamed")[:120]
        counts[key] = counts.get(key, 0) + 1
    return counts


def server_metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Prefix-cache hit rate, speculative-decoding acceptance and the mean engine step (wideserve's
    step histogram) over the profiling window, from
    two /metrics scrapes (see prometheus.scrape). Absent counters give None, never a guess."""
    def delta(*names: str) -> float | None:
        for n in names:
            if n in after:
                return after[n] - before.get(n, 0.0)
        return None

    queries = delta("prefix_cache_queries")
    hits = delta("prefix_cache_hits")
    drafts = delta("spec_decode_num_drafts")
    draft_tokens = delta("spec_decode_num_draft_tokens")
    accepted = delta("spec_decode_num_accepted_tokens")
    out: dict[str, Any] = {
        "prefix_cache_queries": queries, "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
        "spec_decode": None,
        "engine_steps": None, "mean_step_s": None,
    }
    steps = delta("engine_step_seconds_count")
    step_s = delta("engine_step_seconds_sum")
    if steps and step_s is not None:
        out["engine_steps"], out["mean_step_s"] = steps, step_s / steps
    if accepted is not None and (draft_tokens or drafts):
        out["spec_decode"] = {
            "num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            # vLLM's mean acceptance length: the bonus token plus the accepted drafts.
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
        }
    return out
