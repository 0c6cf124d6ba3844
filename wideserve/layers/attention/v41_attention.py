"""DeepSeek-V4.1 CSA2 attention over the paged varlen batch (docs/deepseek_v41.md).

Every layer keeps its own sliding window of FP8 latents (window (p-W, p]) and a sink. Layers
with compress ratio m > 0 also attend to compressed entries (entry j visible to the query at p
iff j < (p+1)//m), which only KV-source ("full") layers compute and write; consumers read the
latest source's cache (shared records: the model declares them with `SharedKVSpec`).

- full: the CSA2 compressor (ratio 1: norm(wkv(x)) per position; m > 1: per-channel softmax
  pooling of m non-overlapping positions, no position bias) writes NVFP4 entries rotated to
  position j*m, and the indexer keys mxfp4(rope(k_norm(wk(latent)))); its indexer picks top-k.
- reindex: own indexer queries over the latest source's keys, new top-k.
- reuse: the latest index source's top-k, unchanged.
The two-level indexer: the candidate source keeps, per query, the `candidate_topk_blocks`
blocks of `candidate_block_size` entries with the highest block-max score (the newest visible
block always); index sources after it choose their top-k among those candidates only.

The picks of a step live in a `CSA2State` that the model threads through its layers, so a
consumer uses exactly what its sources computed for the same tokens. Attention itself is the
batched V4 op (window + picked entries + sink), fed the picks as [T, k] entry ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from wideserve.layers import kv_quant
from wideserve.layers.attention import v4_batched
from wideserve.layers.attention.v4_batched import CHUNK_ELEMENTS, _chunks, _rows, _store
from wideserve.layers.attention.v4_blocks import QueryBlocks
from wideserve.layers.attention.v4_step import V4Step
from wideserve.layers.indexer import index_topk
from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope import RotaryTable, rope_cis, rotate
from wideserve.models.deepseek_v41_config import FULL, REINDEX, SWA, DeepseekV41Config


KEY_CHUNK = 8192    # entries per gather-and-score piece at an index source (_entry_scores)


@dataclass(slots=True)
class CSA2State:
    """What index sources leave for the layers after them within one forward."""

    picks: torch.Tensor | None = None        # [T, k] entry ids (-1 none) or None = dense
    # [T, n] the candidate source's kept block ids per query, ascending, -1 past them
    candidates: torch.Tensor | None = None


class SinkParam(nn.Module):
    """The per-head sink logit (`attn.sinks_param.weight`, fp32)."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, dtype=torch.float32))


class CSA2Compressor(nn.Module):
    """Names: wkv (fp32), wgate (fp32, ratio > 1), norm."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.wkv = nn.Linear(hidden, head_dim, bias=False, dtype=torch.float32)
        if ratio > 1:
            self.wgate = nn.Linear(hidden, head_dim, bias=False, dtype=torch.float32)
        self.norm = RMSNorm(head_dim, eps)

    def latents(self, x: torch.Tensor, step: V4Step, state_name: str):
        """Pre-RoPE normalised latents [N, D] of the entries completing in this step, and
        their plan. m > 1 keeps per-position [kv | gate] rows (fp32) in a window-m cache."""
        plan = step.compress_plan(self.ratio, False)
        if self.ratio == 1:
            rows = torch.from_numpy(plan.row[:, 0]).to(x.device)
            return self.norm(self.wkv(x.index_select(0, rows).float()).to(x.dtype)), plan
        kv = self.wkv(x.float())
        gate = self.wgate(x.float())
        rows = torch.cat([kv, gate], dim=-1)                                  # [T, 2D]
        step.write_window_rows(state_name, rows)
        if plan.num_entries == 0:
            return rows.new_zeros(0, self.head_dim).to(x.dtype), plan
        src = step.gather_state(state_name, rows, plan, 1)                    # [N, m, 2D]
        kv, gate = src[..., :self.head_dim], src[..., self.head_dim:]
        pooled = (kv * gate.softmax(dim=1)).sum(dim=1).to(x.dtype)
        return self.norm(pooled), plan


class CSA2Indexer(nn.Module):
    """Names: wq_b, weights_proj; a KV source also has wk, k_norm (its keys)."""

    def __init__(self, config: DeepseekV41Config, owns_keys: bool) -> None:
        super().__init__()
        c = config
        self.n_heads = c.index_n_heads
        self.head_dim = c.index_head_dim
        self.topk = c.index_topk
        self.wq_b = nn.Linear(c.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(c.hidden_size, self.n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(c.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)


def _candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int,
                      block_size: int) -> torch.Tensor:
    """scores [C, Q, K] (-inf where not visible), visible [C, Q] -> [C, Q, n] ids of the top
    `topk_blocks` blocks by max score, the newest visible block kept, ascending, -1 past the
    kept ones (n = min(topk_blocks, blocks)). A block's max is one amax over a view."""
    K = scores.shape[-1]
    if K % block_size:
        scores = F.pad(scores, (0, -K % block_size), value=float("-inf"))
    blocks = scores.unflatten(-1, (-1, block_size)).amax(dim=-1)              # [C, Q, nb]
    nb = blocks.shape[-1]
    newest = (visible - 1).div(block_size, rounding_mode="floor")
    ids = torch.arange(nb, device=scores.device)
    blocks = blocks.masked_fill(ids == newest[..., None], float("inf"))
    top = blocks.topk(min(topk_blocks, nb), dim=-1)
    kept = torch.where(top.values > float("-inf"), top.indices, nb).sort(dim=-1).values
    return kept.masked_fill(kept == nb, -1)


def _candidate_entries(cands: torch.Tensor, block_size: int,
                       visible: torch.Tensor) -> torch.Tensor:
    """Candidate block ids [C, Q, n] -> their visible entry ids [C, Q, n * block_size],
    ascending, -1 elsewhere (a kept block's ids are a prefix: blocks ascend, -1 last)."""
    ids = cands[..., None] * block_size + torch.arange(block_size, device=cands.device)
    ids = ids.flatten(-2)
    return torch.where((ids >= 0) & (ids < visible[..., None]), ids, -1)


def _candidate_mask(cands: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """Candidate block ids [C, Q, n] -> [C, Q, width] bool over entries 0..width-1."""
    nb = -(-width // block_size)
    keep = torch.zeros(*cands.shape[:-1], nb + 1, dtype=torch.bool, device=cands.device)
    keep.scatter_(-1, torch.where(cands >= 0, cands, nb), True)
    return keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :width]


def _index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_h relu(q_h . k) * w_h: q [C, Q, H, D], weights [C, Q, H], keys [C, K, D] (one set
    per block) or [C, Q, K, D] (one per query) -> [C, Q, K]."""
    spec = "cqhd,ckd->cqhk" if keys.dim() == 3 else "cqhd,cqkd->cqhk"
    return (torch.einsum(spec, q, keys).relu() * weights[..., None]).sum(dim=2)


def _entry_scores(step: V4Step, keys_name: str, ratio: int, blocks: QueryBlocks, a: int,
                  b: int, q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Scores [C, Q, K] of every entry 0..K-1 of the requests of blocks a..b-1, KEY_CHUNK
    entries at a time: a piece's gathered keys are scored while they are still in the CPU's
    cache instead of gathering all K first and reading them back from memory (2.5-4x faster
    at 512K entries on the benchmark machine; same values). Entries no query of a block has
    yet score 0 (their rows may hold stale data or NaN; the caller's bias masks them)."""
    K = step.entry_width(ratio)
    if K <= KEY_CHUNK:
        return _index_scores(q, weights, step.gather_block_entries(keys_name, blocks, ratio,
                                                                   a, b))
    slots = step.request_entry_slots(keys_name, ratio).index_select(0, blocks.block_req[a:b])
    seen = np.where(blocks.q_valid, (blocks.q_pos + 1) // ratio, 0).max(axis=1)[a:b]
    written = torch.from_numpy(seen).to(q.device)[:, None, None]             # [C, 1, 1]
    parts = []
    for k0 in range(0, K, KEY_CHUNK):
        piece = slots[:, k0:k0 + KEY_CHUNK]
        n = piece.shape[1]
        keys = step.read_rows(keys_name, piece.flatten()).view(*piece.shape, -1)  # [C, n, D]
        scores = _index_scores(q, weights, keys)                              # [C, Q, n]
        if int(seen.min()) < k0 + n:      # a score from an unwritten row may be NaN: zero it
            ids = torch.arange(k0, k0 + n, device=q.device)
            scores = torch.where(ids < written, scores, 0.0)
        parts.append(scores)
    return torch.cat(parts, dim=-1)


def _candidate_scores(step: V4Step, keys_name: str, ratio: int, block_req: torch.Tensor,
                      q: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Scores [C, Q, n] of each query's own candidate entries ids [C, Q, n] (-1: -inf). Each
    query gathers its own keys, so a long-query block is scored a few query slots at a time
    to keep the gathered keys within CHUNK_ELEMENTS."""
    C, Q, n = ids.shape
    H, D = q.shape[2], q.shape[3]
    chosen = ids >= 0
    per = max(1, CHUNK_ELEMENTS // max(1, C * n * (D + 3 * H)))
    parts = []
    for u in range(0, Q, per):
        keys = step.gather_picked(keys_name, ratio, block_req, ids[:, u:u + per],
                                  chosen[:, u:u + per])                       # [C, q, n, D]
        parts.append(_index_scores(q[:, u:u + per], weights[:, u:u + per], keys))
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return scores.masked_fill(~chosen, float("-inf"))


def csa2_select(indexer: CSA2Indexer, x: torch.Tensor, q_res: torch.Tensor, step: V4Step,
                keys_name: str, cis: torch.Tensor, ratio: int, state: CSA2State,
                candidate_source: bool, use_candidates: bool, topk_blocks: int,
                block_size: int) -> None:
    """Top-k entry ids per query into state.picks (None: every visible entry, dense), and the
    candidate blocks into state.candidates at the candidate source.

    An index source after the candidate source scores only the entries of its queries'
    candidate blocks (at most topk_blocks * block_size, gathered per query) when they are
    fewer than the visible entries: the same picks as scoring every entry and masking the
    others (candidates ascend, so ties still go to the lowest entry id), but work bounded by
    the candidate budget instead of the context."""
    T = x.shape[0]
    K = step.entry_width(ratio)
    dense = indexer.topk >= K and not use_candidates
    if T == 0 or (dense and not candidate_source):
        state.picks = None
        return
    H, D = indexer.n_heads, indexer.head_dim
    q = rotate(indexer.wq_b(q_res).view(T, H, D), cis)
    q = kv_quant.fake_quant(q, "mxfp4").float()                               # [T, H, D]
    weights = indexer.weights_proj(x).float() * (D ** -0.5 * H ** -0.5)       # [T, H]
    k = min(indexer.topk, K)
    picks = torch.full((T + 1, k), -1, dtype=torch.int64, device=x.device)
    cands = (torch.full((T + 1, min(topk_blocks, -(-K // block_size))), -1,
                        dtype=torch.int64, device=x.device) if candidate_source else None)
    width = state.candidates.shape[1] * block_size if use_candidates else K
    restricted = width < K
    for blocks in step.query_groups():
        Q = blocks.block_q
        ent = step.block_entries(blocks, ratio)
        per_block = Q * width * (D + 3 * H) if restricted else K * (D + 3 * Q * H)
        for a, b in _chunks(blocks.num_blocks, per_block):
            qb, wb = _rows(q, blocks, a, b), _rows(weights, blocks, a, b)
            ids = None
            if restricted:
                ids = _candidate_entries(_rows(state.candidates, blocks, a, b), block_size,
                                         ent.visible[a:b])                    # [C, Q, n*bs]
                scores = _candidate_scores(step, keys_name, ratio, blocks.block_req[a:b],
                                           qb, wb, ids)
            else:
                scores = _entry_scores(step, keys_name, ratio, blocks, a, b, qb, wb)
                scores = scores + ent.bias[a:b]                               # [C, Q, K]
                if candidate_source:
                    _store(cands, blocks, a, b, _candidate_blocks(
                        scores, ent.visible[a:b], topk_blocks, block_size))
                elif use_candidates:
                    mask = _candidate_mask(_rows(state.candidates, blocks, a, b), block_size, K)
                    scores = scores.masked_fill(~mask, float("-inf"))
            idx = index_topk(scores, min(k, scores.shape[-1]))                # [C, Q, <= k]
            ok = scores.gather(-1, idx) > float("-inf")
            if ids is not None:
                idx = ids.gather(-1, idx)
            got = torch.where(ok, idx, -1)
            _store(picks, blocks, a, b, F.pad(got, (0, k - got.shape[-1]), value=-1))
    if candidate_source:
        state.candidates = cands[:T]
    state.picks = None if dense else picks[:T]


class DeepseekV41Attention(nn.Module):
    """Names (the reference's): wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
    sinks_param.weight, compressor.* (full), indexer.* (full, reindex)."""

    def __init__(self, config: DeepseekV41Config, layer: int, main_rope: RotaryTable,
                 compress_rope: RotaryTable) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.mode = c.layer_mode(layer)
        self.ratio = c.compress_ratio(layer)
        self.prefix = f"model.layers.{layer}.attn."
        self.num_heads = c.num_attention_heads
        self.head_dim = c.head_dim
        self.window = c.sliding_window
        self.o_groups = c.o_groups
        self.rope = main_rope if self.ratio == 0 else compress_rope
        self.candidate_source = layer == c.candidate_source_layer_id
        self.use_candidates = c.uses_candidates(layer)
        self.topk_blocks = c.candidate_topk_blocks
        self.block_size = c.candidate_block_size
        if self.ratio:
            self.keys_name = f"model.layers.{c.kv_source_of(layer)}.attn.indexer_keys"
        self.wq_a = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = nn.Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.wo_a = nn.Linear(self.num_heads * self.head_dim // c.o_groups,
                              c.o_groups * c.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(c.o_groups * c.o_lora_rank, c.hidden_size, bias=False)
        self.sinks_param = SinkParam(self.num_heads)
        if self.mode == FULL:
            self.compressor = CSA2Compressor(c.hidden_size, self.head_dim, self.ratio,
                                             c.rms_norm_eps)
        if self.mode in (FULL, REINDEX):
            self.indexer = CSA2Indexer(c, owns_keys=self.mode == FULL)

    @property
    def sinks(self) -> torch.Tensor:
        return self.sinks_param.weight

    def forward(self, x: torch.Tensor, step: V4Step, state: CSA2State) -> torch.Tensor:
        """x [T, d] (after attn_norm) -> [T, d]."""
        T = x.shape[0]
        cis = step.cis(self.rope)
        q_res = self.q_norm(self.wq_a(x))
        q = rotate(self.wq_b(q_res).view(T, self.num_heads, self.head_dim), cis)
        # Caches get the unquantised values (their codec quantises, step.codecs); this step's
        # own rows use the same quantised values a later step reads back.
        raw = rotate(self.kv_norm(self.wkv(x)), cis)
        step.write_window_rows(self.prefix + "window", raw)
        kv = kv_quant.fake_quant(raw, "fp8")
        if self.mode == FULL:
            self._write_entries(x, step)
        if self.mode in (FULL, REINDEX):
            csa2_select(self.indexer, x, q_res, step, self.keys_name, cis, self.ratio, state,
                        self.candidate_source, self.use_candidates, self.topk_blocks,
                        self.block_size)
        picks = state.picks if self.mode != SWA else None
        out = v4_batched.attend(self, q, kv, step, picks)                     # [T, H, D]
        out = rotate(out, step.cis(self.rope, inverse=True)).to(x.dtype)
        return self._project_out(out)

    def attend_dense(self, x: torch.Tensor, context: torch.Tensor, q_pos: torch.Tensor,
                     ctx_pos: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Cache-free attention of a small query block (DSpark's parallel drafts): queries
        x [B, Q, d] at q_pos [B, Q] see the context rows context [B, C, d] at ctx_pos where
        ctx_valid [B, C], and every row of their own block (bidirectional); plus the sink.
        -> [B, Q, d]. Window latents are FP8 as everywhere (sliding-window layers only)."""
        B, Q, _ = x.shape
        C = context.shape[1]

        def cis(pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
            return rope_cis(*self.rope.cos_sin(pos.reshape(-1)), inverse=inverse)

        q = self.wq_b(self.q_norm(self.wq_a(x))).view(B * Q, self.num_heads, self.head_dim)
        q = rotate(q, cis(q_pos)).view(B, Q, self.num_heads, self.head_dim)
        kv = torch.cat([
            rotate(self.kv_norm(self.wkv(context)).reshape(B * C, -1), cis(ctx_pos)).view(B, C, -1),
            rotate(self.kv_norm(self.wkv(x)).reshape(B * Q, -1), cis(q_pos)).view(B, Q, -1)],
            dim=1)
        kv = kv_quant.fake_quant(kv, "fp8").float()                          # [B, C+Q, D]
        logits = torch.einsum("bqhd,bkd->bhqk", q.float(), kv) * self.head_dim ** -0.5
        seen = torch.cat([ctx_valid, ctx_valid.new_ones(B, Q)], dim=1)        # [B, C+Q]
        logits = logits.masked_fill(~seen[:, None, None, :], float("-inf"))
        sink = self.sinks.float().view(1, -1, 1, 1).expand(B, -1, Q, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out = torch.einsum("bhqk,bkd->bqhd", probs, kv).to(x.dtype)
        out = rotate(out.reshape(B * Q, self.num_heads, -1), cis(q_pos, inverse=True))
        return self._project_out(out).view(B, Q, -1)

    def _write_entries(self, x: torch.Tensor, step: V4Step) -> None:
        latent, plan = self.compressor.latents(x, step, self.prefix + "compressor_state")
        if plan.num_entries == 0:
            return
        cis = step.entry_cis(self.rope, self.ratio, False)
        step.write_entries(self.prefix + "compressed", plan, rotate(latent, cis))  # -> NVFP4
        keys = rotate(self.indexer.k_norm(self.indexer.wk(latent)), cis)
        step.write_entries(self.keys_name, plan, keys)                         # -> MXFP4

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> grouped wo_a (one block per head group) -> wo_b -> [T, d]."""
        T, g = out.shape[0], self.o_groups
        grouped = out.reshape(T, g, -1).transpose(0, 1)                       # [g, T, H*D/g]
        w = self.wo_a.weight.view(g, -1, grouped.shape[-1])                   # [g, r_o, H*D/g]
        low = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1)           # [T, g, r_o]
        return self.wo_b(low.reshape(T, -1))
