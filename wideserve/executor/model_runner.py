"""Builds the flat batch for a step, runs the model, and returns the rows to sample from.

Host path: one numpy pass per step over the scheduled requests (never a Python loop per token);
the only per-request Python work is slicing each request's new token ids and block-table rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wideserve.executor.forward_batch import ForwardBatch, KVGroupView


@dataclass(slots=True)
class StepRequest:
    """One request's share of a step, as the runner needs it."""

    request_id: str
    token_ids: list[int]          # the tokens at positions start .. start + len - 1
    start: int                    # position of the first new token (= computed tokens before)
    block_ids: list[list[int]]    # per KV group: the request's block-table row
    kv_write_start: int = 0       # positions below are a replayed cached prefix
    sample: bool = True           # the step reaches the end of the request's tokens
    prompt_logits: bool = False   # also return logits for every new row (prompt logprobs)
    num_spec: int = 0             # draft tokens ending token_ids: logits for each + the last
    replay_start: int = 0         # with kv_write_start: where this request's replay began


@dataclass(slots=True)
class GroupLayout:
    block_size: int
    compress_ratio: int


@dataclass(slots=True)
class ForwardOutput:
    # [S, V] fp32, one row per sampled request, in order; with drafts (runner built with
    # with_drafts=True) num_spec + 1 consecutive rows per sampled request.
    logits: torch.Tensor | None
    sample_rows: list[int]               # index into the step's requests of each request's rows
    prompt_logits: dict[int, torch.Tensor]  # request index -> [n, V] fp32 (all new rows)
    batch: ForwardBatch | None = None    # the step's batch (speculative proposers reuse it)


class ModelRunner:
    def __init__(self, model, groups: list[GroupLayout], cache_group: dict[str, int],
                 kv_caches: dict[str, torch.Tensor], device: torch.device,
                 with_drafts: bool = False) -> None:
        self.model = model
        self.with_drafts = with_drafts      # speculative decoding: logits for draft rows too
        self.groups = groups
        self.cache_group = cache_group
        self.kv_caches = kv_caches
        self.device = device

    def build_batch(self, reqs: list[StepRequest]) -> ForwardBatch:
        qlens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.start for r in reqs), dtype=np.int64, count=len(reqs))
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        req_of_token = np.repeat(np.arange(len(reqs)), qlens)
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl[:-1], qlens)
        input_ids = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in reqs])
        seq_lens = starts + qlens
        dev = self.device
        views = [self._group_view(g, layout, reqs, req_of_token, positions)
                 for g, layout in enumerate(self.groups)]
        write_start = replay_start = None
        if any(r.kv_write_start for r in reqs):
            write_start = torch.tensor([r.kv_write_start for r in reqs], dtype=torch.int64,
                                       device=dev)
            replay_start = np.array([r.replay_start for r in reqs], dtype=np.int64)
        return ForwardBatch(
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            kv_caches=self.kv_caches, kv_groups=views, cache_group=self.cache_group,
            kv_write_start=write_start, kv_replay_start=replay_start)

    def _group_view(self, g: int, layout: GroupLayout, reqs: list[StepRequest],
                    req_of_token: np.ndarray, positions: np.ndarray) -> KVGroupView:
        width = max(1, max(len(r.block_ids[g]) for r in reqs))
        table = np.zeros((len(reqs), width), dtype=np.int64)
        for i, r in enumerate(reqs):
            row = r.block_ids[g]
            table[i, :len(row)] = row
        view = KVGroupView(layout.block_size, layout.compress_ratio,
                           torch.from_numpy(table).to(self.device))
        if layout.compress_ratio == 1:
            bs = layout.block_size
            slots = table[req_of_token, positions // bs] * bs + positions % bs
            view.slot_mapping = torch.from_numpy(slots).to(self.device)
        return view

    @torch.inference_mode()
    def forward(self, reqs: list[StepRequest],
                input_ids: torch.Tensor | None = None) -> ForwardOutput:
        """input_ids [T] on the device replaces the requests' token ids (a proposer feeding
        its own drafts back without a host sync)."""
        batch = self.build_batch(reqs)
        if input_ids is not None:
            batch.input_ids = input_ids
        hidden = self.model.forward(batch)
        ends = batch.query_start_loc_cpu[1:] - 1
        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        logits = None
        if sample_rows:
            idx = ends[sample_rows]
            if self.with_drafts:
                idx = _with_draft_rows(idx, [reqs[i].num_spec for i in sample_rows])
            rows = torch.from_numpy(idx).to(hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        prompt_logits: dict[int, torch.Tensor] = {}
        for i, r in enumerate(reqs):
            if r.prompt_logits:
                lo, hi = int(batch.query_start_loc_cpu[i]), int(batch.query_start_loc_cpu[i + 1])
                prompt_logits[i] = self.model.compute_logits(hidden[lo:hi])
        return ForwardOutput(logits, sample_rows, prompt_logits, batch)


def _with_draft_rows(ends: np.ndarray, num_spec: list[int]) -> np.ndarray:
    """Last rows -> the last num_spec + 1 rows of each request, consecutive."""
    k = np.asarray(num_spec, dtype=np.int64)
    counts = k + 1
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(ends - k, counts) + offsets
