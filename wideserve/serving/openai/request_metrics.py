"""Per-request histograms, observed once when a request finishes, as vLLM keeps them
(vllm/v1/metrics/loggers.py there; exported again under those names by vllm_metrics.py):

    queue time      arrival -> first scheduled         (request_queue_time_seconds)
    prefill time    first scheduled -> first token     (request_prefill_time_seconds)
    decode time     first token -> last token          (request_decode_time_seconds)
    inference time  first scheduled -> last token      (request_inference_time_seconds)
    time per output token = decode time / (tokens - 1) (request_time_per_output_token_seconds)

and the request's sizes: prompt and generated tokens, the longest of its n sequences, and its
n and max_tokens parameters. Arrival and token times are the front end's monotonic clock,
the scheduling time the engine's (time.monotonic in the engine process: the same clock on
one host).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram

_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class RequestMetricsObserver:
    TIMES = {"queue": ("request_queue_time_seconds", "Arrival to first scheduled."),
             "prefill": ("request_prefill_time_seconds", "First scheduled to first token."),
             "decode": ("request_decode_time_seconds", "First token to last token."),
             "inference": ("request_inference_time_seconds",
                           "First scheduled to last token.")}

    def __init__(self, prefix: str, model_name: str, max_model_len: int,
                 registry: CollectorRegistry) -> None:
        lengths = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets: Any) -> Any:
            return Histogram(prefix + name, doc, ["model_name"], buckets=buckets,
                             registry=registry).labels(model_name)

        self.times = {k: hist(name, doc, _REQUEST_BUCKETS)
                      for k, (name, doc) in self.TIMES.items()}
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Decode time over the tokens after the first, per request.",
                         _TPOT_BUCKETS)
        self.prompt = hist("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.generation = hist("request_generation_tokens",
                               "Tokens generated per request (all n sequences).", lengths)
        self.max_generation = hist("request_max_num_generation_tokens",
                                   "Tokens of the longest sequence of a request.", lengths)
        self.n = hist("request_params_n", "The n parameter of requests.", _N_BUCKETS)
        self.max_tokens = hist("request_params_max_tokens",
                               "The max_tokens parameter of requests.", lengths)

    def observe_params(self, n: int, max_tokens: int | None) -> None:
        self.n.observe(n)
        if max_tokens is not None:
            self.max_tokens.observe(max_tokens)

    def observe(self, output: Any) -> None:
        lengths = [len(co.token_ids) for co in output.outputs]
        self.prompt.observe(len(output.prompt_token_ids))
        self.generation.observe(sum(lengths))
        self.max_generation.observe(max(lengths, default=0))
        m = output.metrics
        if m is None or m.queue_time is None:          # never scheduled
            return
        scheduled = m.first_scheduled_time
        self.times["queue"].observe(max(0.0, m.queue_time))
        if m.first_token_time is None or m.last_token_time is None:
            return
        decode = max(0.0, m.last_token_time - m.first_token_time)
        self.times["prefill"].observe(max(0.0, m.first_token_time - scheduled))
        self.times["decode"].observe(decode)
        self.times["inference"].observe(max(0.0, m.last_token_time - scheduled))
        if max(lengths, default=0) > 1:
            self.tpot.observe(decode / (max(lengths) - 1))
