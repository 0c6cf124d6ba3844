"""DeepSeek-V4 attention over the paged varlen batch (docs/deepseek_v4.md, "Attention" to "Lightning indexer").

One shared K=V latent per token. A query at position p attends to
  - the sliding window: latents of positions [p-W+1, p] ("window" cache, ratio 1),
  - compressed entries (CSA/HCA layers): HCA all visible entries w < (p+1)//m; CSA the indexer's
    top-k among them,
  - a per-head sink logit that only enlarges the softmax denominator.
The output's rope channels are rotated back by -p, then a grouped low-rank projection maps the
H heads to the hidden size.

Cache names (per layer prefix P = "model.layers.{i}.self_attn."): P+"window"; CSA adds
P+"compressed", P+"indexer", P+"state", P+"indexer_state"; HCA adds P+"compressed", P+"state".

`V4Step` (v4_step.py) is the per-forward view of a ForwardBatch shared by every layer. The
indexer's top-k selection and the attention itself are backend ops (registry.py): "reference"
loops over requests and is the oracle, "batched" (the default) handles all tokens at once.
"""
from __future__ import annotations

import torch
from torch import nn

from wideserve.layers.attention import v4_static
from wideserve.layers.attention.registry import get_attention_backend, resolve_attention_backend
from wideserve.layers.attention.v4_step import StepCaches, V4Step
from wideserve.layers.attention.compressor import Compressor
from wideserve.layers.attention.indexer import Indexer
from wideserve.layers.norm import RMSNorm, rms_norm
from wideserve.layers.small_m import grouped_linear
from wideserve.layers.rope_interleaved import RotaryTable, rotate
from wideserve.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config

__all__ = ["DeepseekV4Attention", "V4Step"]


class DeepseekV4Attention(nn.Module):
    """HF names: q_a_proj, q_a_norm, q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks,
    compressor (CSA/HCA), compressor.indexer (CSA)."""

    def __init__(self, config: DeepseekV4Config, layer_type: str, cache_prefix: str,
                 main_rope: RotaryTable, compress_rope: RotaryTable,
                 backend: str | None = None) -> None:
        super().__init__()
        c = config
        self.layer_type = layer_type
        self.backend = resolve_attention_backend(backend)    # a registry.py V4 backend name
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
        # None: the attention products run in the model dtype (docs/deepseek_v4.md,
        # "Attention precision"); a dtype (e.g. torch.float32) forces that one.
        self.dtype_override: torch.dtype | None = None
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

    @property
    def compute_dtype(self) -> torch.dtype:
        """What q.k and p.v run in (v4_batched.compute_dtype): the model dtype unless
        `dtype_override` is set."""
        return self.dtype_override or self.q_b_proj.weight.dtype

    def forward(self, x: torch.Tensor, step: StepCaches) -> torch.Tensor:
        """x [T, d] (after input_layernorm) -> [T, d]."""
        T = x.shape[0]
        cis = step.cis(self.rope)
        q_res = self.q_a_norm(self.q_a_proj(x))                               # [T, r_q]
        q = self.q_b_proj(q_res).view(T, self.num_heads, self.head_dim)
        q = rotate(rms_norm(q, None, self.eps), cis)                          # [T, H, D]
        kv = rotate(self.kv_norm(self.kv_proj(x)), cis)                       # [T, D]
        step.write_window_rows(self.prefix + "window", kv)

        # A decode batch on the capturable path (v4_static.py), else the layer's backend.
        ops = v4_static if step.static else get_attention_backend(self.backend)
        picks = None
        if self.ratio:
            self.compressor(x, step, self.prefix + "state", self.prefix + "compressed",
                            self.rope)
            if self.layer_type == CSA:
                indexer: Indexer = self.compressor.indexer
                indexer(x, step, self.prefix + "indexer_state", self.prefix + "indexer",
                        self.rope)
                picks = ops.select(indexer, x, q_res, step, self.prefix + "indexer", cis)
        out = ops.attend(self, q, kv, step, picks)                            # [T, H, D]
        # V = K carries rope: rotating the output back by -p leaves relative positions only.
        out = rotate(out, step.cis(self.rope, inverse=True)).to(x.dtype)
        return self._project_out(out)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> grouped o_a (one block per head group) -> o_b -> [T, d]."""
        T = out.shape[0]
        g = self.o_groups
        grouped = out.reshape(T, g, self.num_heads * self.head_dim // g)     # [T, g, H*D/g]
        # one bmm over the g blocks of o_a's rows (small-M GEMMs in a small-batch step)
        low = grouped_linear(self.o_a_proj, grouped.transpose(0, 1), g)        # [g, T, o_lora]
        return self.o_b_proj(low.transpose(0, 1).reshape(T, g * low.shape[-1]))  # [T, g*o_lora]
