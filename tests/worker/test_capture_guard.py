"""CaptureGuard (worker/capture_guard.py): each kind of forward a CUDA graph cannot record
raises with its reason; the allowed forms pass and are traced. What it proves about the GQA
models is in tests/models/test_cuda_decode_path.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from wideserve.parallel.eplb.replicas import count_rows
from wideserve.worker.capture_guard import CaptureGuard, CaptureViolation


def _x() -> torch.Tensor:
    return torch.arange(6, dtype=torch.int64)


SYNC, SHAPE, HOST = "reads a device value", "depends on the data", "built during the forward"
VIOLATIONS = {  # name: (what the forward does, what the guard must say)
    "item": (lambda x: x.sum().item(), SYNC),
    "int": (lambda x: int(x[0]), SYNC),
    "bool": (lambda x: bool(x.any()), SYNC),
    "tolist": (lambda x: x.tolist(), SYNC),
    "numpy": (lambda x: x.numpy(), SYNC),
    "nonzero": (lambda x: torch.nonzero(x), SHAPE),
    "mask-index": (lambda x: x[x > 2], "boolean mask"),
    "mask-put": (lambda x: x.clone().index_put_((x > 2,), torch.zeros((), dtype=x.dtype)), "boolean mask"),
    "masked_select": (lambda x: torch.masked_select(x, x > 2), SHAPE),
    "unique": (lambda x: torch.unique(x), SHAPE),
    "bincount": (lambda x: torch.bincount(x, minlength=8), SHAPE),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x, x), "output_size"),
    "from_numpy": (lambda x: x + torch.from_numpy(np.arange(6)), HOST),
    "list": (lambda x: x + torch.tensor([1, 2, 3, 4, 5, 6]), HOST),
    "cpu-only op": (lambda x: torch.ops.wideserve.rms_norm(x.float()[None], None, 1e-6),
                    "CPU-only"),
}
ALLOWED = {
    "arith": lambda x: (x * 2 + torch.arange(6)).cumsum(0),
    "repeat_interleave with output_size": lambda x: torch.repeat_interleave(x, x, output_size=15),
    "count_rows": lambda x: count_rows(x % 3, 4),
    "int index": lambda x: x[x % 2],
    "where/masked_fill": lambda x: torch.where(x > 2, x, 0).masked_fill(x < 1, 5),
}


@pytest.fixture(scope="module")
def guard() -> CaptureGuard:
    from wideserve.kernels.loader import build
    build()                        # the CPU-only op must exist (a build failure fails here)
    return CaptureGuard()


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_guard_rejects(name, guard) -> None:
    fn, says = VIOLATIONS[name]
    x = _x()
    guard.allow([x])
    with pytest.raises(CaptureViolation, match=says), guard:
        fn(x)


def test_guard_allows_and_traces(guard) -> None:
    x = _x()
    guard.allow([x])
    for name, fn in ALLOWED.items():
        with guard:
            fn(x)
        assert guard.trace, name
    assert torch.equal(count_rows(torch.tensor([2, 0, 2, 3]), 5), torch.tensor([1, 0, 2, 1, 0]))


def test_guard_refuses_host_tables_when_asked() -> None:
    """host_tables=False (GuardedCapturer's): a read of a HostResident module's table (the
    Engram host table, even through a byte view) is a violation; the same forward passes a
    default guard, and rows staged into an ordinary buffer pass both."""
    from wideserve.layers.engram import HostTable
    table = HostTable(8, 4)
    table.huge_pages = False
    table.weight.data.copy_(torch.arange(32, dtype=torch.float32).view(8, 4))
    ids = torch.tensor([[1, 5], [0, 7]])
    staged = table.gather(ids).clone()
    with CaptureGuard():
        table.gather(ids)
    guard = CaptureGuard(host_tables=False)
    with pytest.raises(CaptureViolation, match="host-resident table"):
        with guard:
            table.gather(ids)
    with pytest.raises(CaptureViolation, match="host-resident table"):
        with guard:
            table.weight.view(torch.uint8).index_select(0, ids.reshape(-1))
    with guard:
        staged.flatten(-2) * 2
