"""The bundled tiny DeepSeek-V4 model: config, the MTP block, save/load, one joint forward.

Shared by `tools/train_tiny.py` (training) and `tools/eval_tiny.py` (the model card numbers).
The main model is transformers' `DeepseekV4ForCausalLM` unchanged (it is the reference
architecture); HF does not instantiate MTP, so the single MTP block lives here.

MTP semantics (the engine implements the same; parameter names are the checkpoint's):
for a token at position p,
    X_main[p]  = main multi-stream state [n, d] after the last decoder layer, BEFORE hc_head
    e          = embed(token at p+1)                         (shared embedding)
    x          = e_proj(enorm(e)) (broadcast over n streams) + h_proj(hnorm(X_main[p])) (per stream)
    x          = one V4 decoder block (mHC + sliding-window attention at RoPE position p, "main"
                 rope, + top-k MoE with e_score_correction_bias)
    logits     = lm_head(norm(hc_head(x)))                   -> distribution of the token at p+2
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HashRouter,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4TopKRouter,
)

MTP_PREFIX = "mtp.0."


@dataclass(slots=True)
class TinySizes:
    """Architecture knobs of the tiny model (defaults = the bundled checkpoint)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora: int = 64
    o_groups: int = 2
    o_lora: int = 64
    experts: int = 8
    top_k: int = 2
    expert_width: int = 128
    hash_layers: int = 1
    hc_mult: int = 2
    sinkhorn_iters: int = 4
    window: int = 64
    csa_ratio: int = 4
    hca_ratio: int = 32
    index_heads: int = 2
    index_dim: int = 32
    index_topk: int = 16
    max_positions: int = 1024


def layer_schedule(n_layers: int) -> list[str]:
    """SWA first (like V4-Flash), then CSA/HCA alternating, so every kind is present."""
    if n_layers < 3:
        raise ValueError(f"layers must be >= 3 to hold SWA, CSA and HCA layers, got {n_layers}")
    rest = ["compressed_sparse_attention", "heavily_compressed_attention"]
    return ["sliding_attention"] + [rest[i % 2] for i in range(n_layers - 1)]


def build_config(sizes: TinySizes, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> DeepseekV4Config:
    s = sizes
    if s.hash_layers >= s.layers:
        raise ValueError("hash_layers must leave at least one top-k MoE layer")
    cfg = DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=s.hidden,
        moe_intermediate_size=s.expert_width,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=1,
        head_dim=s.head_dim,
        partial_rotary_factor=s.rope_dim / s.head_dim,
        q_lora_rank=s.q_lora,
        o_groups=s.o_groups,
        o_lora_rank=s.o_lora,
        num_experts_per_tok=s.top_k,
        n_routed_experts=s.experts,
        n_shared_experts=1,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        max_position_embeddings=s.max_positions,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        # YaRN on the compress rope like the real checkpoints (factor x original = max positions).
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": s.max_positions // 4,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        layer_types=layer_schedule(s.layers),
        mlp_layer_types=["hash_moe"] * s.hash_layers + ["moe"] * (s.layers - s.hash_layers),
        compress_rates={"compressed_sparse_attention": s.csa_ratio, "heavily_compressed_attention": s.hca_ratio},
        hc_mult=s.hc_mult,
        hc_sinkhorn_iters=s.sinkhorn_iters,
        sliding_window=s.window,
        index_n_heads=s.index_heads,
        index_head_dim=s.index_dim,
        index_topk=s.index_topk,
        num_nextn_predict_layers=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    return cfg


def mtp_layer_config(config: DeepseekV4Config) -> DeepseekV4Config:
    """Config whose extra layer index (= num_hidden_layers) is a sliding-window, top-k MoE layer."""
    cfg = copy.deepcopy(config)
    n = config.num_hidden_layers
    cfg.num_hidden_layers = n + 1
    cfg.layer_types = list(config.layer_types) + ["sliding_attention"]
    cfg.mlp_layer_types = list(config.mlp_layer_types) + ["moe"]
    return cfg


class MTPBlock(DeepseekV4DecoderLayer):
    """One MTP module: HF decoder block (names match `mtp.0.*`) + the MTP input/output glue."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__(mtp_layer_config(config), config.num_hidden_layers)
        d = config.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.norm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hc_head = DeepseekV4HyperHead(config)

    def mtp_forward(
        self,
        x_main: torch.Tensor,  # [B, S, n, d] main streams before hc_head
        next_embeds: torch.Tensor,  # [B, S, d] embedding of the token at p+1
        position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]],
        position_ids: torch.Tensor,  # [B or 1, S]
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:  # [B, S, d] normed hidden for lm_head
        e = self.e_proj(self.enorm(next_embeds)).unsqueeze(2)  # [B, S, 1, d]
        x = e + self.h_proj(self.hnorm(x_main))  # [B, S, n, d]
        x = self(
            x,
            position_embeddings=position_embeddings,
            position_ids=position_ids,
            attention_mask=attention_mask,
            input_ids=None,
        )
        return self.norm(self.hc_head(x))


class TinyV4WithMTP(nn.Module):
    """`lm` is the HF model (names `lm.model.*`, `lm.lm_head.*`), `mtp[0]` the MTP block."""

    def __init__(self, config: DeepseekV4Config):
        super().__init__()
        self.lm = DeepseekV4ForCausalLM(config)
        self.mtp = nn.ModuleList([MTPBlock(config)])
        self.mtp.apply(self.lm._init_weights)
        self._captured: list[torch.Tensor] = []
        self.lm.model.layers[-1].register_forward_hook(self._capture_last_layer)

    def _capture_last_layer(self, _module: nn.Module, _args: object, output: torch.Tensor) -> None:
        self._captured.append(output)

    def forward(
        self, input_ids: torch.Tensor, next_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids [B, S]; next_ids [B, S] = token at p+1 (None: skip MTP). Returns (main, mtp) logits."""
        self._captured.clear()
        out = self.lm(input_ids=input_ids, use_cache=False)
        x_main = self._captured.pop()  # [B, S, n, d]
        if next_ids is None:
            return out.logits, None
        model = self.lm.model
        pos = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        embeds = model.embed_tokens(next_ids)
        pe = {
            "main": model.rotary_emb(embeds, position_ids=pos, layer_type="main"),
            "compress": model.rotary_emb(embeds, position_ids=pos, layer_type="compress"),
        }
        mask = create_sliding_window_causal_mask(
            config=self.lm.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=pos
        )
        h = self.mtp[0].mtp_forward(x_main, embeds, pe, pos, mask)
        return out.logits, self.lm.lm_head(h)


def init_hash_tables(model: TinyV4WithMTP, generator: torch.Generator) -> None:
    """HF zero-inits tid2eid (every token -> expert 0); give each token k distinct random experts."""
    for module in model.modules():
        if isinstance(module, DeepseekV4HashRouter):
            vocab, k = module.tid2eid.shape
            perm = torch.rand(vocab, module.num_experts, generator=generator).argsort(dim=-1)
            module.tid2eid.copy_(perm[:, :k])


def topk_routers(model: TinyV4WithMTP) -> list[tuple[str, DeepseekV4TopKRouter]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, DeepseekV4TopKRouter)]


def all_routers(model: TinyV4WithMTP) -> list[tuple[str, nn.Module]]:
    kinds = (DeepseekV4TopKRouter, DeepseekV4HashRouter)
    return [(n, m) for n, m in model.named_modules() if isinstance(m, kinds)]


def checkpoint_state(model: TinyV4WithMTP) -> dict[str, torch.Tensor]:
    """HF checkpoint names: `model.*`, `lm_head.*`, `mtp.0.*`; floats in bf16, tid2eid int64."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = name[len("lm."):] if name.startswith("lm.") else name
        t = t.detach().to("cpu")
        out[key] = (t.to(torch.bfloat16) if t.is_floating_point() else t.to(torch.int64)).contiguous()
    return out


def save_model(model: TinyV4WithMTP, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_file(checkpoint_state(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.lm.config.to_dict()
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg["num_nextn_predict_layers"] = 1
    cfg.pop("_experts_implementation", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def load_model(model_dir: str, dtype: torch.dtype = torch.float32) -> TinyV4WithMTP:
    """Rebuild from a saved directory (bf16 weights upcast to `dtype`); strict on names."""
    config = DeepseekV4Config.from_pretrained(model_dir)
    model = TinyV4WithMTP(config)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    mapped = {("lm." + k if not k.startswith("mtp.") else k): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(mapped, strict=False)
    # Rotary inv_freq buffers are non-persistent, so nothing may be missing.
    if missing or unexpected:
        raise ValueError(f"{model_dir}/model.safetensors: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


def joint_loss(
    model: TinyV4WithMTP, chunk: torch.Tensor, mtp_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk [B, S+2] -> (total, main CE over S targets, MTP CE over S targets)."""
    inputs, nxt, nxt2 = chunk[:, :-2], chunk[:, 1:-1], chunk[:, 2:]
    main_logits, mtp_logits = model(inputs, nxt)
    vocab = main_logits.shape[-1]
    main = F.cross_entropy(main_logits.float().reshape(-1, vocab), nxt.reshape(-1))
    mtp = F.cross_entropy(mtp_logits.float().reshape(-1, vocab), nxt2.reshape(-1))
    return main + mtp_weight * mtp, main, mtp
