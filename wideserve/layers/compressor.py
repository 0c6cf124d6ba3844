"""CSA / HCA KV compressors working from per-position state (reference/model-arch.md §3.5-3.6).

Glossary
- state row: what one position contributes to compression, stored in a sliding-window cache
  (fp32): [kv | gate + position_bias]. Overlapping (CSA) compressors store both halves of the
  two series, so a row is [kv_a, kv_b, g_a, g_b] (4 * head_dim); HCA rows are [kv, g].
- entry w (ratio m): completes at position (w+1)*m - 1. HCA pools positions [w*m, (w+1)*m);
  CSA pools the previous window through its "a" half and window w through its "b" half, i.e.
  positions [(w-1)*m, (w+1)*m) (window -1 does not exist: weight 0).
Each step writes this step's state rows, computes every entry that completes at a position of
the step (reading earlier positions back from the state cache) and writes it, RMS-normed and
rotated to position w*m, into the FULL cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope import RotaryTable, apply_rope

if TYPE_CHECKING:
    from wideserve.layers.v4_step import V4Step


@dataclass(slots=True)
class CompressPlan:
    """Entries completing in one step for one (ratio, overlap); shared by all such layers."""

    req: torch.Tensor        # [N] request index of each entry
    entry: torch.Tensor      # [N] entry index w
    src_pos: torch.Tensor    # [N, L] source positions (may be < 0 for CSA entry 0)
    in_step: torch.Tensor    # [N, L] bool: the position is one of this step's tokens
    row: torch.Tensor        # [N, L] its row in the step (0 where not in_step)

    @property
    def num_entries(self) -> int:
        return int(self.entry.shape[0])


def build_compress_plan(ctx: np.ndarray, seq: np.ndarray, qsl: np.ndarray,
                        write_start: np.ndarray, replay: np.ndarray, ratio: int, overlap: bool,
                        device: torch.device) -> CompressPlan:
    """Plan the entries w with completing position in [max(ctx, write_start), seq).

    Replayed requests (replay[r]) have no per-position state below ctx; an entry that would
    need it means the replay was too short, which is an error."""
    lo = np.maximum(ctx, write_start)
    first = lo // ratio
    count = np.maximum(seq // ratio - first, 0)
    req = np.repeat(np.arange(len(seq)), count)
    # Entry index within each request's run, without a Python loop over entries.
    starts = np.repeat(np.cumsum(count) - count, count)
    entry = np.repeat(first, count) + (np.arange(int(count.sum())) - starts)
    offsets = np.arange(-ratio, ratio) if overlap else np.arange(ratio)
    src = entry[:, None] * ratio + offsets[None, :]                          # [N, L]
    in_step = src >= ctx[req][:, None]
    missing = replay[req][:, None] & ~in_step & (src >= 0)
    if missing.any():
        r = int(req[missing.any(axis=1)][0])
        raise ValueError(f"bounded replay of request {r} starts at position {ctx[r]} but the "
                         f"compressor (ratio {ratio}) needs state from position "
                         f"{int(src[missing].min())}; replay at least "
                         f"{(2 if overlap else 1) * ratio} positions before kv_write_start")
    row = np.where(in_step, qsl[req][:, None] + src - ctx[req][:, None], 0)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return CompressPlan(dev(req.astype(np.int64)), dev(entry.astype(np.int64)),
                        dev(src.astype(np.int64)), dev(in_step), dev(row.astype(np.int64)))


class Compressor(nn.Module):
    """Gated pooling of `ratio` (HCA) or 2*`ratio` overlapping (CSA) positions into one entry.

    HF names: kv_proj, gate_proj, position_bias (fp32), kv_norm (fp32); the CSA main compressor
    also owns the lightning `indexer` (same compressor maths at the indexer width).
    """

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float,
                 indexer: nn.Module | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.ratio = ratio
        self.overlap = overlap
        coff = 2 if overlap else 1
        self.kv_proj = nn.Linear(hidden, coff * head_dim, bias=False)
        self.gate_proj = nn.Linear(hidden, coff * head_dim, bias=False)
        self.position_bias = nn.Parameter(
            torch.empty(ratio, coff * head_dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps).float()
        if indexer is not None:
            self.indexer = indexer

    @property
    def state_width(self) -> int:
        return (4 if self.overlap else 2) * self.head_dim

    def state_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, d] -> state rows [T, state_width] fp32."""
        kv = self.kv_proj(x).float()
        gate = self.gate_proj(x) + self.position_bias[positions % self.ratio]
        return torch.cat([kv, gate.float()], dim=-1)

    def forward(self, x: torch.Tensor, step: V4Step, state_name: str, out_name: str,
                rope: RotaryTable) -> None:
        """Write this step's state rows and every entry completing in the step."""
        rows = self.state_rows(x, step.positions)                             # [T, C]
        step.write_window_rows(state_name, rows)
        plan = step.compress_plan(self.ratio, self.overlap)
        if plan.num_entries == 0:
            return
        src = step.gather_positions(state_name, rows, plan)                   # [N, L, C]
        pooled = self.pool(src, plan.src_pos >= 0)                            # [N, D]
        cos, sin = rope.cos_sin(plan.entry * self.ratio)
        entries = apply_rope(pooled, cos, sin)
        step.write_entries(out_name, plan, entries)

    def pool(self, src: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """src [N, L, C] state rows, valid [N, L] -> normalised entries [N, D] fp32."""
        d = self.head_dim
        if self.overlap:
            m = self.ratio
            kv = torch.cat([src[:, :m, :d], src[:, m:, d:2 * d]], dim=1)       # [N, 2m, D]
            gate = torch.cat([src[:, :m, 2 * d:3 * d], src[:, m:, 3 * d:]], dim=1)
        else:
            kv, gate = src[..., :d], src[..., d:]                             # [N, m, D]
        mask = valid[..., None]
        kv = torch.where(mask, kv, 0.0)
        gate = torch.where(mask, gate, float("-inf"))
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
        return self.kv_norm(pooled)
