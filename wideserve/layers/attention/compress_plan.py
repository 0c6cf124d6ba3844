"""`CompressPlan`: which compressed entries complete in one step (docs/deepseek_v4.md, "CSA
compressor"). Plain numpy planning, shared by `V4Step` (which builds it once per step) and the
compressors (which read it); in a module of its own so that neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class CompressPlan:
    """Entries completing in one step for one (ratio, overlap); shared by all such layers.
    Host arrays (numpy) plus the device tensors every layer needs."""

    req: np.ndarray          # [N] request index of each entry
    entry: np.ndarray        # [N] entry index w
    src_pos: np.ndarray      # [N, L] source positions (may be < 0 for CSA entry 0)
    series: np.ndarray       # [L] which half-row (series) of a state row offset l pools
    in_step: np.ndarray      # [N, L] bool: the position is one of this step's tokens
    row: np.ndarray          # [N, L] its row in the step (0 where not in_step)
    valid: torch.Tensor | None  # [N, L, 1] bool: src_pos >= 0; None when all are

    @property
    def num_entries(self) -> int:
        return int(self.entry.shape[0])


def build_compress_plan(ctx: np.ndarray, seq: np.ndarray, qsl: np.ndarray,
                        write_start: np.ndarray, kept_from: np.ndarray, ratio: int, overlap: bool,
                        device: torch.device) -> CompressPlan:
    """Plan the entries w with completing position in [max(ctx, write_start), seq).

    Replayed requests have no per-position state below kept_from[r] (where the replay began);
    an entry that would need it means the replay was too short, which is an error."""
    lo = np.maximum(ctx, write_start)
    first = lo // ratio
    count = np.maximum(seq // ratio - first, 0)
    req = np.repeat(np.arange(len(seq)), count)
    # Entry index within each request's run, without a Python loop over entries.
    starts = np.repeat(np.cumsum(count) - count, count)
    entry = np.repeat(first, count) + (np.arange(int(count.sum())) - starts)
    offsets = np.arange(-ratio, ratio) if overlap else np.arange(ratio)
    series = (offsets >= 0).astype(np.int64) if overlap else np.zeros(ratio, dtype=np.int64)
    src = entry[:, None] * ratio + offsets[None, :]                          # [N, L]
    in_step = src >= ctx[req][:, None]
    missing = (src >= 0) & (src < kept_from[req][:, None])
    if missing.any():
        r = int(req[missing.any(axis=1)][0])
        raise ValueError(f"bounded replay of request {r} starts at position {kept_from[r]} but "
                         f"the compressor (ratio {ratio}) needs state from position "
                         f"{int(src[missing].min())}; replay at least "
                         f"{(2 if overlap else 1) * ratio} positions before kv_write_start")
    row = np.where(in_step, qsl[req][:, None] + src - ctx[req][:, None], 0)
    valid = None
    if (src < 0).any():
        valid = torch.from_numpy(src[..., None] >= 0).to(device)
    return CompressPlan(req, entry, src, series, in_step, row, valid)
