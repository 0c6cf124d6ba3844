"""Lossless 12-bit expert weights (kernels/lossless.py, csrc/moe_lossless.h): the coding gives
back every bf16 bit pattern, and the coded fused op equals the bf16 op with brgemm for every
expert bit for bit - decode-sized experts (AMX tiles decoding step by step), prefill-sized
ones (a group decoded once, then AMX tiles over it), exceptions, EPLB's map and counters, the
weight-streaming helper reading the coded bytes."""
from __future__ import annotations

import logging

import pytest
import torch

from wideserve.kernels import lossless
from wideserve.kernels import moe as moe_op
from wideserve.kernels import weight_stream
from wideserve.kernels.choice import KernelChoice, KernelPolicy
from wideserve.kernels.loader import cpu_ops_available

runs = pytest.mark.skipif(not (cpu_ops_available() and lossless.available()),
                          reason="the coded op needs AMX-BF16 and the AVX512-BF16 build")


def _weights(E: int, inter: int, d: int, seed: int, spiky: bool = True):
    g = torch.Generator().manual_seed(seed)
    w1 = (torch.randn(E, 2 * inter, d, generator=g) * 0.02).bfloat16()
    w2 = (torch.randn(E, d, inter, generator=g) * 0.02).bfloat16()
    if spiky:       # high bytes outside the table's 15: tiny, huge, negative zero, subnormal
        w1.view(-1)[::97] = 1e-30
        w2.view(-1)[::89] = -3e4
        w1.view(-1)[5::211] = -0.0
        w2.view(-1)[7::113] = 1e-39
    return w1, w2


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("seed", [0, 1])
def test_coding_is_exact(seed: int) -> None:
    w13, w2 = moe_op.pack_experts(*_weights(3, 48, 64, seed))
    coded = lossless.encode_experts(w13, w2)
    assert torch.equal(_bits(lossless.decode(coded.w13, w13.shape)), _bits(w13))
    assert torch.equal(_bits(lossless.decode(coded.w2, w2.shape)), _bits(w2))
    assert coded.w13.exceptions.numel() > 0 and coded.w2.exceptions.numel() > 0
    # 3/4 of the bytes plus the exceptions and the per-group starts
    assert coded.nbytes < 0.78 * (w13.nbytes + w2.nbytes)


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU ops are not built")
@pytest.mark.parametrize("fill", ["spiky", "zeros", "plain"])
def test_encode_op_writes_the_reference_bytes(fill: str) -> None:
    """The C++ encoder (csrc/lossless_encode.cpp) against the torch reference, byte for
    byte: escapes, a stack with fewer than 15 distinct high bytes (ties in the table)."""
    w1, w2 = _weights(5, 48, 64, seed=4, spiky=fill == "spiky")
    if fill == "zeros":
        w1.zero_()
        w2.view(-1)[::3] = 1.0
    for packed in moe_op.pack_experts(w1, w2):
        got, want = lossless.encode(packed), lossless.encode_reference(packed)
        for a, b in zip(got.args(), want.args()):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert torch.equal(_bits(lossless.decode(got, packed.shape)), _bits(packed))


@pytest.mark.parametrize("steps", [1, 2, 5, 6, 12, 32])
def test_steps_are_stored_as_two_runs(steps: int) -> None:
    """A group's tile steps lie in two runs (even steps, then odd ones): a permutation of the
    slots, each run in order, the same slot the C++ decoder computes for the coded bytes."""
    slots = lossless.step_slots(steps).tolist()
    assert sorted(slots) == list(range(steps))
    assert [slots[s] for s in range(0, steps, 2)] == list(range((steps + 1) // 2))
    assert [slots[s] for s in range(1, steps, 2)] == list(range((steps + 1) // 2, steps))
    # the coded bytes of a group hold step s at slots[s]: values of one high byte, no escapes
    g = torch.Generator().manual_seed(steps)
    w1 = (torch.rand(1, 64, 32 * steps, generator=g) * 0.5 + 0.5).bfloat16()
    packed = moe_op.pack_experts(w1, torch.ones(1, 32 * steps, 32, dtype=torch.bfloat16))[0]
    coded = lossless.encode(packed)
    assert coded.exceptions.numel() == 0
    one_step = torch.Size([1, 1, 16, *packed.shape[3:]])
    by_slot = coded.data[0, 0].view(steps, -1)
    for s in range(steps):
        alone = lossless.CodedMatrix(by_slot[slots[s]].reshape(1, 1, -1), coded.exceptions,
                                     torch.zeros(1, dtype=torch.int64), coded.table)
        want = packed[:, :1, 16 * s:16 * (s + 1)]
        assert torch.equal(_bits(lossless.decode(alone, one_step)), _bits(want))


def test_every_bit_pattern_round_trips() -> None:
    """Random bits (NaNs, infinities, all 256 high bytes): most values escape, all return."""
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(-2 ** 15, 2 ** 15, (2, 3, 16, 2, 16, 2), generator=g,
                         dtype=torch.int32).to(torch.int16)
    packed = bits.view(torch.bfloat16)
    coded = lossless.encode(packed)
    assert coded.exceptions.numel() > packed.numel() // 2
    assert torch.equal(_bits(lossless.decode(coded, packed.shape)), bits)


def test_encode_refuses_what_it_cannot_code() -> None:
    with pytest.raises(ValueError, match="packed bf16"):
        lossless.encode(torch.zeros(2, 3, 16, 2, 16, 2))
    with pytest.raises(ValueError, match="whole chunks"):
        lossless.encode(torch.zeros(1, 1, 3, 1, 16, 2, dtype=torch.bfloat16))


def _routing(T: int, E: int, k: int, seed: int, used: int | None = None):
    g = torch.Generator().manual_seed(seed)
    pool = used or E
    ids = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(T)]) \
        if T else torch.zeros(0, k, dtype=torch.int64)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).bfloat16()
    return ids, w


@runs
@pytest.mark.parametrize("E,inter,d,T,k,used", [
    (4, 64, 64, 1, 2, None),       # decode: 1-2 rows an expert
    (8, 96, 128, 37, 3, None),     # up to 16 rows and past (step-decoded and whole-group tiles)
    (6, 32, 96, 300, 2, 2),        # >256 rows an expert (two gathered chunks); 4 experts idle
    # K of both GEMMs past one L1 chunk of tile steps (1,056 = 33 steps, 544 = 17), experts
    # of 17-31 rows past a 32-row block, and of at most 16 past one
    (3, 544, 1056, 71, 2, None),
    (2, 17, 32, 5, 1, None),       # intermediate 17: zero-padded to 32 in the packs
])
def test_op_equals_bf16_brgemm(E, inter, d, T, k, used) -> None:
    w13, w2 = moe_op.pack_experts(*_weights(E, inter, d, seed=T))
    coded = lossless.encode_experts(w13, w2)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(T)).bfloat16()
    ids, w = _routing(T, E, k, seed=T, used=used)
    for limit in (None, 0.05):
        want = moe_op.fused_experts(x, ids, w, w13, w2, inter, limit, brgemm_min_rows=1)
        got = lossless.fused_experts(x, ids, w, coded, inter, limit)
        assert torch.equal(_bits(got), _bits(want))


@runs
@pytest.mark.parametrize("threads", [1, 2])
def test_weight_streaming_posts_the_coded_bytes(threads: int) -> None:
    """With the weight-streaming helper running (kernels/weight_stream.py) every expert-major
    call posts its plan, now of the coded bytes, and the results do not change."""
    E, inter, d, T, k = 12, 64, 128, 40, 3
    coded = lossless.encode_experts(*moe_op.pack_experts(*_weights(E, inter, d, seed=9)))
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(9)).bfloat16()
    ids, w = _routing(T, E, k, seed=9)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    weight_stream.stop()
    try:
        ref = lossless.fused_experts(x, ids, w, coded, inter, None)
        weight_stream.start((), min_plan=0)
        for _ in range(3):
            assert torch.equal(_bits(lossless.fused_experts(x, ids, w, coded, inter, None)),
                               _bits(ref))
        assert weight_stream.stats().plans == 3
    finally:
        weight_stream.stop()
        torch.set_num_threads(before)


@runs
def test_expert_map_and_load_as_the_bf16_op() -> None:
    E, inter, d, T, k = 4, 64, 64, 9, 2
    w13, w2 = moe_op.pack_experts(*_weights(E, inter, d, seed=5))
    coded = lossless.encode_experts(w13, w2)
    x = torch.randn(T, d, generator=torch.Generator().manual_seed(5)).bfloat16()
    ids, w = _routing(T, E, k, seed=5)
    table = torch.tensor([[2], [0], [3], [1]])
    loads = [torch.zeros(E, dtype=torch.int64) for _ in range(2)]
    want = moe_op.fused_experts(x, ids, w, w13, w2, inter, None, expert_map=table,
                                expert_load=loads[0], brgemm_min_rows=1)
    got = lossless.fused_experts(x, ids, w, coded, inter, None, expert_map=table,
                                 expert_load=loads[1])
    assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(loads[0], loads[1]) and int(loads[1].sum()) == T * k


@runs
def test_no_rows_and_no_picks() -> None:
    E, inter, d = 2, 32, 32
    coded = lossless.encode_experts(*moe_op.pack_experts(*_weights(E, inter, d, seed=2)))
    for T, k in ((0, 2), (3, 0)):
        ids, w = _routing(T, E, k, seed=2)
        out = lossless.fused_experts(torch.ones(T, d, dtype=torch.bfloat16), ids, w, coded,
                                     inter, None)
        assert out.shape == (T, d) and not out.any()


@runs
def test_bad_inputs_are_clear_errors() -> None:
    E, inter, d = 2, 32, 64
    coded = lossless.encode_experts(*moe_op.pack_experts(*_weights(E, inter, d, seed=4)))
    ids, w = _routing(3, E, 1, seed=4)
    x = torch.randn(3, d).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        lossless.fused_experts(x.float(), ids, w, coded, inter, None)
    bad = lossless.CodedMatrix(coded.w13.data, coded.w13.exceptions,
                               coded.w13.starts + 10 ** 6, coded.w13.table)
    with pytest.raises(RuntimeError, match="starts"):
        lossless.fused_experts(x, ids, w, lossless.CodedExperts(bad, coded.w2), inter, None)
    with pytest.raises(RuntimeError, match="encode_experts"):
        lossless.fused_experts(x, ids, w, coded, 2 * inter, None)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        lossless.fused_experts(torch.randn(3, 48).bfloat16(), ids, w, coded, inter, None)
    assert lossless.fits(64, 17) and lossless.fits(32, 384)
    assert not lossless.fits(48, 64) and not lossless.fits(64, 48)
    with pytest.raises(RuntimeError, match="expert id"):
        lossless.fused_experts(x, ids + E, w, coded, inter, None)


def _experts(lossless_on: bool):
    from wideserve.layers.experts import RoutedExperts
    m = RoutedExperts(8, 64, 96).to(torch.bfloat16)
    w1, w2 = _weights(8, 96, 64, seed=6, spiky=False)
    with torch.no_grad():
        m.gate_up_proj.copy_(w1)
        m.down_proj.copy_(w2)
    m.kernel_choice = KernelChoice(KernelPolicy(force="brgemm", cache_dir=None))
    m.lossless = lossless_on
    return m


@runs
def test_layer_holds_coded_packs_and_equals_brgemm() -> None:
    """RoutedExperts with `lossless` (KernelConfig.lossless_experts) against the bf16 packs
    on brgemm; the lean decode path's function gives the same; new weights recode."""
    plain, coded = _experts(False), _experts(True)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    ids, w = _routing(11, 8, 2, seed=6)
    with torch.inference_mode():
        want = plain(x, ids, w)
        got = coded(x, ids, w)
        lean = coded.fused_op(x.device, x.dtype)(x, ids, w)
    assert torch.equal(_bits(got), _bits(want)) and torch.equal(_bits(lean), _bits(want))
    assert type(coded._coded).__name__ == "CodedPack" and coded._packs is None
    with torch.no_grad():
        coded.down_proj.mul_(2)
        plain.down_proj.mul_(2)
    with torch.inference_mode():
        assert torch.equal(_bits(coded(x, ids, w)), _bits(plain(x, ids, w)))


def test_layer_falls_back_with_one_warning(caplog, monkeypatch) -> None:
    """Where the coded op cannot run (no AMX, widths not multiples of 32), `lossless` warns
    once and the bf16 packs run."""
    monkeypatch.setattr(lossless, "available", lambda: False)
    m = _experts(True)
    with caplog.at_level(logging.WARNING, logger="wideserve.layers.experts"):
        assert not m._coded_runs(torch.bfloat16)
        assert not m._coded_runs(torch.bfloat16)
    assert sum("--lossless-experts" in r.getMessage() for r in caplog.records) == 1
    assert not m._coded_runs(torch.float32)


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ CPU ops are not built")
def test_op_says_where_it_cannot_run() -> None:
    """Off AMX (or on the AVX2 / AVX512 builds) the op is a clear error, never a crash; the
    layer never calls it there (test_layer_falls_back_with_one_warning)."""
    coded = lossless.encode_experts(*moe_op.pack_experts(*_weights(2, 32, 32, seed=8)))
    ids, w = _routing(2, 2, 1, seed=8)
    x = torch.randn(2, 32).bfloat16()
    if lossless.available():
        assert lossless.fused_experts(x, ids, w, coded, 32, None).shape == (2, 32)
    else:
        with pytest.raises(RuntimeError, match="needs a CPU with AMX-BF16"):
            lossless.fused_experts(x, ids, w, coded, 32, None)
