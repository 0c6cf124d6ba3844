"""Routed experts' bf16 weights in a lossless 12-bit form, and the fused op that decodes them
on the fly (`csrc/moe_lossless.h`; docs/cpu_kernels.md, "Lossless 12-bit expert weights").

A decode step of a MoE model reads every expert's weights from memory once and waits on
memory; this form is 3/4 of the bytes and decodes to exactly the bf16 values, so the op's
outputs equal the bf16 op's with brgemm for every expert, bit for bit. Each value keeps its
low byte; its high byte (sign and 7 exponent bits) becomes a 4-bit code into the tensor's 15
most frequent high bytes, code 15 escaping to an exception list that holds the whole value.

`encode_experts` codes the fused op's packed w13 / w2 (kernels/moe.py `pack_experts`) once, a
derived copy like the packs themselves (layers/experts.py rebuilds it when the weights change).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from wideserve.kernels.loader import cpu_ops_available

CHUNK = 128            # values a chunk codes: four 64-byte vectors of the packed stream
CHUNK_BYTES = 192      # L0, L1 (64 low bytes each), then 64 bytes of two codes
ESCAPE = 15
AMX_K = 32             # the op's AMX tiles take hidden and intermediate in multiples of this
STEP_PAIRS = AMX_K // 2   # K pairs of one AMX tile step
STEP_STREAMS = 2       # csrc/moe_lossless.h kStepStreams


def _chunk_order() -> torch.Tensor:
    """perm[q] = the chunk value (vector v * 32 + word w) stored at coded position q: L0 then
    L1, each position p = 16 * lane + j holding vector 2h (j < 8) or 2h + 1 (j >= 8), word
    8 * lane + j % 8 - the order AVX512's per-lane byte unpacks rebuild."""
    perm = torch.empty(CHUNK, dtype=torch.int64)
    for v in range(4):
        for w in range(32):
            perm[(v // 2) * 64 + 16 * (w // 8) + w % 8 + 8 * (v % 2)] = v * 32 + w
    return perm


PERM = _chunk_order()


def step_slots(steps: int) -> torch.Tensor:
    """slot[s]: where a group's tile step s is stored, in steps from the group's start
    (csrc/moe_lossless.h `step_slot`: step s in run s % STEP_STREAMS, the runs one after
    another, so that the op reading the steps in order reads STEP_STREAMS streams at once)."""
    s = torch.arange(steps)
    run = s % STEP_STREAMS
    return run * (steps // STEP_STREAMS) + run.clamp(max=steps % STEP_STREAMS) \
        + s // STEP_STREAMS


def _steps(shape: torch.Size) -> int:
    """Tile steps of a group of a packed [E, groups, pairs, NB, 16, 2] stack (one where K is
    not whole steps: no AMX op takes it)."""
    return shape[2] // STEP_PAIRS if shape[2] and shape[2] % STEP_PAIRS == 0 else 1


@dataclass(frozen=True)
class CodedMatrix:
    """One of w13 / w2 coded: data [E, groups, group bytes] uint8, exceptions [n] int16 (the
    escaped values' bf16 bits in decode order), starts [E * groups] int64 (each group's first
    exception), table [16] uint8 (the high bytes; entry 15 unused)."""
    data: torch.Tensor
    exceptions: torch.Tensor
    starts: torch.Tensor
    table: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.data, self.exceptions, self.starts, self.table

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.args())


def encode(packed: torch.Tensor) -> CodedMatrix:
    """A packed bf16 stack [E, groups, pairs, NB, 16, 2] -> its coded form (exact: `decode`
    gives it back bit for bit). The C++ op (`csrc/lossless_encode.cpp`, ~6x faster) where
    the extension loads, else `encode_reference`: the same bytes."""
    if packed.dtype != torch.bfloat16 or packed.dim() != 6:
        raise ValueError("lossless.encode: a packed bf16 [E, groups, pairs, NB, 16, 2] stack")
    values = packed[0, 0].numel() if packed.shape[0] and packed.shape[1] else 0
    if values % CHUNK:
        raise ValueError(f"lossless.encode: a group of {values} values is not whole chunks")
    if cpu_ops_available():
        return CodedMatrix(*torch.ops.wideserve.lossless_encode(packed.detach()))
    return encode_reference(packed)


def encode_reference(packed: torch.Tensor) -> CodedMatrix:
    """`encode` in torch ops, one expert at a time (what the C++ op is tested against)."""
    E, groups = packed.shape[:2]
    values = packed[0, 0].numel()
    bits = packed.detach().contiguous().view(torch.int16)
    # the high bytes (arithmetic shift, masked) counted as uint8: no int64 copy of the stack
    high = ((bits.view(-1) >> 8) & 0xFF).to(torch.uint8)
    table_bytes = torch.bincount(high, minlength=256).argsort(
        descending=True, stable=True)[:ESCAPE]
    code_of = torch.full((256,), ESCAPE, dtype=torch.uint8)
    code_of[table_bytes] = torch.arange(ESCAPE, dtype=torch.uint8)
    table = torch.zeros(16, dtype=torch.uint8)
    table[:ESCAPE] = table_bytes.to(torch.uint8)
    data = torch.empty(E, groups, values // CHUNK * CHUNK_BYTES, dtype=torch.uint8)
    steps = _steps(packed.shape)
    slots = step_slots(steps)
    exceptions, counts = [], torch.empty(E, groups, dtype=torch.int64)
    for e in range(E):           # one expert at a time: int64 temporaries stay small
        chunks = bits[e].reshape(groups, -1, CHUNK)[:, :, PERM]         # coded order
        hi = (chunks.to(torch.int64) >> 8) & 0xFF
        codes = code_of[hi]
        low = (chunks & 0xFF).to(torch.uint8)
        packed_codes = codes[..., :64] | (codes[..., 64:] << 4)
        data[e].view(groups, steps, -1)[:, slots] = torch.cat(
            [low, packed_codes], dim=-1).reshape(groups, steps, -1)
        escaped = codes == ESCAPE
        exceptions.append(chunks[escaped])
        counts[e] = escaped.reshape(groups, -1).sum(-1)
    flat = counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    return CodedMatrix(data, torch.cat(exceptions), starts, table)


def decode(coded: CodedMatrix, shape: torch.Size) -> torch.Tensor:
    """The packed bf16 stack of `shape` back from its coded form (tests, and the reference
    for what the op decodes)."""
    E, groups = coded.data.shape[:2]
    steps = _steps(shape)
    raw = coded.data.reshape(E, groups, steps, -1)[:, :, step_slots(steps)].reshape(
        E, groups, -1, CHUNK_BYTES)
    low, packed_codes = raw[..., :128].to(torch.int32), raw[..., 128:].to(torch.int64)
    codes = torch.cat([packed_codes & 0xF, packed_codes >> 4], dim=-1)
    hi = coded.table.to(torch.int32)[codes]
    words = (hi << 8) | low
    escaped = codes == ESCAPE
    words[escaped] = coded.exceptions.to(torch.int32) & 0xFFFF
    out = torch.empty_like(words)
    out[..., PERM] = words
    return (((out + 0x8000) & 0xFFFF) - 0x8000).to(torch.int16).view(torch.bfloat16).reshape(
        shape)


@dataclass(frozen=True)
class CodedExperts:
    w13: CodedMatrix
    w2: CodedMatrix

    @property
    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


def encode_experts(w13: torch.Tensor, w2: torch.Tensor) -> CodedExperts:
    """The fused op's packed (w13, w2) -> their coded forms."""
    return CodedExperts(encode(w13), encode(w2))


@functools.cache          # a fact of the CPU and the build: every forward asks (layers/experts.py)
def available() -> bool:
    """Whether the coded op runs here: the extension's AVX512-BF16 build on a CPU with
    AMX-BF16 (Linux granted the tile state)."""
    return cpu_ops_available() and bool(torch.ops.wideserve.moe_lossless_available())


def fits(hidden: int, intermediate: int) -> bool:
    """Whether the op's AMX tiles take these widths (hidden and the intermediate padded to 16
    both multiples of 32)."""
    return hidden % AMX_K == 0 and (-(-intermediate // 16) * 16) % AMX_K == 0


@torch.compiler.disable      # an opaque C++ op: eager inside a compiled forward
def fused_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  coded: CodedExperts, intermediate: int, limit: float | None,
                  expert_map: torch.Tensor | None = None,
                  expert_load: torch.Tensor | None = None) -> torch.Tensor:
    """kernels/moe.py `fused_experts` on coded weights (bf16 only)."""
    return torch.ops.wideserve.moe_fused_experts_lossless(
        x, topk_ids, topk_weights, *coded.w13.args(), *coded.w2.args(), intermediate, limit,
        expert_map, expert_load)
