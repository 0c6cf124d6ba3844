"""What the engine hands back for a request (the vLLM `RequestOutput` surface).

Logprobs are stored per position as {token_id: Logprob}: the chosen token (sampled, or the
actual prompt token) with its true rank, then the top-N tokens with ranks 1..N; when the chosen
token is itself in the top N the two entries coincide. Prompt logprobs have None at position 0
(nothing predicts the first prompt token).

Times in RequestMetrics are time.monotonic() seconds (system-wide on Linux, so comparable
across the front-end and engine-core processes of one host).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


def make_logprobs_entry(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    rank: int,
    num_logprobs: int,
    decode: Callable[[int], str] | None = None,
) -> dict[int, Logprob]:
    """One position from a row of the sampler's LogprobsTensors (column 0 = chosen token,
    then the batch's top-max_N, of which this request keeps its own num_logprobs)."""
    entry = {int(token_ids[0]): Logprob(float(logprobs[0]), rank,
                                        decode(int(token_ids[0])) if decode else None)}
    for r in range(1, num_logprobs + 1):
        tid = int(token_ids[r])
        if tid not in entry:
            entry[tid] = Logprob(float(logprobs[r]), r, decode(tid) if decode else None)
    return entry


@dataclass(slots=True)
class CompletionOutput:
    index: int                                  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None     # only tracked when logprobs were requested
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None   # None while still generating
    stop_reason: int | str | None = None        # the stop token id or stop string, if any

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0                  # prompt tokens served by the prefix cache
    num_generation_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if (self.first_token_time is None or self.last_token_time is None
                or self.num_generation_tokens < 2):
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict[str, Any] | None = None    # P/D: the prefill's KV handle

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics is not None else 0
