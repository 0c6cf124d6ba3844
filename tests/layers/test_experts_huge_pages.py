"""The fused experts op's packed weights on huge pages (layers/expert_packs.py FusedPack,
kv_cache/host_memory.py on_huge_pages): advised memory where THP exists, and outputs equal to
the same packs on ordinary pages (bf16 and fp32, decode- and prefill-sized calls)."""
from __future__ import annotations

import pytest
import torch

from wideserve.kernels.loader import cpu_ops_available
from wideserve.kv_cache import host_memory
from wideserve.layers.experts import RoutedExperts

E, K, D, INTER = 8, 2, 256, 512          # 8 x 3 x 256 x 512 bf16: 6 MiB of packed weights


@pytest.mark.skipif(not cpu_ops_available(), reason="needs the C++ CPU ops (built in CI)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packs_on_huge_pages_give_the_same_outputs(dtype) -> None:
    torch.manual_seed(0)
    m = RoutedExperts(E, D, INTER).to(dtype)
    with torch.no_grad():
        m.gate_up_proj.normal_(0, 0.05)
        m.down_proj.normal_(0, 0.05)
    m.impl = "fused"
    with torch.inference_mode():
        for tokens in (0, 1, 5, 300):
            x = torch.randn(tokens, D).to(dtype)
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(tokens)]) if tokens \
                else torch.zeros(0, K, dtype=torch.int64)
            wts = torch.rand(tokens, K).softmax(-1)
            got = m(x, ids, wts)
            pack = m._packs
            advised = (pack.w13, pack.w2)
            if host_memory.thp_mode() not in (None, "never"):
                assert all(t.data_ptr() % host_memory.HUGE_PAGE == 0 for t in advised)
            pack.w13, pack.w2 = (t.clone() for t in advised)       # ordinary pages
            assert torch.equal(m(x, ids, wts), got)
            pack.w13, pack.w2 = advised
