"""Block-scaled FP8 / FP4 weight formats of DeepSeek checkpoints (docs/deepseek_v4.md, "Quantised weights"),
of HF / vLLM FP8 checkpoints (Qwen3 FP8) and of NVIDIA ModelOpt NVFP4 checkpoints.

Glossary
- UE8M0: an unsigned 8-bit exponent, value 2^(byte - 127); byte 255 is NaN. Stored as
  `torch.float8_e8m0fnu` (or raw uint8 bytes). A UE8M0 scale multiplies the stored code.
- FP8 block scales: weight float8_e4m3fn [out, in]; one scale per [bm, bn] tile, grid
  [ceil(out/bm), ceil(in/bn)] (the last tiles may be partial). DeepSeek-V4: [128, 128].
- FP4 (e2m1): two codes per byte, the LOW nibble holds the even column; bit 3 of a code is the
  sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}. One UE8M0 scale per `group` consecutive
  values along the input dimension (DeepSeek-V4 experts: 32), grid [out, ceil(in/group)].
- HF `weight_scale_inv` companions hold the same multiplier, possibly as fp32/bf16 (Qwen3 FP8:
  fp32 amax / 448, not a power of two).
- NVFP4 (ModelOpt): e2m1 codes packed as FP4 above, one FP8-E4M3 scale per 16 values along the
  input dimension (`weight_scale`) and one fp32 global scale per tensor (`weight_scale_2`):
  w = code * scale * global.

Everything here is a pure function on tensors, computed on the device of its input, so a GPU
path can keep the quantised tensors and call these only where it needs dense weights.
Any number of leading (batch) dimensions is allowed, e.g. stacked experts [E, out, in].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


def e4m3_to_float(scale: torch.Tensor) -> torch.Tensor:
    """FP8-E4M3 values (float8_e4m3fn or their uint8 bytes) -> float32, exact."""
    return fp8_e4m3_to_float(scale)


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


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     group: int = 16, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """NVFP4: packed e2m1 [..., out, in/2] x E4M3 scales [..., out, ceil(in/group)] x fp32
    global scale [...] (one per tensor) -> dense `dtype` [..., out, in]. Code times scale is
    exact in fp32; times the global scale rounds once; then once more to `dtype`."""
    values = unpack_fp4_e2m1(packed)
    rows, cols = values.shape[-2:]
    _check_grid(scale, scale_grid(values.shape, (1, group)), f"NVFP4 weight {tuple(values.shape)}")
    g = global_scale.float().reshape(*values.shape[:-2], 1, 1)
    return ((values * expand_scale(e4m3_to_float(scale), rows, cols, (1, group))) * g).to(dtype)


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


def quantize_nvfp4(weight: torch.Tensor, group: int = 16
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [..., out, in] -> (uint8 packed e2m1 [..., out, in/2], float8_e4m3fn scales
    [..., out, ceil(in/group)], fp32 global scale [...]) as ModelOpt writes NVFP4: global =
    amax / (6 * 448) per tensor, block scale = block amax / 6 / global rounded to E4M3."""
    rows, cols = weight.shape[-2:]
    if cols % 2:
        raise ValueError(f"FP4 packing needs an even input dimension, got {cols}")
    w = weight.float()
    amax = w.abs().amax(dim=(-2, -1)).clamp(min=torch.finfo(torch.float32).tiny)
    global_scale = amax / (FP4_E2M1_MAX * FP8_E4M3_MAX)
    g = global_scale[..., None, None]
    block = _tile_amax(w, (1, group)) / FP4_E2M1_MAX / g
    scale = block.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    full = expand_scale(scale.float(), rows, cols, (1, group)) * g
    x = torch.where(full > 0, w / full, torch.zeros_like(w))
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    mag = (x.abs().clamp(max=FP4_E2M1_MAX).unsqueeze(-1) - table).abs().argmin(dim=-1)
    codes = (mag | ((x < 0).long() << 3)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale, global_scale


# --- routed experts kept in their checkpoint format (layers/experts.py) ---

_OP_IDS = {"fp8": 0, "mxfp4": 1, "nvfp4": 2}      # kernels/quant_gemm.py's format ids


@dataclass(frozen=True, slots=True)
class ExpertFormat:
    """How a stack of expert weights [L, rows, cols] is held in memory when it stays in the
    checkpoint's format: codes as uint8 [L, rows, packed_cols(cols)], scales [L, scale_rows,
    ceil(cols / block[1])] as stored (`scale_dtype`: "ue8m0" / "e4m3" bytes as uint8, or
    "fp32" multipliers) and, for NVFP4, global scales [L, halves] fp32. The bytes are the
    checkpoint's; only their layout may differ: a gate/up stack (`halves` = 2) keeps the gate's
    and the up projection's scale grids (and global scales) one after the other, as w1 and w3
    are separate tensors in the checkpoint (a 128-row FP8 block would otherwise straddle them
    when I is not a multiple of 128).
    - "fp8": e4m3 codes, one scale per `block` = (rows, cols) tile (DeepSeek: 128 x 128, UE8M0;
      Qwen3 FP8: 128 x 128, fp32);
    - "mxfp4": e2m1 codes, two per byte (low nibble = even column), one UE8M0 scale per
      `block[1]` values of a row (block = (1, 32));
    - "nvfp4": e2m1 codes as MXFP4, one E4M3 scale per `block[1]` (16) values of a row and one
      fp32 global scale per expert and projection (ModelOpt's `weight_scale_2`)."""

    kind: str
    block: tuple[int, int]
    scale_dtype: str = "ue8m0"

    @property
    def op_id(self) -> int:
        """The format id of the C++ op (wideserve/kernels/quant_gemm.py)."""
        return _OP_IDS[self.kind]

    @property
    def has_global(self) -> bool:
        return self.kind == "nvfp4"

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return torch.float32 if self.scale_dtype == "fp32" else torch.uint8

    @property
    def scale_bytes(self) -> int:
        """Bytes per stored scale: 4 for fp32 multipliers, 1 for UE8M0 / E4M3 bytes."""
        return self.scale_torch_dtype.itemsize

    def packed_cols(self, cols: int) -> int:
        return cols if self.kind == "fp8" else cols // 2

    def scale_shape(self, rows: int, cols: int, halves: int = 1) -> tuple[int, int]:
        return (halves * math.ceil(rows // halves / self.block[0]),
                math.ceil(cols / self.block[1]))

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, halves: int = 1,
                   dtype: torch.dtype = torch.bfloat16,
                   global_scale: torch.Tensor | None = None) -> torch.Tensor:
        """[..., rows, packed] codes, [..., Sr, Sc] scales (and [..., halves] global scales)
        -> dense `dtype` [..., rows, cols]."""
        if halves == 2:
            c_gate, c_up = codes.chunk(2, dim=-2)
            s_gate, s_up = scale.chunk(2, dim=-2)
            g = (None, None) if global_scale is None else global_scale.unbind(-1)
            return torch.cat([self.dequantize(c_gate, s_gate, 1, dtype, g[0]),
                              self.dequantize(c_up, s_up, 1, dtype, g[1])], dim=-2)
        if self.scale_dtype != "fp32":
            scale = scale.view(torch.uint8)
        if self.kind == "nvfp4":
            if global_scale is None:
                raise ValueError("NVFP4 experts need their global scales")
            g = global_scale.reshape(codes.shape[:-2])
            return dequantize_nvfp4(codes, scale, g, self.block[1], dtype)
        if self.kind == "fp8":
            return dequantize_fp8_block(codes.view(torch.float8_e4m3fn), scale, self.block, dtype)
        return dequantize_fp4(codes, scale, self.block[1], dtype)

    def quantize(self, dense: torch.Tensor, halves: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Dense [..., rows, cols] -> (uint8 codes, scales in `scale_dtype`'s storage, global
        scales [..., halves] fp32 or None) in this layout."""
        if halves == 2:
            parts = [self.quantize(h) for h in dense.chunk(2, dim=-2)]
            glob = None if parts[0][2] is None else torch.cat([p[2] for p in parts], dim=-1)
            return (torch.cat([p[0] for p in parts], dim=-2),
                    torch.cat([p[1] for p in parts], dim=-2), glob)
        if self.kind == "nvfp4":
            q, s, g = quantize_nvfp4(dense, self.block[1])
            return q, s.view(torch.uint8), g.unsqueeze(-1)
        if self.kind == "fp8":
            q, s = quantize_fp8_block(dense, self.block)
        else:
            q, s = quantize_fp4(dense, self.block[1])
        s = s.view(torch.uint8)
        return q.view(torch.uint8), ue8m0_to_float(s) if self.scale_dtype == "fp32" else s, None


def expert_format(kind: str, fp8_block: tuple[int, int] = (128, 128),
                  fp4_group: int = 32, scale_dtype: str | None = None,
                  nvfp4_group: int = 16) -> ExpertFormat:
    """The config's `expert_dtype` ("fp8" / "fp4"; "mxfp4" accepted; "nvfp4") -> its
    ExpertFormat. `scale_dtype`: "fp32" for FP8 scales stored as float multipliers."""
    if kind == "fp8":
        return ExpertFormat("fp8", tuple(fp8_block), scale_dtype or "ue8m0")
    if kind in ("fp4", "mxfp4"):
        return ExpertFormat("mxfp4", (1, fp4_group), scale_dtype or "ue8m0")
    if kind == "nvfp4":
        return ExpertFormat("nvfp4", (1, nvfp4_group), "e4m3")
    raise ValueError(f"no checkpoint expert format {kind!r}; known: fp8, fp4 (MXFP4), nvfp4")


def ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as UE8M0 bytes: UE8M0 as is; float multipliers that are all powers of two
    converted exactly (HF `weight_scale_inv` companions); anything else is refused."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.view(torch.uint8)
    f = scale_to_float(scale)
    mant, exp = torch.frexp(f)
    if not bool(((mant == 0.5) & (exp - 1 >= -127) & (exp - 1 <= 127)).all()):
        raise ValueError("scales that are not powers of two cannot be kept as UE8M0; load with "
                         "dequantised experts")
    return (exp - 1 + 127).to(torch.uint8)


def dequant_grouped_linear(x: torch.Tensor, counts: torch.Tensor, codes: torch.Tensor,
                           scale: torch.Tensor, fmt: ExpertFormat, halves: int,
                           global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of kernels/quant_gemm.grouped_linear (no C++ op, another device): each
    expert with rows dequantised on the fly, used, dropped; no dense copy is kept. One host
    read of the counts."""
    out = x.new_empty(x.shape[0], codes.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            g = None if global_scale is None else global_scale[e]
            w = fmt.dequantize(codes[e], scale[e], halves, x.dtype, g)
            out[start:start + n] = torch.nn.functional.linear(x[start:start + n], w)
            start += n
    return out


def scaled_mm_grouped_linear(x: torch.Tensor, counts: torch.Tensor, codes: torch.Tensor,
                             scale: torch.Tensor, fmt: ExpertFormat, halves: int) -> torch.Tensor:
    """FP8 experts through torch._scaled_mm (CUDA where the device has FP8 tensor cores):
    per expert with rows and per K block of the scale grid, the rows quantised to e4m3 with one
    fp32 scale per row (as the official kernel quantises activations per 1 x 128 block) times
    the stored codes with their block scale per output row, summed in fp32. Approximate (the
    activations are quantised); the CPU dequantises instead. One host read of the counts."""
    if fmt.kind != "fp8":
        raise ValueError("torch._scaled_mm takes FP8 weights only")
    rows, K = codes.shape[1], x.shape[1]
    bn = fmt.block[1]
    out = torch.zeros(x.shape[0], rows, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if not n:
            continue
        w = codes[e].view(torch.float8_e4m3fn)
        s_rows = _scale_rows(scale[e], rows, fmt.block[0], halves)                    # [R, Sc]
        pad = -n % 16                          # _scaled_mm wants M, N, K multiples of 16
        xe = _pad_rows(x[start:start + n].float(), pad)
        for kb in range(0, K, bn):
            xb = xe[:, kb:kb + bn]
            amax = xb.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
            sa = amax / FP8_E4M3_MAX
            xq = (xb / sa).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            sb = s_rows[:, kb // bn].reshape(1, rows).contiguous()
            part = torch._scaled_mm(xq, w[:, kb:kb + bn].t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16)
            out[start:start + n] += part[:n].float()
        start += n
    return out.to(x.dtype)


def _scale_rows(scale: torch.Tensor, rows: int, bm: int, halves: int) -> torch.Tensor:
    """A stored scale grid [Sr, Sc] -> the fp32 scale of each weight row [rows, Sc]."""
    f = scale.float() if scale.dtype == torch.float32 else ue8m0_to_float(scale.view(torch.uint8))
    if halves == 2:
        return torch.cat([expand_scale(h, rows // 2, h.shape[1], (bm, 1))
                          for h in f.chunk(2, dim=0)], dim=0)
    return expand_scale(f, rows, f.shape[1], (bm, 1))


def _pad_rows(x: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
