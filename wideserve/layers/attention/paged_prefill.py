"""Chunked and mixed prefills on the CPU's matrix units (docs/cpu_kernels.md, "Chunked and
mixed prefills"): in a step whose requests are not all fresh prefills - a prefill chunk after
cached positions, prefills beside decodes - each request with enough query rows that the
kernel choice measured SDPA faster at its length (kernels/choice.py: family "attention" for a
fresh prefill, "attention_ctx" for a chunk after a context) attends through torch's fused
SDPA (kernels/sdpa_context.py: the context gathered from the paged cache, a bottom-right
causal mask), and the other requests (decodes, short chunks) go to the C++ paged op in one
call over just their rows. The step's K/V entries are in the cache before either runs.

Only full attention (no sliding window) and the C++ op's dtypes take this path; the split is
host-side arithmetic on the step's lengths, built once per step and cache group and shared by
every layer (PagedAttentionPlans.context_split).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wideserve.kernels import sdpa_context
from wideserve.kernels.choice import bucket_of
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.utils.device import to_device


@dataclass(slots=True)
class ContextSplit:
    """Which requests of a step attend through SDPA, and the C++ op's call for the rest."""

    sdpa: list[tuple[int, int, int, int]]   # (table row, first token row, queries, length)
    rest_rows: torch.Tensor | None          # [N] token rows of the other requests; None: none
    rest_qsl: torch.Tensor | None           # [R'+1] their query starts within rest_rows
    rest_lens: torch.Tensor | None          # [R'] their lengths (positions after the step)
    rest_req_rows: torch.Tensor | None      # [R'] their block table rows


def build_split(batch: ForwardBatch, view: KVGroupView, fresh: tuple[str, ...],
                context: tuple[str, ...]) -> ContextSplit | None:
    """The split of `batch` given the choice's plans per query bucket (`fresh`: a prefill from
    position 0; `context`: a chunk after cached positions); None where no request picks SDPA."""
    qsl = batch.query_start_loc_cpu
    qlen = np.diff(qsl)
    lens = np.asarray(batch.seq_lens_cpu)
    picks = [r for r in range(len(qlen)) if qlen[r] > 1 and
             (fresh if lens[r] == qlen[r] else context)[bucket_of(int(qlen[r]))] == "sdpa"]
    if not picks:
        return None
    sdpa = [(view.row(r), int(qsl[r]), int(qlen[r]), int(lens[r])) for r in picks]
    rest = np.setdiff1d(np.nonzero(qlen > 0)[0], picks)
    if not len(rest):
        return ContextSplit(sdpa, None, None, None, None)
    rows = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in rest])
    dev = view.block_table.device

    def t(a: np.ndarray) -> torch.Tensor:
        return to_device(a, dev, np.int64)

    rest_qsl = np.concatenate(([0], np.cumsum(qlen[rest])))
    return ContextSplit(sdpa, t(rows), t(rest_qsl), t(lens[rest]), t(view.host_rows(rest)))


def attend_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 view: KVGroupView, split: ContextSplit, scale: float) -> torch.Tensor:
    """[T, H, D]: the SDPA requests one by one, the rest in one C++ op call (full attention;
    the step's entries already written)."""
    out = q.new_empty(q.shape)
    for row, start, n, length in split.sdpa:
        rows = slice(start, start + n)
        if length == n:          # a fresh prefill: its keys are this step's own k/v
            o = sdpa_context.attend(q[rows], k[rows].transpose(0, 1).to(q.dtype),
                                    v[rows].transpose(0, 1).to(q.dtype), scale)
        else:
            o = sdpa_context.attend_paged(q[rows], cache, view.block_table[row], length, scale)
        out[rows] = o
    if split.rest_rows is not None:
        o = torch.ops.wideserve.paged_attention(
            q.index_select(0, split.rest_rows), cache, view.block_table, split.rest_req_rows,
            split.rest_qsl, split.rest_lens, scale, 0, False)
        out.index_copy_(0, split.rest_rows, o)
    return out
