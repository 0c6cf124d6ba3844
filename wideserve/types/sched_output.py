"""What the scheduler hands to the model runner each step, and what it hands back per request.

`SchedulerOutput` is the per-step plan: which requests run and how many tokens each computes.
`EngineCoreOutput` is the per-request result of a step (new tokens, finish, events) that the
engine core sends to the front end.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from wideserve.types.request import Request

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes positions [request.num_computed_tokens - num_new_tokens,
    request.num_computed_tokens) of `request.all_token_ids + spec_token_ids`: the scheduler has
    already advanced num_computed_tokens optimistically when the runner sees this.
    """
    request: "Request"
    num_new_tokens: int
    # True when the request was taken from the waiting queue this step (first admission or
    # resumption after preemption): the runner must (re)build its per-request state.
    is_new_or_resumed: bool
    # First position whose KV this step writes (from the KV manager; see its docstring).
    kv_write_start: int
    # Draft tokens verified this step (a prefix of what the proposer gave; already removed from
    # request.spec_token_ids). They are the last len(spec_token_ids) of the scheduled tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True)
class SchedulerOutput:
    # Requests that were already running come first, then those admitted this step.
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Preempted this step: their blocks are freed; the runner drops their per-request state.
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished (any reason) since the previous SchedulerOutput: the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    num_new_admitted: int = 0
    # P/D: what the connector's worker half does this step (disagg/scheduler_side.py).
    kv_connector_meta: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class RequestEventType(enum.IntEnum):
    QUEUED = 0        # accepted by the scheduler
    SCHEDULED = 1     # taken from the waiting queue (first time and after each preemption)
    PREEMPTED = 2


@dataclass(slots=True)
class RequestEvent:
    type: RequestEventType
    timestamp: float  # time.monotonic()


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's result of a step. Every request gets exactly one output with a
    finish_reason, whoever ended it (stop, length, abort, error, or the front end)."""
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    # Opaque object from the sampler for this request's step; when a stop cut the step's tokens
    # short it may describe more positions than len(new_token_ids): use the first ones only.
    new_logprobs: Any = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None     # the stop token id (or string) that ended it
    num_cached_tokens: int = 0               # prefix-cache hit at first scheduling
    events: list[RequestEvent] | None = None
    error: str | None = None                 # why, when finish_reason == "error"
    # P/D: a prefill instance's handle to the request's held KV (disagg/params.py).
    kv_transfer_params: dict[str, Any] | None = None
    # The error is the engine's fault (a failed step), not the request's (bad input).
    internal_error: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
