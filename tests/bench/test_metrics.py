"""Serving metrics on synthetic timings; every expected value is derived by hand in a comment."""
from __future__ import annotations

import pytest

from wideserve.bench.latency_metrics import (RequestRecord, compute_metrics, distribution,
                                             e2e_interactivity, server_metric_deltas)
from wideserve.bench.prometheus import normalise, parse_metrics


def _records() -> list[RequestRecord]:
    return [
        # r1: sent at 0, content chunks at 0.1, 0.2, 0.4 (3 tokens, 10 prompt tokens)
        RequestRecord(start=0.0, end=0.41, chunk_times=[0.1, 0.2, 0.4], prompt_tokens=10,
                      output_tokens=3, cached_tokens=4),
        # r2: sent at 1.0, chunks at 1.5, 1.6 (2 tokens, 20 prompt tokens)
        RequestRecord(start=1.0, end=1.61, chunk_times=[1.5, 1.6], prompt_tokens=20,
                      output_tokens=2, cached_tokens=0),
        # r3: failed with a context overflow
        RequestRecord(start=0.5, end=0.6, error="HTTP 400: maximum context length",
                      context_overflow=True),
        # r4: warmup, excluded everywhere (it would change every number if counted)
        RequestRecord(start=-5.0, end=9.0, chunk_times=[-4.0, 9.0], prompt_tokens=999,
                      output_tokens=2, phase="warmup"),
    ]


def test_latencies_and_percentiles():
    m = compute_metrics(_records(), num_gpus=2)
    # TTFT: r1 0.1, r2 0.5 -> mean 0.3; linear p90 = 0.1 + 0.9 * (0.5 - 0.1) = 0.46
    assert m["ttft_s"]["mean"] == pytest.approx(0.3)
    assert m["ttft_s"]["p50"] == pytest.approx(0.3)
    assert m["ttft_s"]["p90"] == pytest.approx(0.46)
    # E2EL = last chunk - send: r1 0.4, r2 0.6
    assert m["e2el_s"]["p50"] == pytest.approx(0.5)
    assert m["e2el_s"]["max"] == pytest.approx(0.6)
    # TPOT = (E2EL - TTFT) / (OSL - 1): r1 0.3 / 2 = 0.15, r2 0.1 / 1 = 0.1
    assert m["tpot_s"]["mean"] == pytest.approx(0.125)
    assert m["tpot_s"]["p99"] == pytest.approx(0.1 + 0.99 * 0.05)
    # ITL pooled over requests: r1 gaps 0.1, 0.2; r2 gap 0.1 -> [0.1, 0.1, 0.2]
    assert m["itl_s"]["mean"] == pytest.approx(0.4 / 3)
    assert m["itl_s"]["p50"] == pytest.approx(0.1)
    assert m["itl_s"]["p90"] == pytest.approx(0.1 + 0.8 * 0.1)   # k = 1.8


def test_throughput_interactivity_errors():
    m = compute_metrics(_records(), num_gpus=2)
    # duration = max last chunk (1.6) - min start (0.0) of the successful profiled requests
    assert m["duration_s"] == pytest.approx(1.6)
    assert m["request_throughput"] == pytest.approx(2 / 1.6)
    assert m["input_throughput"] == pytest.approx(30 / 1.6)
    assert m["output_throughput"] == pytest.approx(5 / 1.6)
    assert m["total_token_throughput"] == pytest.approx(35 / 1.6)
    assert m["per_gpu"]["total_token_throughput"] == pytest.approx(35 / 1.6 / 2)
    assert m["per_gpu"]["output_throughput"] == pytest.approx(5 / 1.6 / 2)
    # r_i = E2EL / OSL: 0.4 / 3 = 0.13333, 0.6 / 2 = 0.3
    # p50 = 0.216667 -> 4.6154 tok/s; p90 = 0.13333 + 0.9 * 0.16667 = 0.28333 -> 3.5294
    inter = m["e2e_interactivity_tok_s_user"]
    assert inter["p50"] == pytest.approx(1 / ((0.4 / 3 + 0.3) / 2))
    assert inter["p90"] == pytest.approx(1 / (0.4 / 3 + 0.9 * (0.3 - 0.4 / 3)))
    assert inter["p90"] < inter["p50"]                     # P90 is the slow tail
    # 1 / TPOT at p50 (0.125)
    assert m["tpot_interactivity_tok_s_user"]["p50"] == pytest.approx(8.0)
    assert (m["num_requests"], m["completed"], m["failed"]) == (3, 2, 1)
    assert m["error_rate"] == pytest.approx(1 / 3)
    assert m["context_overflows"] == 1
    assert m["context_overflow_rate"] == pytest.approx(1 / 3)
    assert m["client_cached_prompt_fraction"] == pytest.approx(4 / 30)


def test_empty_and_bad_inputs():
    m = compute_metrics([], num_gpus=1)
    assert m["completed"] == 0 and m["request_throughput"] == 0.0
    assert m["ttft_s"]["p50"] is None
    assert distribution([])["mean"] is None
    assert e2e_interactivity([], [])["p90"] is None
    with pytest.raises(ValueError, match="num_gpus"):
        compute_metrics(_records(), num_gpus=0)


def test_prometheus_parse_and_deltas():
    text = """# HELP wideserve:prefix_cache_queries Prompt tokens looked up.
# TYPE wideserve:prefix_cache_queries counter
wideserve:prefix_cache_queries_total{model_name="m"} 1000.0
wideserve:prefix_cache_queries_created{model_name="m"} 1.7e9
wideserve:prefix_cache_hits_total{model_name="m"} 250.0
vllm:spec_decode_num_drafts_total{engine="0"} 10
vllm:spec_decode_num_drafts_total{engine="1"} 30
vllm:spec_decode_num_draft_tokens_total 120
vllm:spec_decode_num_accepted_tokens_total 60
wideserve:time_to_first_token_seconds_bucket{le="0.1"} 3
"""
    after = parse_metrics(text)
    assert after["prefix_cache_queries"] == 1000.0            # _created skipped
    assert after["spec_decode_num_drafts"] == 40.0            # summed over label sets
    assert "time_to_first_token_seconds" not in after and normalise("vllm:x_total") == "x"
    before = {"prefix_cache_queries": 600.0, "prefix_cache_hits": 50.0,
              "spec_decode_num_drafts": 20.0, "spec_decode_num_draft_tokens": 60.0,
              "spec_decode_num_accepted_tokens": 20.0}
    d = server_metric_deltas(before, after)
    assert d["prefix_cache_hit_rate"] == pytest.approx(200 / 400)
    sd = d["spec_decode"]
    assert sd["acceptance_rate"] == pytest.approx(40 / 60)
    assert sd["mean_acceptance_length"] == pytest.approx(1 + 40 / 20)


def test_absent_server_counters_are_none():
    d = server_metric_deltas({}, {"prefix_cache_queries": 10.0})
    assert d["prefix_cache_hit_rate"] is None          # hits absent: no guess
    assert d["spec_decode"] is None


def test_mean_engine_step_from_the_step_histogram():
    text = """wideserve:engine_step_seconds_bucket{model_name="m",le="0.01"} 3.0
wideserve:engine_step_seconds_sum{model_name="m"} 0.9
wideserve:engine_step_seconds_count{model_name="m"} 30.0
wideserve:time_to_first_token_seconds_sum{model_name="m"} 5.0
"""
    after = parse_metrics(text)
    assert "time_to_first_token_seconds_sum" not in after     # only the kept histogram
    assert "engine_step_seconds_bucket" not in after
    d = server_metric_deltas({"engine_step_seconds_sum": 0.3,
                              "engine_step_seconds_count": 10.0}, after)
    assert d["engine_steps"] == 20.0 and d["mean_step_s"] == pytest.approx(0.6 / 20)
    assert server_metric_deltas({}, {})["mean_step_s"] is None
