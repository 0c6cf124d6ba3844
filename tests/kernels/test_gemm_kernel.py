"""The small-M GEMM C++ ops (wideserve/kernels/csrc/linear.cpp, micro-kernel csrc/gemm.h)
against fp64 oracles and the torch paths, on random shapes (one row, empty batches, odd widths,
output-block tails, more rows than one chunk, narrow router outputs), bf16 and fp32, through
both the AVX512-BF16 and the portable paths; `WeightPack` and the Qwen3-MoE router on them."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from wideserve.kernels import gemm, loader
from wideserve.kernels.choice import KernelChoice, KernelPolicy
from wideserve.layers import linear as linear_mod
from wideserve.layers.linear import WeightPack
from wideserve.models.qwen3_moe.model import TopKRouter


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    return loader.build()        # a compiler error fails every test here, never a skip


SHAPES = {  # name: (rows M, in K, out N)
    "one-row": (1, 64, 48),
    "empty": (0, 32, 16),
    "odd-widths": (7, 33, 21),       # odd K (padded pair), N tail inside a block
    "router-8": (13, 40, 8),         # one block of 16, 8 used
    "two-blocks": (9, 32, 27),
    "chunks": (200, 48, 130),        # > one 96-row chunk, group and block tails
}


def _data(M: int, K: int, N: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * 0.2).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    return x, w, b


def _tolerance(dtype: torch.dtype, ref: torch.Tensor) -> dict:
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5)
    scale = ref.abs().max().item() if ref.numel() else 1.0
    return dict(rtol=1e-2, atol=1e-2 * max(scale, 1.0))   # one bf16 rounding


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_linear_matches_fp64_oracle(shape, bias, dtype, portable) -> None:
    M, K, N = SHAPES[shape]
    x, w, b = _data(M, K, N, dtype, seed=M + N)
    b = b if bias else None
    got = gemm.linear(x, gemm.pack_linear(w), N, b, portable=portable)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (M, N)
    torch.testing.assert_close(got.double(), ref, **_tolerance(dtype, ref))


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_widen_is_the_rounded_result_as_fp32(portable) -> None:
    """`widen` gives exactly the bf16 output widened: F.linear(...).float() in one pass."""
    x, w, b = _data(37, 64, 100, torch.bfloat16, seed=3)
    packed = gemm.pack_linear(w)
    narrow = gemm.linear(x, packed, 100, b, portable=portable)
    wide = gemm.linear(x, packed, 100, b, widen=True, portable=portable)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, narrow.float())


def test_fast_and_portable_agree_to_rounding() -> None:
    x, w, _ = _data(50, 96, 70, torch.bfloat16, seed=5)
    packed = gemm.pack_linear(w)
    fast = gemm.linear(x, packed, 70, widen=True)
    slow = gemm.linear(x, packed, 70, widen=True, portable=True)
    torch.testing.assert_close(fast, slow, rtol=1e-2, atol=1e-2)


def test_bad_inputs_are_clear_errors() -> None:
    x, w, _ = _data(3, 32, 16, torch.bfloat16, seed=1)
    packed = gemm.pack_linear(w)
    with pytest.raises(RuntimeError, match="does not match"):
        gemm.linear(x, packed, 40)                      # N of another weight
    with pytest.raises(RuntimeError, match="does not match"):
        gemm.linear(x[:, :30], packed, 16)              # K of another weight
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        gemm.linear(x.half(), packed, 16)
    with pytest.raises(RuntimeError, match="dtype of x"):
        gemm.linear(x.float(), packed, 16)
    with pytest.raises(RuntimeError, match="k <= experts"):
        gemm.route(x, packed, 16, 17, True)


def _torch_router(x: torch.Tensor, w: torch.Tensor, k: int, renormalize: bool):
    probs = F.softmax(F.linear(x, w), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


ROUTERS = {  # name: (tokens, hidden, experts, k)
    "11m-like": (64, 256, 8, 2),
    "653m-like": (33, 128, 64, 8),
    "one-token": (1, 40, 6, 3),
    "k-equals-e": (5, 32, 4, 4),
    "empty": (0, 32, 8, 2),
}


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "raw"])
@pytest.mark.parametrize("case", list(ROUTERS))
def test_route_matches_torch_router(case, renormalize, dtype, portable) -> None:
    T, d, E, k = ROUTERS[case]
    x, w, _ = _data(T, d, E, dtype, seed=T + E)
    ids, weights = gemm.route(x, gemm.pack_linear(w), E, k, renormalize, portable)
    ref_ids, ref_w = _torch_router(x, w, k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == dtype and ids.shape == (T, k)
    # the logits agree to one rounding: a near-tie may swap two picks, so compare as sets
    # of (id -> weight) where both agree, and require nearly all rows identical
    same = (ids == ref_ids).all(dim=1)
    assert same.sum().item() >= (0.9 * T if T > 10 else T)
    torch.testing.assert_close(weights[same].float(), ref_w[same].float(),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


def test_route_ties_and_nan_follow_torch_topk() -> None:
    """Equal logits pick the experts torch.topk picks (its selection order on the CPU, not
    the lowest index: here [5, 6, 4]); a NaN row gives NaN weights."""
    x = torch.ones(3, 16)
    w = torch.zeros(8, 16)
    w[5] = 1.0                     # expert 5 best, the rest tied
    x[2, 0] = float("nan")
    ids, weights = gemm.route(x, gemm.pack_linear(w), 8, 3, True)
    ref_ids, ref_w = _torch_router(x[:2], w, 3, True)
    assert ids[:2].tolist() == ref_ids.tolist()
    for E, k in ((64, 8), (200, 2), (8, 1)):     # both of torch's selection branches
        x, w = torch.ones(4, 16), torch.zeros(E, 16)
        w[E // 3] = 1.0
        assert torch.equal(gemm.route(x, gemm.pack_linear(w), E, k, False)[0],
                           _torch_router(x, w, k, False)[0])
    torch.testing.assert_close(weights[:2], ref_w)
    assert torch.isnan(weights[2]).all()


@pytest.mark.parametrize("rows", [0, 1, 65])
def test_weightpack_uses_the_kernel_for_bf16(rows) -> None:
    g = torch.Generator().manual_seed(rows)
    ws = tuple((torch.randn(n, 64, generator=g) * 0.2).bfloat16() for n in (64, 16, 16))
    x = torch.randn(2, rows, 64, generator=g).bfloat16()
    pack = WeightPack()
    got = pack.linear(x, ws)
    assert pack.kind == "gemm"
    want = torch.cat([F.linear(x.double(), w.double()) for w in ws], dim=-1)
    torch.testing.assert_close(got.double(), want, **_tolerance(torch.bfloat16, want))
    wide = pack.linear(x, ws, widen=True)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())


def test_weightpack_without_the_kernel_packs_for_onednn() -> None:
    w = torch.randn(24, 32).bfloat16()
    x = torch.randn(5, 32).bfloat16()
    # the extension's kernels off for this pack, oneDNN forced (timed, oneDNN and F.linear
    # are within noise of each other at this size, and the choice could go either way)
    pack = WeightPack(KernelChoice(KernelPolicy(force="onednn", cache_dir=None)),
                      cpu_kernel=False)
    assert torch.equal(pack.linear(x, (w,)), F.linear(x, w))
    assert pack.kind == "onednn"
    assert pack.route(x, (w,), 2, True) is None          # the router keeps the torch path


def test_router_module_fast_path_equals_its_reference() -> None:
    router = TopKRouter(64, 8, 2, renormalize=True).bfloat16()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
    x = torch.randn(40, 64).bfloat16()
    with torch.inference_mode():
        ids, weights = router(x)
        ref_ids, ref_w = router.reference(x)
    assert router._pack.kind == "gemm"
    same = (ids == ref_ids).all(dim=1)
    assert same.float().mean() >= 0.9
    torch.testing.assert_close(weights[same].float(), ref_w[same].float(), rtol=1e-2, atol=1e-3)
    with torch.enable_grad():
        x.requires_grad_(True)
        assert router._pack.route(x, (router.weight,), 2, True) is None   # autograd: torch
