"""The DeepSeek-V4 lightning indexer's fused CPU op (`csrc/v4_indexer.cpp`).

One call scores every visible indexer key of every token in place in the paged cache and
returns each token's top-k entries: no gathered copy of the keys, no [T, H, entries] score
tensor, no sort of all entries (docs/deepseek_v4.md, "Lightning indexer"; docs/cpu_kernels.md).
The readable torch path it replaces is `v4_batched.select`'s bucket loop, its oracle.
"""
from __future__ import annotations

import torch

from wideserve.kernels.loader import cpu_ops_available

Q_DTYPES = (torch.bfloat16, torch.float32)


def supports(q_dtype: torch.dtype, cache: torch.Tensor) -> bool:
    """Whether the op runs here for this q dtype and cache: a CPU cache of bf16/fp32 values
    (packed quantised records are not read by it), bf16 q only with a bf16 cache, and the
    extension built."""
    return (cache.device.type == "cpu" and q_dtype in Q_DTYPES and cache.dtype in Q_DTYPES
            and (q_dtype == torch.float32 or cache.dtype == torch.bfloat16)
            and cpu_ops_available())


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                 table: torch.Tensor, token_rows: torch.Tensor, visible: torch.Tensor,
                 entries_per_block: int, k: int, portable: bool = False) -> torch.Tensor:
    """q [T, H, D]; weights [T, H] fp32 (every scale folded in); cache [slots, D]; table
    [rows, blocks] int64; token_rows, visible [T] int64 -> picks [T, k] int64.

    Token t sees entries 0..visible[t]-1 of table row token_rows[t] (entry e at slot
    table[row, e // epb] * epb + e % epb); score(t, e) = sum_h weights[t, h] *
    relu(q[t, h] . cache[slot]) in fp32; picks[t] are the k best by (score descending, entry
    ascending), -1 past the visible ones. `portable` forces the plain C++ loops."""
    return torch.ops.wideserve.v4_indexer_topk(
        q.contiguous(), weights.float().contiguous(), cache, table.contiguous(),
        token_rows.contiguous(), visible.contiguous(), entries_per_block, k, portable)
