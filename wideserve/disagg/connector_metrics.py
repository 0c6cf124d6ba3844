"""Prometheus families for the KV connector, from the engine's stats snapshot.

The connector's counters are cumulative in the engine (scheduler_side.ConnectorStats) and
ride on the stats snapshot like every other engine counter; the server's collector
(serving/openai/server_metrics.py) exports them at scrape time through `families`. The load
time histogram is kept as per-bucket counts in the engine for the same reason.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "wideserve:kv_transfer_"
# Seconds from a load's admission to its KV having arrived (handshake included).
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0)

COUNTERS = {
    "loads_started": ("loads_started", "Remote KV loads started (decode side)."),
    "loads_done": ("loads_completed", "Remote KV loads whose KV arrived."),
    "loads_failed": ("loads_failed", "Remote KV loads that failed (then recomputed or "
                                     "failed, kv_load_failure_policy)."),
    "loads_skipped": ("loads_skipped", "Handles not loaded: the local prefix cache had it."),
    "tokens_loaded": ("tokens_loaded", "Prompt tokens whose KV arrived instead of being "
                                       "computed."),
    "bytes_loaded": ("bytes_loaded", "KV bytes loaded."),
    "pages_loaded": ("pages_loaded", "KV pages (group blocks) loaded."),
    "transfers": ("transfers", "Transport operations posted for loads (packed: one per "
                               "request)."),
    "leases_granted": ("leases_granted", "Finished requests held for a decode instance "
                                         "(prefill side)."),
    "leases_released": ("leases_released", "Leases ended by the decode side (loaded, pushed "
                                           "or given up)."),
    "leases_expired": ("leases_expired", "Leases that expired before any decode side came."),
    "loads_quarantined": ("loads_quarantined", "Failed loads whose blocks were quarantined "
                                               "(their transfer not known to have stopped)."),
    "quarantines_released": ("quarantines_released", "Quarantined loads whose transfer was "
                                                     "then known to have stopped (freed)."),
    "handles_refused": ("handles_refused", "kv_transfer_params refused at admission (decode "
                                           "side): unsigned, forged, or for another prompt."),
    "leases_refused_mismatch": ("leases_refused_mismatch", "Release or push requests refused "
                                "(prefill side): the lease id or block ids differ from the "
                                "held lease's."),
    "leases_refused_unknown": ("leases_refused_unknown", "Release or push requests naming no "
                               "held lease (prefill side): already served, expired, unknown."),
}
GAUGES = {
    "loading": ("loads_in_flight", "Remote KV loads in flight (decode side)."),
    "held": ("leases_held", "Requests whose blocks are held under a lease (prefill side)."),
    "quarantined": ("loads_in_quarantine", "Given-up loads whose blocks are held until their "
                                           "transfer is known to have stopped (decode side)."),
    "quarantined_blocks": ("blocks_quarantined", "KV blocks held in quarantine (neither free "
                                                 "nor leaked)."),
}


def observe(buckets: list[int], seconds: float) -> None:
    """Count one load in its (non-cumulative) bucket; the last one is +Inf."""
    i = next((i for i, b in enumerate(LOAD_BUCKETS) if seconds <= b), len(LOAD_BUCKETS))
    buckets[i] += 1


def sum_counters(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """A data-parallel group's connector stats: numbers and bucket lists summed over ranks
    (a max stays a max)."""
    out: dict[str, Any] = dict(per_rank[0])
    for key, value in out.items():
        values = [s.get(key) for s in per_rank]
        if key.startswith("max_"):
            out[key] = max(values)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = sum(values)
        elif isinstance(value, list):
            out[key] = [sum(col) for col in zip(*values)]
    return out


def families(stats: Any, model: str) -> Iterator[Any]:
    if not isinstance(stats, dict):
        return
    labels = ["model_name"]
    for table, kind in ((COUNTERS, CounterMetricFamily), (GAUGES, GaugeMetricFamily)):
        for key, (name, doc) in table.items():
            if key in stats:
                fam = kind(PREFIX + name, doc, labels=labels)
                fam.add_metric([model], float(stats[key]))
                yield fam
    counts = stats.get("load_seconds_buckets")
    if isinstance(counts, list) and len(counts) == len(LOAD_BUCKETS) + 1:
        cumulative, total = [], 0
        for bound, n in zip((*map(str, LOAD_BUCKETS), "+Inf"), counts):
            total += int(n)
            cumulative.append((bound, total))
        fam = HistogramMetricFamily(PREFIX + "load_seconds", "Time from a remote KV load's "
                                    "admission to its arrival (completed loads).",
                                    labels=labels)
        fam.add_metric([model], cumulative, float(stats.get("load_seconds_sum", 0.0)))
        yield fam
