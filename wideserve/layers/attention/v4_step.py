"""`V4Step`: the per-forward view of a ForwardBatch shared by every DeepSeek-V4 attention layer.

It holds host copies of the request layout, rope tables at the step's positions, compression
plans per ratio, the batched layouts (v4_blocks.py) and the cache helpers the attention
backends and the compressors use (docs/deepseek_v4.md, "Attention" to "Lightning indexer"). Everything that does not
depend on a layer's weights is computed once per step (and per KV cache group) and shared by
every layer that asks for it, so a layer costs a constant number of torch ops.

Glossary
- ctx[r]: positions of request r cached before the step; its new tokens are ctx..seq-1.
- lo[r]: the first position whose window latent / compressor state may be read: 0, or where a
  bounded replay began (ctx[r] when write_start > ctx, or ForwardBatch.kv_replay_start[r] when
  the replay spans chunks): nothing per-position below it was kept.
- window sources: this step's latents [T rows], each request's W-1 cached latents just before
  ctx (R * (W-1) rows; unreadable ones are never referenced), one zero row. Every position a
  query's window covers is one of these rows, so one gather builds all windows (v4_blocks.py).
- visible entries of a query at p (ratio m): w < (p+1)//m.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Mapping, Protocol

import numpy as np
import torch

from wideserve.kernels.loader import cpu_ops_available
from wideserve.utils.device import to_device
from wideserve.types.forward_batch import ForwardBatch, KVGroupView
from wideserve.layers.attention.v4_blocks import (LONG_QUERY, BlockEntries, Part, QueryBlocks,
                                                  WindowKeys, bucket_widths, build_block_entries,
                                                  build_parts, build_query_blocks,
                                                  build_token_blocks, build_window_keys,
                                                  most_visible)
from wideserve.layers.attention.compress_plan import CompressPlan, build_compress_plan
from wideserve.layers.kv_quant import RecordCodec
from wideserve.layers.rope_interleaved import RotaryTable, rope_cis

# --batch-invariant reads of at least this many packed records unpack each distinct record
# once (V4Step._read); below it the sort that finds them costs more than it saves.
DEDUP_READ_ROWS = 4096
# Most bytes of picked entries a step keeps for the layers that read the same KV source at
# the same picks (V4Step.shared_picked); past it each layer gathers its own.
PICKED_CACHE_BYTES = 1 << 30


class V4AttentionParams(Protocol):
    """What the backend ops read of a DeepSeek-V4 attention layer (v4_attention.py); a
    protocol so that the backends need not import the layer that dispatches to them."""

    prefix: str                # cache-name prefix of the layer
    window: int                # sliding window W
    ratio: int                 # compression ratio (0: sliding-window layer)
    head_dim: int
    sinks: torch.Tensor        # [H] fp32 per-head sink logits
    compute_dtype: torch.dtype  # what the window/entry products run in (v4_batched)


class StepCaches:
    """What both step views share: the step's rope rotations and the cache reads and writes
    that need no host layout (V4Step plans on the host; v4_static.V4DecodeStep does not).
    `static`: the decode batch runs through the capturable ops of v4_static.py."""

    static = False

    def __init__(self, batch: ForwardBatch,
                 codecs: Mapping[str, RecordCodec] | None = None,
                 batch_invariant: bool = False) -> None:
        """codecs: cache name -> how its entries are quantised (layers/kv_quant.py). A cache
        stored as uint8 holds packed records (packed on write, unpacked on read); a float cache
        with a codec stores the dequantised values; a cache without one stores what is written.
        batch_invariant (KernelConfig): no choice here depends on the other requests - entry
        widths padded to their block's own power of two, one query per block, CSA always
        through its top-k picks
        (v4_batched.select, v41_batched.select) - so a query's keys and reduction lengths do
        not change with the batch mix."""
        self.batch = batch
        self.batch_invariant = batch_invariant
        self.codecs = codecs or {}
        self.positions = batch.positions
        self.device = batch.positions.device
        self._memo: dict[tuple, Any] = {}

    def _once(self, key: tuple, build: Callable[[], Any]) -> Any:
        """The step's value for `key`, built on first use (shared by all layers)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def cos_sin(self, table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        return self._once(("rope", id(table)), lambda: table.cos_sin(self.positions))

    def cis(self, table: RotaryTable, inverse: bool = False) -> torch.Tensor:
        """[T, r/2] complex rotation of `table` at the step's positions (rope.rotate)."""
        return self._once(("cis", id(table), inverse),
                          lambda: rope_cis(*self.cos_sin(table), inverse=inverse))

    def _view(self, name: str) -> KVGroupView:
        if name not in self.batch.kv_caches:
            raise KeyError(f"ForwardBatch has no KV cache named {name!r}")
        return self.batch.kv_groups[self.batch.cache_group[name]]

    def flat_cache(self, name: str) -> tuple[torch.Tensor, KVGroupView]:
        """The cache `name` viewed as [slots, width or record bytes], and its group view."""
        view = self._view(name)
        cache = self.batch.kv_caches[name]
        if not cache.dtype.is_floating_point and name not in self.codecs:
            raise ValueError(f"KV cache {name!r} holds quantised records ({cache.dtype}) but "
                             f"the model gave no codec for it")
        return cache.view(-1, cache.shape[-1]), view

    def _read(self, name: str, flat: torch.Tensor, slots: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows `slots` of cache `name` as `dtype` values [N, width] (unpacked records)."""
        if flat.dtype == torch.uint8:
            if self.batch_invariant and slots.numel() >= DEDUP_READ_ROWS:
                # The mode's one-query prefill blocks read each record once per query that
                # sees it (up to the window, 128x): unpack each distinct record once (the
                # codec is per row, so the values are the same bits), then fan out.
                uniq, inverse = torch.unique(slots, return_inverse=True)
                if 2 * uniq.numel() <= slots.numel():
                    return self.codecs[name].unpack(flat.index_select(0, uniq)).to(
                        dtype).index_select(0, inverse)
            return self.codecs[name].unpack(flat.index_select(0, slots)).to(dtype)
        return flat.index_select(0, slots).to(dtype)

    def read_rows(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        """Rows `slots` [N] of cache `name` as fp32 values [N, width] (unpacked records), as
        they are: a row nothing was written to may hold stale data or NaN (mask it)."""
        flat, _ = self.flat_cache(name)
        return self._read(name, flat, slots)

    def _encode(self, name: str, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows to store in cache `name`: packed records, quantised values, or as given."""
        codec = self.codecs.get(name)
        if codec is None:
            return rows.to(flat.dtype)
        if flat.dtype == torch.uint8:
            return codec.pack(rows)
        return codec.fake_quant(rows).to(flat.dtype)

    def write_window_rows(self, name: str, rows: torch.Tensor) -> None:
        """Write one row per new token through the group's slot mapping (every new token has
        a slot: no device-side check, no sync)."""
        flat, view = self.flat_cache(name)
        if view.slot_mapping is None:
            raise ValueError("a per-position KV cache group has no slot_mapping")
        flat.index_copy_(0, view.slot_mapping, self._encode(name, flat, rows))

    def gather_rows(self, name: str, slots: torch.Tensor, valid: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """flat[slots] as `dtype` with rows where `valid` is False set to 0 (they may hold NaN or
        stale data, and 0-weight * NaN would still be NaN) -> [*slots.shape, width]."""
        flat, _ = self.flat_cache(name)
        rows = self._read(name, flat, slots.flatten(), dtype)
        rows = torch.where(valid.reshape(-1, 1), rows, 0.0)
        return rows.view(*slots.shape, rows.shape[-1])


class V4Step(StepCaches):
    """Per-forward batch layout, planned on the host, and cache access helpers (one per
    ForwardBatch)."""

    def __init__(self, batch: ForwardBatch,
                 codecs: Mapping[str, RecordCodec] | None = None,
                 batch_invariant: bool = False) -> None:
        """codecs, batch_invariant: as StepCaches."""
        super().__init__(batch, codecs, batch_invariant)
        self.qsl = np.asarray(batch.query_start_loc_cpu, dtype=np.int64)
        self.seq = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
        self.ctx = self.seq - np.diff(self.qsl)
        if batch.kv_write_start is None:
            self.write_start = self.ctx.copy()
        else:
            self.write_start = np.maximum(batch.write_start_cpu(),
                                          self.ctx)
        # Bounded replay (write_start > ctx): the step recomputes positions whose growing
        # entries are cached but whose window/state were not kept, so nothing per-position
        # below the replay start may be read: windows are clamped there (exact for positions
        # at least num_layers * (W-1) past it; choosing the replay length is the engine's call).
        # The replay starts at ctx, unless the batch says where (it may span chunks).
        self.replay = self.write_start > self.ctx
        if batch.kv_replay_start is None:
            self.lo = np.where(self.replay, self.ctx, 0)
        else:
            self.lo = np.asarray(batch.kv_replay_start, dtype=np.int64)
            if self.lo.shape != self.ctx.shape or (self.lo > self.ctx).any():
                raise ValueError(f"ForwardBatch.kv_replay_start {self.lo.tolist()} must give "
                                 f"each request a position <= its context {self.ctx.tolist()}")
        qlens = np.diff(self.qsl)
        self.num_tokens = int(self.qsl[-1])
        self.active_seq = self.seq[qlens > 0]           # seq_lens of requests with new tokens
        self.token_req = np.repeat(np.arange(len(self.seq), dtype=np.int64), qlens)   # [T]
        # Host positions, from the layout ForwardBatch documents (no device sync).
        self.token_pos = (np.arange(self.num_tokens, dtype=np.int64)
                          + np.repeat(self.ctx - self.qsl[:-1], qlens))
        # Every request has exactly one new token, every position is readable (no replay) and
        # position 0 is cached: the fast decode layout of v4_batched.attend applies.
        self.plain_decode = bool(len(qlens) and (qlens == 1).all() and (self.ctx >= 1).all()
                                 and not self.lo.any())
        self._picked: tuple[tuple, dict] | None = None

    def shared_picked(self, name: str, picks: torch.Tensor, key: tuple,
                      gather: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
        """`gather()` (the entries `picks` chooses from cache `name`, for the part `key`),
        kept while `picks` lives: layers that share a KV source and its picks (DeepSeek-V4.1:
        a source and the layers up to the next index source, up to 6 in a row) read the
        same rows, so they are gathered once (PICKED_CACHE_BYTES at most; V4's per-layer
        picks die with their layer, and their rows with them)."""
        owner = (self.batch.kv_caches[name].data_ptr(), id(picks))
        if self._picked is None or self._picked[0] != owner:
            self._picked = (owner, {"bytes": 0})
            weakref.finalize(picks, self._drop_picked, owner)
        held = self._picked[1]
        if key not in held:
            got = gather()
            size = sum(t.numel() * t.element_size() for t in got)
            if held["bytes"] + size > PICKED_CACHE_BYTES:
                return got
            held[key], held["bytes"] = got, held["bytes"] + size
        return held[key]

    def _drop_picked(self, owner: tuple) -> None:
        if self._picked is not None and self._picked[0] == owner:
            self._picked = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq.shape[0])

    def token_range(self, r: int) -> tuple[int, int]:
        return int(self.qsl[r]), int(self.qsl[r + 1])

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)

    def _slots(self, view: KVGroupView, req: np.ndarray, entry: np.ndarray) -> torch.Tensor:
        """`view.entry_slots` for host index arrays. A block table that lives on the host is
        read with numpy (a handful of numpy calls instead of device ops); otherwise the
        indices go to the device."""
        table = view.block_table
        if table.device.type != "cpu":
            return view.entry_slots(self._dev(req), self._dev(entry))
        pos = entry * view.compress_ratio
        blocks = table.numpy()[view.host_rows(req), pos // view.block_size]
        return torch.from_numpy(blocks * view.entries_per_block
                                + (pos % view.block_size) // view.compress_ratio)

    def position_phase(self, ratio: int) -> torch.Tensor:
        """[T] position % ratio (the compressor's position-bias row)."""
        return self._once(("phase", ratio), lambda: self._dev(self.token_pos % ratio))

    def compress_plan(self, ratio: int, overlap: bool) -> CompressPlan:
        return self._once(("plan", ratio, overlap), lambda: build_compress_plan(
            self.ctx, self.seq, self.qsl, self.write_start, self.lo, ratio, overlap,
            self.device))

    def entry_cis(self, table: RotaryTable, ratio: int, overlap: bool) -> torch.Tensor:
        """Rotation to the start position w*m of every entry of the (ratio, overlap) plan."""
        plan = self.compress_plan(ratio, overlap)
        return self._once(("entry_cis", id(table), ratio, overlap), lambda: rope_cis(
            *table.cos_sin(self._dev(plan.entry * ratio))))

    # ------------------------------------------------------------------ batched layouts
    def query_groups(self, attend: bool = False) -> list[QueryBlocks]:
        """At most two block groups covering every new token once: requests with at least
        LONG_QUERY new tokens in blocks of LONG_QUERY, the others one token per block.
        --batch-invariant: one query per block for prefill too (torch's batched products
        round a query's scores by its block's layout), except for the attention itself
        (`attend`) where the layout-independent C++ op runs (kernels/v4_attend.py)."""
        def build() -> list[QueryBlocks]:
            qlens = np.diff(self.qsl)
            blocked = not self.batch_invariant or (attend and self.invariant_rows_op)
            long = qlens >= (LONG_QUERY if blocked else np.iinfo(np.int64).max)
            groups = []
            if not long.all():
                tokens = (np.arange(self.num_tokens) if not long.any()
                          else np.flatnonzero(~long[self.token_req]))
                if len(tokens):
                    groups.append(build_token_blocks(tokens, self.token_req, self.token_pos,
                                                      self.qsl, self.device))
            if long.any():
                groups.append(build_query_blocks(np.flatnonzero(long), LONG_QUERY, self.qsl,
                                                 self.ctx, self.device))
            return groups
        return self._once(("groups", attend and self.invariant_rows_op), build)

    @property
    def invariant_rows_op(self) -> bool:
        """--batch-invariant with the C++ op of kernels/v4_attend.py here (CPU, extension
        built): the mode's attention runs it over blocks of LONG_QUERY queries."""
        return self.batch_invariant and self.device.type == "cpu" and cpu_ops_available()

    def window_keys(self, blocks: QueryBlocks, window: int) -> WindowKeys:
        return self._once(("keys", id(blocks), window), lambda: build_window_keys(
            blocks, window, self.qsl, self.ctx, self.lo, self.device))

    def entry_width(self, ratio: int) -> int:
        """The most compressed entries any query of the step can see."""
        return int(self.active_seq.max(initial=0)) // ratio

    def block_entries(self, blocks: QueryBlocks, ratio: int) -> BlockEntries:
        return self._once(("entries", id(blocks), ratio), lambda: build_block_entries(
            blocks, ratio, self.entry_width(ratio), self.device))

    def padded_bias(self, blocks: QueryBlocks, window: int, extra: int) -> torch.Tensor:
        """[B, Q, 1, Lk + 1 + extra]: the window bias, then `extra` zero columns (entries
        masked per query later)."""
        bias = self.window_keys(blocks, window).bias
        if not extra:
            return bias
        return self._once(("padded_bias", id(blocks), window, extra), lambda: torch.cat(
            [bias, bias.new_zeros(*bias.shape[:3], extra)], dim=-1))

    # ------------------------------------------------------------------ entry buckets
    def entry_parts(self, blocks: QueryBlocks, ratio: int, floor: int, fixed: int,
                    per_entry: int, budget: int) -> list[Part]:
        """The group's blocks in parts (v4_blocks.build_parts): by padded entry width for
        ratio > 0 (bucket_widths with `floor`), all of width 0 for ratio 0; each part's cost
        (fixed + width * per_entry per block) within `budget`. Shared by every layer."""
        def build() -> list[Part]:
            widths = (bucket_widths(most_visible(blocks, ratio), floor, self.batch_invariant)
                      if ratio
                      else np.zeros(blocks.num_blocks, dtype=np.int64))
            return build_parts(widths, lambda w: fixed + w * per_entry, budget, self.device)
        return self._once(("parts", id(blocks), ratio, floor, fixed, per_entry, budget), build)

    def block_visible(self, blocks: QueryBlocks, ratio: int) -> torch.Tensor:
        """[B, Q] int64 (p + 1) // ratio of each query slot (padding slots: past the end)."""
        return self._once(("visible", id(blocks), ratio),
                          lambda: self._dev((blocks.q_pos + 1) // ratio))

    def token_rows(self, view: KVGroupView) -> torch.Tensor:
        """[T] int64 block-table row of each new token's request in `view`."""
        return self._once(("token_rows", id(view)),
                          lambda: view.rows(self._dev(self.token_req)))

    def token_visible(self, ratio: int) -> torch.Tensor:
        """[T] int64 entries each new token sees: (p + 1) // ratio."""
        return self._once(("token_visible", ratio),
                          lambda: self._dev((self.token_pos + 1) // ratio))

    def part_entry_bias(self, blocks: QueryBlocks, part: Part, ratio: int) -> torch.Tensor:
        """[P, Q, width] fp32: 0 where the query sees the entry, -inf elsewhere (built on the
        device from the visible counts)."""
        def build() -> torch.Tensor:
            ids = torch.arange(part.width, device=self.device)
            seen = ids < part.take(self.block_visible(blocks, ratio))[..., None]
            return torch.where(seen, 0.0, float("-inf")).float()
        return self._once(("part_entry_bias", id(part), ratio), build)

    def part_bias(self, blocks: QueryBlocks, part: Part, window: int, ratio: int,
                  extra: int) -> torch.Tensor:
        """[P, Q, 1, Lk + 1 + N]: the window bias, then (ratio > 0) the part's entries 0..width-1
        or `extra` zero columns (per-query entries, masked later)."""
        def build() -> torch.Tensor:
            if ratio:
                return torch.cat([part.take(self.window_keys(blocks, window).bias),
                                  self.part_entry_bias(blocks, part, ratio)[:, :, None]], -1)
            return part.take(self.padded_bias(blocks, window, extra))
        return self._once(("part_bias", id(part), window, ratio, extra), build)

    def gather_part_entries(self, name: str, blocks: QueryBlocks, part: Part, ratio: int,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Entries 0..width-1 of each part block's request -> [P, width, C] `dtype`; entries past
        the block's most visible repeat its last visible one (written, finite), so the bias
        alone keeps them out. Slots are computed on the device from the block table."""
        flat, view = self.flat_cache(name)

        def build() -> torch.Tensor:
            # Whole table blocks, then every entry of each: one row gather and a broadcast
            # add, not a table lookup per entry.
            epb, width = view.entries_per_block, part.width
            table = view.block_table.index_select(0, view.rows(part.take(blocks.block_req)))
            nblk = -(-width // epb)
            if table.shape[1] < nblk:       # a bucket floor wider than any row: pad (masked)
                table = torch.nn.functional.pad(table, (0, nblk - table.shape[1]))
            slots = (table[:, :nblk, None] * epb
                     + torch.arange(epb, device=self.device)).flatten(1)[:, :width]
            last = self._dev(most_visible(blocks, ratio)[part.ids] - 1)[:, None]
            ids = torch.arange(width, device=self.device)
            return torch.where(ids <= last, slots, slots.gather(1, last))

        slots = self._once(("part_slots", id(view), id(part), ratio), build)
        return self._read(name, flat, slots.flatten(), dtype).view(*slots.shape, -1)

    # ------------------------------------------------------------------ cache access
    def write_entries(self, name: str, plan: CompressPlan, entries: torch.Tensor) -> None:
        flat, view = self.flat_cache(name)
        slots = self._once(("entry_slots", id(view), id(plan)), lambda: self._slots(
            view, plan.req, plan.entry))
        flat.index_copy_(0, slots, self._encode(name, flat, entries))

    def gather_state(self, name: str, step_rows: torch.Tensor, plan: CompressPlan,
                     num_series: int) -> torch.Tensor:
        """Half-rows [N, L, 2D] ([kv | gate] of series plan.series[l]) at the plan's source
        positions: this step's rows where the position is new, the state cache otherwise
        (only positions within its window; positions < 0 read a safe slot, masked later)."""
        flat, view = self.flat_cache(name)
        N, L = plan.src_pos.shape
        halves = flat.view(-1, flat.shape[-1] // num_series)                  # [slots*s, 2D]

        def build() -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
            series = np.broadcast_to(plan.series, plan.src_pos.shape)
            step_ids = np.flatnonzero(plan.in_step)
            step_src = (plan.row * num_series + series).reshape(-1)[step_ids]
            if len(step_ids) == N * L:
                return None, self._dev(step_ids), self._dev(step_src)
            req = np.broadcast_to(plan.req[:, None], plan.src_pos.shape)
            slots = self._slots(view, req, np.maximum(plan.src_pos, 0))
            cached = (slots * num_series + self._dev(series)).flatten()
            return cached, self._dev(step_ids), self._dev(step_src)

        cached, step_ids, step_src = self._once(("state", id(view), id(plan)), build)
        new = step_rows.reshape(-1, halves.shape[-1]).index_select(0, step_src)
        if cached is None:
            return new.view(N, L, -1)
        out = halves.index_select(0, cached).float()
        return out.index_copy_(0, step_ids, new).view(N, L, -1)

    def read_positions(self, name: str, r: int, start: int, end: int) -> torch.Tensor:
        """Cached per-position rows of request r for positions [start, end) -> [end-start, C]."""
        flat, view = self.flat_cache(name)
        pos = torch.arange(start, end, device=self.device)
        return self._read(name, flat, view.entry_slots(torch.full_like(pos, r), pos))

    def read_entries(self, name: str, r: int, count: int) -> torch.Tensor:
        """Compressed entries 0..count-1 of request r -> [count, C]."""
        flat, view = self.flat_cache(name)
        idx = torch.arange(count, device=self.device)
        return self._read(name, flat, view.entry_slots(torch.full_like(idx, r), idx))

    # ------------------------------------------------------------------ batched cache reads
    def window_history(self, name: str, window: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Each request's cached latents at positions ctx-W+1 .. ctx-1 -> [R * (W-1), D].

        Rows at unreadable positions (< lo) are read through a safe slot and NOT cleaned: no
        key row of `window_keys` points at them (unreadable keys point at the zero row)."""
        flat, view = self.flat_cache(name)

        def build() -> torch.Tensor:
            pos = self.ctx[:, None] - (window - 1) + np.arange(window - 1)        # [R, W-1]
            req = np.broadcast_to(np.arange(self.num_reqs)[:, None], pos.shape)
            safe = np.where(pos >= self.lo[:, None], pos, 0)
            return self._slots(view, req, safe).flatten()

        return self._read(name, flat, self._once(("hist", id(view), window), build), dtype)

    def request_entry_slots(self, name: str, ratio: int) -> torch.Tensor:
        """[R, K] cache slots of entries 0..K-1 (K = `entry_width(ratio)`) of every request
        in cache `name`. Slots of entries a request does not have yet are in range but
        meaningless: mask them."""
        view = self._view(name)

        def build() -> torch.Tensor:
            shape = (self.num_reqs, self.entry_width(ratio))
            ids = np.broadcast_to(np.arange(shape[1]), shape)
            req = np.broadcast_to(np.arange(shape[0])[:, None], shape)
            return self._slots(view, req, ids)

        return self._once(("req_entries", id(view), ratio), build)

    def gather_block_entries(self, name: str, blocks: QueryBlocks, ratio: int,
                             a: int, b: int) -> torch.Tensor:
        """Entries 0..K-1 of the request of each block a..b-1 -> [b-a, K, width] fp32, zero
        where the block's queries see no such entry yet (it may hold stale data or NaN)."""
        ent = self.block_entries(blocks, ratio)
        K = ent.width
        flat, view = self.flat_cache(name)
        slots = self._once(("block_slots", id(view), id(blocks), ratio), lambda: (
            self.request_entry_slots(name, ratio).index_select(0, blocks.block_req)))
        rows = self._read(name, flat, slots[a:b].flatten())                  # [(b-a)*K, C]
        unwritten, unwritten_host = ent.unwritten()
        i, j = np.searchsorted(unwritten_host, (a * K, b * K))
        if j > i:
            rows = rows.index_fill_(0, unwritten[i:j] - a * K, 0.0)
        return rows.view(b - a, K, rows.shape[-1])

    def gather_picked(self, name: str, ratio: int, block_req: torch.Tensor, picks: torch.Tensor,
                      chosen: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Entries `picks` [B, Q, k] (-1 = none, `chosen` = picks >= 0) of each block's
        request -> [B, Q, k, width] `dtype`; rows not chosen are zero or a finite entry."""
        view = self._view(name)
        slots = view.entry_slots(block_req[:, None, None].expand_as(picks), picks.clamp(min=0))
        # If every request has entry 0 (written, finite), a -1 pick reads it and stays masked;
        # otherwise unchosen rows may hold anything and are zeroed.
        if int(self.active_seq.min(initial=ratio)) >= ratio:
            flat, _ = self.flat_cache(name)
            rows = self._read(name, flat, slots.flatten(), dtype)
            return rows.view(*picks.shape, rows.shape[-1])
        return self.gather_rows(name, slots, chosen, dtype)
