"""Builds the flat batch for a step, runs the model, and returns the rows to sample from.

Host path (docs/host_path.md): one numpy pass per step over the scheduled requests (never a
Python loop per token). Block tables persist across steps (block_tables.py): a step appends
only the block ids each request gained, so its cost does not grow with the context. Every
metadata array goes to the device through `to_device` (shared memory on the CPU, pinned and
non-blocking on CUDA), and nothing in here reads a device value back.

Decode steps can instead go through the captured decode step (decode_capture.py, enabled by
`enable_decode_capture`): padded to a capture size, metadata in static buffers, replayed.
Small decode steps that are not captured take the small-batch path (small_batch.py, enabled
by `enable_small_batch`): exact-size views of static buffers, the model's plan kept. Other
decode steps take the persistent decode batch (decode_batch.py, `enable_decode_batch`): the
same for any size, without the small path's small-M GEMMs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ContextManager

import numpy as np
import torch

from wideserve.utils.device import to_device
from wideserve.worker.block_tables import BlockTables
from wideserve.worker.decode_batch import DecodeBatch
from wideserve.worker.decode_capture import CapturedDecode, Capturer, StepSync
from wideserve.worker.images import StepImages, image_extras
from wideserve.worker.small_batch import SmallBatchDecode
from wideserve.types.forward_batch import ForwardBatch, KVGroupView


@dataclass(slots=True)
class StepRequest:
    """One request's share of a step, as the runner needs it."""

    request_id: str
    token_ids: list[int]          # the tokens at positions start .. start + len - 1
    start: int                    # position of the first new token (= computed tokens before)
    # Per KV group: the request's block-table row. May be the KV manager's own lists (read
    # during the step, never kept or modified): rows only grow, entries only change to 0.
    block_ids: Sequence[Sequence[int]]
    kv_write_start: int = 0       # positions below are a replayed cached prefix
    sample: bool = True           # the step reaches the end of the request's tokens
    prompt_logits: bool = False   # also return every new row's hidden state (prompt logprobs)
    num_spec: int = 0             # draft tokens ending token_ids: logits for each + the last
    replay_start: int = 0         # with kv_write_start: where this request's replay began
    is_new: bool = False          # first step of the request (or of its resumption)
    # The request's tokens (Request.all_token_ids, not copied): a captured decode step's
    # host-staged inputs read the few before `start` (Engram n-grams; decode_capture.py).
    context: Sequence[int] = ()
    images: StepImages | None = None   # rows at image positions, their embeddings (images.py)


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
    # request index -> [n, d] hidden states of all new rows (prompt logprobs: the engine turns
    # them into logits in bounded slices, never [n, vocab] at once)
    prompt_hidden: dict[int, torch.Tensor]
    batch: ForwardBatch | None = None    # the step's batch (speculative proposers reuse it)


class ModelRunner:
    def __init__(self, model, groups: list[GroupLayout], cache_group: dict[str, int],
                 kv_caches: dict[str, torch.Tensor], device: torch.device,
                 with_drafts: bool = False, tables: BlockTables | None = None) -> None:
        """tables: block tables to share (a draft model's runner shares the target's)."""
        self.model = model
        self.with_drafts = with_drafts      # speculative decoding: logits for draft rows too
        self.groups = groups
        self.cache_group = cache_group
        self.kv_caches = kv_caches
        self.device = device
        self.tables = tables if tables is not None else BlockTables(len(groups), device)
        self.captured: CapturedDecode | None = None     # enable_decode_capture()
        self.small: SmallBatchDecode | None = None      # enable_small_batch()
        self.decode: DecodeBatch | None = None          # enable_decode_batch()
        # DEP's EP dispatcher (engine/dp_engine.py): the step header before every forward.
        self.step_sync: StepSync | None = None

    def enable_decode_capture(self, sizes: list[int] | tuple[int, ...], max_model_len: int,
                              capturer: Capturer | None = None) -> CapturedDecode:
        """Decode steps of up to max(sizes) requests run padded over static buffers (CUDA
        graphs where the model is capturable, captured here); other steps stay eager."""
        cap = CapturedDecode(self.model, self.groups, self.cache_group, self.kv_caches,
                             self.tables, self.device, sizes, capturer, self.step_sync)
        with torch.inference_mode():
            cap.capture(max_model_len)
        self.captured = cap
        return cap

    def enable_small_batch(self, max_size: int, gemms: bool = False) -> SmallBatchDecode | None:
        """Decode steps of up to max_size requests take the small-batch path (0: off). Not
        with drafts: the proposers move a step's batch on in place (spec_decode/proposer.py).
        gemms: small-M GEMMs for the model's plain linears there (LoadConfig.small_batch_gemms)."""
        if max_size < 0:
            raise ValueError(f"small_batch_decode must be >= 0 (0: off), got {max_size}")
        self.small = None if max_size == 0 or self.with_drafts else SmallBatchDecode(
            self.groups, self.cache_group, self.kv_caches, self.tables, self.device, max_size,
            model=self.model if gemms else None)
        return self.small

    def enable_decode_batch(self, max_size: int) -> DecodeBatch | None:
        """Decode steps of up to max_size requests that neither the captured step nor the
        small-batch path take run over persistent inputs, the model's plan kept per size (0:
        off). Not with drafts: the proposers move a step's batch on in place."""
        if max_size < 0:
            raise ValueError(f"the persistent decode batch's size must be >= 0 (0: off), "
                             f"got {max_size}")
        self.decode = None if max_size == 0 or self.with_drafts else DecodeBatch(
            self.groups, self.cache_group, self.kv_caches, self.tables, self.device, max_size)
        return self.decode

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests (their block-table rows are freed). A
        request that is not dropped keeps its row until it is."""
        self.tables.drop(request_ids)

    def build_batch(self, reqs: list[StepRequest]) -> ForwardBatch:
        # Per-request fields gathered by list comprehensions into np.array: several times
        # cheaper per request than np.fromiter over a generator (docs/host_path.md).
        lens = [len(r.token_ids) for r in reqs]
        num_tokens = sum(lens)
        # One token per request (decode): token = request. A zero-token request beside a
        # two-token one also has as many tokens as requests, hence the min.
        one_each = num_tokens == len(reqs) > 0 and min(lens) == 1
        qlens = np.array(lens, dtype=np.int64)
        starts = np.array([r.start for r in reqs], dtype=np.int64)
        if one_each:
            qsl = np.arange(len(reqs) + 1, dtype=np.int64)
            input_ids = np.array([r.token_ids[0] for r in reqs], dtype=np.int64)
        else:
            qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
            np.cumsum(qlens, out=qsl[1:])
            input_ids = np.array([t for r in reqs for t in r.token_ids], dtype=np.int64)
        seq_lens = starts + qlens
        dev = self.device
        update = self.tables.update
        rows = np.array([update(r.request_id, r.block_ids, r.is_new) for r in reqs],
                        dtype=np.int64)
        rows_t = to_device(rows, dev)
        if one_each:
            positions, token_rows = starts, rows
        else:
            req_of_token = np.repeat(np.arange(len(reqs)), qlens)
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qsl[:-1],
                                                                          qlens)
            token_rows = rows[req_of_token]
        views = [self._group_view(g, layout, rows, rows_t, token_rows, positions)
                 for g, layout in enumerate(self.groups)]
        write_start = write_start_cpu = replay_start = None
        if any(r.kv_write_start for r in reqs):
            write_start_cpu = np.array([r.kv_write_start for r in reqs], dtype=np.int64)
            write_start = to_device(write_start_cpu.copy(), dev)
            replay_start = np.array([r.replay_start for r in reqs], dtype=np.int64)
        batch = ForwardBatch(
            input_ids=to_device(input_ids, dev), positions=to_device(positions, dev),
            query_start_loc=to_device(qsl, dev), seq_lens=to_device(seq_lens, dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            kv_caches=self.kv_caches, kv_groups=views, cache_group=self.cache_group,
            kv_write_start=write_start, kv_write_start_cpu=write_start_cpu,
            kv_replay_start=replay_start, num_output_rows_cpu=self._output_rows(reqs, qlens))
        if any([r.images is not None for r in reqs]):
            batch.extras.update(image_extras([r.images for r in reqs], qsl, dev))
        return batch

    def _output_rows(self, reqs: list[StepRequest], qlens: np.ndarray) -> np.ndarray:
        """[R] rows of each request whose hidden states `forward` reads: all of them for
        prompt logprobs, the sampled row (and the drafts' with_drafts), none otherwise."""
        spec = self.with_drafts
        return np.array([q if r.prompt_logits else (r.num_spec + 1 if spec else 1) if r.sample
                         else 0 for r, q in zip(reqs, qlens.tolist())], dtype=np.int64)

    def _group_view(self, g: int, layout: GroupLayout, rows: np.ndarray, rows_t: torch.Tensor,
                    token_rows: np.ndarray, positions: np.ndarray) -> KVGroupView:
        view = KVGroupView(layout.block_size, layout.compress_ratio,
                           self.tables.device_table(g), req_rows=rows_t, req_rows_cpu=rows)
        if layout.compress_ratio == 1:
            bs = layout.block_size
            block, offset = np.divmod(positions, bs)
            slots = self.tables.host(g)[token_rows, block]     # a new array: scaled in place
            slots *= bs
            slots += offset
            view.slot_mapping = to_device(slots, self.device)
        return view

    @torch.inference_mode()
    def forward(self, reqs: list[StepRequest],
                input_ids: torch.Tensor | None = None) -> ForwardOutput:
        """input_ids [T] on the device replaces the requests' token ids (a proposer feeding
        its own drafts back without a host sync)."""
        # A step with image rows carries their embeddings in extras: the plain path only.
        plain = input_ids is not None or any([r.images is not None for r in reqs])
        n = None if self.captured is None or plain else self.captured.padded_size(reqs)
        small = None if plain else self.small
        decode = None if plain else self.decode
        # The small step's model calls (forward and logits) run inside its kernel scope.
        scope: Callable[[], ContextManager[None]] = contextlib.nullcontext
        if self.step_sync is not None:
            n = self._agree(reqs, n)
        if n is not None:
            step = self.captured.run(reqs, n)
            hidden, batch = step.hidden, step.batch
        elif small is not None and small.applies(reqs):
            batch = small.batch(reqs)
            scope = small.kernels
            with scope():
                hidden = self.model.forward(batch)
        elif decode is not None and decode.applies(reqs):
            batch = decode.batch(reqs)
            hidden = self.model.forward(batch)
        else:
            batch = self.build_batch(reqs)
            if input_ids is not None:
                batch.input_ids = input_ids
            hidden = self.model.forward(batch)
        if self.step_sync is not None:
            self.step_sync.forward_done()
        qsl = batch.query_start_loc_cpu
        sample_rows = [i for i, r in enumerate(reqs) if r.sample]
        logits = None
        if sample_rows:
            # Every row is a request's last (one token each: as many rows as requests, none
            # with zero tokens): no gather.
            if hidden.shape[0] == len(sample_rows) == len(reqs) \
                    and min([len(r.token_ids) for r in reqs]) == 1:
                sampled = hidden
            else:
                idx = qsl[1:][np.array(sample_rows, dtype=np.int64)] - 1
                if self.with_drafts:
                    idx = _with_draft_rows(idx, [reqs[i].num_spec for i in sample_rows])
                sampled = hidden.index_select(0, to_device(idx, hidden.device))
            with scope():
                logits = self.model.compute_logits(sampled)
        prompt_hidden: dict[int, torch.Tensor] = {}
        if any([r.prompt_logits for r in reqs]):
            for i, r in enumerate(reqs):
                if r.prompt_logits:
                    prompt_hidden[i] = hidden[int(qsl[i]):int(qsl[i + 1])]
        return ForwardOutput(logits, sample_rows, prompt_hidden, batch)

    def _agree(self, reqs: list[StepRequest], n: int | None) -> int | None:
        """The step header (DEP) before the forward, from what the host knows: this rank's
        tokens (its capture size for a captured decode step). Returns the size to replay at,
        every rank's agreed one, or None to run eagerly (a step too large to pad, or a size
        not captured)."""
        assert self.step_sync is not None
        tokens = n if n is not None else sum([len(r.token_ids) for r in reqs])
        size = self.step_sync.begin_step(tokens)
        return size if n is not None and self.captured is not None \
            and size in self.captured.sizes else None


def _with_draft_rows(ends: np.ndarray, num_spec: list[int]) -> np.ndarray:
    """Last rows -> the last num_spec + 1 rows of each request, consecutive."""
    k = np.asarray(num_spec, dtype=np.int64)
    counts = k + 1
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(ends - k, counts) + offsets
