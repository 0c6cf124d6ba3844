"""DeepSelect top-k: exact top-k of score rows by a radix select over the float bits instead of
a sort (`csrc/deepselect.cpp`; docs/cpu_kernels.md, "DeepSelect top-k").

`topk(scores, k, lengths)` returns, per row, the k best entries ordered by (score descending,
entry ascending): the first k of a stable descending sort, so ties go to the lowest entry.
That is the order the indexer's consumers use (layers/attention/indexer.py, `index_topk`);
the set is torch.topk's (with ties, the same values). Rows may have their own lengths (entries
at or past a row's length are not considered); places past a row's entries are -1.

The C++ op runs on CPU float rows when the extension is built; `keyed_topk` is the torch path
(one int64 key per entry, unique and monotone in that order, then torch.topk), used
elsewhere and as the op's oracle in tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from wideserve.kernels.loader import cpu_ops_available, load

_INT64_MIN = -(1 << 63)


def keyed_topk(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The torch path of `topk`. Each (score, entry) pair becomes one int64 key strictly
    monotone in (score, -entry): the high 32 bits are the float's bits made order-preserving
    as a signed int (negative floats have their magnitude bits flipped; -0.0 is first turned
    into +0.0 because the stable sort ties them), the low 32 bits are (n-1-entry). Keys are
    unique, so torch.topk's unspecified tie order never matters."""
    n = scores.shape[-1]
    got = min(k, n)
    s = scores.float().contiguous() + 0.0               # -0.0 + 0.0 = +0.0 (IEEE)
    bits = s.view(torch.int32).to(torch.int64)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)                    # [..., n]
    entry = torch.arange(n, device=s.device)
    key = order * (1 << 32) + ((n - 1) - entry)
    if lengths is not None:
        key = key.masked_fill(entry >= lengths[..., None], _INT64_MIN)
    picks = torch.topk(key, got, dim=-1).indices
    if lengths is not None:
        picks = picks.masked_fill(entry[:got] >= lengths[..., None], -1)
    return F.pad(picks, (0, k - got), value=-1)


def runs_here(scores: torch.Tensor) -> bool:
    """Whether the C++ op serves these scores (CPU, extension built)."""
    return scores.device.type == "cpu" and cpu_ops_available()


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def select(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None,
           portable: bool = False) -> torch.Tensor:
    """The C++ op on scores [..., n] (any float dtype; compared in fp32, exact for bf16 and
    fp16), lengths [...] or None -> picks [..., k] int64. `portable` forces the plain C++
    passes (the AVX512 ones otherwise, where compiled)."""
    load()                                           # once per process; raises if unbuilt
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, n).float().contiguous()
    lens = None if lengths is None else lengths.reshape(-1).to(torch.int64).contiguous()
    picks = torch.ops.wideserve.deepselect_topk(rows, k, lens, portable)
    return picks.view(*lead, k)


def topk(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The k best entries of each row, (score descending, entry ascending), -1 past a row's
    entries: the C++ op where it runs, else `keyed_topk`."""
    if k < 0:
        raise ValueError(f"top-k needs k >= 0, got {k}")
    if runs_here(scores):
        return select(scores, k, lengths)
    return keyed_topk(scores, k, lengths)
