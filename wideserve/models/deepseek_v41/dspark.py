"""DSpark, DeepSeek-V4.1's parallel drafter (`mtp.0..2`; docs/deepseek_v41.md, "DSpark").

Three stacked sliding-window stages (own MoE with dspark_n_routed_experts / top
dspark_num_experts_per_tok, own single-pass mHC) draft a block of `dspark_block_size` tokens
in one pass. For an anchor token at position a (the newest token, not yet run by the target):
- inputs: the anchor's embedding, then block_size - 1 noise-token embeddings, at positions
  a .. a + block_size - 1;
- context: the target's tap features at positions [a - W, a) (W = sliding_window): for each
  position the mean over the residual streams entering the attention of each layer in
  dspark_target_layer_ids, concatenated; stage 0 projects them, main_norm(main_proj(.)), and
  every stage attends to them and, bidirectionally, to its own block;
- output slot i predicts the token at a + 1 + i: lm_head(norm(h_i)) plus a rank-r Markov head
  on the previous token (the anchor for slot 0, the slot i - 1 draft after), and a confidence
  logit (acceptance) from [norm(h_i) | Markov embedding].
Names are the reference's (`mtp.{s}.attn.wq_a.weight`, `mtp.0.main_proj.weight`,
`mtp.2.markov_head.embed.weight`, `mtp.2.confidence_head.proj.weight`); embedding and lm_head
are the target's.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from wideserve.models.deepseek_v41.attention import DeepseekV41Attention
from wideserve.layers.linear import FunctionalLinear
from wideserve.layers.moe import DeepseekV4MoE
from wideserve.layers.norm import RMSNorm
from wideserve.layers.rope_interleaved import RotaryTable
from wideserve.models.deepseek_v41.common import SinglePassHC, collapse, expand
from wideserve.models.deepseek_v41.config import DeepseekV41Config


class MarkovHead(nn.Module):
    """First-order token-transition logits of rank r: head(embed(previous token))."""

    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = nn.Linear(rank, vocab, bias=False)
        self.target_logits = FunctionalLinear()   # states @ the target's LM head^T, fp32


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1, bias=False, dtype=torch.float32)


class DSparkStage(nn.Module):
    def __init__(self, c: DeepseekV41Config, stage: int, rope: RotaryTable) -> None:
        super().__init__()
        # A sliding-window layer past the backbone (compress_ratios lists it as 0).
        layer_cfg = replace(c, compress_ratios=list(c.compress_ratios) + [0] * (stage + 1),
                            num_hidden_layers=c.num_hidden_layers + stage + 1)
        self.attn = DeepseekV41Attention(layer_cfg, c.num_hidden_layers + stage, rope, rope)
        self.ffn = DeepseekV4MoE(c.hidden_size, c.moe_intermediate_size,
                                 c.dspark_n_routed_experts, c.dspark_num_experts_per_tok,
                                 c.scoring_func, c.routed_scaling_factor, c.swiglu_limit, False,
                                 c.vocab_size)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc = (c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc = SinglePassHC(*hc)
        self.ffn_hc = SinglePassHC(*hc)
        if stage == 0:
            self.main_proj = nn.Linear(c.hidden_size * len(c.dspark_target_layer_ids),
                                       c.hidden_size, bias=False)
            self.main_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if stage == c.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.markov_head = MarkovHead(c.vocab_size, c.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(c.hidden_size, c.dspark_markov_rank)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, context: torch.Tensor,
                q_pos: torch.Tensor, ctx_pos: torch.Tensor, ctx_valid: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [B, Q, n, d], pre [B, Q, n] -> (streams, this stage's FFN-site pre)."""
        B, Q, n, d = streams.shape
        flat = streams.view(B * Q, n, d)
        attn_pre, post, comb = self.attn_hc.coefficients(flat)
        x = self.attn_norm(collapse(flat, pre.view(B * Q, n))).view(B, Q, d)
        y = self.attn.attend_dense(x, context, q_pos, ctx_pos, ctx_valid).view(B * Q, d)
        flat = expand(y, flat, post, comb)
        ffn_pre, post, comb = self.ffn_hc.coefficients(flat)
        x = self.ffn_norm(collapse(flat, attn_pre))
        y = self.ffn(x, torch.zeros(B * Q, dtype=torch.int64, device=x.device))
        return expand(y, flat, post, comb).view(B, Q, n, d), ffn_pre.view(B, Q, n)


def build_stages(config: DeepseekV41Config, rope: RotaryTable) -> nn.ModuleList:
    return nn.ModuleList(DSparkStage(config, s, rope)
                         for s in range(config.num_nextn_predict_layers))


def draft_block(stages: nn.ModuleList, c: DeepseekV41Config, embeds: torch.Tensor,
                features: torch.Tensor, anchor_pos: torch.Tensor, ctx_pos: torch.Tensor,
                ctx_valid: torch.Tensor) -> torch.Tensor:
    """embeds [B, Q, d] (anchor then noise tokens), features [B, C, taps * d] at ctx_pos
    [B, C] (valid where ctx_valid) -> normalised states [B, Q, d] of the last stage."""
    B, Q, _ = embeds.shape
    q_pos = anchor_pos[:, None] + torch.arange(Q, device=embeds.device)
    streams = embeds[:, :, None, :].expand(-1, -1, c.hc_mult, -1).contiguous()
    pre = torch.zeros(B, Q, c.hc_mult, dtype=torch.float32, device=embeds.device)
    pre[..., 0].fill_(1.0)       # (an op: `= 1` lifts a host scalar tensor, docs/cuda_graphs.md)
    context = stages[0].main_norm(stages[0].main_proj(features))
    for stage in stages:
        streams, pre = stage(streams, pre, context, q_pos, ctx_pos, ctx_valid)
    return stages[-1].norm(collapse(streams.flatten(0, 1), pre.flatten(0, 1))).view(B, Q, -1)


def draft_head(stages: nn.ModuleList, states: torch.Tensor, previous: torch.Tensor,
               lm_head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """states [..., d], previous token ids [...] -> (draft logits [..., V] fp32,
    confidence logits [...] fp32)."""
    last = stages[-1]
    emb = last.markov_head.embed(previous)
    logits = last.markov_head.target_logits(states.float(), lm_head.weight, widen_weight=True)
    logits = logits + last.markov_head.head(emb).float()
    conf = last.confidence_head.proj(torch.cat([states.float(), emb.float()], -1))
    return logits, conf.squeeze(-1)


def dspark_rope(config: DeepseekV41Config) -> RotaryTable:
    """DSpark stages are ratio-0 layers: plain RoPE at rope_theta."""
    return RotaryTable({"rope_type": "default", "rope_theta": config.rope_theta},
                       config.qk_rope_head_dim)
