"""The fused mHC ops (kernels/mhc.py) against the torch forms they replace in small steps:
V4's HyperConnection (layers/mhc.py) and V4.1's SinglePassHC / collapse / expand, on random
shapes (no rows, one, odd row counts, widths not a multiple of 16, 2 and 4 streams), to fp32
rounding; and their refusals."""
from __future__ import annotations

import pytest
import torch

from wideserve.kernels import mhc as fused
from wideserve.kernels.loader import build
from wideserve.layers.mhc import HyperConnection, hc_expand
from wideserve.models.deepseek_v41.common import SinglePassHC, collapse, expand


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    build()      # a build failure is a test failure, never a skip


SHAPES = [(0, 2, 16), (1, 2, 128), (3, 4, 48), (4, 4, 130), (5, 2, 7)]


def _site(cls: type, n: int, d: int, iters: int, seed: int) -> HyperConnection:
    g = torch.Generator().manual_seed(seed)
    site = cls(n, d, iters, 1e-6, 1e-6)
    with torch.no_grad():
        site.fn.copy_(torch.randn(site.fn.shape, generator=g) * 0.05)
        site.base.copy_(torch.randn(site.base.shape, generator=g))
        site.scale.copy_(torch.rand(3, generator=g) + 0.5)
    return site


@pytest.mark.parametrize("rows,n,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v4_site_matches_torch(rows, n, d, dtype):
    site = _site(HyperConnection, n, d, 4, rows + n + d)
    g = torch.Generator().manual_seed(d)
    x = torch.randn(rows, n, d, generator=g).to(dtype)
    y = torch.randn(rows, d, generator=g).to(dtype)
    with torch.no_grad():
        post, comb, collapsed = site(x)
        pre, post_f, comb_f = site.fused_coefficients(x)
        torch.testing.assert_close(post_f, post, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(comb_f, comb, rtol=1e-5, atol=1e-6)
        got = fused.collapse(x, pre)
        assert got.dtype == dtype and got.shape == (rows, d)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2,
                                                                            atol=1e-2)
        torch.testing.assert_close(got, collapsed, **tol)
        out = fused.expand(x, post, comb, y)
        assert out.dtype == dtype and out.shape == (rows, n, d)
        torch.testing.assert_close(out, hc_expand(x, post, comb, y), **tol)


@pytest.mark.parametrize("rows,n,d", SHAPES)
def test_v41_site_matches_torch(rows, n, d):
    site = _site(SinglePassHC, n, d, 3, 7 * rows + d)
    g = torch.Generator().manual_seed(d + 1)
    x = torch.randn(rows, n, d, generator=g)
    y = torch.randn(rows, d, generator=g)
    with torch.no_grad():
        for got, want in zip(site.fused_coefficients(x), site.coefficients(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        pre, post, comb = site.coefficients(x)
        torch.testing.assert_close(fused.collapse(x, pre), collapse(x, pre))
        torch.testing.assert_close(fused.expand(x, post, comb, y), expand(y, x, post, comb))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_collapse_and_v41_expand_equal_torch_bits(n, dtype):
    """No fused multiply-add and torch's order of sums: the collapse, and V4.1's elementwise
    expand, equal the torch forms bit for bit (and round to bf16 as torch's cast does)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(33, n, 200, generator=g).to(dtype)
    y = torch.randn(33, 200, generator=g).to(dtype)
    pre, post = torch.rand(33, n, generator=g), torch.rand(33, n, generator=g)
    comb = torch.rand(33, n, n, generator=g)
    assert torch.equal(fused.collapse(x, pre), (pre.unsqueeze(-1) * x).sum(1).to(dtype))
    assert torch.equal(fused.collapse(x, pre), collapse(x, pre))
    assert torch.equal(fused.expand(x, post, comb, y), expand(y, x, post, comb))


def test_bad_inputs_are_refused():
    x = torch.randn(2, 2, 16)
    site = _site(HyperConnection, 2, 16, 2, 0)
    with pytest.raises(RuntimeError, match="fn must be"):
        fused.coeffs(x, site.fn.detach()[:-1], site.base.detach(), site.scale.detach(), 2,
                     1e-6, 1e-6)
    with pytest.raises(RuntimeError, match="iterations"):
        fused.coeffs(x, site.fn.detach(), site.base.detach(), site.scale.detach(), 0, 1e-6,
                     1e-6)
    with pytest.raises(RuntimeError, match="y must be"):
        fused.expand(x, torch.rand(2, 2), torch.rand(2, 2, 2), torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        fused.collapse(x.half(), torch.rand(2, 2))
