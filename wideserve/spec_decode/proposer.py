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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wideserve.utils.device import to_device

if TYPE_CHECKING:
    from wideserve.kv_cache.groups import KVCacheConfig
    from wideserve.kv_cache.spec import KVCacheSpec
    from wideserve.types.forward_batch import ForwardBatch
    from wideserve.worker.model_runner import ModelRunner, StepRequest
    from wideserve.types.request import Request

# One chained draft step: (the step's batch, each row's newest draft, the proposer's carried
# state for those rows) -> (the next drafts, the new state). State rows follow the batch rows.
DraftStep = Callable[["ForwardBatch", torch.Tensor, Any], tuple[torch.Tensor, Any]]


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


class ChainedProposer(Proposer):
    """A proposer whose drafts 2..k come one row per request per step, each fed the previous
    draft (MTP, draft model). The chain's batch is built once and then moved one position on
    in place (`advance`); it is rebuilt only for the rows still drafting when some request
    wants fewer drafts than the others."""

    runner: ModelRunner | None = None

    def chain(self, inp: ProposeInput, active: np.ndarray, first_pos: np.ndarray,
              tok: torch.Tensor, state: Any, step: DraftStep) -> list[list[int]]:
        """active [A]: requests (index into inp) that drafted `tok` [A] (draft 1, at
        first_pos [A]); returns every request's drafts (up to inp.num_drafts)."""
        from wideserve.worker.model_runner import StepRequest
        assert self.runner is not None
        steps = [(active, tok)]
        batch = None
        for j in range(1, int(inp.num_drafts.max(initial=0))):
            keep = np.nonzero(inp.num_drafts[active] > j)[0]
            if keep.size == 0:
                break
            if batch is None or keep.size < active.size:
                if keep.size < active.size:
                    keep_t = torch.from_numpy(keep).to(tok.device)
                    active, first_pos = active[keep], first_pos[keep]
                    tok, state = tok.index_select(0, keep_t), _select(state, keep_t)
                # Draft j (position first_pos + j) is computed from draft j - 1's row.
                batch = self.runner.build_batch([
                    StepRequest(inp.step_reqs[i].request_id, [0], int(p) + j - 1,
                                inp.step_reqs[i].block_ids, sample=False)
                    for i, p in zip(active.tolist(), first_pos.tolist())])
            else:
                advance(self.runner, batch)
            batch.input_ids = tok
            tok, state = step(batch, tok, state)
            steps.append((active, tok))
        out: list[list[int]] = [[] for _ in inp.step_reqs]
        for idx, t in steps:
            for i, v in zip(idx.tolist(), t.tolist()):
                out[i].append(v)
        return out


def _select(state: Any, rows: torch.Tensor) -> Any:
    return None if state is None else state.index_select(0, rows)


def advance(runner: ModelRunner, batch: ForwardBatch) -> None:
    """A one-token-per-request batch moved one position on, in place: positions, context
    lengths and the ratio-1 groups' slots (the block tables already hold the lookahead blocks:
    the rows were updated when the batch was built)."""
    batch.positions = batch.positions + 1
    batch.seq_lens = batch.seq_lens + 1
    batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    batch.extras = {}
    pos = batch.seq_lens_cpu - 1
    for g, (view, layout) in enumerate(zip(batch.kv_groups, runner.groups)):
        if layout.compress_ratio == 1:
            bs = layout.block_size
            slots = runner.tables.host(g)[view.req_rows_cpu, pos // bs] * bs + pos % bs
            view.slot_mapping = to_device(slots, runner.device)
