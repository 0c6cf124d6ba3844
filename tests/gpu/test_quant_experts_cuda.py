"""Routed experts in checkpoint format on CUDA (marked `gpu`: benchmarks/gpu/check.sh runs them):
FP8 through torch._scaled_mm where the device has FP8 (compute capability 8.9+), MXFP4 and older
devices through per-expert dequantise-per-call. The CPU suite runs the same maths on the CPU
(tests/layers/test_quant_experts.py) but cannot show the CUDA dispatch."""
from __future__ import annotations

import pytest
import torch

from wideserve.layers import quant
from wideserve.layers.experts import RoutedExperts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind,tol", [("fp8", 5e-2), ("fp4", 2e-2)])
def test_packed_experts_on_cuda_match_the_cpu(kind: str, tol: float) -> None:
    fmt = quant.expert_format(kind)
    E, d, inter, T, k = 8, 256, 128, 40, 2
    layer = RoutedExperts(E, d, inter, swiglu_limit=7.0)
    layer.keep_checkpoint_format(fmt)
    g = torch.Generator().manual_seed(0)
    w13, s13, _ = fmt.quantize(torch.randn(E, 2 * inter, d, generator=g) / d ** 0.5, halves=2)
    w2, s2, _ = fmt.quantize(torch.randn(E, d, inter, generator=g) / inter ** 0.5)
    with torch.no_grad():
        for p, v in ((layer.gate_up_proj, w13), (layer.gate_up_proj_scale, s13),
                     (layer.down_proj, w2), (layer.down_proj_scale, s2)):
            p.copy_(v)
    x = torch.randn(T, d, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, E, (T, k), generator=g)
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    want = layer(x, ids, w).float()
    layer.to("cuda")
    got = layer(x.cuda(), ids.cuda(), w.cuda()).float().cpu()
    assert (got - want).abs().max() <= tol * want.abs().max()
