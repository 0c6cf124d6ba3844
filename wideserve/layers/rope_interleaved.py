"""DeepSeek-V4 rotary embedding (docs/deepseek_v4.md, "Attention").

Partial and interleaved: only the trailing `rope_dim` channels of a head rotate, in adjacent
pairs (2i, 2i+1) by angle pos * inv_freq[i]. Two tables exist: "main" (pure sliding-window
layers, plain RoPE) and "compress" (everything in CSA/HCA layers: q, window kv, compressed
entries, indexer; higher theta plus frequency-only YaRN). The attention output is rotated back
by the query position (`inverse=True`) because V = K carries RoPE.

cos/sin are kept in fp32 (HF casts them to the model dtype first; identical in fp32).
"""
from __future__ import annotations

import math
from typing import Any

import torch


def _yarn_attention_factor(params: dict[str, Any], factor: float) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, m) / mscale(factor, m_all)
    return mscale(factor)


def rope_inv_freq(params: dict[str, Any], rope_dim: int) -> tuple[torch.Tensor, float]:
    """inv_freq [rope_dim // 2] (fp32, CPU) and the cos/sin scale for one rope table."""
    base = float(params["rope_theta"])
    # Same fp32 arithmetic as the HF reference, so tables match bit for bit.
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32, device="cpu") / rope_dim
    pos_freqs = base ** exponents
    inv_freq = 1.0 / pos_freqs
    if params.get("rope_type", "default") == "default":
        return inv_freq, 1.0
    # YaRN, frequency only: fast pairs keep their frequency, slow pairs are divided by factor.
    factor = float(params["factor"])
    orig = float(params["original_max_position_embeddings"])
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, _yarn_attention_factor(params, factor)


class RotaryTable:
    """cos/sin for positions from one rope table; not an nn.Module so that meta-device
    construction never leaves it uninitialised. Device copies are cached per instance."""

    def __init__(self, params: dict[str, Any], rope_dim: int) -> None:
        self.rope_dim = rope_dim
        self.inv_freq, self.scale = rope_inv_freq(params, rope_dim)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] (any int dtype) -> cos, sin [N, rope_dim // 2] fp32."""
        dev = positions.device
        inv = self._on_device.get(dev)
        if inv is None:
            inv = self._on_device[dev] = self.inv_freq.to(dev)
        freqs = positions.float()[..., None] * inv
        return freqs.cos() * self.scale, freqs.sin() * self.scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x in adjacent pairs.

    x [N, ..., D]; cos/sin [N, r/2] (broadcast over the middle axes). inverse=True rotates by
    the negative angle. Computed in fp32, returned in x's dtype.
    """
    half = cos.shape[-1]
    r = 2 * half
    extra = x.dim() - 2
    c = cos.reshape(cos.shape[0], *([1] * extra), half)
    s = sin.reshape(sin.shape[0], *([1] * extra), half)
    if inverse:
        s = -s
    pairs = x[..., -r:].float().unflatten(-1, (half, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


def rope_cis(cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """cos/sin [N, r/2] -> the rotation as complex64 cos + i*sin (or its conjugate) for
    `rotate`; build it once per step and table, it is shared by every layer."""
    return torch.complex(cos, -sin if inverse else sin)


def rotate(x: torch.Tensor, cis: torch.Tensor) -> torch.Tensor:
    """`apply_rope` as one complex multiply: pair (x0, x1) as x0 + i*x1 times cis = c + i*s
    gives (x0*c - x1*s) + i*(x0*s + x1*c), the same products and sums as apply_rope (bitwise
    equal on CPU). x [N, ..., D]; cis [N, r/2] complex64 from `rope_cis`."""
    half = cis.shape[-1]
    r = 2 * half
    c = cis.reshape(cis.shape[0], *([1] * (x.dim() - 2)), half)
    pairs = x[..., -r:].float()
    # view_as_complex needs unit stride inside a pair and even strides/offset elsewhere.
    # (Under torch.compile a storage offset cannot be read: copy, the compiler fuses it.)
    if torch.compiler.is_compiling():
        pairs = pairs.clone(memory_format=torch.contiguous_format)
    elif pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
        pairs = pairs.contiguous()
    z = torch.view_as_complex(pairs.unflatten(-1, (half, 2)))
    rotated = torch.view_as_real(z * c).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)
