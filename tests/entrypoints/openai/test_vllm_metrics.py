"""vLLM-named metric aliases: computed from the same registry, so they always agree."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from wideserve.engine.step_timer import StepTimer
from wideserve.serving.openai.server_metrics import ServerMetrics
from wideserve.serving.openai.request_metrics import buckets_1_2_5
from wideserve.types.outputs import CompletionOutput, RequestMetrics, RequestOutput
from wideserve.types.sampling_params import SamplingParams


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    key = tuple(sorted({"model_name": "m", **labels}.items()))
    return samples[(name, key)]


def test_spec_decode_and_request_success_under_vllm_names():
    stats = {"num_running": 2, "spec_decode": {
        "num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5,
        "num_accepted_tokens_per_pos": [3, 2, 0]}}
    m = ServerMetrics("m", lambda: stats)
    m.observe_finish("stop", 0.5)
    m.observe_rejected()
    lines = m.render().decode().splitlines()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in lines
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",' \
           'position="1"} 2.0' in lines
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 2.0' in lines
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' \
        in lines
    assert not any(line.startswith("vllm:") and "rejected" in line for line in lines)


def test_every_vllm_series_has_engine_and_model_name():
    m = ServerMetrics("m", lambda: {"num_running": 1, "kv_usage": 0.5, "prefix_queries": 4,
                                    "prefix_hits": 2},
                      cache_info={"block_size": "64"})
    m.observe_request_start(4, SamplingParams(max_tokens=8))
    names = [(name, dict(labels)) for name, labels in _samples(m) if name.startswith("vllm:")]
    assert len(names) > 100
    assert all(labels.get("engine") == "0" and labels.get("model_name") == "m"
               for _, labels in names)
    assert {"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:cache_config_info", "vllm:prompt_tokens_cached_total",
            "vllm:gpu_cache_usage_perc", "vllm:gpu_prefix_cache_hits_total"} \
        <= {n for n, _ in names}


def test_request_timings_and_sizes_under_vllm_names():
    m = ServerMetrics("m", lambda: {}, max_model_len=1000)
    m.observe_request_start(7, SamplingParams(n=2, max_tokens=50))
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5,
                             first_token_time=11.5, last_token_time=14.5)
    out = RequestOutput("r", None, list(range(7)), None, [
        CompletionOutput(0, "", [1, 2, 3, 4]), CompletionOutput(1, "", [5, 6])], True, metrics)
    m.observe_request_done(out)
    s = _samples(m)
    for name, seconds in (("request_queue_time_seconds", 0.5),
                          ("request_prefill_time_seconds", 1.0),
                          ("request_decode_time_seconds", 3.0),
                          ("request_inference_time_seconds", 4.0),
                          ("request_time_per_output_token_seconds", 1.0),   # 3 s / (4 - 1)
                          ("request_prompt_tokens", 7), ("request_generation_tokens", 6),
                          ("request_max_num_generation_tokens", 4), ("request_params_n", 2),
                          ("request_params_max_tokens", 50)):
        for prefix, labels in (("vllm:", {"engine": "0"}), ("wideserve:", {})):
            assert _value(s, f"{prefix}{name}_sum", **labels) == seconds, name
            assert _value(s, f"{prefix}{name}_count", **labels) == 1, name
    assert _value(s, "vllm:request_prompt_tokens_bucket", engine="0", le="5.0") == 0
    assert _value(s, "vllm:request_prompt_tokens_bucket", engine="0", le="10.0") == 1
    assert buckets_1_2_5(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_inter_token_latency_per_token_and_per_step():
    """A speculative step that yields 3 tokens 0.3 s after the last: per token, 3 gaps of
    0.1 s (wideserve's ITL); per step, one gap of 0.3 s (vLLM's: one per output step)."""
    m = ServerMetrics("m", lambda: {})
    m.observe_tokens(1, None, 0.05)                 # the first token: TTFT only
    m.observe_tokens(3, 0.3, None)
    s = _samples(m)
    assert _value(s, "wideserve:inter_token_latency_seconds_count") == 3
    assert abs(_value(s, "wideserve:inter_token_latency_seconds_sum") - 0.3) < 1e-9
    assert _value(s, "wideserve:inter_step_latency_seconds_count") == 1
    assert _value(s, "vllm:inter_token_latency_seconds_count", engine="0") == 1
    assert _value(s, "vllm:inter_token_latency_seconds_sum", engine="0") == 0.3
    assert _value(s, "vllm:time_to_first_token_seconds_count", engine="0") == 1
    # vLLM's name for the same before 0.11, which older dashboards still read.
    assert _value(s, "vllm:time_per_output_token_seconds_count", engine="0") == 1


def test_iteration_tokens_histogram_from_the_engine_steps():
    timer = StepTimer()
    for tokens in (1, 8, 9, 300, 20000):
        timer.start()
        timer.finish(tokens, 1)
    timer.finish(0, 0)                                  # an idle poll: not a step
    stats = {"steps": {"steps": timer.stats.steps, "tokens": timer.stats.tokens,
                       "token_histogram": timer.stats.token_histogram}}
    s = _samples(ServerMetrics("m", lambda: stats))
    bucket = "vllm:iteration_tokens_total_bucket"
    assert [_value(s, bucket, engine="0", le=le) for le in ("1.0", "8.0", "16.0", "512.0",
                                                            "16384.0", "+Inf")] \
        == [1, 2, 3, 4, 4, 5]
    assert _value(s, "vllm:iteration_tokens_total_count", engine="0") == 5
    assert _value(s, "vllm:iteration_tokens_total_sum", engine="0") == 1 + 8 + 9 + 300 + 20000
