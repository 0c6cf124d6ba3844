"""WeightPack (layers/linear.py): fused and packed projections equal F.linear over the sources,
and follow the sources when they change."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from wideserve.layers.linear import WeightPack, packing_runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_equals_separate_linears(dtype, rows, with_bias) -> None:
    g = torch.Generator().manual_seed(rows)
    ws = tuple(torch.randn(n, 16, generator=g).to(dtype) for n in (8, 4, 4))
    bs = tuple((torch.randn(n, generator=g).to(dtype) if with_bias and i != 1 else None)
               for i, n in enumerate((8, 4, 4)))
    x = torch.randn(2, rows, 16, generator=g).to(dtype)          # any leading shape
    got = WeightPack().linear(x, ws, bs)
    want = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-5)


def test_follows_in_place_writes_and_new_storage() -> None:
    lin = torch.nn.Linear(16, 8).bfloat16()
    pack = WeightPack()
    x = torch.randn(3, 16).bfloat16()

    def check() -> None:
        torch.testing.assert_close(pack.linear(x, (lin.weight,), (lin.bias,)), lin(x),
                                   rtol=0, atol=0)

    check()
    with torch.no_grad():
        lin.weight.mul_(2)              # version counter
    check()
    lin.weight.data = torch.randn(8, 16).bfloat16()     # new storage
    check()
    lin.float()                         # new dtype: the plain path
    x = x.float()
    check()


def test_bf16_packs_on_this_cpu() -> None:
    """The CI machines have avx512_bf16: the packed path is the one the CPU default takes."""
    assert packing_runs(torch.bfloat16)
