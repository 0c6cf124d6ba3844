"""SpeculativeConfig: which proposer, how many drafts, and the benchmark-only forced acceptance.

Spelled like vLLM's `--speculative-config` JSON:
    {"method": "mtp", "num_speculative_tokens": 3}
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 3}
    {"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance_length": 2.0}
    {"method": "dspark", "num_speculative_tokens": 5, "dspark_confidence_threshold": 0.3}

Acceptance length (AL) = tokens a request gains per verification step = accepted drafts + 1
(the bonus or recovered token), in [1, k + 1]: vLLM's "mean acceptance length" and the unit of
InferenceX's golden values. `forced_acceptance_length` makes the verifier accept AL - 1 drafts
per step on average whatever their content: outputs are then NOT the target model's (for
synthetic benchmark prompts only, docs/benchmarking.md, "Replay rules").

No torch import here: the CLI parses this before anything heavy loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wideserve.config.json_flag import json_object

METHODS = ("mtp", "ngram", "draft_model", "dspark")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1
    model: str | None = None                  # draft_model: its directory (same tokenizer)
    load_format: str = "auto"                 # draft_model: "auto", "safetensors" or "dummy"
    prompt_lookup_min: int = 1                # ngram: shortest suffix n-gram to look up
    prompt_lookup_max: int = 3                # ngram: longest (tried first)
    forced_acceptance_length: float | None = None   # benchmarks only: outputs are not the model's
    # dspark: stop a block at the first slot whose predicted acceptance is below this
    dspark_confidence_threshold: float | None = None
    # Drafts per request shrink with the batch so that decoding requests x (k + 1) stays
    # within this many verified tokens per step (0: always k; None: the device's default,
    # decoder.BATCH_TOKEN_BUDGET). Where a step is compute-bound every rejected draft is
    # wasted work (BENCHMARKS.md, "Speculative decoding").
    batch_token_budget: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        k = self.num_speculative_tokens
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; "
                             f"got {self.method!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model (the draft model's directory) is "
                             "required for method 'draft_model'")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config.model is only for method 'draft_model', "
                             f"not {self.method!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"speculative_config.load_format must be auto, safetensors or "
                             f"dummy, got {self.load_format!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, "
                                 f"got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) is larger than "
                             f"prompt_lookup_max ({hi})")
        budget = self.batch_token_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ValueError(f"speculative_config.batch_token_budget must be an integer >= 0, "
                             f"got {budget!r}")
        al = self.forced_acceptance_length
        if al is not None:
            if isinstance(al, bool) or not isinstance(al, (int, float)) \
                    or not 1.0 <= al <= k + 1:
                raise ValueError(f"speculative_config.forced_acceptance_length must be a "
                                 f"number in [1, num_speculative_tokens + 1 = {k + 1}], "
                                 f"got {al!r}")
            self.forced_acceptance_length = float(al)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        data = json_object(data, "speculative_config", cls)
        if "method" not in data:
            raise ValueError("speculative_config.method is required "
                             f"(one of {', '.join(METHODS)})")
        return cls(**data)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """A JSON string, a dict, a SpeculativeConfig, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        return cls.from_dict(value)  # type: ignore[arg-type]

    @property
    def is_forced(self) -> bool:
        return self.forced_acceptance_length is not None

    def describe(self) -> str:
        text = f"{self.method} k={self.num_speculative_tokens}"
        if self.method == "draft_model":
            text += f" draft={self.model}"
        if self.is_forced:
            text += f" FORCED acceptance length {self.forced_acceptance_length:g}"
        return text
