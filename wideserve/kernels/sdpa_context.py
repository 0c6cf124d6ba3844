"""One request's prefill (or prefill chunk after its cached context) attending as a whole
(docs/cpu_kernels.md, "Chunked and mixed prefills", "Flash prefill"), two ways:
- torch's fused SDPA (`attend_paged`): the keys and values gathered from the paged K||V cache
  into one contiguous copy, SDPA (on the CPU torch's flash attention) running the whole causal
  block with a bottom-right mask;
- the extension's flash kernel (`attend_flash`, csrc/flash_attention.cpp): both products on
  brgemm (AMX where present) reading the cache in place, bf16 only.
Either beats the C++ paged op (csrc/paged_attention.cpp, scalar-per-key online softmax) from
~128 query rows up on AMX machines; which one runs is the kernel choice's "attention" /
"attention_ctx" families (kernels/choice.py), measured per machine.

Cache layout (layers/attention/paged_attention_batched.py): [blocks, block_size, 2*Hkv*D],
an entry being K (Hkv*D) then V (Hkv*D); a request's block table row maps its positions to
blocks. Only positions below the request's length are read (no stale slot reaches SDPA).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from wideserve.kernels.loader import cpu_ops_available


def gather_context(cache: torch.Tensor, blocks: torch.Tensor, length: int, kv_heads: int,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, length) of the request whose block table row is
    `blocks` ([max_blocks] int64): two [Hkv, length, D] views of one gathered copy."""
    block_size = cache.shape[1]
    flat = cache.view(-1, cache.shape[-1])
    pos = torch.arange(length, device=cache.device)
    slots = blocks[pos // block_size] * block_size + pos % block_size
    e = flat.index_select(0, slots).to(dtype).view(length, 2, kv_heads, -1)
    return e[:, 0].transpose(0, 1), e[:, 1].transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Lq, H, D] the last Lq positions of a request, k/v [Hkv, S, D] its positions [0, S)
    (S >= Lq) -> [Lq, H, D]: query i (position S - Lq + i) sees keys 0..S-Lq+i."""
    lq, heads = q.shape[0], q.shape[1]
    s, kv_heads = k.shape[1], k.shape[0]
    context = s - lq
    if context < 0:
        raise ValueError(f"{lq} queries but only {s} keys")
    qh = q.transpose(0, 1)[None]                                          # [1, H, Lq, D]
    gqa = heads != kv_heads
    if context == 0:
        o = F.scaled_dot_product_attention(qh, k[None], v[None], is_causal=True, scale=scale,
                                           enable_gqa=gqa)
    else:
        # torch's is_causal is top-left aligned when Lq != S: the bottom-right mask explicitly
        mask = torch.ones(lq, s, dtype=torch.bool, device=q.device).tril_(context)
        o = F.scaled_dot_product_attention(qh, k[None], v[None], attn_mask=mask, scale=scale,
                                           enable_gqa=gqa)
    return o[0].transpose(0, 1)


def attend_paged(q: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, length: int,
                 scale: float) -> torch.Tensor:
    """`attend` over the request's cached positions [0, length): q [Lq, H, D] its last Lq."""
    kv_heads = cache.shape[-1] // (2 * q.shape[-1])
    k, v = gather_context(cache, blocks, length, kv_heads, q.dtype)
    return attend(q, k, v, scale)


FLASH_MAX_DIM = 256


@functools.cache
def flash_compiled() -> bool:
    """Whether the flash kernel runs on this CPU (AVX512-BF16 build, torch's bf16 brgemm)."""
    return cpu_ops_available() and bool(torch.ops.wideserve.flash_prefill_available())


def flash_fits(head_dim: int) -> bool:
    """Whether the flash kernel takes heads of this size (brgemm's VNNI pairs, 32-wide K)."""
    return head_dim % 32 == 0 and head_dim <= FLASH_MAX_DIM and flash_compiled()


def attend_flash(q: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, length: int,
                 scale: float) -> torch.Tensor:
    """`attend_paged` by the flash kernel: q [Lq, H, D] bf16 the last Lq of the request's
    `length` positions, read from the bf16 cache in place through its block table row."""
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()        # the op reads each query's heads as one row
    return torch.ops.wideserve.flash_prefill(q, cache, blocks, length, scale)
