"""The capturable decode step of DeepSeek-V4 / V4.1 attention (docs/cuda_graphs.md).

A decode batch (every request one new token at position p = its context, no bounded replay)
runs here instead of through V4Step's host-planned layouts when the attention backend sends
decode batches to the static path (`registry.static_decode`: "batched" on every device but
the CPU, "static" everywhere). Nothing here reads a host array or a device value: every shape
follows the batch size R and the block tables' widths (the reserved tables, or a context
bucket's view of them), every index is computed on the device from `batch.positions`, the
block tables and the slot mappings. What differs from the step's contents is masked:

- window: each request's W-1 positions before p, read through its block-table row; positions
  below 0 read position 0's slot and are zeroed and masked (key j is readable iff its position
  is >= 0; the token itself always is);
- compressed entries: entries 0..K-1 of every request, K = the table's width in entries
  (`entry_capacity`), those at or past (p + 1) // ratio zeroed and masked. CSA with
  index_topk < K picks its top-k among them (`select`), else attends to all of them;
- compressors (`compress_entries`): every row computes the entry (p + 1) // ratio - 1 from the
  state window; a row where it does not complete at p writes it to slot 0 of the null block
  (block 0: never handed out, never read as data), so the write has the batch's shape.

Same maths and precision as v4_batched (the decode layout of plain_decode), so greedy outputs
match the batched backend's; the ops are tested against it (tests/models/test_v4_static.py).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from wideserve.layers.attention.v4_batched import _softmax_attend, compute_dtype
from wideserve.layers.attention.v4_step import StepCaches, V4AttentionParams
from wideserve.layers.attention.indexer import Indexer, index_topk
from wideserve.layers.kv_quant import RecordCodec
from wideserve.layers.rope_interleaved import RotaryTable, rope_cis, rotate
from wideserve.types.forward_batch import ForwardBatch


KEY_CHUNK = 4096    # entries scored per piece by the indexers (`score_entries`)


class V4DecodeStep(StepCaches):
    """The per-forward view of a decode batch: device tensors only, shapes fixed by R and the
    block tables. Request r's token is row r at position positions[r]. Shared values are
    keyed by the cache's group index, not by an object id: torch.compile guards on ids, so
    an id key would recompile the forward every step."""

    static = True

    def __init__(self, batch: ForwardBatch,
                 codecs: Mapping[str, RecordCodec] | None = None) -> None:
        super().__init__(batch, codecs)
        self.num_tokens = int(batch.positions.shape[0])

    @property
    def num_reqs(self) -> int:
        return self.num_tokens

    def _req(self) -> torch.Tensor:
        return self._once(("req",), lambda: torch.arange(self.num_tokens, device=self.device))

    def position_phase(self, ratio: int) -> torch.Tensor:
        """[R] position % ratio (the compressor's position-bias row)."""
        return self._once(("phase", ratio), lambda: self.positions % ratio)

    def visible(self, ratio: int) -> torch.Tensor:
        """[R] entries each request's token sees: (p + 1) // ratio."""
        return self._once(("visible", ratio),
                          lambda: torch.div(self.positions + 1, ratio, rounding_mode="floor"))

    def slots(self, name: str, entry: torch.Tensor) -> torch.Tensor:
        """Cache slots of entries `entry` [R, ...] (>= 0) of each row's request."""
        view = self._view(name)
        req = self._req().view(-1, *([1] * (entry.dim() - 1))).expand_as(entry)
        return view.entry_slots(req, entry)

    # ------------------------------------------------------------------ window
    def window_keys(self, name: str, window: int, kv: torch.Tensor,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, W + 1, D] keys: the W-1 cached latents before p, the token's own, a zero
        row (the sink's slot); [R, W + 1] fp32 bias: 0 where readable, -inf elsewhere)."""
        W = window

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            pos = self.positions[:, None] - (W - 1) + torch.arange(W - 1, device=self.device)
            ok = pos >= 0
            return self.slots(name, pos.clamp(min=0)), ok
        slots, ok = self._once(("hist", self.batch.cache_group[name], W), build)
        flat, _ = self.flat_cache(name)
        R, D = kv.shape
        hist = self._read(name, flat, slots.flatten(), dtype).view(R, W - 1, D)
        hist = torch.where(ok[..., None], hist, 0.0)
        keys = torch.cat([hist, kv.to(dtype)[:, None], hist.new_zeros(R, 1, D)], dim=1)
        bias = self._once(("hist_bias", W), lambda: torch.cat(
            [entry_bias(ok), ok.new_zeros(R, 2, dtype=torch.float32)], dim=1))
        return keys, bias

    # ------------------------------------------------------------------ entries
    def entry_capacity(self, name: str) -> int:
        """K: the entries a request's block-table row can hold (a static shape)."""
        view = self._view(name)
        return int(view.block_table.shape[1]) * view.entries_per_block

    def entry_slots(self, name: str, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, K] cache slots of entries 0..K-1 of every request, [R, K] bool visible)."""
        def build() -> tuple[torch.Tensor, torch.Tensor]:
            view = self._view(name)
            epb = view.entries_per_block
            table = view.block_table.index_select(0, view.rows(self._req()))
            slots = (table[:, :, None] * epb
                     + torch.arange(epb, device=self.device)).flatten(1)          # [R, K]
            ids = torch.arange(slots.shape[1], device=self.device)
            return slots, ids < self.visible(ratio)[:, None]
        return self._once(("entries", self.batch.cache_group[name], ratio), build)

    def all_entries(self, name: str, ratio: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries 0..K-1 of every request -> ([R, K, C] `dtype`, zero where not visible
        yet; [R, K] bool visible)."""
        slots, seen = self.entry_slots(name, ratio)
        return self.gather_rows(name, slots, seen, dtype), seen

    def score_entries(self, name: str, ratio: int, dtype: torch.dtype,
                      score: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """score(keys [R, n, C]) -> [..., n] over entries 0..K-1 of every request, KEY_CHUNK
        entries at a time (the indexer's [R, heads, n] intermediate stays bounded whatever
        K is: at a 1M-position bucket K is 256K for ratio 4), concatenated -> [..., K].
        Keys not visible yet are zero (their scores are the caller's to mask)."""
        slots, seen = self.entry_slots(name, ratio)
        K = slots.shape[1]
        parts = [score(self.gather_rows(name, slots[:, a:a + KEY_CHUNK],
                                        seen[:, a:a + KEY_CHUNK], dtype))
                 for a in range(0, K, KEY_CHUNK)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def gather_picked(self, name: str, ratio: int, block_req: Any, picks: torch.Tensor,
                      chosen: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Entries `picks` [R, ...] (-1 = none; `chosen` = picks >= 0) of each row's request
        -> [R, ..., C] `dtype`, zero where not chosen. (`block_req`: V4Step's signature; a
        decode row is its own request.)"""
        return self.gather_rows(name, self.slots(name, picks.clamp(min=0)), chosen, dtype)

    # ------------------------------------------------------------------ compressors
    def compress(self, comp: Any, x: torch.Tensor, state_name: str, out_name: str,
                 rope: RotaryTable) -> None:
        """`Compressor.forward` of this batch (`compress_entries`)."""
        compress_entries(comp, x, self, state_name, out_name, rope)

    def entry_target(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([R] the entry w = (p + 1) // ratio - 1 each row computes, clamped at 0;
        [R] bool: it completes at p)."""
        return self._once(("target", ratio), lambda: (
            (self.visible(ratio) - 1).clamp(min=0), (self.positions + 1) % ratio == 0))

    def entry_cis(self, table: RotaryTable, ratio: int) -> torch.Tensor:
        """Rotation to the start position w * ratio of every row's target entry."""
        return self._once(("entry_cis", id(table), ratio), lambda: rope_cis(
            *table.cos_sin(self.entry_target(ratio)[0] * ratio)))

    def gather_state(self, name: str, step_rows: torch.Tensor, ratio: int, overlap: bool,
                     num_series: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Half-rows [R, L, 2D] that pool into each row's target entry (L = 2 * ratio with
        overlap: [(w-1)m, (w+1)m), series a then b; else [wm, (w+1)m)): the token's own row
        at p, the state cache below it; and [R, L, 1] bool: the position is >= 0 (None when
        no position can be negative)."""
        flat, _ = self.flat_cache(name)
        halves = flat.view(-1, flat.shape[-1] // num_series)                  # [slots*s, 2D]

        def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            lo = -ratio if overlap else 0
            offsets = torch.arange(lo, ratio, device=self.device)
            series = (offsets >= 0).long() if overlap else torch.zeros_like(offsets)
            src = self.entry_target(ratio)[0][:, None] * ratio + offsets           # [R, L]
            cached = self.slots(name, src.clamp(min=0)) * num_series + series
            return cached.flatten(), series, src == self.positions[:, None], src >= 0
        key = ("state", self.batch.cache_group[name], ratio, overlap)
        cached, series, own, valid = self._once(key, build)
        R, L = own.shape
        new = step_rows.view(R, num_series, -1).index_select(1, series)      # [R, L, 2D]
        old = halves.index_select(0, cached).view(R, L, -1).float()
        return torch.where(own[..., None], new, old), (valid[..., None] if overlap else None)

    def write_entries(self, name: str, ratio: int, entries: torch.Tensor) -> None:
        """Each row's target entry [R, C] into cache `name`: at its slot where it completes,
        at slot 0 of the null block elsewhere (the write keeps the batch's shape)."""
        flat, _ = self.flat_cache(name)

        def build() -> torch.Tensor:
            w, done = self.entry_target(ratio)
            return torch.where(done, self.slots(name, w), 0)
        slots = self._once(("entry_slots", self.batch.cache_group[name], ratio), build)
        flat.index_copy_(0, slots, self._encode(name, flat, entries))


def entry_bias(allowed: torch.Tensor) -> torch.Tensor:
    """bool mask -> fp32 0 where allowed, -inf elsewhere."""
    return torch.where(allowed, 0.0, float("-inf")).float()


def compress_entries(comp: Any, x: torch.Tensor, step: V4DecodeStep, state_name: str,
                     out_name: str, rope: RotaryTable) -> None:
    """`Compressor.forward` of a decode batch: the state rows, then every row's target
    entry pooled, normed, rotated to w * ratio and written (or parked in the null block)."""
    rows = comp.state_rows(x, step.position_phase(comp.ratio))                # [R, C]
    step.write_window_rows(state_name, rows)
    src, valid = step.gather_state(state_name, rows, comp.ratio, comp.overlap, comp.num_series)
    pooled = comp.pool(src, valid)                                            # [R, D]
    step.write_entries(out_name, comp.ratio, rotate(pooled, step.entry_cis(rope, comp.ratio)))


def select(indexer: Indexer, x: torch.Tensor, q_res: torch.Tensor, step: V4DecodeStep,
           keys_name: str, cis: torch.Tensor) -> torch.Tensor | None:
    """v4_batched.select for a decode batch: top-k entry ids [R, index_topk] (-1 = none;
    ties: lowest id) among each request's visible entries, or None when index_topk covers
    the table's K entries (attention goes dense over all of them, masked)."""
    R = x.shape[0]
    K = step.entry_capacity(keys_name)
    k = indexer.topk
    if k >= K:
        return None
    H, D = indexer.n_heads, indexer.head_dim
    dt = compute_dtype(indexer)
    q = rotate(indexer.q_b_proj(q_res).view(R, H, D), cis).to(dt)           # [R, H, D]
    weights = indexer.scorer.weights_proj(x).float() * H ** -0.5              # [R, H]

    def score(keys: torch.Tensor) -> torch.Tensor:                         # [R, n, D]
        s = torch.relu(torch.bmm(q, keys.transpose(1, 2)).float()) * D ** -0.5   # [R, H, n]
        return torch.bmm(weights[:, None, :], s)[:, 0]                         # [R, n]
    scores = step.score_entries(keys_name, indexer.ratio, dt, score)
    scores = scores + entry_bias(step.entry_slots(keys_name, indexer.ratio)[1])    # [R, K]
    idx = index_topk(scores, k, cpu_op=False)
    return torch.where(idx >= step.visible(indexer.ratio)[:, None], -1, idx)


def attend(attn: V4AttentionParams, q: torch.Tensor, kv: torch.Tensor, step: V4DecodeStep,
           picks: torch.Tensor | None) -> torch.Tensor:
    """v4_batched.attend for a decode batch: q [R, H, D], kv [R, D] -> [R, H, D] in
    compute_dtype(attn). Keys: [window (W) | sink slot | entries: all K (dense) or the picks]."""
    R, H, D = q.shape
    dt = compute_dtype(attn)
    keys, bias = step.window_keys(attn.prefix + "window", attn.window, kv, dt)
    comp_name = attn.prefix + "compressed"
    if attn.ratio and picks is None:
        entries, seen = step.all_entries(comp_name, attn.ratio, dt)
    elif picks is not None:
        seen = picks >= 0
        entries = step.gather_picked(comp_name, attn.ratio, None, picks, seen, dt)
    if attn.ratio or picks is not None:
        keys = torch.cat([keys, entries], dim=1)
        bias = torch.cat([bias, entry_bias(seen)], dim=1)
    out = _softmax_attend(q.to(dt), keys, bias[:, None, None, :], attn.sinks.float(),
                          attn.head_dim ** -0.5, attn.window, None)
    return out[:, 0]
