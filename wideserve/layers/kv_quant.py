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

A width that is not a multiple of the group (a head dim of 48 in fp8's groups of 32) is
zero-padded to whole groups before the scales are taken, as the reference's quantize_cache
does: the last group's scale comes from its real channels only (a zero never raises an amax)
and the padding is dropped again. Records hold the real channels' codes (ceil(D/2) bytes for
e2m1, a zero nibble after an odd channel count) and one scale per group, ceil(D/g) of them.

`fake_quant(x, fmt)` is quantise-then-dequantise (what a reader of the record sees);
`pack(x, fmt)` -> uint8 records [..., record_bytes] and `unpack(records, fmt, width)` -> float32
give the same values: unpack(pack(x)) == fake_quant(x) bit for bit. (Quantising a quantised
value again is not always a no-op for nvfp4, so writers pass the unquantised values.)

DeepSeek-V4's `fp8_ds_mla` record (`--kv-cache-dtype fp8`, 584 B for 512 channels): the
D - r non-rotary channels as FP8 in groups of 64 with power-of-two (UE8M0) scales, the r rotary
channels as bf16, then the scales and one pad byte.

`RecordCodec` is what a cache's reader and writer use (attention/v4_step.py): a cache stored as
uint8 holds packed records; one stored as floats holds the dequantised values (exact in bf16:
every value above has at most 5 significant bits).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FORMATS = ("fp8", "nvfp4", "mxfp4")
GROUP = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def record_bytes(fmt: str, width: int) -> int:
    """Bytes of one record of `width` channels."""
    _check(fmt, width)
    return _code_bytes(fmt, width) + -(-width // GROUP[fmt])


def _code_bytes(fmt: str, width: int) -> int:
    return width if fmt == "fp8" else -(-width // 2)


def _check(fmt: str, width: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV record format {fmt!r}; known: {FORMATS}")
    if width <= 0:
        raise ValueError(f"{fmt} records need a positive width, got {width}")


def _pad_last(x: torch.Tensor, g: int) -> torch.Tensor:
    """x zero-padded on its last axis to a multiple of g (x itself when it is one: F.pad
    copies even when it adds nothing, and these run on every cache read and write)."""
    extra = -x.shape[-1] % g
    return F.pad(x, (0, extra)) if extra else x


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [..., D] -> [..., ceil(D/g), g] float32, the last group zero-padded."""
    return _pad_last(x.float(), g).unflatten(-1, (-1, g))


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 -> the smallest power of two >= x, by exponent arithmetic (no log
    rounding): bump the exponent when any mantissa bit is set - adding 0x7FFFFF to the bits
    carries into the exponent exactly then (sign bit 0, exponent below 255)."""
    bits = x.contiguous().view(torch.int32)
    return (((bits + 0x7FFFFF) >> 23) << 23).view(torch.float32)


def _scales(groups: torch.Tensor, fmt: str) -> torch.Tensor:
    amax = groups.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        return _pow2_ceil(amax.clamp_min(1e-4) * (1 / 448))
    if fmt == "nvfp4":
        return (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
    return _pow2_ceil(amax.clamp_min(6 * 2**-126) * (1 / 6))


@functools.lru_cache(maxsize=None)
def _table(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A constant fp32 table on `device`, built once: a tensor built from the host on every
    call is what a captured decode graph must not contain (docs/cuda_graphs.md)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


def _e2m1_index(normalized: torch.Tensor) -> torch.Tensor:
    """|value| (already in [0, 6]) -> code index 0..7, nearest level, ties to the even index."""
    mid = _table(_MIDPOINTS, normalized.device)
    lower = torch.bucketize(normalized, mid)
    tie = normalized == mid[lower.clamp_max(len(_MIDPOINTS) - 1)]
    return lower + (tie & (lower % 2 == 1)).to(lower.dtype)


def _quantise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes [..., ceil(D/g), g] as float (fp8 value or signed e2m1 level) or int
    index with sign, scales [..., D/g, 1] fp32)."""
    groups = _grouped(x, GROUP[fmt])
    scale = _scales(groups, fmt)
    if fmt == "fp8":
        return (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    normalized = (groups / scale).clamp(-6, 6)
    index = _e2m1_index(normalized.abs().contiguous())
    return index + 8 * (normalized < 0).to(index.dtype), scale


def _e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    levels = _table(_LEVELS, codes.device)
    value = levels[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def fake_quant(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantise and dequantise x [..., D] (fp32 maths); returns x's dtype."""
    _check(fmt, x.shape[-1])
    codes, scale = _quantise(x, fmt)
    values = codes.float() if fmt == "fp8" else _e2m1_value(codes)
    return (values * scale).flatten(-2)[..., :x.shape[-1]].to(x.dtype)


def pack(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., D] -> uint8 records [..., record_bytes(fmt, D)]: codes, then scales."""
    _check(fmt, x.shape[-1])
    codes, scale = _quantise(x, fmt)
    lead, width = x.shape[:-1], x.shape[-1]
    if fmt == "fp8":
        code_bytes = codes.view(torch.uint8).reshape(*lead, -1)[..., :width]
    else:   # the padding's codes are 0: an odd width keeps one zero nibble
        nib = codes.reshape(*lead, -1)[..., :2 * _code_bytes(fmt, width)].to(torch.uint8)
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
    ncode = _code_bytes(fmt, width)
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
    values = _pad_last(values, g)
    return (values.unflatten(-1, (-1, g)) * scale[..., None]).flatten(-2)[..., :width]


# ------------------------------------------------------------------ DeepSeek-V4 fp8_ds_mla
def _ds_mla_split(width: int, rope_dim: int) -> int:
    nope = width - rope_dim
    if nope <= 0 or rope_dim < 0:
        raise ValueError(f"fp8_ds_mla needs 0 <= rope_dim < width, got width {width}, "
                         f"rope_dim {rope_dim}")
    return nope


def _ds_mla_quantise(x: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-rotary channels in groups of 64 (the last one may be short) -> (FP8 codes
    [..., nope], power-of-two scales [..., ceil(nope/64), 1])."""
    nope = _ds_mla_split(x.shape[-1], rope_dim)
    groups = _pad_last(x[..., :nope].float(), 64).unflatten(-1, (-1, 64))
    scale = _pow2_ceil(groups.abs().amax(-1, keepdim=True).clamp_min(1e-4) * (1 / 448))
    codes = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.flatten(-2)[..., :nope], scale


def _ds_mla_values(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    nope = codes.shape[-1]
    grouped = _pad_last(codes.float(), 64).unflatten(-1, (-1, 64))
    return (grouped * scale).flatten(-2)[..., :nope]


def ds_mla_fake_quant(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    codes, scale = _ds_mla_quantise(x, rope_dim)
    rope = x[..., x.shape[-1] - rope_dim:].to(torch.bfloat16).float()
    return torch.cat([_ds_mla_values(codes, scale), rope], dim=-1).to(x.dtype)


def ds_mla_pack(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[nope FP8 codes | rope_dim bf16 | ceil(nope/64) UE8M0 scales | 1 pad byte]."""
    codes, scale = _ds_mla_quantise(x, rope_dim)
    lead = x.shape[:-1]
    rope = x[..., x.shape[-1] - rope_dim:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).reshape(*lead, -1)
    pad = torch.zeros(*lead, 1, dtype=torch.uint8, device=x.device)
    return torch.cat([codes.contiguous().view(torch.uint8), rope, scales, pad], dim=-1)


def ds_mla_unpack(records: torch.Tensor, width: int, rope_dim: int) -> torch.Tensor:
    nope = _ds_mla_split(width, rope_dim)
    codes = records[..., :nope].contiguous().view(torch.float8_e4m3fn)
    rope = records[..., nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    n_scales = -(-nope // 64)
    scale_bytes = records[..., nope + 2 * rope_dim:nope + 2 * rope_dim + n_scales]
    scale = (scale_bytes.to(torch.int32) << 23).view(torch.float32)[..., None]
    return torch.cat([_ds_mla_values(codes, scale), rope], dim=-1)


# ------------------------------------------------------------------ per-cache codecs
# KVCacheSpec.record_format -> the format above.
SPEC_FORMATS = {"fp8_ue8m0": "fp8", "nvfp4_ds_mla": "nvfp4", "mxfp4_index": "mxfp4",
                "fp8_ds_mla": "fp8_ds_mla"}


@dataclass(frozen=True, slots=True)
class RecordCodec:
    """How one cache's entries are quantised (fmt: fp8 | nvfp4 | mxfp4 | fp8_ds_mla)."""

    fmt: str
    width: int
    rope_dim: int = 0

    def fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp8_ds_mla":
            return ds_mla_fake_quant(x, self.rope_dim)
        return fake_quant(x, self.fmt)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp8_ds_mla":
            return ds_mla_pack(x, self.rope_dim)
        return pack(x, self.fmt)

    def unpack(self, records: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp8_ds_mla":
            return ds_mla_unpack(records, self.width, self.rope_dim)
        return unpack(records, self.fmt, self.width)


def codec_for(record_format: str, width: int, rope_dim: int = 0) -> RecordCodec:
    if record_format not in SPEC_FORMATS:
        raise ValueError(f"no codec for KV record format {record_format!r}; known: "
                         f"{sorted(SPEC_FORMATS)}")
    return RecordCodec(SPEC_FORMATS[record_format], width, rope_dim)
