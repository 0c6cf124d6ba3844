"""The fused experts op's two schedules (csrc/moe_by_expert.h): whole experts per thread
against every expert's columns split between the threads give the same outputs bit for bit
(each token's sum in the same order) at one and two threads, on the shapes of
tests/kernels/test_moe_kernel.py and on a routing that makes rows finish out of their order;
the op's own choice equals both; bad schedules are clear errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wideserve.kernels import loader
from wideserve.kernels import moe as moe_op

from test_moe_kernel import CASES, _routing, _weights


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    return loader.build()        # a compiler error fails every test here, never a skip


def _threads(n: int):
    class Threads:
        def __enter__(self) -> None:
            self.before = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc: object) -> None:
            torch.set_num_threads(self.before)
    return Threads()


def _inputs(case: str) -> tuple:
    E, k, d, I, T, limit, kind = CASES[case]
    w1, w2 = (t.bfloat16() for t in _weights(E, d, I, seed=E + d))
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, E, k, kind, seed=T + k)
    return (x, ids, w.bfloat16(), *moe_op.pack_experts(w1, w2), I, limit)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_expert_schedule_equals_column_schedule(case: str, threads: int) -> None:
    args = _inputs(case)
    with _threads(threads):
        columns = moe_op.fused_experts(*args, schedule="columns")
        if not moe_op.fast_path_compiled():   # no micro-kernel here: the schedule is refused
            with pytest.raises(RuntimeError, match="micro-kernel"):
                moe_op.fused_experts(*args, schedule="experts")
            return
        experts = moe_op.fused_experts(*args, schedule="experts")
        chosen = moe_op.fused_experts(*args)
    assert torch.equal(experts, columns)
    assert torch.equal(chosen, columns)


def test_rows_finished_out_of_order_are_added_in_order() -> None:
    """Every token picks experts 0, 1 and one of 30 small ones, with weights 1, -1, 1. Experts
    0 and 1 are the same matrices with outputs ~1e6 times the others': in the sorted order
    their rows cancel exactly and the third row's value comes through; added before them (out
    of order), it would be lost in the rounding of ~1e6. Experts 0 and 1 hold 2 x 96 rows, the
    small ones 3-4 each: the thread that takes expert 0 takes expert 1 next, the other
    finishes the small experts long before, and their rows wait to be added after expert 1's."""
    E, T, d, I = 32, 96, 64, 160
    w1, w2 = _weights(E, d, I, seed=3)
    w1[1], w2[0] = w1[0], w2[0] * 1e6
    w2[1] = w2[0]
    packed = moe_op.pack_experts(w1.bfloat16(), w2.bfloat16())
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(4)).bfloat16()
    ids = torch.stack([torch.zeros(T, dtype=torch.int64), torch.ones(T, dtype=torch.int64),
                       2 + torch.arange(T) % (E - 2)], 1)
    w = torch.tensor([1.0, -1.0, 1.0]).repeat(T, 1).bfloat16()
    small = moe_op.fused_experts(x, ids[:, 2:], w[:, 2:], *packed, I, None, schedule="columns")
    with _threads(2):
        columns = moe_op.fused_experts(x, ids, w, *packed, I, None, schedule="columns")
        assert torch.equal(columns, small)    # the big rows cancel exactly in this order
        if not moe_op.fast_path_compiled():
            pytest.raises(RuntimeError, moe_op.fused_experts, x, ids, w, *packed, I, None,
                          schedule="experts")
            return
        for _ in range(5):
            got = moe_op.fused_experts(x, ids, w, *packed, I, None, schedule="experts")
            assert torch.equal(got, columns)


def test_bad_schedule_is_a_clear_error() -> None:
    x, ids, w, w13, w2, I, limit = _inputs("half-empty")
    with pytest.raises(RuntimeError, match="schedule must be 'columns', 'experts' or None"):
        moe_op.fused_experts(x, ids, w, w13, w2, I, limit, schedule="rows")
    with pytest.raises(RuntimeError, match="micro-kernel"):   # experts at brgemm's threshold
        moe_op.fused_experts(x, ids, w, w13, w2, I, limit, brgemm_min_rows=1,
                             schedule="experts")
    with pytest.raises(RuntimeError, match="micro-kernel"):
        moe_op.fused_experts(x, ids, w, w13, w2, I, limit, portable=True, schedule="experts")
    f13, f2 = moe_op.pack_experts(*(t.float() for t in _weights(8, 32, 48, seed=40)))
    with pytest.raises(RuntimeError, match="bf16 inputs only"):
        moe_op.fused_experts(x.float(), ids, w.float(), f13, f2, I, limit, schedule="experts")
