"""What crosses the boundary into the engine core (in-process or over ZMQ with msgspec)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from wideserve.types.multimodal import ImageInput
from wideserve.types.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    # A list, or over engine IPC little-endian int32 bytes (types/request.token_ids_to_bytes):
    # the engine reads those in place, no Python int per token.
    prompt_token_ids: list[int] | bytes
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # The client request this sequence belongs to (prompts x n of one HTTP request share
    # it); admission is fair across groups (engine/request_queue.py). None: its own group.
    group_id: str | None = None
    # Image spans of the prompt, in order (types/multimodal.py); None: a text prompt.
    images: list[ImageInput] | None = None


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of a run of positions: column 0 is the chosen token, then the top N."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)     # rank of the chosen token (1 = best)

    def extend(self, other: "TokenLogprobs") -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)

    def __len__(self) -> int:
        return len(self.ranks)


@dataclass(slots=True)
class StepLogprobs:
    """EngineCoreOutput.new_logprobs: the sampled tokens' logprobs and, with a request's first
    output, the prompt's (prompt token i >= 1 given tokens < i; the first has none)."""

    sampled: TokenLogprobs | None = None
    prompt: TokenLogprobs | None = None
