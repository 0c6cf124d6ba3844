"""examples/grafana/wideserve.json only plots series the server exports: every metric named in
a panel's query (and in the dashboard's variables) is among the samples /metrics renders when
every feature reports (speculative decoding, EPLB, P/D, data-parallel ranks), the stats built
from the engine's own stats types."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from wideserve.engine.engine_core import EngineStats
from wideserve.engine.engine_ipc import to_builtins
from wideserve.engine.step_timer import StepStats
from wideserve.disagg.scheduler_side import ConnectorStats
from wideserve.engine.dp_engine import DPStepStats
from wideserve.serving.dp_metrics import DPStatsCollector
from wideserve.worker.eplb_balancer import BalancerStats
from wideserve.serving.openai.server_metrics import ServerMetrics
from wideserve.types.outputs import CompletionOutput, RequestMetrics, RequestOutput
from wideserve.types.sampling_params import SamplingParams
from wideserve.spec_decode.acceptance_metrics import SpecDecodeStats

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# vLLM's own dashboard (its panels and queries; the file names its source and licence).
VLLM_DASHBOARD = Path(__file__).resolve().parents[1] / "data" / "grafana" / "vllm_dashboard.json"
SERIES = re.compile(r"\b(?:vllm|wideserve):[A-Za-z0-9_:]+")


def _rank_stats(rank: int) -> dict:
    steps = StepStats(steps=10 + rank, tokens=100)
    steps.seconds = {p: 0.01 * (rank + 1) for p in steps.seconds}
    kv = {**dataclasses.asdict(ConnectorStats()), "loading": 0, "held": 0, "quarantined": 0,
          "quarantined_blocks": 0}
    stats = EngineStats(num_running=1, num_waiting=0, kv_usage=0.5, prefix_queries=10,
                        prefix_hits=5, num_preemptions=0, prompt_tokens=10,
                        generation_tokens=20, steps=steps,
                        spec_decode=SpecDecodeStats("mtp", 3), kv_transfer=kv,
                        dp=dataclasses.asdict(DPStepStats(rank=rank, world_size=2)),
                        eplb={"target": BalancerStats(), "draft": BalancerStats()})
    return to_builtins(stats)


def exported_series() -> set[str]:
    ranks = [_rank_stats(0), _rank_stats(1)]
    metrics = ServerMetrics("m", lambda: ranks[0])
    metrics.registry.register(DPStatsCollector(lambda: ranks, "m", lambda: [1, 1]))
    metrics.observe_request_start(4, SamplingParams(max_tokens=8))
    metrics.observe_tokens(1, None, 0.1)
    metrics.observe_tokens(1, 0.01, None)
    metrics.observe_finish("stop", 0.2)
    metrics.observe_request_done(RequestOutput(
        "r", None, [1, 2, 3, 4], None, [CompletionOutput(0, "", [5, 6])], True,
        RequestMetrics(arrival_time=0.0, first_scheduled_time=0.01, first_token_time=0.1,
                       last_token_time=0.11)))
    metrics.observe_step_times([0.01])
    return {s.name for s in exported_samples(metrics)}


def exported_samples(metrics: ServerMetrics) -> list:
    text = metrics.render().decode()
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    out = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var.get("type") == "query":
            out.append((f"variable {var['name']}", var["definition"]))
    return out


def test_every_panel_query_names_an_exported_series() -> None:
    dashboard = json.loads((EXAMPLES / "grafana" / "wideserve.json").read_text())
    exported = exported_series()
    queries = _queries(dashboard)
    assert len(queries) >= 30
    missing = [(title, name) for title, expr in queries for name in SERIES.findall(expr)
               if name not in exported]
    assert not missing, missing
    assert all(SERIES.search(expr) for _, expr in queries)


def test_every_vllm_dashboard_query_names_an_exported_series() -> None:
    """vLLM's own Grafana dashboard works unchanged: each series a panel reads is exported,
    with the model_name label its queries select on (and vLLM's engine label)."""
    dashboard = json.loads(VLLM_DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) == 28 and all(SERIES.search(expr) for _, expr in queries[:-1])
    exported = exported_series()
    missing = [(title, name) for title, expr in queries for name in SERIES.findall(expr)
               if name not in exported]
    assert not missing, missing
    assert queries[-1] == ("variable model_name", "label_values(model_name)")
    ranks = [_rank_stats(0)]
    metrics = ServerMetrics("m", lambda: ranks[0])
    metrics.observe_request_start(4)
    vllm = [s for s in exported_samples(metrics) if s.name.startswith("vllm:")]
    assert vllm and all(s.labels.get("model_name") == "m" and s.labels.get("engine") == "0"
                        for s in vllm)


def test_dashboard_covers_what_the_issue_asks_for() -> None:
    dashboard = json.loads((EXAMPLES / "grafana" / "wideserve.json").read_text())
    text = " ".join(expr for _, expr in _queries(dashboard))
    for name in ("wideserve:engine_step_phase_seconds_total",        # step-time breakdown
                 "wideserve:dp_rank_step_phase_seconds_total",       # per-rank, slowest rank
                 "wideserve:eplb_balancedness",
                 "wideserve:kv_transfer_bytes_loaded_total",
                 "wideserve:kv_transfer_load_seconds_bucket",
                 "vllm:kv_cache_usage_perc",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert name in text, name
    assert "max(" in text and "topk(1" in text          # the slowest rank, and which one


def test_prometheus_config_scrapes_metrics() -> None:
    text = (EXAMPLES / "prometheus.yml").read_text()
    assert "metrics_path: /metrics" in text and "job_name: wideserve" in text
