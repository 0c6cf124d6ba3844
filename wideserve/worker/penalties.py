"""Penalty inputs kept per request across steps instead of rebuilt from the whole history.

Repetition, frequency and presence penalties read, for every row of a step, how often each
token occurs in the request's output and whether it occurs in the prompt or the output. The
reference (`sampler._build_penalties`) scatters the request's whole output (and prompt) into a
fresh [P, V] tensor every step: O(history) host work and upload per step. Here each request
with penalties owns a device row of output counts [V] (and, once a repetition penalty needs it,
its prompt mask [V], built once): a step adds only the tokens appended since the last one.

Why this is exact under the engine's rewinds: a request's output only ever grows. Rejected
drafts never enter it (verification rows see the drafts before them as `extra` tokens, added
to a copy of the step's rows), preemption keeps the output (the request recomputes KV, not
tokens) and prefix-cache hits change KV, never tokens. Should an output ever be shorter than
what a row has counted, the row is rebuilt from the output (never silently wrong).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from wideserve.utils.device import to_device
from wideserve.worker.sampler import PenaltyState, check_ids
from wideserve.types.sampling_params import SamplingParams


class PenaltyRequest(Protocol):
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]


@dataclass(slots=True)
class _Row:
    counts: torch.Tensor               # [V] fp32, occurrences of each token in the output
    counted: int                       # output tokens already in `counts`
    prompt: torch.Tensor | None = None  # [V] bool, token in the prompt (built on first need)


class PenaltyTracker:
    """One per engine: `state` gives a step's PenaltyState, `drop` forgets finished requests."""

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._rows.pop(rid, None)

    def state(self, rows: Sequence[tuple[PenaltyRequest, Sequence[int]]]) -> PenaltyState | None:
        """rows: per logits row, (its request, the tokens this row sees after the request's
        output: the drafts before it when verifying, else ()). None if no row has penalties."""
        sel = [i for i, (r, _) in enumerate(rows) if r.sampling_params.has_penalties]
        if not sel:
            return None
        params = [rows[i][0].sampling_params for i in sel]
        rep = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        synced: dict[str, _Row] = {}
        for i in sel:
            r = rows[i][0]
            if r.request_id not in synced:
                synced[r.request_id] = self._sync(r)
        entries = [synced[rows[i][0].request_id] for i in sel]
        counts = torch.stack([e.counts for e in entries])                # [P, V]
        extra = [rows[i][1] for i in sel]
        if any(len(x) for x in extra):
            lens = np.array([len(x) for x in extra], dtype=np.int64)
            ids = np.concatenate([np.asarray(x, dtype=np.int64) for x in extra])
            check_ids(ids, self.vocab_size, "draft tokens")
            at = np.repeat(np.arange(len(extra), dtype=np.int64), lens)
            counts.index_put_((to_device(at, self.device), to_device(ids, self.device)),
                              torch.ones(ids.size, device=self.device), accumulate=True)
        seen = None
        if (rep != 1.0).any():
            for r in (rows[i][0] for i in sel):
                self._prompt(r, synced[r.request_id])
            seen = (counts > 0) | torch.stack([e.prompt for e in entries])  # type: ignore[misc]
        return PenaltyState(
            rows=to_device(np.asarray(sel, dtype=np.int64), self.device),
            presence=to_device(np.array([p.presence_penalty for p in params], np.float32),
                               self.device),
            frequency=to_device(np.array([p.frequency_penalty for p in params], np.float32),
                                self.device),
            repetition=to_device(rep, self.device), output_counts=counts, seen=seen)

    def _sync(self, r: PenaltyRequest) -> _Row:
        """The request's row, with the output tokens appended since the last step added."""
        out = r.output_token_ids
        row = self._rows.get(r.request_id)
        if row is None or len(out) < row.counted:
            row = _Row(torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device), 0)
            self._rows[r.request_id] = row
        if len(out) > row.counted:
            new = np.asarray(out[row.counted:], dtype=np.int64)
            check_ids(new, self.vocab_size, "output_token_ids")
            row.counts.index_put_((to_device(new, self.device),),
                                  torch.ones(new.size, device=self.device), accumulate=True)
            row.counted = len(out)
        return row

    def _prompt(self, r: PenaltyRequest, row: _Row) -> None:
        if row.prompt is None:
            ids = np.asarray(r.prompt_token_ids, dtype=np.int64)
            check_ids(ids, self.vocab_size, "prompt_token_ids")
            mask = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
            mask[to_device(ids, self.device)] = True
            row.prompt = mask
