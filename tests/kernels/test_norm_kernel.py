"""The C++ norm and argmax ops (wideserve/kernels/csrc/norm.cpp) against the torch references
(layers/norm.py rms_norm, torch.argmax), in their AVX512 form and their portable form
(`portable=True`); widths that are not a multiple of 16 take the portable loop in both."""
from __future__ import annotations

import pytest
import torch

from wideserve.worker import sampler
from wideserve.kernels.loader import build
from wideserve.layers import norm

OPS = torch.ops.wideserve
# The residual sum is rounded exactly like torch's add, so it must match bit for bit; the norm
# differs only in the order the sum of squares is accumulated: within one rounding of the
# output dtype (a few fp32 ulps; one bf16 ulp at most).
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    build()      # a build failure is a test failure, never a skip


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.numel():
        scale = want.float().abs().clamp_min(1.0)
        assert ((got.float() - want.float()).abs() / scale).max().item() <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 64), (1, 256), (37, 256), (5, 48), (9, 33), (3, 4, 128)])
@pytest.mark.parametrize("portable", [False, True])
def test_norm_ops_match_reference(dtype, shape, portable):
    g = torch.Generator().manual_seed(hash((shape, portable)) % 1000)
    h = (torch.randn(shape, generator=g) * 3).to(dtype)
    delta = torch.randn(shape, generator=g).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    for weight in (w, None):
        _close(OPS.rms_norm(h, weight, 1e-6, portable), norm.rms_norm(h, weight, 1e-6), dtype)
        s, out = OPS.add_rms_norm(h, delta, weight, 1e-5, portable)
        want_s = h + delta
        assert torch.equal(s, want_s)
        _close(out, norm.rms_norm(want_s, weight, 1e-5), dtype)
    # fp32 weight on bf16 activations (weights loaded in fp32), non-contiguous input
    wide = torch.randn(shape[-1] * 2, *shape[:-1], generator=g).to(dtype).movedim(0, -1)[..., ::2]
    _close(OPS.rms_norm(wide, w.float(), 1e-6, portable),
           norm.rms_norm(wide, w.float(), 1e-6), dtype)


def test_wrappers_fall_back_where_the_op_does_not_apply():
    x = torch.randn(4, 32, dtype=torch.float16)
    w = torch.ones(32, dtype=torch.float16)
    assert not norm.cpu_kernel_applies(x, w)
    assert torch.equal(norm.fast_rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6))
    trained = torch.nn.Parameter(torch.ones(32))
    assert not norm.cpu_kernel_applies(x.float(), trained)          # autograd: torch path
    with torch.no_grad():
        assert norm.cpu_kernel_applies(x.float(), trained)
    with pytest.raises(RuntimeError, match="delta must match"):
        OPS.add_rms_norm(x.float(), torch.zeros(4, 31), None, 1e-6)
    with pytest.raises(RuntimeError, match="weight must be"):
        OPS.rms_norm(x.float(), torch.ones(31), 1e-6)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (0, 10), (7, 8192), (3, 17), (64, 1000)])
def test_argmax_matches_torch(portable, shape):
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g)
    assert torch.equal(OPS.argmax_rows(x, portable), x.argmax(dim=-1))
    if shape[0] and shape[1] > 2:
        x[0, 1:] = x[0, 0]                 # ties: the first index
        x[-1, :] = float("-inf")           # all masked
        if shape[0] > 2:
            x[1, shape[1] // 2] = float("nan")   # a NaN wins, the first NaN
            x[1, -1] = float("nan")
            x[2, -1] = float("inf")
        assert torch.equal(OPS.argmax_rows(x, portable), x.argmax(dim=-1))


def test_sampler_argmax_uses_the_op_and_falls_back():
    x = torch.randn(5, 40)
    assert torch.equal(sampler.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(sampler.argmax_rows(x.double()), x.double().argmax(dim=-1))
    with pytest.raises(RuntimeError, match="empty"):
        OPS.argmax_rows(torch.zeros(2, 0))


def test_module_caches_its_fp32_weight_and_follows_writes() -> None:
    """RMSNorm hands the ops its weight converted once to fp32: the same results as the op
    converting the bf16 weight itself, and a new copy after the parameter is written."""
    from wideserve.layers.norm import RMSNorm
    norm = RMSNorm(64, eps=1e-6).bfloat16()
    with torch.no_grad():
        norm.weight.normal_()
    h, delta = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        for _ in range(2):
            assert torch.equal(norm.fast(h), torch.ops.wideserve.rms_norm(h, norm.weight, 1e-6))
            got = norm.add_and_norm(h, delta)
            want = torch.ops.wideserve.add_rms_norm(h, delta, norm.weight, 1e-6)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            first = norm.fp32_weight()
            assert first.dtype == torch.float32 and norm.fp32_weight() is first
            with torch.no_grad():
                norm.weight.mul_(2)              # in place: the version counter moves
            assert norm.fp32_weight() is not first
