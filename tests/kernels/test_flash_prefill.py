"""The flash prefill kernel (csrc/flash_attention.cpp, kernels/sdpa_context.attend_flash)
against the fp32 reference of the same attention (SDPA over the context gathered from the
paged cache, in fp32): query counts 0, 1, odd and past several tiles, contexts before the
queries, GQA ratios, head dims 32..256, shuffled block tables, NaN in every cache slot the
request does not own; and the clear errors of bad arguments."""
from __future__ import annotations

import pytest
import torch

from wideserve.kernels import sdpa_context

pytestmark = pytest.mark.skipif(not sdpa_context.flash_compiled(),
                                reason="the flash kernel needs AVX512-BF16 and bf16 brgemm")


def _case(lq: int, length: int, heads: int, kv_heads: int, dim: int, block: int, seed: int):
    """q [lq, H, D] and a cache whose blocks are shuffled and NaN outside the request's
    positions [0, length) (a stale or unwritten slot read shows up as NaN)."""
    g = torch.Generator().manual_seed(seed)
    used = -(-length // block)
    blocks = used + 3
    cache = torch.full((blocks, block, 2 * kv_heads * dim), float("nan"), dtype=torch.bfloat16)
    table = torch.randperm(blocks, generator=g)
    entries = torch.randn(length, 2 * kv_heads * dim, generator=g).bfloat16()
    flat = cache.view(-1, cache.shape[-1])
    pos = torch.arange(length)
    flat[table[pos // block] * block + pos % block] = entries
    q = torch.randn(lq, heads, dim, generator=g).bfloat16()
    return q, cache, table


CASES = [  # (queries, length, heads, kv heads, head dim, block size)
    (1, 1, 4, 4, 64, 16),
    (5, 5, 4, 2, 64, 16),
    (64, 64, 8, 2, 64, 16),
    (65, 65, 8, 2, 64, 16),
    (130, 300, 16, 4, 64, 16),     # a chunk after 170 cached positions
    (257, 257, 4, 1, 128, 64),     # one past a 256-key tile
    (600, 600, 16, 4, 64, 64),     # several tiles and query blocks, 2 threads' pairs
    (37, 1037, 2, 2, 32, 16),      # a short chunk after a long context
    (3, 130, 2, 1, 256, 32),
    (1, 513, 6, 3, 96, 8),         # a decode-sized chunk, a head dim of 3 x 32
]


@pytest.mark.parametrize("lq,length,heads,kv_heads,dim,block", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_fp32_reference(lq, length, heads, kv_heads, dim, block, threads) -> None:
    q, cache, table = _case(lq, length, heads, kv_heads, dim, block, seed=lq + length)
    scale = dim ** -0.5
    want = sdpa_context.attend_paged(q.float(), cache.float(), table, length, scale)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = sdpa_context.attend_flash(q, cache, table, length, scale)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert not got.isnan().any()
    # bf16 SDPA's own distance from the fp32 reference sets the bar (P and the output are
    # rounded to bf16 in both)
    bf16 = sdpa_context.attend_paged(q, cache, table, length, scale)
    err = (got.float() - want).abs().max().item()
    bar = (bf16.float() - want).abs().max().item()
    assert err <= 2 * bar + 1e-2, (err, bar)


def test_zero_queries_and_a_query_view() -> None:
    q, cache, table = _case(40, 90, 8, 2, 64, 16, seed=3)
    assert sdpa_context.attend_flash(q[:0], cache, table, 90, 0.125).shape == (0, 8, 64)
    # queries read in place from a wider row (a view into a fused qkv output)
    wide = torch.cat((q.reshape(40, -1), torch.randn(40, 256).bfloat16()), dim=-1)
    view = wide[:, :8 * 64].view(40, 8, 64)
    torch.testing.assert_close(sdpa_context.attend_flash(view, cache, table, 90, 0.125),
                               sdpa_context.attend_flash(q.contiguous(), cache, table, 90,
                                                         0.125), rtol=0, atol=0)


def test_the_scale_is_applied() -> None:
    q, cache, table = _case(20, 50, 4, 2, 64, 16, seed=5)
    for scale in (0.05, 0.125, 1.0):
        want = sdpa_context.attend_paged(q.float(), cache.float(), table, 50, scale)
        got = sdpa_context.attend_flash(q, cache, table, 50, scale)
        assert (got.float() - want).abs().max().item() < 3e-2


def test_bad_arguments_are_clear_errors() -> None:
    q, cache, table = _case(8, 20, 4, 2, 64, 16, seed=1)
    op = torch.ops.wideserve.flash_prefill
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q.float(), cache, table, 20, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        op(q, cache.float(), table, 20, 0.125)
    with pytest.raises(RuntimeError, match="queries but only"):
        op(q, cache, table, 7, 0.125)
    with pytest.raises(RuntimeError, match="blocks, the table row has"):
        op(q, cache, table[:1], 20, 0.125)
    bad = table.clone()
    bad[0] = cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, cache, bad, 20, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(q[..., :48].contiguous(), cache[..., :2 * 2 * 48].contiguous(), table, 20, 0.125)
    with pytest.raises(RuntimeError, match="cache width"):
        op(torch.randn(8, 3, 64).bfloat16(), cache, table, 20, 0.125)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, cache, table.int(), 20, 0.125)


def test_flash_fits_only_dims_it_takes() -> None:
    assert sdpa_context.flash_fits(64) and sdpa_context.flash_fits(256)
    assert not sdpa_context.flash_fits(48) and not sdpa_context.flash_fits(288)


def test_a_tail_tile_ignores_stale_packing_memory() -> None:
    """The packed tiles are not zero-filled: past the request's length only V's rows a P V
    call reads are zeroed (P is 0 there, 0 x NaN is not). Freed NaN-filled blocks of the
    packed tiles' size first, so the allocator hands the op memory that held NaN."""
    q, cache, table = _case(37, 37, 2, 1, 64, 16, seed=11)
    want = sdpa_context.attend_paged(q.float(), cache.float(), table, 37, 0.125)
    for _ in range(3):
        poison = [torch.full((256 * 64,), float("nan"), dtype=torch.bfloat16)
                  for _ in range(4)]
        del poison
        got = sdpa_context.attend_flash(q, cache, table, 37, 0.125)
        assert not got.isnan().any()
        assert (got.float() - want).abs().max().item() < 3e-2
