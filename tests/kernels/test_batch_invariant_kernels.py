"""--batch-invariant at the kernel level: which GEMM kernels give a row the same bits whatever
rows share its call (checked over M = 1..300 and over the row's position), that the mode
plans one of those for every token bucket, and that greedy argmax breaks ties one way."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from wideserve.kernels import gemm
from wideserve.kernels import moe as moe_op
from wideserve.kernels.choice import (BUCKETS, INVARIANT_KERNELS, KernelChoice, KernelPolicy,
                                      brgemm_runs, prepack, packed_linear)
from wideserve.kernels.loader import cpu_ops_available
from wideserve.layers.experts import RoutedExperts
from wideserve.layers.linear import (FunctionalLinear, InvariantLinear, WeightPack,
                                     use_invariant_linears)
from wideserve.worker.sampler import argmax_rows

needs_ops = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU ops not built")
SHAPES = ((1000, 512), (256, 256), (40, 72))      # N not a multiple of 16 and K of 32 too
ROWS = 300


def _variant_rows(fn, x: torch.Tensor) -> list[int]:
    """Row counts M at which fn(x[:M]) differs bitwise from the first M rows of fn(x), and
    positions i at which row i alone differs from row i of fn(x) (as -i - 1). fn(x, lo):
    rows lo.. of the input."""
    call = fn if fn.__code__.co_argcount == 2 else (lambda a, lo: fn(a))
    full = call(x, 0)
    bad = [m for m in range(1, x.shape[0] + 1) if not torch.equal(call(x[:m], 0), full[:m])]
    return bad + [-i - 1 for i in range(0, x.shape[0], 13)
                  if not torch.equal(call(x[i:i + 1], i), full[i:i + 1])]


def _kernels(w: torch.Tensor) -> dict:
    n = w.shape[0]
    panel = gemm.pack_linear(w)
    fns = {"micro": lambda x: torch.ops.wideserve.gemm_linear(x, panel, n, None, False, False)}
    if w.dtype == torch.bfloat16 and brgemm_runs():
        fns["brgemm"] = lambda x: torch.ops.wideserve.gemm_linear_brgemm(x, panel, n, None,
                                                                          False)
    return fns


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_invariant_kernels_give_every_row_the_same_bits_for_any_row_count(shape, dtype):
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(*shape, generator=g) * 0.05).to(dtype)
    x = torch.randn(ROWS, shape[1], generator=g).to(dtype)
    for name, fn in _kernels(w).items():
        assert name in INVARIANT_KERNELS
        assert _variant_rows(fn, x) == [], name


@needs_ops
def test_onednn_and_mkl_are_not_row_invariant_so_the_mode_excludes_them():
    # Why the mode's candidates are only micro and brgemm: MKL's fp32 GEMM and oneDNN's bf16
    # GEMM round some rows differently with the row count. Where depends on the CPU: oneDNN's
    # bf16 GEMM varied at K = 512 on the AMX Xeon, but only at K = 4,096 on a Zen 4.
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 512, generator=g) * 0.05
    x = torch.randn(ROWS, 512, generator=g)
    assert _variant_rows(lambda a: F.linear(a, w), x) != []
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        w4 = torch.randn(1000, 4096, generator=g) * 0.05
        x4 = torch.randn(ROWS, 4096, generator=g)
        def onednn(wk: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
            packed = prepack(wk.bfloat16())
            return lambda a: packed_linear(a, packed)
        assert any(_variant_rows(onednn(wk), xk.bfloat16()) for wk, xk in ((w, x), (w4, x4)))
    assert "onednn" not in INVARIANT_KERNELS and "torch" not in INVARIANT_KERNELS


def _mixed_timer(family, kernels, shape, rows):
    """Injected timings: micro fastest up to 16 rows, brgemm (or torch) above."""
    fast = "micro" if rows <= 16 else ("brgemm" if "brgemm" in kernels else "torch")
    return {k: (1.0 if k == fast else 2.0) for k in kernels}


@needs_ops
def test_the_mode_plans_one_invariant_kernel_for_every_bucket():
    choice = KernelChoice(KernelPolicy(force="auto", cache_dir=None), timer=_mixed_timer)
    default = choice.plan("linear", 256, 256, torch.bfloat16)
    assert len(set(default)) > 1                        # the default mixes kernels by bucket
    plan = choice.plan("linear", 256, 256, torch.bfloat16, invariant=True)
    assert len(plan) == len(BUCKETS) and len(set(plan)) == 1 and plan[0] in INVARIANT_KERNELS
    forced = KernelChoice(KernelPolicy(force="onednn", cache_dir=None), timer=_mixed_timer)
    assert forced.plan("linear", 256, 256, torch.bfloat16, invariant=True)[0] \
        in INVARIANT_KERNELS                            # a variant kernel is never forced in


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_pack_and_functional_linears_are_row_invariant_in_the_mode(dtype):
    choice = KernelChoice(KernelPolicy(force="auto", cache_dir=None), timer=_mixed_timer)
    g = torch.Generator().manual_seed(2)
    # fp32 runs the micro-kernel's scalar-width loop: a narrower weight keeps it to seconds
    n = 1000 if dtype == torch.bfloat16 else 200
    w = (torch.randn(n, 512, generator=g) * 0.05).to(dtype)
    x = torch.randn(ROWS, 512, generator=g).to(dtype)
    pack = WeightPack(choice, batch_invariant=True)
    assert _variant_rows(lambda a: pack.linear(a, (w,)), x) == []
    default = WeightPack(choice)
    if dtype == torch.bfloat16 and brgemm_runs():
        # the default's plan switches kernel at 17 rows: those rows round differently where
        # brgemm's sums round unlike the micro-kernel's (AMX); where they are the same
        # (brgemm on AVX512-BF16 dot products, a Zen 4) the default is row-invariant too
        fns = _kernels(w)
        same = torch.equal(fns["micro"](x), fns["brgemm"](x))
        assert (_variant_rows(lambda a: default.linear(a, (w,)), x) == []) == same
    # A model's plain nn.Linear, made invariant at load (CausalLM.apply_kernel_config)
    lin = torch.nn.Linear(512, n, bias=False, dtype=dtype)
    lin.weight.data = w
    use_invariant_linears(lin, True, choice)
    assert type(lin) is InvariantLinear and lin.weight is not None
    site = FunctionalLinear(choice)                # a functional F.linear site
    site.batch_invariant = True
    full = pack.linear(x, (w,))                      # row-invariant (above): any M agrees
    with torch.no_grad():
        for m in (1, 5, 17, ROWS):
            assert torch.equal(lin(x[:m]), full[:m]) and torch.equal(site(x[:m], w), full[:m])
    use_invariant_linears(lin, False)              # and back: the plain module
    assert type(lin) is torch.nn.Linear and not hasattr(lin, "_pack")


@needs_ops
def test_experts_give_a_token_the_same_bits_alone_and_in_any_batch():
    choice = KernelChoice(KernelPolicy(force="auto", cache_dir=None), timer=_mixed_timer)
    g = torch.Generator().manual_seed(3)
    experts = RoutedExperts(8, 256, 128)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05, generator=g)
        experts.down_proj.normal_(0, 0.05, generator=g)
    experts = experts.bfloat16()
    experts.kernel_choice = choice
    x = torch.randn(ROWS, 256, generator=g).bfloat16()
    ids = torch.stack([torch.zeros(ROWS, dtype=torch.int64),          # expert 0: every row
                       torch.randint(1, 8, (ROWS,), generator=g)], dim=1)
    wts = torch.rand(ROWS, 2, generator=g).bfloat16()
    def run(a: torch.Tensor, lo: int) -> torch.Tensor:
        return experts(a, ids[lo:lo + a.shape[0]], wts[lo:lo + a.shape[0]])

    experts.batch_invariant = True
    with torch.no_grad():
        assert _variant_rows(run, x) == []
        if brgemm_runs():
            experts.batch_invariant = False          # brgemm from 17 rows of an expert
            w13, w2, inter = experts._fused_pack()
            micro, big = (moe_op.fused_experts(x, ids, wts, w13, w2, inter, None,
                                               brgemm_min_rows=rows) for rows in (None, 1))
            # varies with the batch exactly where brgemm rounds unlike the micro-kernel
            assert (_variant_rows(run, x) == []) == torch.equal(micro, big)


def test_greedy_argmax_breaks_ties_at_the_first_index_on_every_path():
    x = torch.zeros(5, 300)
    x[:, [7, 42, 299]] = 3.0
    x[3, 1] = 3.0
    want = torch.tensor([7, 7, 7, 1, 7])
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(argmax_rows(x, cpu_op=False), want)
    assert torch.equal(argmax_rows(x[3:4]), want[3:4])       # alone or in a batch


@needs_ops
def test_a_widened_parameter_is_packed_once_and_again_after_an_update(monkeypatch):
    # mHC's x @ fn.float()^T on a bf16 parameter: a new fp32 tensor per call, which the
    # mode once packed again on every call of every step (issue 27's V4.1 cost).
    choice = KernelChoice(KernelPolicy(force="auto", cache_dir=None), timer=_mixed_timer)
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter((torch.randn(24, 64, generator=g) * 0.05).bfloat16(),
                           requires_grad=False)
    x = torch.randn(5, 64, generator=g)
    packs = []
    real = gemm.pack_linear
    monkeypatch.setattr(gemm, "pack_linear", lambda w: packs.append(w.shape) or real(w))
    site = FunctionalLinear(choice)
    site.batch_invariant = True
    with torch.no_grad():
        first = site(x, p, widen_weight=True)
        assert torch.equal(site(x, p, widen_weight=True), first) and len(packs) == 1
        p.mul_(2)                                     # an in-place update: packed again
        again = site(x, p, widen_weight=True)
        assert len(packs) == 2
    with torch.no_grad():
        ref = WeightPack(choice, batch_invariant=True).linear(x, (p.float(),))
    assert torch.equal(again, ref)                    # the updated weight's values


def _fma_chain(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The fp32 micro-kernel's reduction, op by op: acc = fma(x[:, k], w[:, k], acc) for
    k = 0..K-1 from 0, then + bias. fp32 * fp32 is exact in fp64 and the one addition is
    rounded to fp32 once more (a double rounding that only a tie 2^-29 apart could tell)."""
    xd, wd = x.double(), w.double()
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (xd[:, k, None] * wd[None, :, k] + acc.double()).float()
    return acc if bias is None else acc + bias


@needs_ops
@pytest.mark.parametrize("portable", [False, True], ids=["avx512", "portable"])
@pytest.mark.parametrize("m,n,k", [(0, 24, 64), (1, 8, 256), (37, 40, 72), (300, 200, 33),
                                   (97, 4096 + 7, 16)])
def test_the_fp32_micro_kernel_is_one_fma_chain_per_output(m, n, k, portable):
    # The mode's fp32 linears (mHC mixes, V4 routers, V4.1's compressor, DSpark's head) run
    # here: every output one fused multiply-add chain over K in order, the same bits on the
    # AVX-512 and the portable loop and at any M or place in the call. N not a multiple of
    # 16, K odd, M = 0, 1, odd and past a register tile and a 96-row chunk.
    g = torch.Generator().manual_seed(m * 7 + n)
    w = torch.randn(n, k, generator=g) * 0.1
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    packed = gemm.pack_linear(w)
    for b in (None, bias):
        got = torch.ops.wideserve.gemm_linear(x, packed, n, b, False, portable)
        assert got.shape == (m, n) and got.dtype == torch.float32
        assert torch.equal(got, _fma_chain(x, w, b))
    if m > 1:
        full = torch.ops.wideserve.gemm_linear(x, packed, n, None, False, portable)
        for lo, hi in ((0, 1), (m - 1, m), (1, m), (m // 2, m // 2 + 5)):
            assert torch.equal(torch.ops.wideserve.gemm_linear(x[lo:hi], packed, n, None,
                                                               False, portable), full[lo:hi])


def _attend_case(g, C, Q, H, D, N, k, dtype, sink_slot):
    q = torch.randn(C, Q * H, D, generator=g).to(dtype)
    keys = torch.randn(C, N, D, generator=g).to(dtype)
    keys[:, sink_slot] = 0                  # the sink's key: a zero row, as V4Step lays it
    bias = torch.where(torch.rand(C, Q, 1, N, generator=g) < 0.6, 0.0, float("-inf"))
    sinks = torch.randn(H, generator=g)
    own = None
    if k:
        own = (torch.randn(C, Q, k, D, generator=g).to(dtype),
               torch.rand(C, Q, k, generator=g) < 0.7)
    return q, keys, bias, sinks, D ** -0.5, sink_slot, own


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("C,Q,H,D,N,k", [(0, 32, 4, 64, 20, 0), (1, 1, 1, 16, 1, 0),
                                         (3, 1, 4, 64, 81, 0), (5, 32, 4, 64, 111, 0),
                                         (2, 7, 3, 40, 37, 5), (4, 32, 2, 512, 60, 16)])
def test_the_invariant_v4_attention_op_matches_the_torch_form(C, Q, H, D, N, k, dtype):
    # kernels/v4_attend.py against layers/attention/v4_batched.py's _softmax_attend (which
    # rounds by layout): the same maths up to the order of the sums. D not a multiple of 16
    # (the portable dot), M = C * Q = 0, 1, odd, large; picks (`own`) for Q > 1.
    from wideserve.kernels import v4_attend
    from wideserve.layers.attention.v4_batched import _softmax_attend
    g = torch.Generator().manual_seed(C * 100 + N)
    q, keys, bias, sinks, scale, slot, own = _attend_case(g, C, Q, H, D, N, k, dtype, N // 2)
    got = v4_attend.attend_rows(q, keys, bias[:, :, 0], sinks, scale, slot, own)
    want = _softmax_attend(q, keys, bias, sinks, scale, slot, own)
    assert got.shape == want.shape == (C, Q, H, D) and got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_invariant_v4_attention_op_does_not_depend_on_the_key_layout(dtype):
    # One query's readable keys (window, sink, entries, picks) laid out as a decode step, a
    # one-query block and slot 13 of a 32-query block do: other columns between them
    # (masked, holding NaN or other keys), the sink at another column, other queries beside
    # it. Its output bits must be the same in all three.
    g = torch.Generator().manual_seed(9)
    H, D, n_read, k = 4, 64, 23, 6
    q1 = torch.randn(H, D, generator=g).to(dtype)
    read = torch.randn(n_read, D, generator=g).to(dtype)
    picks = torch.randn(k, D, generator=g).to(dtype)
    chosen = torch.rand(k, generator=g) < 0.6
    sinks = torch.randn(H, generator=g)
    from wideserve.kernels import v4_attend

    def layout(N, Q, slot_q, sink_slot, where):
        # where: the columns the readable keys go to (ascending), the sink at sink_slot
        qb = torch.randn(1, Q, H, D, generator=g).to(dtype)
        qb[0, slot_q] = q1
        keys = torch.full((1, N, D), float("nan"), dtype=dtype)
        keys[0, torch.randperm(N, generator=g)[:N // 3]] = torch.randn(N // 3, D,
                                                                       generator=g).to(dtype)
        bias = torch.full((1, Q, N), float("-inf"))
        bias[:, [i for i in range(Q) if i != slot_q]] = 0.0     # others read every column
        keys[0, where] = read
        keys[0, sink_slot] = 0
        bias[0, slot_q, where] = 0.0
        own = (torch.randn(1, Q, k, D, generator=g).to(dtype),
               torch.ones(1, Q, k, dtype=torch.bool))
        own[0][0, slot_q], own[1][0, slot_q] = picks, chosen
        out = v4_attend.attend_rows(qb.flatten(1, 2), keys, bias, sinks,
                                    D ** -0.5, sink_slot, own)
        return out[0, slot_q]

    # n_read - 8 window keys, the sink, 8 entries; then the picks
    decode = layout(70, 1, 0, n_read - 8, [i if i < n_read - 8 else i + 1 for i in
                                           range(n_read)])
    one = layout(90, 1, 0, 50, [2 * i for i in range(n_read - 8)] + [60 + i for i in range(8)])
    block = layout(120, 32, 13, 57, [i + 30 for i in range(n_read - 8)] + [90 + 3 * i
                                                                          for i in range(8)])
    assert decode.isfinite().all() and torch.equal(decode, one) and torch.equal(one, block)
