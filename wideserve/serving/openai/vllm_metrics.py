"""wideserve's metrics again under vLLM's names (`vllm:` prefix), for the dashboards and
benchmark clients that scrape vLLM (Grafana boards, aiperf, `vllm bench serve`, which reads
only `vllm:spec_decode*`). The mapping is documented in docs/vllm_compat.md.

The aliases are computed at scrape time from the same registry, so the two names can never
disagree; a metric with no vLLM counterpart is exported under its wideserve name only. Every
alias carries vLLM's `engine` label besides `model_name`: one engine per server ("0"; with
data parallelism the values are the ranks' aggregate, per rank under wideserve:dp_rank_*).

Inter-token latency: vLLM observes one gap per output step of a request (its
update_from_output, whatever number of tokens a speculative step accepted), so its
vllm:inter_token_latency_seconds is our per-step series; wideserve:inter_token_latency_seconds
stays per token, and vllm:request_time_per_output_token_seconds is the per-request mean.
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# wideserve family name (without prefix) -> vLLM family name (without prefix).
VLLM_NAMES = {
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_perc": "kv_cache_usage_perc",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "requests": "request_success",
    "cached_prompt_tokens": "prompt_tokens_cached",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_step_latency_seconds": "inter_token_latency_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "request_prefill_time_seconds": "request_prefill_time_seconds",
    "request_decode_time_seconds": "request_decode_time_seconds",
    "request_inference_time_seconds": "request_inference_time_seconds",
    "request_time_per_output_token_seconds": "request_time_per_output_token_seconds",
    "request_prompt_tokens": "request_prompt_tokens",
    "request_generation_tokens": "request_generation_tokens",
    "request_max_num_generation_tokens": "request_max_num_generation_tokens",
    "request_params_n": "request_params_n",
    "request_params_max_tokens": "request_params_max_tokens",
    "engine_iteration_tokens": "iteration_tokens_total",
    "cache_config_info": "cache_config_info",
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "spec_decode_num_accepted_tokens_per_pos",
}
# vLLM's older names of the same series, still read by dashboards written for vLLM < 0.11
# (it renamed them and kept the old ones behind --show-hidden-metrics-for-version).
DEPRECATED_NAMES = {
    "kv_cache_usage_perc": ("gpu_cache_usage_perc",),
    "prefix_cache_queries": ("gpu_prefix_cache_queries",),
    "prefix_cache_hits": ("gpu_prefix_cache_hits",),
    "inter_step_latency_seconds": ("time_per_output_token_seconds",),
}
# vLLM counts only finished requests in request_success, labelled finished_reason.
_SUCCESS_OUTCOMES = frozenset({"stop", "length", "abort"})
ENGINE = "0"


class VllmAliasCollector(Collector):
    def __init__(self, source: CollectorRegistry, prefix: str) -> None:
        self.source = source
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            short = family.name[len(self.prefix):] if family.name.startswith(self.prefix) else None
            target = VLLM_NAMES.get(short) if short else None
            if target is not None:
                yield self._renamed(family, short, target)
                for old_name in DEPRECATED_NAMES.get(short, ()):
                    yield self._renamed(family, short, old_name)

    def _renamed(self, family: Metric, short: str, target: str) -> Metric:
        out = Metric("vllm:" + target, family.documentation, family.type)
        old, new = family.name, out.name
        for s in family.samples:
            labels: dict[str, Any] = dict(s.labels)
            if short == "requests":
                outcome = labels.pop("outcome", None)
                if outcome not in _SUCCESS_OUTCOMES:
                    continue
                labels["finished_reason"] = outcome
            labels["engine"] = ENGINE
            out.add_sample(new + s.name[len(old):], labels, s.value, s.timestamp, s.exemplar)
        return out


def vllm_registry(source: CollectorRegistry, prefix: str) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(VllmAliasCollector(source, prefix))
    return reg
