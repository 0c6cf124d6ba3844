"""The proposer interface: after a step's verification, k draft tokens per request.

When a proposer runs (every step with a batch, after the target forward and the rejection
sampler, before the scheduler's update): request i computed positions
start_i .. start_i + n_i - 1 (`ProposeInput.step_reqs[i]`); its first `num_valid[i]` rows are
now verified (prompt chunk rows and accepted drafts) and, when it sampled, `sampled[i]`'s last
token sits at position c_i = start_i + num_valid[i] (not computed by the target yet). Drafts
are the tokens for positions c_i + 1 .. c_i + num_drafts[i].

Model-based proposers keep their KV caches in the target's KV cache manager (extra cache
names in the same groups/pools, `kv_cache_specs`), so allocation, prefix caching, preemption
and rewinding are the target's: caches are stored by position, the rows a proposer writes for
rejected or draft positions are overwritten by the step that computes those positions, and
`SchedulerConfig.num_lookahead_tokens` reserves the slots past the verified tokens.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from wideserve.core.kv_cache.groups import KVCacheConfig
    from wideserve.core.kv_cache.spec import KVCacheSpec
    from wideserve.executor.forward_batch import ForwardBatch
    from wideserve.executor.model_runner import ModelRunner, StepRequest
    from wideserve.request import Request


@dataclass(slots=True)
class ProposeInput:
    step_reqs: list[StepRequest]       # the target step's requests, in batch order
    requests: list[Request]            # same order; state before the scheduler's update
    batch: ForwardBatch                # the target step's batch
    num_valid: np.ndarray                # [R] leading rows of each request now verified
    sampled: list[list[int] | None]      # [R] tokens emitted this step (None: no sample)
    num_drafts: np.ndarray               # [R] drafts wanted (0: none)

    def next_tokens(self) -> np.ndarray:
        """[R] the token at position start + num_valid (the last emitted token, or the next
        prompt token after a partial prefill chunk); -1 where there is none."""
        out = np.full(len(self.step_reqs), -1, dtype=np.int64)
        for i, (s, r) in enumerate(zip(self.sampled, self.requests)):
            if s:
                out[i] = s[-1]
            else:
                pos = self.step_reqs[i].start + int(self.num_valid[i])
                if pos < r.num_tokens:
                    out[i] = r.all_token_ids[pos]
        return out


class Proposer(ABC):
    # Whether the proposer writes KV past the verified tokens (lookahead slots needed).
    writes_kv: bool = True

    def kv_cache_specs(self, kv_cache_dtype: str) -> dict[str, KVCacheSpec]:
        """Extra caches (name -> spec) allocated beside the target's."""
        return {}

    def bind(self, target_runner: ModelRunner, kv_config: KVCacheConfig,
             kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once the KV tensors exist."""

    def drop(self, request_ids: list[str]) -> None:
        """Forget per-request state of finished requests."""

    @abstractmethod
    def propose(self, inp: ProposeInput) -> list[list[int]]:
        """Per request, up to num_drafts[i] draft tokens (fewer is allowed)."""
