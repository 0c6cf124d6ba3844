"""Per-rank Prometheus series for a data-parallel server (labels model_name, dp_rank).

The server's existing engine metrics stay (summed over ranks by DPEngineClient.stats); these
add each rank's load (what the balancer sees) and where lock-step time goes: the per-step DP
sync, the EP all-to-all, the experts' own compute, and the dummy steps of idle ranks.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "wideserve:"
RANK_GAUGES = {
    "num_running": ("dp_rank_num_requests_running", "Running requests of the rank."),
    "num_waiting": ("dp_rank_num_requests_waiting", "Waiting requests of the rank."),
    "kv_usage": ("dp_rank_kv_cache_usage_perc", "KV cache usage of the rank (0-1)."),
}
RANK_COUNTERS = {
    "generation_tokens": ("dp_rank_generation_tokens", "Tokens sampled by the rank."),
    "prefix_hits": ("dp_rank_prefix_cache_hits", "Prompt tokens the rank found cached."),
}
DP_COUNTERS = {
    "sync_s": ("dp_step_sync_seconds", "Time in the per-step DP sync."),
    "sync_count": ("dp_step_syncs", "Per-step DP syncs (busy and idle)."),
    "a2a_s": ("ep_all_to_all_seconds", "Time in EP all-to-all exchanges (counts and rows)."),
    "expert_s": ("ep_expert_seconds", "Time running routed experts on received rows."),
    "dummy_steps": ("dp_dummy_steps", "Steps run as a dummy batch (rank idle, group busy)."),
    "ep_drain_calls": ("ep_drain_calls", "MoE calls answered after the rank's own step."),
}


class DPStatsCollector(Collector):
    def __init__(self, rank_stats: Callable[[], list[dict[str, Any]]], model_name: str,
                 picks: Callable[[], list[int]]) -> None:
        self._rank_stats = rank_stats
        self._model = model_name
        self._picks = picks

    def collect(self) -> Iterator[Any]:
        ranks = self._rank_stats()
        labels = ["model_name", "dp_rank"]
        for key, (name, doc) in RANK_GAUGES.items():
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for r, s in enumerate(ranks):
                if key in s:
                    fam.add_metric([self._model, str(r)], float(s[key]))
            yield fam
        for key, (name, doc) in RANK_COUNTERS.items():
            fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for r, s in enumerate(ranks):
                if key in s:
                    fam.add_metric([self._model, str(r)], float(s[key]))
            yield fam
        for key, (name, doc) in DP_COUNTERS.items():
            fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for r, s in enumerate(ranks):
                dp = s.get("dp") or {}
                if key in dp:
                    fam.add_metric([self._model, str(r)], float(dp[key]))
            yield fam
        yield from _rank_steps(ranks, self._model)
        fam = CounterMetricFamily(PREFIX + "dp_requests_routed",
                                  "Requests the front end sent to the rank.", labels=labels)
        for r, n in enumerate(self._picks()):
            fam.add_metric([self._model, str(r)], float(n))
        yield fam


def _rank_steps(ranks: list[dict[str, Any]], model: str) -> Iterator[Any]:
    """Each rank's own step count and step time per phase: in lock-step the slowest rank
    sets every rank's pace, and these say which one it is (max over dp_rank of
    rate(step_phase_seconds) / rate(engine_steps))."""
    labels = ["model_name", "dp_rank"]
    steps = CounterMetricFamily(PREFIX + "dp_rank_engine_steps",
                                "Engine steps the rank ran (its own batch or a dummy one).",
                                labels=labels)
    phases = CounterMetricFamily(PREFIX + "dp_rank_step_phase_seconds",
                                 "The rank's time per step phase (schedule, prepare, forward, "
                                 "sample, output...).", labels=labels + ["phase"])
    for r, s in enumerate(ranks):
        st = s.get("steps") or {}
        if "steps" in st:
            steps.add_metric([model, str(r)], float(st["steps"]))
        for phase, seconds in sorted((st.get("seconds") or {}).items()):
            phases.add_metric([model, str(r), str(phase)], float(seconds))
    yield steps
    yield phases
