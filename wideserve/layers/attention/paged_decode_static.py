"""Paged GQA decode attention in static shapes over device metadata (backend "static").

The attention a CUDA graph can record (docs/cuda_graphs.md): a decode step of R requests,
one new token each, over the paged K||V cache (the entry layout of paged_attention.py).
Every tensor shape depends only on R and on the block table's width (its reserved, fixed
width when a graph is captured), and the op reads only tensors already on the device: the
block table, the request rows, the slot mapping and the context lengths. Nothing is planned
on the host from the step's context lengths, nothing is read back, no output shape depends
on a tensor's values. A replay therefore recomputes correctly whatever the contexts are.

The maths: request r's query (at position seq_len - 1) attends to every position of its row
of the block table, gathered through it; positions >= seq_len (and, with a sliding
window, those at or below seq_len - 1 - window) are masked on the device. The gathered width
is the whole table row, not the request's context: the price of fixed shapes, paid in
memory traffic, not in host time. With a sliding window only the `window_columns` columns
the window can touch are gathered, from a first column computed per request on the device:
a width fixed by the window. The row is walked in chunks of whole blocks (at most
KEY_CHUNK_ELEMENTS gathered cache elements per chunk) combined by an online softmax, so the
scratch stays bounded at long tables; a table that fits is one chunk.

Precision: everything in fp32 (the gathered entries upcast, both products, the softmax, the
combine), the output rounded once to the model dtype. Measured in bf16 against an fp32 oracle
(16 requests, 4 KV heads x 4, head dim 64, up to 256 positions, 5 seeds): max error
0.0025-0.0039 on outputs of size ~3, equal to the per-request SDPA reference's own (the last
rounding); with the two products in bf16, as the "batched" backend's GEMM path computes them,
it was 0.0046-0.011, 2-3x that (the scores and the probabilities each rounded to bf16). The cost is
the gathered scratch in fp32 (KEY_CHUNK_ELEMENTS bounds it).

Masked positions never read what lies there (a stale entry, another request's, a position
that left the window): their slot is replaced by the request's own new entry, written just
before, so nothing gathered can be NaN and 0 * NaN cannot reach an output. Their score is
the finite MASKED rather than -inf: a chunk whose positions are all masked then has a finite
max and sum, and its weight in the combine, exp(MASKED - m), is exactly 0 against the real
maximum m (every request sees its own new token, so m is a real score).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wideserve.types.forward_batch import ForwardBatch, KVGroupView

KEY_CHUNK_ELEMENTS = 1 << 25     # R x positions x entry width gathered per chunk (128 MiB fp32)
MASKED = torch.finfo(torch.float32).min


def is_decode_batch(batch: ForwardBatch) -> bool:
    """Every request exactly one new token and every token written (no bounded replay): the
    batches this op takes. Reads shapes and the host query offsets only (no device read)."""
    if batch.kv_write_start is not None or batch.num_tokens != batch.num_reqs:
        return False
    return bool((np.diff(batch.query_start_loc_cpu) == 1).all())


def chunk_blocks(num_reqs: int, width: int, block_size: int, entry_width: int,
                 budget: int = KEY_CHUNK_ELEMENTS) -> int:
    """Blocks of the table row gathered per chunk: as many as fit `budget` cache elements
    over all requests (at least one, at most the whole row)."""
    per_block = max(1, num_reqs * block_size * entry_width)
    return max(1, min(width, budget // per_block))


def window_columns(window: int, block_size: int) -> int:
    """Table columns the positions (p - window, p] can touch, whatever p is."""
    return -(-(window - 1) // block_size) + 1


def paged_decode_static(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                        cache_name: str, scale: float, window: int | None = None,
                        plans: object = None) -> torch.Tensor:
    """q [R, H, D], k/v [R, Hkv, D] (k rotated) of a decode batch (`is_decode_batch`) ->
    [R, H, D]; the paged backends' contract (`plans` is not read)."""
    cache, view = batch.cache(cache_name)
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    entry = (view.block_size, 2 * num_kv_heads * head_dim)
    if (view.compress_ratio != 1 or view.slot_mapping is None or num_heads % num_kv_heads
            or tuple(cache.shape[1:]) != entry):
        raise ValueError(f"{cache_name}: static decode attention needs a compress_ratio 1 group "
                         f"with a slot mapping, a cache [blocks, {entry[0]}, {entry[1]}] and "
                         f"query heads a multiple of KV heads; got ratio {view.compress_ratio}, "
                         f"cache {tuple(cache.shape)}, {num_heads} / {num_kv_heads} heads")
    entries = torch.cat((k.reshape(num_reqs, -1), v.reshape(num_reqs, -1)), dim=-1)
    # Every decode token is written (the runner never maps one to -1): no mask, no sync.
    cache.view(-1, cache.shape[-1]).index_copy_(0, view.slot_mapping, entries.to(cache.dtype))
    return decode_attention(q, cache, view, batch.seq_lens, scale, window)


def decode_attention(q: torch.Tensor, cache: torch.Tensor, view: KVGroupView,
                     seq_lens: torch.Tensor, scale: float, window: int | None,
                     budget: int = KEY_CHUNK_ELEMENTS) -> torch.Tensor:
    """q [R, H, D], one query per request at position seq_lens[r] - 1 whose entry is already
    at view.slot_mapping[r], over the cache [blocks, block_size, 2*Hkv*D] through the view's
    block table -> [R, H, D] (q's dtype)."""
    num_reqs, num_heads, head_dim = q.shape
    block_size, entry_width = cache.shape[1], cache.shape[2]
    num_kv_heads = entry_width // (2 * head_dim)
    rows = (view.req_rows if view.req_rows is not None
            else torch.arange(num_reqs, device=q.device))
    table = view.block_table.index_select(0, rows)                       # [R, width]
    width = table.shape[1]
    cols = torch.arange(width, device=q.device)[None, :]                # [1, width] columns
    if window is not None and window_columns(window, block_size) < width:
        # A window touches a fixed number of columns: gather those of each request's row.
        first = torch.div((seq_lens - window).clamp(min=0), block_size, rounding_mode="floor")
        cols = first[:, None] + cols[:, :window_columns(window, block_size)]   # [R, span]
        table = table.gather(1, cols.clamp(max=width - 1))   # past the row: masked positions
        width = cols.shape[1]
    queries = q.float().view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    req = _Requests(queries,
                    cache.view(-1, entry_width), (seq_lens - 1)[:, None],
                    view.slot_mapping[:, None], scale, window)
    step = chunk_blocks(num_reqs, width, block_size, entry_width, budget)
    m = total = acc = None
    for b0 in range(0, width, step):
        m_c, total_c, out_c = req.chunk(table[:, b0:b0 + step], cols[:, b0:b0 + step],
                                        block_size)
        if m is None:
            m, total, acc = m_c, total_c, out_c
            continue
        m_new = torch.maximum(m, m_c)
        old, new = torch.exp(m - m_new), torch.exp(m_c - m_new)
        total = total * old + total_c * new
        acc = acc * old + out_c * new
        m = m_new
    return (acc / total).to(q.dtype).view(num_reqs, num_heads, head_dim)


@dataclass(slots=True)
class _Requests:
    """What every chunk of one call reads."""

    queries: torch.Tensor        # [R, Hkv, G, D] fp32
    flat: torch.Tensor           # [slots, W] the cache
    q_pos: torch.Tensor          # [R, 1] each query's position
    own_slot: torch.Tensor       # [R, 1] the slot of each request's new entry
    scale: float
    window: int | None

    def chunk(self, blocks: torch.Tensor, cols: torch.Tensor, block_size: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The blocks [R, n] at table columns `cols` ([1 or R, n]: their positions):
        (max [R, Hkv, G, 1], sum of exp [R, Hkv, G, 1], unnormalised output [R, Hkv, G, D]),
        all fp32."""
        num_reqs, num_kv_heads, _, head_dim = self.queries.shape
        c = blocks.shape[1] * block_size
        offsets = torch.arange(block_size, device=blocks.device)
        slots = (blocks[:, :, None] * block_size + offsets).view(num_reqs, c)   # [R, c]
        key_pos = (cols[:, :, None] * block_size + offsets).view(cols.shape[0], c)
        hidden = key_pos > self.q_pos                                            # [R, c]
        if self.window is not None:
            hidden |= key_pos <= self.q_pos - self.window
        slots = torch.where(hidden, self.own_slot, slots)
        kv = self.flat.index_select(0, slots.view(-1)).float()
        kv = kv.view(num_reqs, c, 2, num_kv_heads, head_dim)
        keys = kv[:, :, 0].permute(0, 2, 3, 1)                                   # [R, Hkv, D, c]
        values = kv[:, :, 1].transpose(1, 2)                                     # [R, Hkv, c, D]
        scores = torch.matmul(self.queries, keys).mul_(self.scale)              # [R, Hkv, G, c]
        scores.masked_fill_(hidden[:, None, None, :], MASKED)
        m = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - m)
        out = torch.matmul(p, values)
        return m, p.sum(dim=-1, keepdim=True), out
