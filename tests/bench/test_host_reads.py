"""benchmarks/host_reads.py's HostReadCounter: it counts each host-read entry point, splits
reads inside a wrapped forward from the rest, and leaves torch.Tensor as it found it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("host_reads", ROOT / "benchmarks/host_reads.py")
host_reads = importlib.util.module_from_spec(spec)
sys.modules["host_reads"] = host_reads
spec.loader.exec_module(host_reads)


class Reader(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:                    # __bool__
            x = x * int(x[0])              # __int__
        return x[x.nonzero()[0]] + x.max().item()


def test_counts_inside_and_outside_the_forward() -> None:
    before = {name: getattr(torch.Tensor, name) for name in host_reads.READS}
    m, x = Reader(), torch.tensor([2, 0, 3])
    with host_reads.HostReadCounter() as c:
        c.wrap_forward(m)
        m(x)
        x.tolist()
        np.asarray(x)
        x.cpu().numpy()
    assert c.inside == {"__bool__": 1, "__int__": 1, "nonzero": 1, "item": 1}
    assert c.total == {**c.inside, "tolist": 1, "__array__": 1, "cpu": 1, "numpy": 1}
    assert {name: getattr(torch.Tensor, name) for name in host_reads.READS} == before
