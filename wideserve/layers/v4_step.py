"""`V4Step`: the per-forward view of a ForwardBatch shared by every DeepSeek-V4 attention layer.

It holds host copies of the request layout, rope tables at the step's positions, compression
plans per ratio, and the cache helpers both attention backends use (reference/model-arch.md
§3.4-3.7). Everything is computed once per step and shared by all layers that ask for it.

Glossary
- ctx[r]: positions of request r cached before the step; its new tokens are ctx..seq-1.
- lo[r]: the first position whose window latent may be read: 0, or ctx[r] under bounded replay
  (write_start > ctx: nothing per-position below ctx was kept).
- window sources: this step's latents [T rows], each request's W-1 cached latents just before
  ctx (R * (W-1) rows, zero where unreadable), one zero row. Every position a query's window
  covers is one of these rows, so one gather builds all windows (see v4_blocks.py).
- visible entries of a query at p (ratio m): w < (p+1)//m.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from wideserve.executor.forward_batch import ForwardBatch, KVGroupView
from wideserve.layers.compressor import CompressPlan, build_compress_plan
from wideserve.layers.rope import RotaryTable
from wideserve.layers.v4_blocks import (LONG_QUERY, QueryBlocks, WindowKeys, build_query_blocks,
                                         build_window_keys)


@dataclass(slots=True)
class BlockEntries:
    """A group's compressed-entry layout for one ratio: every block reads its request's
    entries 0..K-1 (K = the step's most visible), each query masks those it cannot see."""

    visible: torch.Tensor      # [B, Q] int64 (p + 1) // ratio of each query slot
    readable: torch.Tensor     # [B, K] bool: entry < the block's most visible (written)
    ids: torch.Tensor          # [K] int64 0..K-1

    @property
    def width(self) -> int:
        return int(self.ids.shape[0])


class V4Step:
    """Per-forward batch layout and cache access helpers (one per ForwardBatch)."""

    def __init__(self, batch: ForwardBatch) -> None:
        self.batch = batch
        self.positions = batch.positions
        self.device = batch.positions.device
        self.qsl = np.asarray(batch.query_start_loc_cpu, dtype=np.int64)
        self.seq = np.asarray(batch.seq_lens_cpu, dtype=np.int64)
        self.ctx = self.seq - np.diff(self.qsl)
        if batch.kv_write_start is None:
            self.write_start = self.ctx.copy()
        else:
            self.write_start = np.maximum(batch.kv_write_start.cpu().numpy().astype(np.int64),
                                          self.ctx)
        # Bounded replay (write_start > ctx): the step recomputes positions whose growing
        # entries are cached but whose window/state were not kept, so nothing per-position
        # below ctx may be read: windows are clamped at the replay start (exact for positions
        # at least num_layers * (W-1) past it; choosing the replay length is the engine's call).
        self.replay = self.write_start > self.ctx
        self.lo = np.where(self.replay, self.ctx, 0)
        qlens = np.diff(self.qsl)
        self.num_tokens = int(self.qsl[-1])
        self.token_req = np.repeat(np.arange(len(self.seq), dtype=np.int64), qlens)   # [T]
        # Host positions, from the layout ForwardBatch documents (no device sync).
        self.token_pos = (np.arange(self.num_tokens, dtype=np.int64)
                          + np.repeat(self.ctx - self.qsl[:-1], qlens))
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plans: dict[tuple[int, bool], CompressPlan] = {}
        self._groups: list[QueryBlocks] | None = None
        self._keys: dict[tuple[int, int], WindowKeys] = {}
        self._hist: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._entries: dict[tuple[int, int], BlockEntries] = {}
        self._slots: dict[tuple[str, int, int], torch.Tensor] = {}
        self._token_req_dev: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq.shape[0])

    def token_range(self, r: int) -> tuple[int, int]:
        return int(self.qsl[r]), int(self.qsl[r + 1])

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.require(a, requirements=["C", "W"])).to(self.device)

    @property
    def token_req_dev(self) -> torch.Tensor:
        """[T] int64: request index of every token, on the device."""
        if self._token_req_dev is None:
            self._token_req_dev = self._dev(self.token_req)
        return self._token_req_dev

    def cos_sin(self, table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        key = id(table)
        if key not in self._rope:
            self._rope[key] = table.cos_sin(self.positions)
        return self._rope[key]

    def compress_plan(self, ratio: int, overlap: bool) -> CompressPlan:
        key = (ratio, overlap)
        if key not in self._plans:
            self._plans[key] = build_compress_plan(self.ctx, self.seq, self.qsl,
                                                   self.write_start, self.replay, ratio,
                                                   overlap, self.device)
        return self._plans[key]

    # ------------------------------------------------------------------ batched layouts
    def query_groups(self) -> list[QueryBlocks]:
        """At most two block groups covering every new token once: requests with at least
        LONG_QUERY new tokens in blocks of LONG_QUERY, the others one token per block."""
        if self._groups is None:
            qlens = np.diff(self.qsl)
            active = np.flatnonzero(qlens > 0)
            long = qlens[active] >= LONG_QUERY
            self._groups = [build_query_blocks(reqs, q, self.qsl, self.ctx, self.device)
                            for reqs, q in ((active[~long], 1), (active[long], LONG_QUERY))
                            if len(reqs)]
        return self._groups

    def window_keys(self, blocks: QueryBlocks, window: int) -> WindowKeys:
        key = (id(blocks), window)
        if key not in self._keys:
            self._keys[key] = build_window_keys(blocks, window, self.qsl, self.ctx, self.lo,
                                                self.device)
        return self._keys[key]

    def window_history(self, name: str, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [R, W-1] of each request's cached positions ctx-W+1 .. ctx-1 in cache `name`
        (a safe slot where unreadable) and their readability [R, W-1]."""
        view = self._view(name)
        key = (id(view), window)
        if key not in self._hist:
            pos = self.ctx[:, None] - (window - 1) + np.arange(window - 1)        # [R, W-1]
            valid = pos >= self.lo[:, None]
            req = np.broadcast_to(np.arange(self.num_reqs)[:, None], pos.shape)
            slots = view.entry_slots(self._dev(req), self._dev(np.where(valid, pos, 0)))
            self._hist[key] = slots, self._dev(valid)
        return self._hist[key]

    def entry_width(self, ratio: int) -> int:
        """The most compressed entries any query of the step can see."""
        return int((self.seq[np.diff(self.qsl) > 0] // ratio).max(initial=0))

    def block_entries(self, blocks: QueryBlocks, ratio: int) -> BlockEntries:
        key = (id(blocks), ratio)
        if key not in self._entries:
            visible = (blocks.q_pos + 1) // ratio                                 # [B, Q]
            most = np.where(blocks.q_valid, visible, 0).max(axis=1)
            ids = np.arange(self.entry_width(ratio))
            self._entries[key] = BlockEntries(self._dev(visible),
                                              self._dev(ids[None, :] < most[:, None]),
                                              self._dev(ids))
        return self._entries[key]

    def request_entry_slots(self, name: str, ratio: int) -> torch.Tensor:
        """[R, K] cache slots of entries 0..K-1 (K = `entry_width(ratio)`) of every request
        in cache `name`. Slots of entries a request does not have yet are in range but
        meaningless: mask them."""
        view = self._view(name)
        key = ("entries", id(view), ratio)
        if key not in self._slots:
            shape = (self.num_reqs, self.entry_width(ratio))
            ids = np.broadcast_to(np.arange(shape[1]), shape)
            req = np.broadcast_to(np.arange(shape[0])[:, None], shape)
            self._slots[key] = view.entry_slots(self._dev(req), self._dev(ids))
        return self._slots[key]

    # ------------------------------------------------------------------ cache access
    def _view(self, name: str) -> KVGroupView:
        if name not in self.batch.kv_caches:
            raise KeyError(f"ForwardBatch has no KV cache named {name!r}")
        return self.batch.kv_groups[self.batch.cache_group[name]]

    def flat_cache(self, name: str) -> tuple[torch.Tensor, KVGroupView]:
        """The cache `name` viewed as [slots, width], and its group view."""
        view = self._view(name)
        cache = self.batch.kv_caches[name]
        if not cache.dtype.is_floating_point:
            raise ValueError(f"KV cache {name!r} holds quantised records ({cache.dtype}); the "
                             f"DeepSeek-V4 forward needs raw float caches")
        return cache.view(-1, cache.shape[-1]), view

    def write_window_rows(self, name: str, rows: torch.Tensor) -> None:
        """Write one row per new token through the group's slot mapping (-1 = skip)."""
        flat, view = self.flat_cache(name)
        slots = view.slot_mapping
        if slots is None:
            raise ValueError(f"KV cache {name!r} is per-position but its group has no slot_mapping")
        keep = slots >= 0
        flat[slots[keep]] = rows[keep].to(flat.dtype)

    def write_entries(self, name: str, plan: CompressPlan, entries: torch.Tensor) -> None:
        flat, view = self.flat_cache(name)
        flat[view.entry_slots(plan.req, plan.entry)] = entries.to(flat.dtype)

    def gather_positions(self, name: str, step_rows: torch.Tensor,
                         plan: CompressPlan) -> torch.Tensor:
        """Rows [N, L, C] of the plan's source positions: this step's rows where the position
        is new, the per-position cache otherwise (only positions within its window)."""
        flat, view = self.flat_cache(name)
        req = plan.req[:, None].expand_as(plan.src_pos)
        cached = flat[view.entry_slots(req, plan.src_pos.clamp(min=0))].float()
        return torch.where(plan.in_step[..., None], step_rows[plan.row], cached)

    def read_positions(self, name: str, r: int, start: int, end: int) -> torch.Tensor:
        """Cached per-position rows of request r for positions [start, end) -> [end-start, C]."""
        flat, view = self.flat_cache(name)
        pos = torch.arange(start, end, device=self.device)
        return flat[view.entry_slots(torch.full_like(pos, r), pos)]

    def read_entries(self, name: str, r: int, count: int) -> torch.Tensor:
        """Compressed entries 0..count-1 of request r -> [count, C]."""
        flat, view = self.flat_cache(name)
        idx = torch.arange(count, device=self.device)
        return flat[view.entry_slots(torch.full_like(idx, r), idx)]

    def gather_rows(self, name: str, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """flat[slots] as fp32 with rows where `valid` is False set to 0 (they may hold NaN or
        stale data, and 0-weight * NaN would still be NaN) -> [*slots.shape, width]."""
        flat, _ = self.flat_cache(name)
        return torch.where(valid[..., None], flat[slots].float(), 0.0)
