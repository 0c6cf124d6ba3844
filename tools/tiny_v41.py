"""The bundled tiny DeepSeek-V4.1 model: config, the training model, one joint step, save/load.

Shared by `tools/train_tiny_v41.py` (training) and `tools/eval_tiny_v41.py` (card numbers).
The training model is the reference implementation itself: nemo-automodel 0.7.0's
`DeepseekV41ForCausalLM` (backbone) and `DeepseekV41DSparkModel` (the three DSpark stages),
run on the CPU in fp32 with its eager attention and torch experts. Its KV quantisers are
quantisation-aware (straight-through gradients), so the weights are trained for the FP8 /
NVFP4 / MXFP4 records the engine serves with.

DSpark is trained jointly, on the backbone's tap features of the same forward (detached: the
drafter's loss does not move the backbone): for sampled anchors a, the block
[token a, 4 noise tokens] at positions a..a+4 drafts tokens a+1..a+5; loss = 0.1 x CE to the
text + 0.9 x L1 distance to the backbone's next-token distribution + the confidence head's
BCE against the per-slot acceptance 1 - L1/2 (the reference's DSpark objective). The drafter's
embedding and lm_head are frozen copies of the backbone's, refreshed before every step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")   # the reference compiles its expert MLP

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

NOISE_TOKEN = 3        # <|system|>: never in the training stream, a real (non-zero) embedding


@dataclass(slots=True)
class TinyV41Sizes:
    """Architecture knobs (defaults = the bundled checkpoint)."""

    hidden: int = 128
    heads: int = 4
    head_dim: int = 64
    rope_dim: int = 16
    q_lora: int = 64
    o_groups: int = 2
    o_lora: int = 64
    experts: int = 8
    top_k: int = 2
    expert_width: int = 64
    hc_mult: int = 2
    sinkhorn_iters: int = 4
    window: int = 64
    index_heads: int = 16
    index_dim: int = 32
    index_topk: int = 16
    candidate_blocks: int = 4
    candidate_block: int = 8
    engram_heads: int = 4
    engram_dim: int = 32
    engram_buckets: int = 800
    dspark_experts: int = 4
    dspark_top_k: int = 2
    markov_rank: int = 32
    max_positions: int = 1024


# Seven layers, every V4.1 layer mode: 0 SWA; 1 Full r2; 2 Reuse r2; 3 Reindex r2;
# 4 Full r1 = the candidate source (two-level indexer); 5 Reindex r1 restricted to the
# candidates; 6 Reuse r1. Engram before layers 1 and 4. The last three ratios are the DSpark
# stages (sliding window only), taps at layers 4..6.
RATIOS = [0, 2, 2, 2, 1, 1, 1, 0, 0, 0]
KV_SOURCES = [1, 4]
INDEX_SOURCES = [1, 3, 4, 5]
CANDIDATE_SOURCE = 4
ENGRAM_LAYERS = [1, 4]
DSPARK_TAPS = [4, 5, 6]
N_LAYERS = 7


def engram_rows(s: TinyV41Sizes, ngram: int = 4) -> list[int]:
    """Rows per Engram layer: each holds its (ngram-1) x heads prime buckets, the primes taken
    in order above `engram_buckets`, never reused across layers (the reference's rule)."""
    def is_prime(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))

    rows, p = [], s.engram_buckets - 1
    for _ in ENGRAM_LAYERS:
        total = 0
        for _ in range((ngram - 1) * s.engram_heads):
            p += 1
            while not is_prime(p):
                p += 1
            total += p
        rows.append(total)
    return rows


def text_config(s: TinyV41Sizes, vocab: int, compressed_vocab: int, rows: list[int]) -> dict:
    """The nested `text_config` of config.json (the reference's DeepseekV41TextConfig keys)."""
    return dict(
        vocab_size=vocab, hidden_size=s.hidden, moe_intermediate_size=s.expert_width,
        num_hidden_layers=N_LAYERS, num_attention_heads=s.heads, num_key_value_heads=1,
        head_dim=s.head_dim, qk_rope_head_dim=s.rope_dim, q_lora_rank=s.q_lora,
        o_lora_rank=s.o_lora, o_groups=s.o_groups, n_routed_experts=s.experts,
        num_experts_per_tok=s.top_k, n_shared_experts=1, routed_scaling_factor=1.5,
        swiglu_limit=10.0, sliding_window=s.window, rms_norm_eps=1e-6, initializer_range=0.02,
        max_position_embeddings=s.max_positions, rope_theta=10000.0,
        compress_rope_theta=160000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 256},
        compress_ratios=list(RATIOS), kv_source_layer_ids=list(KV_SOURCES),
        index_source_layer_ids=list(INDEX_SOURCES), index_n_heads=s.index_heads,
        index_head_dim=s.index_dim, index_topk=s.index_topk,
        candidate_source_layer_id=CANDIDATE_SOURCE, candidate_topk_blocks=s.candidate_blocks,
        candidate_block_size=s.candidate_block, hc_mult=s.hc_mult,
        hc_sinkhorn_iters=s.sinkhorn_iters, hc_eps=1e-6,
        engram_layer_ids=list(ENGRAM_LAYERS), engram_num_embeddings=rows,
        engram_max_ngram_size=4, engram_vocab_size=s.engram_buckets,
        engram_n_heads=s.engram_heads, engram_head_dim=s.engram_dim, engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed_vocab,
        num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=NOISE_TOKEN,
        dspark_target_layer_ids=list(DSPARK_TAPS), dspark_markov_rank=s.markov_rank,
        dspark_n_routed_experts=s.dspark_experts, dspark_num_experts_per_tok=s.dspark_top_k,
        dtype="float32", pad_token_id=2, bos_token_id=0, eos_token_id=1)


def hf_tokenizer(tokenizer_json: str):  # noqa: ANN201 - transformers type
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_json)


def compressed_vocab_size(tok) -> int:  # noqa: ANN001
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map
    return _compressed_token_map(tok)[1]


def _backend():  # noqa: ANN202
    from nemo_automodel.components.models.common import BackendConfig
    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                         experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)


class TinyV41(nn.Module):
    """Backbone + DSpark drafter, both the reference's modules."""

    def __init__(self, text_cfg: dict, tok, num_anchors: int = 16) -> None:  # noqa: ANN001
        super().__init__()
        from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
        from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
        cfg = DeepseekV41Config(text_config=dict(text_cfg), vision_config={"num_hidden_layers": 0})
        self.text_cfg = dict(text_cfg)
        self.lm = DeepseekV41ForCausalLM(cfg, backend=_backend(), tokenizer=tok)
        self.lm.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
        self.draft = DeepseekV41DSparkModel(cfg.text_config, _backend(), num_anchors=num_anchors,
                                            enable_confidence_head=True,
                                            confidence_head_stop_gradient=True)
        self.sync_draft_head()
        self._taps: list[torch.Tensor] = []
        for m in self.lm.get_dspark_target_feature_modules(list(DSPARK_TAPS)):
            m.register_forward_pre_hook(lambda _m, args: self._taps.append(args[0].mean(2)))

    @torch.no_grad()
    def sync_draft_head(self) -> None:
        """The drafter's embedding and lm_head are frozen copies of the backbone's."""
        self.draft.initialize_embeddings_and_head(embed_tokens=self.lm.get_input_embeddings(),
                                                  lm_head=self.lm.get_output_embeddings())

    def forward(self, chunk: torch.Tensor, dspark: bool = True):  # noqa: ANN201
        """chunk [B, S+1] -> (main CE, DSpark metrics or None); the stream's next tokens."""
        x, y = chunk[:, :-1], chunk[:, 1:]
        self._taps.clear()
        out = self.lm(x, return_hidden_states=True)
        main = F.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]), y.reshape(-1))
        if not dspark:
            return main, None, out
        from nemo_automodel.components.speculative.dspark.core import DSparkTrainerModule
        features = torch.cat(self._taps, dim=-1).detach()
        metrics = DSparkTrainerModule(self.draft)(
            input_ids=x, target_hidden_states=features,
            loss_mask=torch.ones_like(x, dtype=torch.float32),
            target_last_hidden_states=out.hidden_states.detach())
        return main, metrics, out


def routers(model: TinyV41) -> list[tuple[str, nn.Module]]:
    """Every top-k gate (backbone layers and DSpark stages) with its correction bias."""
    from nemo_automodel.components.moe.layers import Gate
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, Gate) and getattr(m, "e_score_correction_bias", None) is not None]


def checkpoint_state(model: TinyV41) -> dict[str, torch.Tensor]:
    """The backbone's state_dict plus the drafter's `mtp.*` (the engine's names); float
    parameters in bf16, buffers (router biases) as they are."""
    params = {n for n, _ in model.lm.named_parameters()}
    params |= {n for n, _ in model.draft.named_parameters()}
    state = dict(model.lm.state_dict())
    state.update({k: v for k, v in model.draft.state_dict().items() if k.startswith("mtp.")})
    return {k: (v.to(torch.bfloat16) if k in params and v.is_floating_point() else v)
            .contiguous() for k, v in state.items()}


def save_model(model: TinyV41, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    save_file(checkpoint_state(model), os.path.join(out_dir, "model.safetensors"))
    text = dict(model.text_cfg, dtype="bfloat16")
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "text_config": text, "vision_config": {"num_hidden_layers": 0},
              "torch_dtype": "bfloat16", "max_position_embeddings": text["max_position_embeddings"],
              "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def load_model(model_dir: str, num_anchors: int = 16) -> TinyV41:
    """The saved directory back into the reference modules, weights upcast to fp32."""
    with open(os.path.join(model_dir, "config.json")) as f:
        text = dict(json.load(f)["text_config"], dtype="float32")
    model = TinyV41(text, hf_tokenizer(os.path.join(model_dir, "tokenizer.json")), num_anchors)
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    lm = {k: v.float() if v.is_floating_point() else v for k, v in state.items()
          if not k.startswith("mtp.")}
    model.lm.load_state_dict(lm, strict=True)
    draft = {k: v.float() for k, v in state.items() if k.startswith("mtp.")}
    missing, unexpected = model.draft.load_state_dict(draft, strict=False)
    assert not unexpected and all(not k.startswith("mtp.") for k in missing), (missing, unexpected)
    model.sync_draft_head()
    return model.eval()
