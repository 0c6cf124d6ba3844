"""Rotary position embedding in the rotate-half layout of Hugging Face Llama/Qwen.

Channel i of a head is paired with channel i + D/2 (not with its neighbour, as in llama.cpp's
interleaved layout; the GGUF loader un-permutes Q/K weights so this layout applies to them too).

Supported `rope_type`s: "default", "linear", "llama3". Anything else is rejected by name, so a
checkpoint that needs e.g. YaRN fails at load time instead of producing wrong text.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from wideserve.kernels.loader import cpu_ops_available

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ROPE_TABLE_MIN = 1024      # positions of the smallest cos/sin table (RotaryEmbedding.cos_sin)


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """The parts of a config's `rope_parameters` / `rope_scaling` that change frequencies."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0                  # llama3
    high_freq_factor: float = 4.0                 # llama3
    original_max_position_embeddings: int = 8192  # llama3


def parse_rope_config(config_json: dict, default_theta: float = 10000.0
                      ) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from an HF config dict, old style (`rope_theta` + `rope_scaling`)
    or transformers-5 style (`rope_parameters` holding both)."""
    params = config_json.get("rope_parameters") or config_json.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config: rope_parameters must be a dict, got {type(params).__name__}")
    theta = float(params.get("rope_theta", config_json.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config: rope_type {rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", config_json.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"config: partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type == "default":
        return theta, RopeScaling()
    if "factor" not in params:
        raise ValueError(f"config: rope_type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise ValueError(f"config: rope_type 'llama3' needs {key!r}")
    original = params.get("original_max_position_embeddings",
                           config_json.get("max_position_embeddings", 8192))
    return theta, RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]), int(original))


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] fp32, the same arithmetic as transformers' ROPE_INIT_FUNCTIONS."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the middle band blended.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    middle = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(middle, blended, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, Hkv, D] at `positions` [T]."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        # A plain attribute, not a buffer: `model.to(torch.bfloat16)` must not round the
        # frequencies (positions in the thousands would then rotate visibly wrong).
        self._inv_freq = inverse_frequencies(head_dim, theta, scaling or RopeScaling())
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None   # derived: cos_sin()

    def cos_sin(self, positions: torch.Tensor, max_position: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] fp32. `max_position`: a bound (exclusive) on `positions` the caller
        knows on the host; with it, on the CPU, the rows are gathered from tables of every
        position below the bound, computed once (the same values: one row per position of the
        same elementwise arithmetic), instead of five small ops over [T, D] every step. The
        tables grow by doubling. Elsewhere (CUDA: a graph must not see the tables move) the
        rows are computed."""
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        if max_position is None or positions.device.type != "cpu" \
                or torch.compiler.is_compiling():
            return self._compute(positions)
        if self._table is None or self._table[0].shape[0] < max_position:
            size = max(ROPE_TABLE_MIN, 1 << max(0, max_position - 1).bit_length())
            self._table = self._compute(torch.arange(size, device=positions.device))
        cos, sin = self._table
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq[None, :]   # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                        # [T, D]
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D] fp32 tables from `RotaryEmbedding.cos_sin`."""
    # Like transformers: tables are computed in fp32 and applied in the activation dtype.
    cos = cos.to(x.dtype)[:, None, :]                                    # [T, 1, D]
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def fused_norm_rope_applies(qkv: torch.Tensor, enabled: bool = True) -> bool:
    """Whether `norm_rope_qkv_` runs the C++ op (docs/cpu_kernels.md, "q/k norm + RoPE"): CPU,
    fp32/bf16, row-contiguous, no autograd (the op writes in place), the extension built; not
    inside torch.compile (the op has no fake kernel; a compiled graph fuses these ops itself).
    enabled: the caller's switch (llama Attention.cpu_kernel; False: the torch ops)."""
    if not (enabled and qkv.is_cpu and qkv.dtype in KERNEL_DTYPES and qkv.dim() == 2
            and not qkv.requires_grad and qkv.stride(-1) == 1):
        return False
    return not torch.compiler.is_compiling() and cpu_ops_available()


def norm_rope_qkv_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, heads: int,
                   kv_heads: int, eps: float, portable: bool = False) -> None:
    """In place on qkv [T, (H + 2*Hkv) * D] (q heads, k heads, v heads): the per-head RMSNorm
    of q and k (when weights are given) then RoPE, as `rms_norm` + `apply_rotary` do, in one
    pass of torch.ops.wideserve.qk_norm_rope_ (wideserve/kernels/csrc/qk_norm_rope.cpp).
    portable: force its plain C++ loop (no AVX512)."""
    dim = cos.shape[-1]
    torch.ops.wideserve.qk_norm_rope_(qkv, cos.contiguous(), sin.contiguous(), q_weight,
                                      k_weight, heads, kv_heads, dim, eps, portable)
