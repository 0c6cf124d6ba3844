"""Per-request sampling parameters (the vLLM `SamplingParams` surface, validated eagerly).

Conventions:
- temperature < SAMPLING_EPS means greedy (argmax); the sampler never divides by it.
- top_k 0 or -1 means "off" (normalised to 0); top_p 1.0 and min_p 0.0 are "off".
- max_tokens None means "up to the context limit" (the engine clamps to max_model_len).
- logprobs / prompt_logprobs: None = off, N >= 0 = the sampled (or prompt) token plus the top N.
  Logprobs are "raw": log_softmax of the model's logits before penalties and temperature.
- stop strings are matched on the detokenised output; stop_token_ids on sampled ids. After
  construction `stop` is always a list[str] and `stop_token_ids` a list[int].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from wideserve.types.structured_params import StructuredOutputsParams

SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 128
_SEED_MIN = -(2**63)          # torch.Generator.manual_seed accepts this range
_SEED_MAX = 2**64 - 1


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # P/D disaggregation (vLLM's name and shape): {"do_remote_decode": true} on the prefill
    # leg; the prefill's handle ({"do_remote_prefill": true, ...}) on the decode leg.
    kv_transfer_params: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None   # constrained decoding
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (OpenAI's)

    def __post_init__(self) -> None:
        self._check_sampling()
        self._check_lengths()
        self._check_penalties()
        self._check_stops()
        self._check_logprobs()
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        if self.kv_transfer_params is not None:
            if not isinstance(self.kv_transfer_params, dict):
                raise ValueError("kv_transfer_params must be an object")
            if self.n != 1:
                raise ValueError(f"kv_transfer_params: needs n == 1, got n={self.n}")
        self._check_logit_bias()
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {so!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    # ---- validation, one group per helper -------------------------------------------------

    def _check_sampling(self) -> None:
        t = self.temperature
        if not _is_number(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 and finite, got {t!r}")
        p = self.top_p
        if not _is_number(p) or not 0.0 < p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if not _is_int(k) or k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or >= 1, got {k!r}")
        if k == -1:
            self.top_k = 0
        m = self.min_p
        if not _is_number(m) or not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {m!r}")
        s = self.seed
        if s is not None and (not _is_int(s) or not _SEED_MIN <= s <= _SEED_MAX):
            raise ValueError(f"seed must be None or an int in [-2**63, 2**64 - 1], got {s!r}")

    def _check_lengths(self) -> None:
        mt = self.max_tokens
        if mt is not None and (not _is_int(mt) or mt < 1):
            raise ValueError(f"max_tokens must be None or >= 1, got {mt!r}")
        mn = self.min_tokens
        if not _is_int(mn) or mn < 0:
            raise ValueError(f"min_tokens must be >= 0, got {mn!r}")
        if mt is not None and mn > mt:
            raise ValueError(f"min_tokens must be <= max_tokens ({mt}), got {mn}")

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {r!r}")

    def _check_stops(self) -> None:
        stop = self.stop
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, (list, tuple)):
            stops = list(stop)
        else:
            raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {s!r}")
        self.stop = stops
        ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        for i in ids:
            if not _is_int(i) or i < 0:
                raise ValueError(f"stop_token_ids must contain only ints >= 0, got {i!r}")
        self.stop_token_ids = ids

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
        for t, b in bias.items():
            if not _is_int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            if not _is_number(b) or not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {b!r}")

    def _check_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")

    # ---- derived views -------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def all_stop_token_ids(self, eos_token_ids: set[int] | frozenset[int] | None) -> set[int]:
        """Token ids that end generation: stop_token_ids, plus EOS unless ignore_eos."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos and eos_token_ids:
            ids |= set(eos_token_ids)
        return ids
