"""The routed experts' derived weight copies (layers/experts.py): each prepared for one
implementation and tagged with the fingerprint of the weights it was made from, so that the
layer rebuilds it when they change (layers/linear.py's rule)."""
from __future__ import annotations

import dataclasses

import torch

from wideserve.kernels import lossless
from wideserve.kernels import moe as moe_op
from wideserve.kv_cache import host_memory
from wideserve.layers.linear import prepack, weights_fingerprint


class DerivedPack:
    """A copy of the expert weights prepared for one implementation, with the fingerprint of
    the sources it was made from (rebuilt when they change, layers/linear.py)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        self.key = weights_fingerprint((w1, w2))

    def current(self, w1: torch.Tensor, w2: torch.Tensor) -> bool:
        return self.key == weights_fingerprint((w1, w2))


class ExpertPacks(DerivedPack):
    """Per-expert oneDNN-packed copies of gate_up_proj and down_proj (layers/linear.py)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__(w1, w2)
        self.w1 = [prepack(w) for w in w1.detach()]
        self.w2 = [prepack(w) for w in w2.detach()]


class FusedPack(DerivedPack):
    """gate_up_proj and down_proj in the fused op's layout (wideserve/kernels/moe.py)."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__(w1, w2)
        # Every decode step streams these whole: on huge pages (kv_cache/host_memory.py).
        self.w13, self.w2 = (host_memory.on_huge_pages(w, "packed expert weights")
                             for w in moe_op.pack_experts(w1, w2))
        self.threads: tuple[int, bool] = (0, False)   # (threads, invariant) of the threshold
        self.brgemm_min_rows: int | None = None   # experts with this many rows: brgemm


class CodedPack(DerivedPack):
    """The fused op's packs coded losslessly (kernels/lossless.py); the coded bytes, which
    every decode step streams, on huge pages."""

    def __init__(self, w1: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__(w1, w2)
        coded = lossless.encode_experts(*moe_op.pack_experts(w1, w2))
        self.coded = lossless.CodedExperts(*(
            dataclasses.replace(m, data=host_memory.on_huge_pages(m.data, "coded expert weights"))
            for m in (coded.w13, coded.w2)))
