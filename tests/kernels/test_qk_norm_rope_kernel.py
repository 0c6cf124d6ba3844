"""The fused C++ q/k norm + RoPE op (wideserve/kernels/csrc/qk_norm_rope.cpp) against the torch
path it replaces in models/llama/model.py's Attention (layers/norm.py rms_norm per head, then
layers/rope_rotate_half.py apply_rotary), on random shapes: Llama (no q/k norm) and Qwen3 (with it), fp32
and bf16, head dims 64 and 128 (the AVX512 path) and 40 (portable only), 0, 1 and many tokens,
in the AVX512 form and the portable form (`portable=True`)."""
from __future__ import annotations

import pytest
import torch

from wideserve.kernels.loader import build
from wideserve.layers.norm import rms_norm
from wideserve.layers.rope_rotate_half import (RopeScaling, RotaryEmbedding, apply_rotary,
                                               fused_norm_rope_applies, norm_rope_qkv_)

# Worst |difference| relative to the largest |value|. bf16: the op rotates in fp32 and rounds
# once, the torch path rounds every product and the sum (together ~2 ulps, 2^-7 each);
# fp32: the same maths in another order.
TOL = {torch.float32: 1e-6, torch.bfloat16: 2 ** -6}


@pytest.fixture(scope="module", autouse=True)
def _built() -> None:
    build()      # a build failure is a test failure, never a skip


def _reference(qkv, cos, sin, qw, kw, heads, kv_heads, dim, eps):
    t = qkv.shape[0]
    q, k, v = torch.split(qkv, (heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k = q.reshape(t, heads, dim), k.reshape(t, kv_heads, dim)
    if qw is not None:
        q, k = rms_norm(q, qw, eps), rms_norm(k, kw, eps)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return torch.cat((q.reshape(t, heads * dim), k.reshape(t, kv_heads * dim), v), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 40])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("portable", [False, True])
def test_op_matches_torch_path(dtype, dim, qk_norm, portable) -> None:
    g = torch.Generator().manual_seed(dim + 7 * qk_norm)
    for tokens, heads, kv_heads in ((0, 4, 2), (1, 4, 2), (37, 8, 2), (5, 3, 3)):
        rope = RotaryEmbedding(dim, 1e6 if qk_norm else 5e5, RopeScaling())
        positions = torch.randint(0, 4000, (tokens,), generator=g)
        cos, sin = rope.cos_sin(positions)
        width = (heads + 2 * kv_heads) * dim
        qkv = (torch.randn(tokens, width, generator=g) * 3).to(dtype)
        qw = kw = None
        if qk_norm:
            qw = (torch.rand(dim, generator=g) + 0.5).to(dtype)
            kw = (torch.rand(dim, generator=g) + 0.5).to(dtype)
        want = _reference(qkv, cos, sin, qw, kw, heads, kv_heads, dim, 1e-6)
        got = qkv.clone()
        norm_rope_qkv_(got, cos, sin, qw, kw, heads, kv_heads, 1e-6, portable=portable)
        assert got.dtype == dtype and got.shape == want.shape
        v0 = (heads + kv_heads) * dim
        assert torch.equal(got[:, v0:], qkv[:, v0:])                   # v untouched
        if tokens:
            err = (got.float() - want.float()).abs().max().item()
            assert err <= TOL[dtype] * want.float().abs().max().item(), (tokens, heads, err)


def test_row_stride_is_honoured() -> None:
    # A [T, W] view into a wider buffer (stride(0) > W): rows are found by their stride.
    dim, heads, kv_heads, tokens = 64, 4, 2, 9
    width = (heads + 2 * kv_heads) * dim
    base = torch.randn(tokens, width + 32)
    qkv = base[:, :width]
    cos, sin = RotaryEmbedding(dim, 1e4).cos_sin(torch.arange(tokens))
    want = _reference(qkv, cos, sin, None, None, heads, kv_heads, dim, 1e-6)
    tail = base[:, width:].clone()
    norm_rope_qkv_(qkv, cos, sin, None, None, heads, kv_heads, 1e-6)
    assert (qkv - want).abs().max().item() <= TOL[torch.float32] * want.abs().max().item()
    assert torch.equal(base[:, width:], tail)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_a_head_does_not_depend_on_its_neighbours(dtype, dim) -> None:
    # The AVX512 path runs several heads of a row at once (4 at head dim 64, 2 at 128, 1 at
    # 256) and the rest one by one: every head must come out bit for bit as it does alone.
    g = torch.Generator().manual_seed(dim)
    heads, kv_heads, tokens = 11, 5, 7
    cos, sin = RotaryEmbedding(dim, 1e6).cos_sin(torch.randint(0, 4000, (tokens,), generator=g))
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3).to(dtype)
    qw, kw = ((torch.rand(dim, generator=g) + 0.5).to(dtype) for _ in range(2))
    got = qkv.clone()
    norm_rope_qkv_(got, cos, sin, qw, kw, heads, kv_heads, 1e-6)
    q, k = qkv[:, :heads * dim], qkv[:, heads * dim:(heads + kv_heads) * dim]
    for h in range(max(heads, kv_heads)):          # one q head and one k head at a time
        qh, kh = q[:, h % heads * dim:][:, :dim], k[:, h % kv_heads * dim:][:, :dim]
        one = torch.cat((qh, kh, torch.zeros_like(kh)), -1)
        norm_rope_qkv_(one, cos, sin, qw, kw, 1, 1, 1e-6)
        assert torch.equal(one[:, :dim], got[:, h % heads * dim:][:, :dim]), h
        assert torch.equal(one[:, dim:2 * dim],
                           got[:, (heads + h % kv_heads) * dim:][:, :dim]), h


def test_bad_shapes_are_rejected() -> None:
    cos, sin = RotaryEmbedding(64, 1e4).cos_sin(torch.arange(3))
    with pytest.raises(RuntimeError, match="width"):
        norm_rope_qkv_(torch.zeros(3, 500), cos, sin, None, None, 4, 2, 1e-6)
    with pytest.raises(RuntimeError, match="together"):
        norm_rope_qkv_(torch.zeros(3, 512), cos, sin, torch.ones(64), None, 4, 2, 1e-6)


def test_applies_only_where_it_can() -> None:
    assert fused_norm_rope_applies(torch.zeros(2, 512, dtype=torch.bfloat16))
    assert not fused_norm_rope_applies(torch.zeros(2, 512, dtype=torch.float16))
    assert not fused_norm_rope_applies(torch.zeros(2, 512, requires_grad=True))
