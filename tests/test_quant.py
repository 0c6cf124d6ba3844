"""FP8 / FP4 / UE8M0 decoding against a straightforward bit-level implementation."""
from __future__ import annotations

import math

import pytest
import torch

from wideserve.layers import quant


# --- independent decoders (bit arithmetic in Python, no torch casts, no lookup tables) ---

def ref_ue8m0(byte: int) -> float:
    return math.nan if byte == 255 else 2.0 ** (byte - 127)


def ref_e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * (man / 8) * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def ref_e2m1(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    if exp == 0:
        return sign * man * 0.5
    return sign * (1 + man / 2) * 2.0 ** (exp - 1)


def ref_dequant_fp8(weight: torch.Tensor, scale: torch.Tensor,
                    block: tuple[int, int]) -> torch.Tensor:
    w = weight.view(torch.uint8).reshape(-1, *weight.shape[-2:])
    s = scale.view(torch.uint8).reshape(-1, *scale.shape[-2:])
    out = torch.empty(w.shape, dtype=torch.float64)
    for b in range(w.shape[0]):
        for i in range(w.shape[1]):
            for j in range(w.shape[2]):
                scale_byte = int(s[b, i // block[0], j // block[1]])
                out[b, i, j] = ref_e4m3(int(w[b, i, j])) * ref_ue8m0(scale_byte)
    return out.reshape(weight.shape)


def ref_dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    p = packed.view(torch.uint8).reshape(-1, *packed.shape[-2:])
    s = scale.view(torch.uint8).reshape(-1, *scale.shape[-2:])
    out = torch.empty(p.shape[0], p.shape[1], 2 * p.shape[2], dtype=torch.float64)
    for b in range(p.shape[0]):
        for i in range(p.shape[1]):
            for j in range(out.shape[2]):
                byte = int(p[b, i, j // 2])
                code = byte & 0xF if j % 2 == 0 else byte >> 4
                out[b, i, j] = ref_e2m1(code) * ref_ue8m0(int(s[b, i, j // group]))
    return out.reshape(*packed.shape[:-1], out.shape[-1])


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32).to(torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C                        # no NaN codes
    return raw.view(torch.float8_e4m3fn)


def random_scale(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(110, 140, shape, generator=gen, dtype=torch.int32).to(torch.uint8).view(
        torch.float8_e8m0fnu)


# --- tests ---

def test_ue8m0_every_byte():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = quant.ue8m0_to_float(raw)
    for b in range(256):
        want = ref_ue8m0(b)
        assert (math.isnan(got[b]) and math.isnan(want)) or got[b].item() == want, b
    assert torch.equal(quant.ue8m0_to_float(raw.view(torch.float8_e8m0fnu))[:255], got[:255])


def test_fp4_unpack_every_byte_low_nibble_first():
    raw = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    got = quant.unpack_fp4_e2m1(raw.view(torch.int8))
    assert got.shape == (16, 32)
    for b in range(256):
        i, j = divmod(b, 16)
        assert got[i, 2 * j].item() == ref_e2m1(b & 0xF)
        assert got[i, 2 * j + 1].item() == ref_e2m1(b >> 4)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((129, 257), (128, 128)),
                                         ((2, 70, 45), (32, 32)), ((5, 300), (128, 128))])
def test_dequantize_fp8_block(shape, block):
    gen = torch.Generator().manual_seed(0)
    weight = random_fp8(shape, gen)
    scale = random_scale(quant.scale_grid(shape, block), gen)
    want = ref_dequant_fp8(weight, scale, block)
    got = quant.dequantize_fp8_block(weight, scale, block, dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), want)
    got_bf16 = quant.dequantize_fp8_block(weight, scale, block, dtype=torch.bfloat16)
    assert torch.equal(got_bf16, want.to(torch.bfloat16))


@pytest.mark.parametrize("shape,group", [((70, 100), 32), ((3, 16, 64), 32), ((9, 10), 4)])
def test_dequantize_fp4(shape, group):
    gen = torch.Generator().manual_seed(1)
    *lead, rows, cols = shape
    packed = torch.randint(-128, 128, (*lead, rows, cols // 2), generator=gen, dtype=torch.int32
                           ).to(torch.int8)
    scale = random_scale((*lead, rows, math.ceil(cols / group)), gen)
    want = ref_dequant_fp4(packed, scale, group)
    got = quant.dequantize_fp4(packed, scale, group, dtype=torch.float32)
    assert got.shape == shape
    assert torch.equal(got.double(), want)


def test_hf_style_float_scale():
    gen = torch.Generator().manual_seed(2)
    weight = random_fp8((130, 140), gen)
    scale_e8 = random_scale((2, 2), gen)
    as_float = quant.ue8m0_to_float(scale_e8)              # HF weight_scale_inv in fp32
    assert torch.equal(quant.dequantize_fp8_block(weight, as_float, dtype=torch.float32),
                       quant.dequantize_fp8_block(weight, scale_e8, dtype=torch.float32))


def test_quantize_fp8_roundtrip_error_bound():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 2, 300)
    q, s = quant.quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    full = quant.expand_scale(quant.ue8m0_to_float(s), 200, 300, (128, 128))
    assert (w.abs() / full).max() <= quant.FP8_E4M3_MAX          # every block fits e4m3
    err = (quant.dequantize_fp8_block(q, s, dtype=torch.float32) - w).abs()
    bound = torch.maximum(w.abs() * 2.0 ** -4, full * 2.0 ** -10)  # half-ulp normal / subnormal
    assert (err <= bound).all()


def test_quantize_fp4_exact_on_grid_and_packing():
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (6, 64), generator=gen)
    values = torch.tensor([ref_e2m1(c) for c in range(16)])[codes]
    values[:, 0] = 6.0                                       # amax 6 per group -> scale exactly 1
    values[:, 32] = -6.0
    scale = 2.0 ** torch.randint(-4, 4, (6, 2), generator=gen).float()
    w = values * scale.repeat_interleave(32, dim=1)
    packed, s = quant.quantize_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (6, 32) and s.shape == (6, 2)
    assert torch.equal(quant.ue8m0_to_float(s), scale)
    assert torch.equal(quant.dequantize_fp4(packed, s, dtype=torch.float32), w)
    one, _ = quant.quantize_fp4(torch.tensor([[0.5, -6.0]]))
    assert one.view(torch.uint8).item() == 0xF1              # 0.5 = code 1 (low), -6 = code 15


def test_bad_inputs():
    gen = torch.Generator().manual_seed(5)
    weight = random_fp8((256, 256), gen)
    with pytest.raises(ValueError, match="does not match the expected grid"):
        quant.dequantize_fp8_block(weight, random_scale((2, 3), gen))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        quant.dequantize_fp8_block(torch.zeros(4, 4, dtype=torch.float16),
                                   random_scale((1, 1), gen))
    with pytest.raises(TypeError, match="packed FP4"):
        quant.dequantize_fp4(torch.zeros(4, 4), random_scale((4, 1), gen))
    with pytest.raises(ValueError, match="even"):
        quant.quantize_fp4(torch.zeros(2, 3))
