"""Causal grouped-query attention over a paged K||V cache (backend "reference").

One cache entry per position (compress_ratio 1) holds the rotated keys and the values of all KV
heads: entry = [k_0 .. k_{Hkv-1} | v_0 .. v_{Hkv-1}], width 2 * Hkv * D.

A step first writes its new tokens' entries (through the group's slot mapping), then every
request attends to positions [lo, seq_len) read back through its block table, where lo is 0 for
full attention and seq_len - query_len - window + 1 for a sliding window of `window` positions
(query position p sees keys (p - window, p], as in transformers' sliding-window mask).
Requests are handled one at a time (a host loop per request, never per token); within a request
the work is one batched SDPA call. This is the readable oracle; paged_attention_batched.py runs
the same maths for all requests at once (the default), and registry.py picks between them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from wideserve.types.forward_batch import ForwardBatch, KVGroupView


def write_kv(cache: torch.Tensor, view: KVGroupView, k: torch.Tensor, v: torch.Tensor,
             keep: torch.Tensor | None = None) -> None:
    """Store k, v [T, Hkv, D] at the view's slot mapping; slots of -1 (and rows where
    `keep` [T] is False) are skipped."""
    if view.slot_mapping is None:
        raise ValueError("paged attention needs a slot mapping (compress_ratio 1 group)")
    num_tokens = k.shape[0]
    flat = cache.view(-1, cache.shape[-1])                                    # [slots, W]
    entries = torch.cat((k.reshape(num_tokens, -1), v.reshape(num_tokens, -1)), dim=-1)
    if entries.shape[-1] != flat.shape[-1]:
        raise ValueError(f"KV entry width {entries.shape[-1]} != cache width {flat.shape[-1]}")
    slots = view.slot_mapping
    valid = slots >= 0
    if keep is not None:
        valid = valid & keep
    # Boolean indexing costs a device sync; acceptable in the reference op.
    flat[slots[valid]] = entries[valid].to(flat.dtype)


def replay_keep_mask(batch: ForwardBatch) -> torch.Tensor | None:
    """[T] False for replayed positions whose FULL-cache entries are already stored."""
    if batch.kv_write_start is None:
        return None
    qlens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
    req_of_token = torch.repeat_interleave(
        torch.arange(batch.num_reqs, device=qlens.device), qlens, output_size=batch.num_tokens)
    return batch.positions >= batch.kv_write_start[req_of_token]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                    cache_name: str, scale: float, window: int | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (k already rotated) -> [T, H, D].

    window: None for full attention, else the sliding-window length in positions."""
    cache, view = batch.cache(cache_name)
    if view.compress_ratio != 1:
        raise ValueError(f"{cache_name}: paged attention needs compress_ratio 1, "
                         f"got {view.compress_ratio}")
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    # Replayed prefix positions are rewritten only where the cache is a window (bounded state).
    write_kv(cache, view, k, v, keep=replay_keep_mask(batch) if window is None else None)
    flat = cache.view(-1, cache.shape[-1])
    kv_split = num_kv_heads * head_dim
    out = torch.empty_like(q)
    qsl, seq_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu
    for r in range(batch.num_reqs):
        start, end = int(qsl[r]), int(qsl[r + 1])
        if end == start:
            continue
        seq_len = int(seq_lens[r])
        lo = 0 if window is None else max(0, seq_len - (end - start) - window + 1)
        key_pos = torch.arange(lo, seq_len, device=q.device)                        # [L]
        slots = view.block_table[view.row(r), key_pos // view.block_size] * view.block_size \
            + key_pos % view.block_size
        entries = flat[slots].to(q.dtype)                                            # [L, W]
        keys = entries[:, :kv_split].view(-1, num_kv_heads, head_dim).transpose(0, 1)  # [Hkv, L, D]
        values = entries[:, kv_split:].view(-1, num_kv_heads, head_dim).transpose(0, 1)
        q_pos = batch.positions[start:end]                                           # [Q]
        visible = key_pos[None, :] <= q_pos[:, None]                                 # [Q, L]
        if window is not None:
            visible &= key_pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), keys, values, attn_mask=visible,
            scale=scale, enable_gqa=True)                                            # [H, Q, D]
        out[start:end] = o.transpose(0, 1)
    return out
