"""DeepSeek-V4/V4.1 attention rows in a layout-independent order (`csrc/v4_attend.cpp`), the
kernel of --batch-invariant's V4 attention (docs/cpu_kernels.md, "Batch invariance").

A query's result depends on the keys it may read and their order (window positions
ascending, the sink, entries ascending, its own picks), not on the columns its block lays
them out at: so prefill runs blocks of many queries and still gives each query the bits of
a decode step or a one-query block. The readable torch form (whose batched products round by
layout) is layers/attention/v4_batched.py `_softmax_attend`.
"""
from __future__ import annotations

import torch

from wideserve.kernels.loader import cpu_ops_available

DTYPES = (torch.bfloat16, torch.float32)


def supports(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the op runs for these inputs: CPU tensors of one dtype in DTYPES, the extension
    built."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and keys.dtype == q.dtype
            and cpu_ops_available())


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def attend_rows(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                scale: float, sink_slot: int,
                own: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [C, Q*H, D], keys = values [C, N, D], bias [C, Q, N] (0 / -inf: which columns a query
    reads), sinks [H], own: each query's picked entries [C, Q, k, D] and whether each was
    picked [C, Q, k] -> [C, Q, H, D] in q's dtype. Scores q.k rounded to q's dtype, then
    * scale + bias in fp32; column `sink_slot` scores the head's sink and adds no value."""
    rows, chosen = own if own is not None else (None, None)
    return torch.ops.wideserve.v4_attend_rows(q, keys, bias.float(), sinks.float(), scale,
                                              sink_slot, rows, chosen)
