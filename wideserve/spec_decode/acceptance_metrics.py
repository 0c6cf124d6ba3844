"""Speculative-decoding counters (vLLM's `spec_decode_*` names, so clients that scrape them work).

Glossary
- draft: one verification of one request in one step that carried >= 1 draft token.
- draft tokens: the tokens those drafts proposed and the target verified.
- accepted tokens: draft tokens the verifier kept (the bonus/recovered token is not counted).
- acceptance length (AL): tokens gained per draft = 1 + accepted / drafts (in [1, k + 1]).
- acceptance rate: accepted tokens / draft tokens.
- per position j (0-based): drafts whose draft j was accepted; position j only counts when
  positions 0 .. j-1 were accepted too (acceptance stops at the first rejection).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class SpecDecodeStats:
    """Totals since start (an EngineStats field; builtins-only so it crosses ZMQ as is)."""

    method: str
    num_speculative_tokens: int
    forced_acceptance_length: float | None = None   # not None: outputs are NOT the model's
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    mean_acceptance_length: float = 0.0             # 1 + accepted / drafts (0 before any)
    acceptance_rate: float = 0.0                    # accepted / draft tokens

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_draft_tokens: np.ndarray, num_accepted: np.ndarray) -> None:
        """One step: per request verified, its draft count (0 = none) and accepted count."""
        has = num_draft_tokens > 0
        if not has.any():
            return
        drafts, accepted = num_draft_tokens[has], num_accepted[has]
        self.num_drafts += int(has.sum())
        self.num_draft_tokens += int(drafts.sum())
        self.num_accepted_tokens += int(accepted.sum())
        # Position j is counted by every draft that accepted more than j tokens.
        counts = np.bincount(accepted, minlength=self.num_speculative_tokens + 1)
        per_pos = counts[::-1].cumsum()[::-1][1:self.num_speculative_tokens + 1]
        for j, c in enumerate(per_pos.tolist()):
            self.num_accepted_tokens_per_pos[j] += c
        self.mean_acceptance_length = 1.0 + self.num_accepted_tokens / self.num_drafts
        self.acceptance_rate = self.num_accepted_tokens / self.num_draft_tokens

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.method, self.num_speculative_tokens, self.forced_acceptance_length,
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
            list(self.num_accepted_tokens_per_pos), self.mean_acceptance_length,
            self.acceptance_rate)

    def acceptance_rate_per_pos(self) -> list[float]:
        return [c / self.num_drafts if self.num_drafts else 0.0
                for c in self.num_accepted_tokens_per_pos]
