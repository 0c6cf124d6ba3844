"""One request's prefill chunk attending to its cached context through torch's fused SDPA
(docs/cpu_kernels.md, "Chunked and mixed prefills"): the chunk's keys and values are
gathered from the paged K||V cache into one contiguous copy, and SDPA (on the CPU oneDNN's
flash attention, its GEMMs on brgemm: AMX where present) runs the whole causal block with a
bottom-right mask. It beats the C++ paged op (csrc/paged_attention.cpp, scalar-per-key online
softmax) from ~128 query rows up on AMX machines; which one runs is the kernel choice's
"attention_ctx" family (kernels/choice.py), measured per machine.

Cache layout (layers/attention/paged_attention_batched.py): [blocks, block_size, 2*Hkv*D],
an entry being K (Hkv*D) then V (Hkv*D); a request's block table row maps its positions to
blocks. Only positions below the request's length are read (no stale slot reaches SDPA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
