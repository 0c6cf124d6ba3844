"""DeepSeek-V4 attention over the paged varlen batch (reference/model-arch.md §3.4-3.7).

One shared K=V latent per token. A query at position p attends to
  - the sliding window: latents of positions [p-W+1, p] ("window" cache, ratio 1),
  - compressed entries (CSA/HCA layers): HCA all visible entries w < (p+1)//m; CSA the indexer's
    top-k among them,
  - a per-head sink logit that only enlarges the softmax denominator.
The output's rope channels are rotated back by -p, then a grouped low-rank projection maps the
H heads to the hidden size.

Cache names (per layer prefix P = "model.layers.{i}.self_attn."): P+"window"; CSA adds
P+"compressed", P+"indexer", P+"state", P+"indexer_state"; HCA adds P+"compressed", P+"state".

`V4Step` is the per-forward view of a ForwardBatch shared by every layer: host copies of the
request layout, rope tables at the step's positions, compression plans per ratio, and the
gather/scatter helpers that read only what a position may see (in-window, completed entries).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from wideserve.executor.forward_batch import ForwardBatch, KVGroupView
from wideserve.layers.compressor import CompressPlan, Compressor, build_compress_plan
from wideserve.layers.indexer import Indexer
from wideserve.layers.norm import RMSNorm, rms_norm
from wideserve.layers.rope import RotaryTable, apply_rope
from wideserve.models.deepseek_v4_config import CSA, HCA, SLIDING, DeepseekV4Config

QUERY_BLOCK = 256   # queries per attention block: bounds the score tensor on long prefills


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
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._plans: dict[tuple[int, bool], CompressPlan] = {}

    @property
    def num_reqs(self) -> int:
        return int(self.seq.shape[0])

    def token_range(self, r: int) -> tuple[int, int]:
        return int(self.qsl[r]), int(self.qsl[r + 1])

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

    # ------------------------------------------------------------------ cache access
    def _cache(self, name: str) -> tuple[torch.Tensor, KVGroupView]:
        if name not in self.batch.kv_caches:
            raise KeyError(f"ForwardBatch has no KV cache named {name!r}")
        cache, view = self.batch.cache(name)
        if not cache.dtype.is_floating_point:
            raise ValueError(f"KV cache {name!r} holds quantised records ({cache.dtype}); the "
                             f"reference DeepSeek-V4 forward needs raw float caches")
        return cache.view(-1, cache.shape[-1]), view

    def write_window_rows(self, name: str, rows: torch.Tensor) -> None:
        """Write one row per new token through the group's slot mapping (-1 = skip)."""
        flat, view = self._cache(name)
        slots = view.slot_mapping
        if slots is None:
            raise ValueError(f"KV cache {name!r} is per-position but its group has no slot_mapping")
        keep = slots >= 0
        flat[slots[keep]] = rows[keep].to(flat.dtype)

    def write_entries(self, name: str, plan: CompressPlan, entries: torch.Tensor) -> None:
        flat, view = self._cache(name)
        flat[view.entry_slots(plan.req, plan.entry)] = entries.to(flat.dtype)

    def gather_positions(self, name: str, step_rows: torch.Tensor,
                         plan: CompressPlan) -> torch.Tensor:
        """Rows [N, L, C] of the plan's source positions: this step's rows where the position
        is new, the per-position cache otherwise (only positions within its window)."""
        flat, view = self._cache(name)
        req = plan.req[:, None].expand_as(plan.src_pos)
        cached = flat[view.entry_slots(req, plan.src_pos.clamp(min=0))].float()
        return torch.where(plan.in_step[..., None], step_rows[plan.row], cached)

    def read_positions(self, name: str, r: int, start: int, end: int) -> torch.Tensor:
        """Cached per-position rows of request r for positions [start, end) -> [end-start, C]."""
        flat, view = self._cache(name)
        pos = torch.arange(start, end, device=self.device)
        return flat[view.entry_slots(torch.full_like(pos, r), pos)]

    def read_entries(self, name: str, r: int, count: int) -> torch.Tensor:
        """Compressed entries 0..count-1 of request r -> [count, C]."""
        flat, view = self._cache(name)
        idx = torch.arange(count, device=self.device)
        return flat[view.entry_slots(torch.full_like(idx, r), idx)]


class DeepseekV4Attention(nn.Module):
    """HF names: q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks,
    compressor (CSA/HCA), compressor.indexer (CSA)."""

    def __init__(self, config: DeepseekV4Config, layer_type: str, cache_prefix: str,
                 main_rope: RotaryTable, compress_rope: RotaryTable) -> None:
        super().__init__()
        c = config
        self.layer_type = layer_type
        self.prefix = cache_prefix
        self.num_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.window = c.sliding_window
        self.o_groups = c.o_groups
        self.eps = c.rms_norm_eps
        self.rope = main_rope if layer_type == SLIDING else compress_rope
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps).float()
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(c.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps).float()
        self.o_a_proj = nn.Linear(self.num_heads * self.head_dim // c.o_groups,
                                  c.o_groups * c.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.ratio = 0
        if layer_type == CSA:
            self.ratio = c.csa_ratio
            indexer = Indexer(c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim,
                              self.ratio, c.index_topk, c.rms_norm_eps)
            self.compressor = Compressor(c.hidden_size, self.head_dim, self.ratio, True,
                                         c.rms_norm_eps, indexer=indexer)
        elif layer_type == HCA:
            self.ratio = c.hca_ratio
            self.compressor = Compressor(c.hidden_size, self.head_dim, self.ratio, False,
                                         c.rms_norm_eps)

    def forward(self, x: torch.Tensor, step: V4Step) -> torch.Tensor:
        """x [T, d] (after input_layernorm) -> [T, d]."""
        T = x.shape[0]
        cos, sin = step.cos_sin(self.rope)
        q_res = self.q_a_norm(self.q_a_proj(x))                               # [T, r_q]
        q = self.q_b_proj(q_res).view(T, self.num_heads, self.head_dim)
        q = apply_rope(rms_norm(q, None, self.eps), cos, sin)                 # [T, H, D]
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)              # [T, D]
        step.write_window_rows(self.prefix + "window", kv)

        picks: list[torch.Tensor | None] | None = None
        if self.ratio:
            self.compressor(x, step, self.prefix + "state", self.prefix + "compressed",
                            self.rope)
            if self.layer_type == CSA:
                indexer: Indexer = self.compressor.indexer
                indexer(x, step, self.prefix + "indexer_state", self.prefix + "indexer",
                        self.rope)
                picks = indexer.select(x, q_res, step, self.prefix + "indexer", cos, sin,
                                       QUERY_BLOCK)

        out = torch.empty(T, self.num_heads, self.head_dim, dtype=torch.float32,
                          device=x.device)
        for r in range(step.num_reqs):
            qs, qe = step.token_range(r)
            if qe > qs:
                out[qs:qe] = self._attend_request(q, kv, step, r,
                                                  None if picks is None else picks[r])
        out = apply_rope(out, cos, sin, inverse=True).to(x.dtype)
        return self._project_out(out)

    def _attend_request(self, q: torch.Tensor, kv: torch.Tensor, step: V4Step, r: int,
                        picks: torch.Tensor | None) -> torch.Tensor:
        """Attention of request r's new queries -> [S, H, D] fp32."""
        qs, qe = step.token_range(r)
        ctx, seq = int(step.ctx[r]), int(step.seq[r])
        W = self.window
        # Window latents the request's queries can see: cached [lo, ctx) + this step's rows.
        lo = ctx if step.replay[r] else max(0, ctx - W + 1)
        win_keys = torch.cat([step.read_positions(self.prefix + "window", r, lo, ctx).float(),
                              kv[qs:qe].float()])                              # [K, D]
        win_pos = torch.arange(lo, seq, device=q.device)
        comp = None
        if self.ratio:
            comp = step.read_entries(self.prefix + "compressed", r, seq // self.ratio).float()
        out = []
        for a in range(qs, qe, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, qe)
            # Keys this block's window can reach: positions [first query - W + 1, last query].
            k0 = max(lo, ctx + (a - qs) - W + 1) - lo
            k1 = ctx + (b - qs) - lo
            blk_picks = None if picks is None else picks[a - qs:b - qs]
            out.append(self._attend_block(q[a:b].float(), step.positions[a:b],
                                          win_keys[k0:k1], win_pos[k0:k1], comp, blk_picks))
        return torch.cat(out)

    def _attend_block(self, q: torch.Tensor, pos: torch.Tensor, keys: torch.Tensor,
                      kpos: torch.Tensor, comp: torch.Tensor | None,
                      picks: torch.Tensor | None) -> torch.Tensor:
        """q [S, H, D] at positions pos [S]; window keys [K, D] at kpos [K]; -> [S, H, D]."""
        scale = self.head_dim ** -0.5
        logits = [torch.einsum("shd,kd->shk", q, keys) * scale]
        see = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - self.window)
        masks = [see]
        values = [keys]
        if comp is not None and comp.shape[0] > 0:
            if picks is None:   # dense over visible entries (HCA, or CSA with k >= entries)
                visible = (pos + 1) // self.ratio
                ent = torch.arange(comp.shape[0], device=q.device)
                logits.append(torch.einsum("shd,cd->shc", q, comp) * scale)
                masks.append(ent[None, :] < visible[:, None])
                values.append(comp)
            else:               # sparse: each query's own top-k entries
                sel = comp[picks.clamp(min=0)]                                # [S, k, D]
                logits.append(torch.einsum("shd,skd->shk", q, sel) * scale)
                masks.append(picks >= 0)
                values.append(sel)
        S, H = q.shape[0], q.shape[1]
        scores = torch.cat([lg.masked_fill(~m[:, None, :], float("-inf"))
                            for lg, m in zip(logits, masks)]
                           + [self.sinks.float().view(1, H, 1).expand(S, H, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        out = torch.zeros_like(q)
        start = 0
        for v in values:
            n = v.shape[-2]
            p = probs[..., start:start + n]
            out = out + (torch.einsum("shk,kd->shd", p, v) if v.dim() == 2
                         else torch.einsum("shk,skd->shd", p, v))
            start += n
        return out

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> grouped o_a (one block per head group) -> o_b -> [T, d]."""
        T = out.shape[0]
        g = self.o_groups
        grouped = out.reshape(T, g, self.num_heads * self.head_dim // g)     # [T, g, H*D/g]
        w = self.o_a_proj.weight.view(g, -1, grouped.shape[-1])               # [g, o_lora, H*D/g]
        low = torch.einsum("tgi,goi->tgo", grouped, w).flatten(1)             # [T, g*o_lora]
        return self.o_b_proj(low)

    def kv_cache_names(self) -> list[str]:
        names = [self.prefix + "window"]
        if self.layer_type == CSA:
            names += [self.prefix + n for n in ("compressed", "indexer", "state", "indexer_state")]
        elif self.layer_type == HCA:
            names += [self.prefix + n for n in ("compressed", "state")]
        return names

