"""Quantised KV records of DeepSeek-V4.1 (docs/deepseek_v41.md, "KV records").

Three formats, each over groups of consecutive channels of one entry:
- fp8 (window latents, all channels): groups of 32, scale = the power of two >= amax/448
  (amax floored at 1e-4), codes float8_e4m3fn. Record: D code bytes + D/32 UE8M0 scale bytes
  (512 channels: 528 B).
- nvfp4 (compressed entries): groups of 16, scale = (amax floored at 6*2^-9) / 6 rounded to
  float8_e4m3fn, codes e2m1. Record: D/2 packed bytes + D/16 E4M3 scale bytes (512: 288 B).
- mxfp4 (indexer keys and queries): groups of 32, scale = the power of two >= amax/6 (amax
  floored at 6*2^-126), codes e2m1. Record: D/2 packed bytes + D/32 UE8M0 bytes (128: 68 B).
e2m1 rounds to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code. Packing: the
low nibble holds the even channel; bit 3 is the sign (layers/quant.py, same as the weights).

`fake_quant(x, fmt)` is quantise-then-dequantise (what a reader of the record sees);
`pack(x, fmt)` -> uint8 records [..., record_bytes] and `unpack(records, fmt, width)` -> float32
give the same values: unpack(pack(x)) == fake_quant(x) bit for bit.
"""
from __future__ import annotations

import torch

FORMATS = ("fp8", "nvfp4", "mxfp4")
GROUP = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def record_bytes(fmt: str, width: int) -> int:
    """Bytes of one record of `width` channels."""
    _check(fmt, width)
    codes = width if fmt == "fp8" else width // 2
    return codes + width // GROUP[fmt]


def _check(fmt: str, width: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV record format {fmt!r}; known: {FORMATS}")
    if width % GROUP[fmt]:
        raise ValueError(f"{fmt} records need a width divisible by {GROUP[fmt]}, got {width}")


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 -> the smallest power of two >= x, by exponent arithmetic (no log
    rounding): bump the exponent when any mantissa bit is set."""
    bits = x.contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _scales(groups: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = groups.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        return _pow2_ceil(amax.clamp_min(1e-4) * (1 / 448))
    if fmt == "nvfp4":
        return (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
    return _pow2_ceil(amax.clamp_min(6 * 2**-126) * (1 / 6))


def _e2m1_index(normalized: torch.Tensor) -> torch.Tensor:
    """|value| (already in [0, 6]) -> code index 0..7, nearest level, ties to the even index."""
    mid = normalized.new_tensor(_MIDPOINTS)
    lower = torch.bucketize(normalized, mid)
    tie = normalized == mid[lower.clamp_max(len(_MIDPOINTS) - 1)]
    return lower + (tie & (lower % 2 == 1)).to(lower.dtype)


def _quantise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., D/g, g] as float (fp8 value or signed e2m1 level) or int
    index with sign, scales [..., D/g, 1] fp32)."""
    g = GROUP[fmt]
    groups = x.float().unflatten(-1, (-1, g))
    scale = _scales(groups, fmt)
    if fmt == "fp8":
        return (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    normalized = (groups / scale).clamp(-6, 6)
    index = _e2m1_index(normalized.abs().contiguous())
    return index + 8 * (normalized < 0).to(index.dtype), scale


def _e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    levels = torch.tensor(_LEVELS, dtype=torch.float32, device=codes.device)
    value = levels[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise and dequantise x [..., D] (fp32 maths); returns x's dtype."""
    _check(fmt, x.shape[-1])
    codes, scale = _quantise(x, fmt)
    values = codes.float() if fmt == "fp8" else _e2m1_value(codes)
    return (values * scale).flatten(-2).to(x.dtype)


def pack(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., D] -> uint8 records [..., record_bytes(fmt, D)]: codes, then scales."""
    _check(fmt, x.shape[-1])
    codes, scale = _quantise(x, fmt)
    lead = x.shape[:-1]
    if fmt == "fp8":
        code_bytes = codes.view(torch.uint8).reshape(*lead, -1)
    else:
        nib = codes.reshape(*lead, -1).to(torch.uint8)
        code_bytes = nib[..., 0::2] | (nib[..., 1::2] << 4)
    if fmt == "nvfp4":
        scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    else:   # UE8M0: the biased exponent of a power of two
        scale_bytes = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return torch.cat([code_bytes, scale_bytes.reshape(*lead, -1)], dim=-1)


def unpack(records: torch.Tensor, fmt: str, width: int) -> torch.Tensor:
    """uint8 records [..., record_bytes] -> float32 values [..., width]."""
    _check(fmt, width)
    g = GROUP[fmt]
    ncode = width if fmt == "fp8" else width // 2
    code_bytes, scale_bytes = records[..., :ncode], records[..., ncode:]
    if fmt == "nvfp4":
        scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        scale = (scale_bytes.to(torch.int32) << 23).view(torch.float32)
    if fmt == "fp8":
        values = code_bytes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        values = _e2m1_value(torch.stack([code_bytes & 0xF, code_bytes >> 4], dim=-1)
                             ).flatten(-2)
    return (values.unflatten(-1, (-1, g)) * scale[..., None]).flatten(-2)
