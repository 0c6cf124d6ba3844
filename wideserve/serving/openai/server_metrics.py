"""Prometheus metrics for the server, in a registry of its own (no global state).

Two sources:
- the front end observes each request (outcome, tokens, TTFT, inter-token and end-to-end
  latency) as it happens;
- the engine's stats snapshot (it rides on every Outputs message and heartbeat) is read at
  scrape time by a custom collector: running/waiting, KV usage, prefix-cache queries and hits,
  preemptions, the per-phase step-time totals and the tokens-per-step histogram. Engine
  counters are cumulative in the engine, so they are exported as-is rather than
  re-incremented here.

Per finished request (request_metrics.py): queue, prefill, decode and inference time, time per
output token, prompt and generation lengths, and the n / max_tokens parameters, as vLLM
reports them. Inter-token latency is kept two ways: per token (a step's gap spread over the
tokens it produced, which differ from steps under speculative decoding) and per step (one
gap per output step of a request, which is what vLLM's vllm:inter_token_latency_seconds is).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import Collector

from wideserve.engine.step_timer import ITERATION_TOKEN_BUCKETS
from wideserve.disagg import connector_metrics as kv_transfer_metrics
from wideserve.serving.openai.request_metrics import RequestMetricsObserver
from wideserve.serving.openai.vllm_metrics import vllm_registry

PREFIX = "wideserve:"
OUTCOMES = ("stop", "length", "abort", "error", "rejected")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                 5.0, 10.0, 30.0)

# Engine stats key -> (metric suffix, help, kind). Keys missing from a snapshot are skipped.
ENGINE_GAUGES = {
    "num_running": ("num_requests_running", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_usage": ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."),
    "torch_threads": ("engine_torch_threads", "Torch threads the engine runs now: its plan's, "
                                              "or more while the front end's core is lent."),
}
ENGINE_COUNTERS = {
    "prefix_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("num_preemptions", "Requests preempted (recompute)."),
    "thread_switches": ("engine_thread_switches", "Times the engine's torch thread count "
                                                  "moved (the front end's core lent or "
                                                  "taken back: utils/thread_governor.py)."),
    "prompt_tokens": ("engine_prompt_tokens", "Prompt tokens computed by the engine "
                                              "(recomputation after preemption included)."),
    "generation_tokens": ("engine_generation_tokens", "Tokens sampled by the engine."),
}
# Inside stats["spec_decode"] (SpecDecodeStats), under vLLM's names so clients that scrape
# `spec_decode_*` (wideserve bench, vLLM's benchmark_serving) report acceptance.
SPEC_COUNTERS = {
    "num_drafts": ("spec_decode_num_drafts", "Verifications of a request's draft tokens."),
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}
# Inside stats["eplb"][role] (BalancerStats; role = "target" or "draft"): expert-parallel
# load balancing (docs/eplb.md).
EPLB_GAUGES = {
    "balancedness": ("eplb_balancedness", "Mean over MoE layers of mean/max per-rank expert "
                                          "load over the EPLB window (1 = balanced)."),
    "rebalancing": ("eplb_rebalancing", "1 while a rebalance is moving expert weights."),
    "last_rebalance_s": ("eplb_last_rebalance_seconds", "Wall time of the last rebalance, "
                                                        "plan to last layer moved."),
    "max_move_step_s": ("eplb_max_move_step_seconds", "Worst per-step time spent moving "
                                                      "weights in the last rebalance."),
}
EPLB_COUNTERS = {
    "rebalances": ("eplb_rebalances", "Completed EPLB rebalances."),
    "layers_moved": ("eplb_layers_moved", "MoE layers whose expert weights were rearranged."),
    "bytes_sent": ("eplb_bytes_sent", "Expert weight bytes this rank sent to other ranks."),
}
# Inside stats["steps"] (StepStats).
STEP_COUNTERS = {
    "steps": ("engine_steps", "Engine steps that ran a batch."),
    "tokens": ("engine_batched_tokens", "Tokens computed by engine steps."),
}


class EngineStatsCollector(Collector):
    """Exports the engine's latest stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def collect(self) -> Iterator[Any]:
        stats = self._stats() or {}
        labels = ["model_name"]
        for key, (name, doc) in ENGINE_GAUGES.items():
            if key in stats:
                fam = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
                fam.add_metric([self._model], float(stats[key]))
                yield fam
        for key, (name, doc) in ENGINE_COUNTERS.items():
            if key in stats:
                fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
                fam.add_metric([self._model], float(stats[key]))
                yield fam
        yield from self._spec_decode(stats.get("spec_decode"), labels)
        yield from self._eplb(stats.get("eplb"))
        yield from kv_transfer_metrics.families(stats.get("kv_transfer"), self._model)
        steps = stats.get("steps") or {}
        for key, (name, doc) in STEP_COUNTERS.items():
            if key in steps:
                fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
                fam.add_metric([self._model], float(steps[key]))
                yield fam
        yield from self._iteration_tokens(steps)
        phases = steps.get("seconds")
        if isinstance(phases, dict) and phases:
            fam = CounterMetricFamily(
                PREFIX + "engine_step_phase_seconds",
                "Engine time per step phase (schedule, prepare, forward, sample, output...).",
                labels=["model_name", "phase"])
            for phase, seconds in sorted(phases.items()):
                fam.add_metric([self._model, str(phase)], float(seconds))
            yield fam

    def _iteration_tokens(self, steps: dict[str, Any]) -> Iterator[Any]:
        counts = steps.get("token_histogram")
        if not isinstance(counts, list) or len(counts) != len(ITERATION_TOKEN_BUCKETS) + 1:
            return
        fam = HistogramMetricFamily(PREFIX + "engine_iteration_tokens",
                                    "Tokens computed per engine step.", labels=["model_name"])
        cumulative, buckets = 0, []
        for edge, count in zip([*map(float, ITERATION_TOKEN_BUCKETS), float("inf")], counts):
            cumulative += int(count)
            buckets.append(("+Inf" if edge == float("inf") else str(edge), cumulative))
        fam.add_metric([self._model], buckets, float(steps.get("tokens", 0)))
        yield fam

    def _eplb(self, eplb: Any) -> Iterator[Any]:
        if not isinstance(eplb, dict) or not eplb:
            return
        for table, kind in ((EPLB_GAUGES, GaugeMetricFamily), (EPLB_COUNTERS,
                                                              CounterMetricFamily)):
            for key, (name, doc) in table.items():
                fam = kind(PREFIX + name, doc, labels=["model_name", "role"])
                for role, values in sorted(eplb.items()):
                    if isinstance(values, dict) and key in values:
                        fam.add_metric([self._model, str(role)], float(values[key]))
                yield fam

    def _spec_decode(self, spec: Any, labels: list[str]) -> Iterator[Any]:
        if not isinstance(spec, dict):
            return
        for key, (name, doc) in SPEC_COUNTERS.items():
            if key in spec:
                fam = CounterMetricFamily(PREFIX + name, doc, labels=labels)
                fam.add_metric([self._model], float(spec[key]))
                yield fam
        per_pos = spec.get("num_accepted_tokens_per_pos")
        if isinstance(per_pos, list) and per_pos:
            fam = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Drafts whose token at this position (0-based) was accepted.",
                labels=labels + ["position"])
            for j, count in enumerate(per_pos):
                fam.add_metric([self._model, str(j)], float(count))
            yield fam
        if spec.get("forced_acceptance_length") is not None:
            fam = GaugeMetricFamily(
                PREFIX + "spec_decode_forced_acceptance_length",
                "Benchmark-only forced acceptance length (outputs are NOT the model's).",
                labels=labels)
            fam.add_metric([self._model], float(spec["forced_acceptance_length"]))
            yield fam


def cache_config_info(model_info: dict[str, Any], config: Any) -> dict[str, str]:
    """The KV cache's settings as info labels (vLLM's vllm:cache_config_info)."""
    block = model_info.get("kv_block_size")
    capacity = model_info.get("kv_capacity_tokens")
    blocks = int(capacity) // int(block) if block and capacity is not None else None
    return {"block_size": str(block), "num_gpu_blocks": str(blocks),
            "kv_capacity_tokens": str(capacity), "cache_dtype": str(config.cache.kv_cache_dtype),
            "enable_prefix_caching": str(bool(config.cache.enable_prefix_caching))}


class ServerMetrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], dict[str, Any]],
                 max_model_len: int = 1 << 20,
                 cache_info: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        reg, labels = self.registry, ["model_name"]
        self.requests = Counter(PREFIX + "requests", "Finished requests by outcome.",
                                ["model_name", "outcome"], registry=reg)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens received.",
                                     labels, registry=reg)
        self.cached_prompt_tokens = Counter(
            PREFIX + "cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
            labels, registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Tokens generated and returned.", labels, registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Arrival to first token.", labels, buckets=_TTFT_BUCKETS,
                              registry=reg)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Gap between consecutive tokens of a request.", labels,
                             buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Arrival to last token.", labels, buckets=_E2E_BUCKETS,
                             registry=reg)
        self.step_time = Histogram(PREFIX + "engine_step_seconds", "Wall time of one engine step.",
                                   labels, buckets=_STEP_BUCKETS, registry=reg)
        self.step_gap = Histogram(PREFIX + "inter_step_latency_seconds",
                                  "Gap between consecutive output steps of a request (one "
                                  "per step, however many tokens it produced).", labels,
                                  buckets=_ITL_BUCKETS, registry=reg)
        self.requests_done = RequestMetricsObserver(PREFIX, model_name, max_model_len, reg)
        if cache_info is not None:
            info = Gauge(PREFIX + "cache_config_info", "The KV cache's settings (value 1).",
                         ["model_name", *cache_info], registry=reg)
            info.labels(model_name, *cache_info.values()).set(1)
        reg.register(EngineStatsCollector(engine_stats, model_name))
        self.vllm_aliases = vllm_registry(reg, PREFIX)
        # One label set (this model) per family: bound once here, not looked up (under the
        # family's lock) for every token of every request.
        self._outcomes = {o: self.requests.labels(model_name, o) for o in OUTCOMES}
        self._prompt = self.prompt_tokens.labels(model_name)
        self._cached = self.cached_prompt_tokens.labels(model_name)
        self._generated = self.generation_tokens.labels(model_name)
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self._e2e = self.e2e.labels(model_name)
        self._step = self.step_time.labels(model_name)
        self._step_gap = self.step_gap.labels(model_name)

    def observe_request_start(self, num_prompt_tokens: int, params: Any = None) -> None:
        self._prompt.inc(num_prompt_tokens)
        if params is not None:
            self.requests_done.observe_params(params.n, params.max_tokens)

    def observe_tokens(self, num_new: int, since_last_s: float | None,
                       ttft_s: float | None) -> None:
        """One output step of one sequence: num_new tokens, since_last_s after the previous."""
        self._generated.inc(num_new)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        elif since_last_s is not None and num_new > 0:
            self._step_gap.observe(since_last_s)
            # Several tokens in one chunk (a speculative step): spread the gap evenly.
            per_token = since_last_s / num_new
            for _ in range(num_new):
                self._itl.observe(per_token)

    def observe_cached(self, num_cached_tokens: int) -> None:
        self._cached.inc(num_cached_tokens)

    def observe_finish(self, outcome: str, e2e_s: float | None) -> None:
        child = self._outcomes.get(outcome) or self.requests.labels(self.model_name, outcome)
        child.inc()
        if e2e_s is not None:
            self._e2e.observe(e2e_s)

    def observe_request_done(self, output: Any) -> None:
        """A finished request's timings and lengths (a wideserve.types.outputs.RequestOutput)."""
        self.requests_done.observe(output)

    def observe_rejected(self) -> None:
        self._outcomes["rejected"].inc()

    def observe_step_times(self, seconds: list[float]) -> None:
        for s in seconds:
            self._step.observe(s)

    def render(self) -> bytes:
        """wideserve's families, then the same again under vLLM's names (vllm_metrics.py)."""
        return generate_latest(self.registry) + generate_latest(self.vllm_aliases)
