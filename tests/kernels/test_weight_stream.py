"""Weight streaming's helper thread (wideserve/kernels/csrc/weight_stream.cpp, kernels/
weight_stream.py): it starts once per process, runs at SCHED_IDLE on the CPUs it is given,
reads the ranges the fused MoE op posts, never changes the op's result, stops and restarts,
and is absent in a forked child."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from wideserve.kernels import loader
from wideserve.kernels import moe as moe_op
from wideserve.kernels import weight_stream


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    return loader.build()        # a compiler error fails every test here, never a skip


@pytest.fixture(autouse=True)
def stopped():
    weight_stream.stop()
    yield
    weight_stream.stop()


def _layer(experts: int, d: int, inter: int, tokens: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(experts, 2 * inter, d, generator=g) * 0.1).bfloat16()
    w2 = (torch.randn(experts, d, inter, generator=g) * 0.1).bfloat16()
    w13, w2p = moe_op.pack_experts(w1, w2)
    x = torch.randn(tokens, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) \
        if tokens else torch.zeros(0, k, dtype=torch.int64)
    wts = torch.rand(tokens, k, generator=g)

    def call(big: int | None = 1) -> torch.Tensor:
        return torch.ops.wideserve.moe_fused_experts(x, ids, wts, w13, w2p, inter, None, False,
                                                     None, None, big)
    return call


def test_start_stop_and_stats() -> None:
    assert weight_stream.stats().running is False
    assert weight_stream.start([os.sched_getaffinity(0).__iter__().__next__()])
    assert not weight_stream.start(())              # one helper per process
    s = weight_stream.stats()
    assert s.running and s.pinned and s.sched_idle and s.plans == 0
    weight_stream.stop()
    assert weight_stream.stats().running is False
    weight_stream.stop()                            # stopping twice is a no-op
    assert weight_stream.start(())                  # and it starts again
    s = weight_stream.stats()
    assert s.running and not s.pinned


@pytest.mark.parametrize("tokens,threads", [(0, 1), (1, 1), (5, 1), (128, 1), (128, 2),
                                            (37, 2)])
@pytest.mark.parametrize("big", [1, None])          # brgemm / micro-kernel experts
def test_results_equal_with_and_without_the_helper(tokens: int, threads: int,
                                                   big: int | None) -> None:
    call = _layer(experts=12, d=96, inter=80, tokens=tokens, k=3, seed=tokens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = call(big)
        weight_stream.start((), min_plan=0)
        for _ in range(3):
            assert torch.equal(call(big), ref)
    finally:
        torch.set_num_threads(before)
    # every call with two or more experts posted its plan (an empty batch has none)
    assert weight_stream.stats().plans == (3 if tokens else 0)


def test_helper_reads_the_posted_weights() -> None:
    # 24 experts of ~1.2 MB: calls long enough for the helper to read whole ranges ahead.
    # The normal policy: at SCHED_IDLE on a machine whose cores the other tests keep busy
    # the helper may get no time while a call runs (that is the policy's point).
    call = _layer(experts=24, d=512, inter=384, tokens=96, k=8, seed=1)
    weight_stream.start((), idle=False)
    assert not weight_stream.stats().sched_idle
    deadline = time.monotonic() + 60
    while not weight_stream.stats().bytes:
        assert time.monotonic() < deadline, "the helper read no posted range"
        call()
    s = weight_stream.stats()
    assert s.plans >= 1 and s.ranges >= 1 and s.bytes > 0


def test_a_queued_tail_is_streamed_after_the_call() -> None:
    call = _layer(experts=16, d=256, inter=128, tokens=24, k=4, seed=3)
    tail = torch.randn(8 << 20).bfloat16()    # 16 MB, more than the call's experts (~3 MB)
    weight_stream.start((), min_plan=0, idle=False)   # runs on a busy machine too
    call()
    before = weight_stream.stats()
    weight_stream.queue([tail, torch.empty(0)])           # an empty tensor is left out
    out = call()
    deadline = time.monotonic() + 30
    while weight_stream.stats().bytes - before.bytes < tail.nbytes:
        assert time.monotonic() < deadline, "the queued tail was not streamed"
        time.sleep(0.01)
    assert torch.equal(out, call())
    with pytest.raises(RuntimeError, match="contiguous CPU tensors"):
        weight_stream.queue([torch.randn(8, 8).t()])


def test_queue_without_a_helper_is_a_no_op() -> None:
    assert not weight_stream.active()
    weight_stream.queue([torch.randn(16)])
    weight_stream.start(())
    assert weight_stream.active()


def test_small_calls_are_not_posted() -> None:
    call = _layer(experts=8, d=64, inter=32, tokens=9, k=2, seed=2)   # ~100 KB of weights
    weight_stream.start(())                           # MIN_PLAN_BYTES: 4 MB
    call()
    call(None)
    assert weight_stream.stats().plans == 0


def _child_stats(q) -> None:
    q.put(tuple(torch.ops.wideserve.weight_stream_stats()))


def test_a_forked_child_has_no_helper() -> None:
    weight_stream.start(())
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_stats, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    assert got[0] == 0 and weight_stream.stats().running


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(RuntimeError, match="lead_bytes must be positive"):
        weight_stream.start((), lead=0)
    with pytest.raises(RuntimeError, match="min_plan_bytes must be >= 0"):
        weight_stream.start((), min_plan=-1)
    with pytest.raises(RuntimeError, match="out of range"):
        weight_stream.start([1 << 20])
    assert weight_stream.stats().running is False
