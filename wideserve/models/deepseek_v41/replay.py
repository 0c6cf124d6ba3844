"""DeepSeek-V4.1 decoder bounded replay, exact (docs/deepseek_v41.md, "Decoder bounded replay").

From the last KV source K on (layer 20 of V4.1-Flash), no layer writes KV that outlives the
step except its own sliding window: K's compressed entries and indexer keys come from its
input alone (every row of it is computed by the layers before), and the layers after K only
read them. So a long prefill step need not run the decoder layers on every new row. Which rows
are needed, working back from the end (W = sliding_window, n = layers K..L-1):
- the caller reads the last `need` rows' hidden states (1 to sample; the drafts' rows when
  verifying; every row for prompt logprobs) and later steps read each decoder layer's window,
  the last W-1 positions: layer L-1 must compute its output exactly on the last `need` rows,
  so its input exactly on the last need + W-1 rows (the window of the first of them);
- a layer's output at p reads its window latents at p-W+1..p: to have layer l's input exact
  on rows [a, seq), layer l-1 runs on [a - (W-1), seq).
So layer l runs on the rows from start_l = max(ctx, seq - need - (L - l) * (W - 1)): n(W-1) +
need rows at K (W + (n-1)(W-1) to sample one token), W-1 fewer at each layer after it. A
layer's windows are clamped at its first row (`kv_replay_start`), which only touches rows
whose results no later layer reads: the outputs the caller reads and every window row the
later steps read are those of running every row. K itself writes its entries for every row
before its queries are cut (DeepseekV41Block.write_shared_kv). A request whose rows all
matter (prompt logprobs, short steps) keeps every row; steps where nobody has more than
need + W - 1 new rows are untouched.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from wideserve.types.forward_batch import ForwardBatch
from wideserve.utils.device import to_device


@dataclass(slots=True)
class ReplayStage:
    """Rows a stage keeps and the sub-batch its layers run on."""

    rows: torch.Tensor          # [n] indices into the previous stage's rows (or the step's)
    batch: ForwardBatch         # the sub-batch of those rows


@dataclass(slots=True)
class DecoderReplay:
    """The stages of one step: layer -> the stage that starts at it (rows only shrink)."""

    stages: dict[int, ReplayStage]
    exact_rows: torch.Tensor    # [m] the step's rows whose final hidden states are exact
    exact_at: torch.Tensor      # [m] where they are in the last stage's rows


def replay_starts(ctx: np.ndarray, seq: np.ndarray, need: np.ndarray, window: int,
                  layer: int, num_layers: int) -> np.ndarray:
    """[R] first position layer `layer` runs on (module doc): the last `need` rows' outputs
    and the last W-1 window rows of every later layer are exact."""
    return np.maximum(ctx, seq - np.maximum(need, 1) - (num_layers - layer) * (window - 1))


def plan_decoder_replay(batch: ForwardBatch, token_req: np.ndarray, token_pos: np.ndarray,
                        lo: np.ndarray, window: int, first: int, num_layers: int
                        ) -> DecoderReplay | None:
    """The stages of layers first..num_layers-1 for `batch` (token_req / token_pos / lo: the
    full step's host layout, V4Step). None when the batch does not say which rows its caller
    reads (ForwardBatch.num_output_rows_cpu) or no layer would skip a row."""
    need = batch.num_output_rows_cpu
    if need is None:
        return None
    qsl = np.asarray(batch.query_start_loc_cpu, dtype=np.int64)
    seq = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
    ctx = seq - np.diff(qsl)
    need = np.asarray(need, dtype=np.int64)
    if not (replay_starts(ctx, seq, need, window, num_layers - 1, num_layers) > ctx).any():
        return None
    dev = batch.input_ids.device
    stages: dict[int, ReplayStage] = {}
    prev_start, prev_rows = ctx, np.arange(len(token_pos), dtype=np.int64)
    for layer in range(first, num_layers):
        start = replay_starts(ctx, seq, need, window, layer, num_layers)
        if (start == prev_start).all():
            continue
        rows = np.flatnonzero(token_pos >= start[token_req])
        stages[layer] = ReplayStage(to_device(np.searchsorted(prev_rows, rows), dev),
                                    _sub_batch(batch, rows, start, ctx, lo))
        prev_start, prev_rows = start, rows
    # The last stage's rows within W-1 of its first see a clamped window: not exact.
    exact_from = np.where(prev_start > ctx, prev_start + window - 1, ctx)
    at = np.flatnonzero(token_pos[prev_rows] >= exact_from[token_req[prev_rows]])
    return DecoderReplay(stages, to_device(prev_rows[at], dev), to_device(at, dev))


def _sub_batch(batch: ForwardBatch, rows: np.ndarray, start: np.ndarray, ctx: np.ndarray,
               lo: np.ndarray) -> ForwardBatch:
    """`batch` restricted to the token rows `rows` (each request's rows from start[r] on):
    the rows before are context to it, and its windows read nothing below start[r] where it
    cut rows (elsewhere the full step's lo stays in force)."""
    seq = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
    new_qsl = np.concatenate([[0], np.cumsum(seq - start)])
    dev = batch.input_ids.device
    idx = to_device(rows, dev)
    views = [dataclasses.replace(v, slot_mapping=None if v.slot_mapping is None
                                 else v.slot_mapping[idx]) for v in batch.kv_groups]
    return ForwardBatch(
        input_ids=batch.input_ids[idx], positions=batch.positions[idx],
        query_start_loc=to_device(new_qsl, batch.query_start_loc.device),
        seq_lens=batch.seq_lens, query_start_loc_cpu=new_qsl, seq_lens_cpu=seq,
        kv_caches=batch.kv_caches, kv_groups=views, cache_group=batch.cache_group,
        kv_replay_start=np.where(start > ctx, start, lo), extras=batch.extras)
