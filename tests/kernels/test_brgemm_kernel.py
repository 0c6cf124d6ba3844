"""The brgemm GEMM paths (wideserve/kernels/csrc/brgemm.cpp, the brgemm branches of moe.cpp and
moe_route) against fp64 oracles and the micro-kernel, on random shapes: no rows, one row, odd
row counts, several 32-row blocks, odd K, N not a multiple of 16, narrow router outputs,
empty experts and experts on both sides of the brgemm threshold. Skipped only where torch's
brgemm does not run on the CPU (its ukernel needs AVX512-BF16 / AMX), which
`brgemm_runs()` reports; the tests then check that the choice never offers it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from wideserve.kernels import choice, gemm, loader
from wideserve.kernels import moe as moe_op
from wideserve.layers.experts import swiglu


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    return loader.build()        # a compiler error fails every test here, never a skip


def _needs_brgemm() -> None:
    if not choice.brgemm_runs():
        assert "brgemm" not in choice.KernelChoice(
            choice.KernelPolicy(cache_dir=None)).runnable("linear", torch.bfloat16)
        pytest.skip("torch's bf16 brgemm does not run on this CPU")


SHAPES = {  # name: (M, K, N)
    "empty": (0, 32, 16),
    "one-row": (1, 64, 48),
    "odd": (7, 33, 21),            # odd K (zero pair), N tail inside a block
    "router": (13, 40, 8),         # one block of 16, 8 used
    "two-blocks": (45, 96, 27),    # M over one 32-row block, nb = 2
    "large": (300, 128, 130),      # many row blocks, group and block tails
}


def _data(M: int, K: int, N: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.2).bfloat16()
    b = torch.randn(N, generator=g).bfloat16()
    return x, w, b


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_brgemm_linear_matches_fp64_oracle(shape: str, bias: bool) -> None:
    _needs_brgemm()
    M, K, N = SHAPES[shape]
    x, w, b = _data(M, K, N, seed=M + N)
    b = b if bias else None
    got = gemm.linear_brgemm(x, gemm.pack_linear(w), N, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    scale = ref.abs().max().item() if ref.numel() else 1.0
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=1e-2 * max(scale, 1.0))
    # against the micro-kernel on the same packed weight: fp32 sums in another order, one
    # bf16 rounding each, so at most one ulp apart
    micro = gemm.linear(x, gemm.pack_linear(w), N, b)
    torch.testing.assert_close(got.float(), micro.float(), rtol=1e-2, atol=1e-2)


def test_brgemm_widen_is_the_rounded_result_as_fp32() -> None:
    _needs_brgemm()
    x, w, b = _data(37, 64, 100, seed=3)
    packed = gemm.pack_linear(w)
    narrow = gemm.linear_brgemm(x, packed, 100, b)
    wide = gemm.linear_brgemm(x, packed, 100, b, widen=True)
    assert wide.dtype == torch.float32 and torch.equal(wide, narrow.float())


def test_brgemm_rejects_a_mismatched_pack() -> None:
    _needs_brgemm()
    x, w, _ = _data(4, 64, 40, seed=1)
    with pytest.raises(RuntimeError, match="does not match"):
        gemm.linear_brgemm(x, gemm.pack_linear(w), 70)     # two groups, one packed
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemm.linear_brgemm(x.float(), gemm.pack_linear(w.float()), 40)


def test_route_through_brgemm_matches_the_micro_kernel_route() -> None:
    _needs_brgemm()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 64, generator=g).bfloat16()
    w = (torch.randn(20, 64, generator=g) * 0.3).bfloat16()
    packed = gemm.pack_linear(w)
    ids_b, wts_b = gemm.route(x, packed, 20, 4, True, brgemm=True)
    ids_m, wts_m = gemm.route(x, packed, 20, 4, True)
    same = (ids_b == ids_m).all(dim=1)           # logits may differ by an ulp: rare ties flip
    assert same.float().mean() >= 0.9
    torch.testing.assert_close(wts_b[same].float(), wts_m[same].float(), rtol=1e-2, atol=1e-3)
    ref = torch.topk(F.softmax(F.linear(x, w).float(), -1), 4, dim=-1)
    agree = (ids_b.sort(-1).values == ref.indices.sort(-1).values).all(dim=1)
    assert agree.float().mean() >= 0.9


def _oracle(x, ids, w, w1, w2, limit) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w1[e].double() @ x[t].double()).chunk(2)
            out[t] += float(w[t, j]) * (w2[e].double() @ swiglu(gate, up, limit))
    return out


EXPERT_CASES = {  # name: (experts, k, d, I, T, limit, brgemm_min_rows)
    "all-brgemm": (4, 2, 64, 48, 40, None, 1),
    "mixed": (8, 2, 32, 40, 50, None, 12),     # busy experts on brgemm, the rest micro
    "odd-d-clamp": (5, 3, 33, 20, 37, 0.5, 4),
    "big-I": (3, 2, 80, 200, 70, 1.0, 16),     # several up/down groups, row blocks
    "empty-batch": (4, 2, 32, 16, 0, None, 1),
    "top-1": (6, 1, 32, 16, 45, None, 2),
}


@pytest.mark.parametrize("case", list(EXPERT_CASES))
def test_fused_experts_brgemm_matches_oracle(case: str) -> None:
    _needs_brgemm()
    E, k, d, I, T, limit, big = EXPERT_CASES[case]
    g = torch.Generator().manual_seed(E + d)
    w1 = (torch.randn(E, 2 * I, d, generator=g) * 0.3).bfloat16()
    w2 = (torch.randn(E, d, I, generator=g) * 0.3).bfloat16()
    x = torch.randn(T, d, generator=g).bfloat16()
    # skewed routing over half the experts (the others empty): some above the threshold
    used = max(k, E // 2)
    probs = torch.tensor([2.0 ** -i for i in range(used)])
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(T)]) if T \
        else torch.zeros(0, k, dtype=torch.int64)
    w = torch.rand(T, k, generator=g).bfloat16()
    packed = moe_op.pack_experts(w1, w2)
    got = moe_op.fused_experts(x, ids, w, *packed, I, limit, brgemm_min_rows=big)
    want = _oracle(x, ids, w, w1, w2, limit)
    scale = max(want.abs().max().item(), 1.0) if T else 1.0
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1.6e-2 * scale)
    micro = moe_op.fused_experts(x, ids, w, *packed, I, limit)
    torch.testing.assert_close(got.float(), micro.float(), rtol=1.6e-2, atol=1.6e-2 * scale)
    if T:
        counts = torch.bincount(ids.flatten(), minlength=E)
        assert int(counts.max()) >= big          # the case does reach the brgemm branch


def test_fused_experts_threshold_above_every_expert_is_the_micro_kernel() -> None:
    """A threshold no expert reaches runs exactly the micro-kernel path (bitwise)."""
    g = torch.Generator().manual_seed(5)
    w1 = (torch.randn(4, 32, 32, generator=g) * 0.3).bfloat16()
    w2 = (torch.randn(4, 32, 16, generator=g) * 0.3).bfloat16()
    x = torch.randn(9, 32, generator=g).bfloat16()
    ids = torch.randint(0, 4, (9, 2), generator=g)
    w = torch.rand(9, 2, generator=g).bfloat16()
    packed = moe_op.pack_experts(w1, w2)
    assert torch.equal(moe_op.fused_experts(x, ids, w, *packed, 16, None, brgemm_min_rows=100),
                       moe_op.fused_experts(x, ids, w, *packed, 16, None))


def test_fused_experts_brgemm_row_chunks_and_tails() -> None:
    """Experts with prefill-sized row counts: the up GEMM gathers 256 rows at a time and
    splits a chunk into a 32-multiple block and a last block under 32 (moe.cpp
    `row_blocks`), the down GEMM walks 32-row blocks. Row counts on each side of those
    boundaries (293 = 256 + 32 + 5, 256, 31, 1, none), odd d, I not a multiple of 16: the
    fp64 oracle, one thread against two bitwise, and each token's row alone (a 1-row expert
    call) against the same row inside its tall expert bitwise (brgemm rows are independent
    of the call's row count)."""
    _needs_brgemm()
    counts = {0: 293, 1: 256, 2: 31, 4: 1}                # expert 3: no rows
    E, d, I = 5, 33, 20
    ids = torch.cat([torch.full((c, 1), e, dtype=torch.int64) for e, c in counts.items()])
    T = ids.shape[0]
    g = torch.Generator().manual_seed(17)
    ids = ids[torch.randperm(T, generator=g)]
    w1 = (torch.randn(E, 2 * I, d, generator=g) * 0.3).bfloat16()
    w2 = (torch.randn(E, d, I, generator=g) * 0.3).bfloat16()
    x = torch.randn(T, d, generator=g).bfloat16()
    w = torch.rand(T, 1, generator=g).bfloat16()
    packed = moe_op.pack_experts(w1, w2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = moe_op.fused_experts(x, ids, w, *packed, I, None, brgemm_min_rows=1)
        torch.set_num_threads(2)
        two = moe_op.fused_experts(x, ids, w, *packed, I, None, brgemm_min_rows=1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, two)
    want = _oracle(x, ids, w, w1, w2, None)
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.double(), want, rtol=1.6e-2, atol=1.6e-2 * scale)
    for t in torch.randperm(T, generator=g)[:12].tolist():
        alone = moe_op.fused_experts(x[t:t + 1], ids[t:t + 1], w[t:t + 1], *packed, I, None,
                                     brgemm_min_rows=1)
        assert torch.equal(alone[0], got[t]), t
