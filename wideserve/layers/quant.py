"""Block-scaled FP8 / FP4 weight formats of DeepSeek checkpoints (docs/deepseek_v4.md, "Quantised weights").

Glossary
- UE8M0: an unsigned 8-bit exponent, value 2^(byte - 127); byte 255 is NaN. Stored as
  `torch.float8_e8m0fnu` (or raw uint8 bytes). A UE8M0 scale multiplies the stored code.
- FP8 block scales: weight float8_e4m3fn [out, in]; one scale per [bm, bn] tile, grid
  [ceil(out/bm), ceil(in/bn)] (the last tiles may be partial). DeepSeek-V4: [128, 128].
- FP4 (e2m1): two codes per byte, the LOW nibble holds the even column; bit 3 of a code is the
  sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}. One UE8M0 scale per `group` consecutive
  values along the input dimension (DeepSeek-V4 experts: 32), grid [out, ceil(in/group)].
- HF `weight_scale_inv` companions hold the same multiplier, possibly as fp32/bf16.

Everything here is a pure function on tensors, computed on the device of its input, so a GPU
path can keep the quantised tensors and call these only where it needs dense weights.
Any number of leading (batch) dimensions is allowed, e.g. stacked experts [E, out, in].
"""
from __future__ import annotations

import math

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

# Raw-byte dtypes a packed FP4 tensor may arrive in (safetensors has no fp4 dtype; DeepSeek
# stores int8). torch.float4_e2m1fn_x2 exists in recent torch builds only.
_FP4_STORAGE = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None))
                     if d is not None)


def is_fp4_storage(dtype: torch.dtype) -> bool:
    return dtype in _FP4_STORAGE


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (float8_e8m0fnu or uint8 bytes) -> float32, bit-exact (2^-127 included)."""
    if scale.dtype == torch.float8_e8m0fnu:
        raw = scale.view(torch.uint8)
    elif scale.dtype == torch.uint8:
        raw = scale
    else:
        raise TypeError(f"UE8M0 scale must be float8_e8m0fnu or uint8, got {scale.dtype}")
    exp = raw.to(torch.int32)
    # A normal float32 with biased exponent b is exactly 2^(b-127); b == 0 needs the subnormal
    # 2^-127 (mantissa bit 22), b == 255 is NaN in UE8M0 as in float32.
    bits = torch.where(exp == 0, torch.full_like(exp, 1 << 22), exp << 23)
    bits = torch.where(exp == 255, torch.full_like(exp, 0x7FC00000), bits)
    return bits.view(torch.float32)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any supported scale tensor (UE8M0 bytes or a float multiplier) -> float32."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return ue8m0_to_float(scale)
    if scale.dtype.is_floating_point and scale.dtype.itemsize >= 2:
        return scale.float()
    raise TypeError(f"unsupported weight scale dtype {scale.dtype}")


def fp8_e4m3_to_float(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype == torch.uint8:
        weight = weight.view(torch.float8_e4m3fn)
    if weight.dtype != torch.float8_e4m3fn:
        raise TypeError(f"FP8 weight must be float8_e4m3fn, got {weight.dtype}")
    return weight.float()


def unpack_fp4_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes (two e2m1 codes each, low nibble first) -> float32 [..., 2n]."""
    if not is_fp4_storage(packed.dtype):
        raise TypeError(f"packed FP4 weight must be int8/uint8 bytes, got {packed.dtype}")
    raw = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    table = torch.cat([table, -table])                                    # [16] by code
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).long()             # [..., n, 2]
    return table[codes].reshape(*raw.shape[:-1], 2 * raw.shape[-1])


def scale_grid(shape: tuple[int, ...] | torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    """Scale-tensor shape for a weight of `shape` tiled by `block` = (rows, cols)."""
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Per-tile scales [..., ceil(rows/bm), ceil(cols/bn)] -> per-element [..., rows, cols]."""
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def _check_grid(scale: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(scale.shape) != expected:
        raise ValueError(f"{what}: scale shape {tuple(scale.shape)} does not match the expected "
                         f"grid {expected}")


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor,
                         block: tuple[int, int] = (128, 128),
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP8 e4m3 weight [..., out, in] x block scales -> dense `dtype` [..., out, in]."""
    _check_grid(scale, scale_grid(weight.shape, block), f"FP8 weight {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    # The product of an e4m3 code and a power of two is exact in fp32: one rounding, to `dtype`.
    return (fp8_e4m3_to_float(weight) * expand_scale(scale_to_float(scale), rows, cols, block)
            ).to(dtype)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32,
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Packed e2m1 [..., out, in/2] x per-`group` scales [..., out, ceil(in/group)]
    -> dense `dtype` [..., out, in]."""
    values = unpack_fp4_e2m1(packed)
    rows, cols = values.shape[-2:]
    _check_grid(scale, scale_grid(values.shape, (1, group)), f"FP4 weight {tuple(values.shape)}")
    return (values * expand_scale(scale_to_float(scale), rows, cols, (1, group))).to(dtype)


# --- quantisers: the inverse direction (checkpoint writers, tests, online quantisation) ---

def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax, as UE8M0 (float8_e8m0fnu)."""
    amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    exp = torch.ceil(torch.log2(amax / qmax)).clamp(-127, 127)
    return (exp.to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _tile_amax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    *lead, rows, cols = weight.shape
    gr, gc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(*lead, gr * block[0], gc * block[1], dtype=torch.float32,
                         device=weight.device)
    padded[..., :rows, :cols] = weight.float().abs()
    return padded.reshape(*lead, gr, block[0], gc, block[1]).amax(dim=(-3, -1))


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., out, in] -> (float8_e4m3fn weight, UE8M0 scale grid), power-of-two scales."""
    scale = _pow2_scale(_tile_amax(weight, block), FP8_E4M3_MAX)
    rows, cols = weight.shape[-2:]
    full = expand_scale(ue8m0_to_float(scale), rows, cols, block)
    q = (weight.float() / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def quantize_fp4(weight: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., out, in] (in even) -> (int8 packed e2m1 [..., out, in/2],
    UE8M0 scales [..., out, ceil(in/group)])."""
    rows, cols = weight.shape[-2:]
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even input dimension, got {cols}")
    scale = _pow2_scale(_tile_amax(weight, (1, group)), FP4_E2M1_MAX)
    x = weight.float() / expand_scale(ue8m0_to_float(scale), rows, cols, (1, group))
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    mag = (x.abs().clamp(max=FP4_E2M1_MAX).unsqueeze(-1) - table).abs().argmin(dim=-1)  # [..., in]
    codes = (mag | ((x < 0).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), scale
