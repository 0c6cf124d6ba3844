"""CSA / HCA KV compressors from per-position state (docs/deepseek_v4.md, "CSA compressor").

Glossary
- state row: what one position contributes to compression, stored in a sliding-window cache
  (fp32) as `coff` half-rows [kv | gate + position_bias] of 2 * head_dim each, one per series.
  Overlapping (CSA) compressors keep two series ("a" and "b"): a row is
  [kv_a, g_a, kv_b, g_b] (4 * head_dim); HCA rows are [kv, g] (one series).
- entry w (ratio m): completes at position (w+1)*m - 1. HCA pools positions [w*m, (w+1)*m);
  CSA pools the previous window through its "a" series and window w through its "b" series,
  i.e. positions [(w-1)*m, (w+1)*m) (window -1 does not exist: weight 0).
Each step writes this step's state rows, computes every entry that completes at a position of
the step (reading earlier positions back from the state cache) and writes it, RMS-normed and
rotated to position w*m, into the FULL cache. All entries of a step are computed together (one
gather of half-rows, one softmax pooling), whatever the attention backend.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope_interleaved import RotaryTable, rotate

if TYPE_CHECKING:
    from wideserve.layers.attention.v4_step import V4Step


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
    def num_series(self) -> int:
        return 2 if self.overlap else 1

    @property
    def state_width(self) -> int:
        return 2 * self.num_series * self.head_dim

    def state_rows(self, x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """x [T, d], phase [T] = position % ratio -> state rows [T, state_width] fp32."""
        T, s, d = x.shape[0], self.num_series, self.head_dim
        kv = self.kv_proj(x).float().view(T, s, d)
        bias = self.position_bias.index_select(0, phase)
        gate = (self.gate_proj(x) + bias).float().view(T, s, d)
        return torch.cat([kv, gate], dim=-1).view(T, 2 * s * d)

    def forward(self, x: torch.Tensor, step: V4Step, state_name: str, out_name: str,
                rope: RotaryTable) -> None:
        """Write this step's state rows and every entry completing in the step."""
        if step.static:     # a decode batch on the capturable path (v4_static.py)
            return step.compress(self, x, state_name, out_name, rope)
        rows = self.state_rows(x, step.position_phase(self.ratio))           # [T, C]
        step.write_window_rows(state_name, rows)
        plan = step.compress_plan(self.ratio, self.overlap)
        if plan.num_entries == 0:
            return
        src = step.gather_state(state_name, rows, plan, self.num_series)     # [N, L, 2D]
        pooled = self.pool(src, plan.valid)                                   # [N, D]
        cis = step.entry_cis(rope, self.ratio, self.overlap)
        step.write_entries(out_name, plan, rotate(pooled, cis))

    def pool(self, src: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """src [N, L, 2D] half-rows [kv | gate], valid [N, L, 1] (None: all) -> entries
        [N, D] fp32: per-channel softmax of the gates over L weights the kv values."""
        d = self.head_dim
        kv, gate = src[..., :d], src[..., d:]
        if valid is not None:   # positions before 0 (CSA entry 0): weight 0, may hold anything
            kv = torch.where(valid, kv, 0.0)
            gate = torch.where(valid, gate, float("-inf"))
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
        return self.kv_norm(pooled)
