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
consumer uses exactly what its sources computed for the same tokens. The ops come from the
attention registry (kind "v41"): the CSA2 select (v41_batched.py) and the batched V4 attend
(window + picked entries + sink), fed the picks as [T, k] entry ids.
"""
from __future__ import annotations

import torch
from torch import nn

from wideserve.layers import kv_quant
from wideserve.layers.attention.registry import (get_v41_attention_backend,
                                                 resolve_v41_attention_backend)
from wideserve.layers.attention import v4_static
from wideserve.layers.attention.v41_batched import CSA2State, select_decode
from wideserve.layers.attention.v4_step import StepCaches, V4Step
from wideserve.layers.norm import RMSNorm
from wideserve.layers.small_m import grouped_linear
from wideserve.layers.rope_interleaved import RotaryTable, rope_cis, rotate
from wideserve.models.deepseek_v41.config import FULL, REINDEX, SWA, DeepseekV41Config


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

    def latents(self, x: torch.Tensor, step: StepCaches, state_name: str):
        """Pre-RoPE normalised latents [N, D] of the entries completing in this step, and
        their plan. m > 1 keeps per-position [kv | gate] rows (fp32) in a window-m cache.
        A decode step on the static path: every row's target entry [R, D], plan None
        (v4_static.V4DecodeStep.entry_target)."""
        if step.static:
            return self._decode_latents(x, step, state_name), None
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

    def _decode_latents(self, x: torch.Tensor, step: v4_static.V4DecodeStep,
                        state_name: str) -> torch.Tensor:
        if self.ratio == 1:
            return self.norm(self.wkv(x.float()).to(x.dtype))
        rows = torch.cat([self.wkv(x.float()), self.wgate(x.float())], dim=-1)   # [R, 2D]
        step.write_window_rows(state_name, rows)
        src, _ = step.gather_state(state_name, rows, self.ratio, False, 1)       # [R, m, 2D]
        kv, gate = src[..., :self.head_dim], src[..., self.head_dim:]
        return self.norm((kv * gate.softmax(dim=1)).sum(dim=1).to(x.dtype))


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


class DeepseekV41Attention(nn.Module):
    """Names (the reference's): wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
    sinks_param.weight, compressor.* (full), indexer.* (full, reindex)."""

    # What V4's batched attend runs the window/entry products in (v4_step.V4AttentionParams).
    compute_dtype = torch.float32

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
        # The ops (layers/attention/registry.py, kind "v41"): the CSA2 select, V4's attend.
        self.backend = resolve_v41_attention_backend()

    @property
    def sinks(self) -> torch.Tensor:
        return self.sinks_param.weight

    def forward(self, x: torch.Tensor, step: StepCaches, state: CSA2State,
                write_entries: bool = True) -> torch.Tensor:
        """x [T, d] (after attn_norm) -> [T, d]. write_entries=False: a KV source whose
        entries this step already wrote (`write_entries`; the decoder bounded replay)."""
        if step.static:     # a decode batch on the capturable path (v4_static.py)
            select, attend = select_decode, v4_static.attend
        else:
            backend = get_v41_attention_backend(self.backend)
            select, attend = backend.select, backend.attend
        T = x.shape[0]
        cis = step.cis(self.rope)
        q_res = self.q_norm(self.wq_a(x))
        q = rotate(self.wq_b(q_res).view(T, self.num_heads, self.head_dim), cis)
        # Caches get the unquantised values (their codec quantises, step.codecs); this step's
        # own rows use the same quantised values a later step reads back.
        raw = rotate(self.kv_norm(self.wkv(x)), cis)
        step.write_window_rows(self.prefix + "window", raw)
        kv = kv_quant.fake_quant(raw, "fp8")
        if self.mode == FULL and write_entries:
            self.write_entries(x, step)
        if self.mode in (FULL, REINDEX):
            select(self.indexer, x, q_res, step, self.keys_name, cis, self.ratio, state,
                   self.candidate_source, self.use_candidates, self.topk_blocks,
                   self.block_size)
        picks = state.picks if self.mode != SWA else None
        out = attend(self, q, kv, step, picks)                                # [T, H, D]
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

    def write_entries(self, x: torch.Tensor, step: StepCaches) -> None:
        """A KV source's compressed entries and indexer keys completing in the step, from x
        [T, d] (after attn_norm) alone."""
        latent, plan = self.compressor.latents(x, step, self.prefix + "compressor_state")
        if step.static:     # every row's target entry; `where`: the entry's slot or scratch
            cis, where = step.entry_cis(self.rope, self.ratio), self.ratio
        elif plan.num_entries == 0:
            return
        else:
            cis, where = step.entry_cis(self.rope, self.ratio, False), plan
        step.write_entries(self.prefix + "compressed", where, rotate(latent, cis))  # -> NVFP4
        keys = rotate(self.indexer.k_norm(self.indexer.wk(latent)), cis)
        step.write_entries(self.keys_name, where, keys)                         # -> MXFP4

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> grouped wo_a (one block per head group) -> wo_b -> [T, d]."""
        T, g = out.shape[0], self.o_groups
        grouped = out.reshape(T, g, -1).transpose(0, 1)                       # [g, T, H*D/g]
        # one bmm over the g blocks of wo_a's rows (small-M GEMMs in a small-batch step)
        low = grouped_linear(self.wo_a, grouped, g).transpose(0, 1)            # [T, g, r_o]
        return self.wo_b(low.reshape(T, -1))
