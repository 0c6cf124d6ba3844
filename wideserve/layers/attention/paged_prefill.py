"""Chunked and mixed prefills on the CPU's matrix units (docs/cpu_kernels.md, "Chunked and
mixed prefills", "Flash prefill"): in a step whose requests are not all fresh prefills on
SDPA - a prefill chunk after cached positions, prefills beside decodes, fresh prefills the
choice gives the flash kernel - each request with enough query rows that the kernel choice
measured SDPA or the flash kernel faster at its length (kernels/choice.py: family "attention"
for a fresh prefill, "attention_ctx" for a chunk after a context) attends as a whole through
that one (kernels/sdpa_context.py: SDPA on the context gathered from the paged cache with a
bottom-right causal mask, or the flash kernel reading the cache in place), and the other
requests (decodes, short chunks) go to the C++ paged op in one call over just their rows.
The step's K/V entries are in the cache before any of them runs.

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

WHOLE = ("sdpa", "flash")     # the kernels that attend a request as a whole


@dataclass(slots=True)
class ContextSplit:
    """Which requests of a step attend as a whole (SDPA or flash), and the C++ op's call for
    the rest."""

    # (table row, first token row, queries, length, kernel: "sdpa" or "flash")
    whole: list[tuple[int, int, int, int, str]]
    rest_rows: torch.Tensor | None          # [N] token rows of the other requests; None: none
    rest_qsl: torch.Tensor | None           # [R'+1] their query starts within rest_rows
    rest_lens: torch.Tensor | None          # [R'] their lengths (positions after the step)
    rest_req_rows: torch.Tensor | None      # [R'] their block table rows


def build_split(batch: ForwardBatch, view: KVGroupView, fresh: tuple[str, ...],
                context: tuple[str, ...]) -> ContextSplit | None:
    """The split of `batch` given the choice's plans per query bucket (`fresh`: a prefill from
    position 0; `context`: a chunk after cached positions); None where every request picks
    the C++ op."""
    qsl = batch.query_start_loc_cpu
    qlen = np.diff(qsl)
    lens = np.asarray(batch.seq_lens_cpu)
    kernel = {r: (fresh if lens[r] == qlen[r] else context)[bucket_of(int(qlen[r]))]
              for r in range(len(qlen)) if qlen[r] > 1}
    picks = [r for r, k in kernel.items() if k in WHOLE]
    if not picks:
        return None
    whole = [(view.row(r), int(qsl[r]), int(qlen[r]), int(lens[r]), kernel[r]) for r in picks]
    rest = np.setdiff1d(np.nonzero(qlen > 0)[0], picks)
    if not len(rest):
        return ContextSplit(whole, None, None, None, None)
    rows = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in rest])
    dev = view.block_table.device

    def t(a: np.ndarray) -> torch.Tensor:
        return to_device(a, dev, np.int64)

    rest_qsl = np.concatenate(([0], np.cumsum(qlen[rest])))
    return ContextSplit(whole, t(rows), t(rest_qsl), t(lens[rest]), t(view.host_rows(rest)))


def attend_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                 view: KVGroupView, split: ContextSplit, scale: float) -> torch.Tensor:
    """[T, H, D]: the whole-request ones one by one, the rest in one C++ op call (full
    attention; the step's entries already written)."""
    out = q.new_empty(q.shape)
    flash = q.dtype == cache.dtype == torch.bfloat16   # else (a quantized cache) SDPA
    for row, start, n, length, kernel in split.whole:
        rows = slice(start, start + n)
        if kernel == "flash" and flash:
            o = sdpa_context.attend_flash(q[rows], cache, view.block_table[row], length, scale)
        elif length == n:        # a fresh prefill: its keys are this step's own k/v
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
