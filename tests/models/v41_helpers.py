"""The DeepSeek-V4.1 oracle (nemo-automodel 0.7.0's DeepseekV41ForCausalLM, eager attention,
torch experts, fp32 on the CPU) and tiny configs covering every layer mode, Engram and both
indexer levels; checkpoints saved from it (safetensors of its state_dict, config.json,
a WordLevel tokenizer.json) load into wideserve through the normal loader."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")   # the oracle compiles its expert MLP

import torch
from safetensors.torch import save_file

VOCAB = 256
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
    head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_lora_rank=16, o_groups=2,
    n_routed_experts=8, num_experts_per_tok=2, sliding_window=8, index_n_heads=16,
    index_head_dim=32, hc_mult=4, hc_sinkhorn_iters=20, rms_norm_eps=1e-6,
    engram_vocab_size=37, engram_n_heads=2, engram_head_dim=16,
    engram_compressed_vocab_size=VOCAB, engram_pad_token_id=2, dspark_noise_token_id=VOCAB - 1,
    dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, dspark_markov_rank=8,
    num_nextn_predict_layers=3, dspark_block_size=5, dtype="float32", initializer_range=0.15,
    rope_scaling={"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 32})

# A: every layer mode, two-level indexer (candidate source 6), Engram at 1 and 4.
A = dict(_COMMON, num_hidden_layers=10,
         compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
         kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8],
         candidate_source_layer_id=6, candidate_topk_blocks=3, candidate_block_size=4,
         index_topk=5, engram_layer_ids=[1, 4], engram_num_embeddings=[600, 600],
         dspark_target_layer_ids=[7, 8, 9])
# B: no candidates, ratio 2 only, reindex without candidates, small top-k; no Engram.
B = dict(_COMMON, num_hidden_layers=6, compress_ratios=[0, 2, 2, 2, 2, 0, 0, 0, 0],
         kv_source_layer_ids=[1], index_source_layer_ids=[1, 3], candidate_source_layer_id=-1,
         index_topk=3, engram_layer_ids=[], engram_num_embeddings=[],
         dspark_target_layer_ids=[3, 4, 5])
# C: a ratio-1 source first, then the candidate source at ratio 2 with a Reindex after it;
# Engram at layer 0 (n-grams from the first position).
C = dict(_COMMON, num_hidden_layers=7, compress_ratios=[1, 1, 1, 0, 2, 2, 2, 0, 0, 0],
         kv_source_layer_ids=[0, 4], index_source_layer_ids=[0, 2, 4, 5],
         candidate_source_layer_id=4, candidate_topk_blocks=2, candidate_block_size=2,
         index_topk=4, engram_layer_ids=[0], engram_num_embeddings=[300],
         dspark_target_layer_ids=[4, 5, 6])
# D: candidates that really restrict: a ratio-1 candidate source keeping 3 blocks of 2 (6 of
# up to 60 visible entries), a Reindex choosing 3 of them, a Reuse after it.
D = dict(_COMMON, num_hidden_layers=5, compress_ratios=[0, 1, 1, 1, 0, 0, 0, 0],
         kv_source_layer_ids=[1], index_source_layer_ids=[1, 2], candidate_source_layer_id=1,
         candidate_topk_blocks=3, candidate_block_size=2, index_topk=3, engram_layer_ids=[],
         engram_num_embeddings=[], dspark_target_layer_ids=[2, 3, 4])
CONFIGS = {"A": A, "B": B, "C": C, "D": D}


def tokenizer(vocab: int = VOCAB):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def oracle_model(kw: dict, seed: int = 0):
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    cfg = DeepseekV41Config(text_config=dict(kw), vision_config={"num_hidden_layers": 0})
    be = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                       experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)
    torch.manual_seed(seed)
    m = DeepseekV41ForCausalLM(cfg, backend=be, tokenizer=tokenizer(kw["vocab_size"]))
    m.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():   # non-trivial sinks, mHC biases, router biases, norms
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in m.named_parameters():
            if name.endswith(("sinks_param.weight", ".base", "e_score_correction_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed.weight") and ".engram." in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return m.eval()


@torch.no_grad()
def oracle_logits(m, seq: list[int]) -> torch.Tensor:
    return m(torch.tensor([seq])).logits[0].float()


def save_checkpoint(m, kw: dict, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "text_config": dict(kw), "vision_config": {"num_hidden_layers": 0},
              "torch_dtype": "float32", "max_position_embeddings": 4096}
    (path / "config.json").write_text(json.dumps(config))
    tokenizer(kw["vocab_size"]).backend_tokenizer.save(str(path / "tokenizer.json"))
    return path


def save_dspark_checkpoint(kw: dict, path: Path, target_seed: int = 8, draft_seed: int = 9):
    """A random target (oracle_model(kw)) with a random DSpark drafter (two anchors and the
    confidence head), saved as one checkpoint: the target's state plus the drafter's `mtp.*`
    tensors. Returns (path, target, state)."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel
    target = oracle_model(kw, seed=target_seed)
    be = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope_fusion=False,
                       experts="torch", dispatcher="torch", enable_hf_state_dict_adapter=False)
    torch.manual_seed(draft_seed)
    draft = DeepseekV41DSparkModel(target.config.text_config, be, num_anchors=2,
                                   enable_confidence_head=True)
    save_checkpoint(target, kw, path)
    state = {k: v.contiguous() for k, v in target.state_dict().items()}
    state.update({k: v.contiguous() for k, v in draft.state_dict().items()
                  if k.startswith("mtp.")})
    save_file(state, str(path / "model.safetensors"))
    return path, target, state


def ws_model(path: Path):
    from wideserve.config import LoadConfig
    from wideserve.worker.model_loader import load_model
    return load_model(LoadConfig(model=str(path), dtype="float32")).model


def random_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@contextlib.contextmanager
def kv_quant_off():
    """Both sides with their KV quantisers replaced by the identity: the maths without the
    rounding steps, where batching-dependent last-bit differences cannot cross a bin."""
    import nemo_automodel.components.models.deepseek_v41.attention as oracle_attention

    from wideserve.layers import kv_quant
    saved = oracle_attention.quantize_cache, kv_quant.fake_quant
    oracle_attention.quantize_cache = lambda x, format, block_size: x
    kv_quant.fake_quant = lambda x, fmt: x
    try:
        yield
    finally:
        oracle_attention.quantize_cache, kv_quant.fake_quant = saved


def official_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A reference state_dict (target and DSpark `mtp.*`) under the official DeepSeek names of
    the released checkpoint (the reference's state-dict adapters' mappings), routed experts
    split per expert into w1 / w3 [I, d] and w2 [d, I]."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import (
        _dspark_released_key, _released_key)
    out = {}
    for name, t in state.items():
        released = _dspark_released_key if name.startswith("mtp.") else _released_key
        if name.endswith(".ffn.experts.gate_and_up_projs"):
            base = released(name).removesuffix(".gate_and_up_projs")
            inter = t.shape[2] // 2
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w1.weight"] = t[e, :, :inter].T.contiguous()
                out[f"{base}.{e}.w3.weight"] = t[e, :, inter:].T.contiguous()
        elif name.endswith(".ffn.experts.down_projs"):
            base = released(name).removesuffix(".down_projs")
            for e in range(t.shape[0]):
                out[f"{base}.{e}.w2.weight"] = t[e].T.contiguous()
        else:
            out[released(name)] = t.contiguous()
    return out
