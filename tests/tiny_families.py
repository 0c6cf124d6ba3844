"""Tiny random checkpoints (config.json only, weights `load_format="dummy"`) of each model
family, for the tests that hold every family to the same rule: the host-read budget
(tests/engine/test_host_read_budget.py) and the capturable decode forward
(tests/models/test_decode_fullgraph.py); benchmarks/host_reads.py counts the same models.
DeepSeek-V4 / V4.1 are the bundled tiny models."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=1e6,
               tie_word_embeddings=False, eos_token_id=1)
CONFIGS = {
    "llama": dict(_COMMON, architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen3moe": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                     moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True),
}
BUNDLED = {"v4": "shakespeare-v4-tiny", "v41": "shakespeare-v41-tiny"}
FAMILIES = (*CONFIGS, *BUNDLED)


def model_dir(family: str, tmp: Path) -> Path:
    """The checkpoint directory of `family` (written under tmp for the random ones)."""
    if family in BUNDLED:
        return ROOT / "wideserve" / "assets" / BUNDLED[family]
    if family not in CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    path = tmp / family
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIGS[family]))
    return path


def vocab_size(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    return (cfg.get("text_config") or cfg)["vocab_size"]


def qwen3_moe_checkpoint(path: Path, dtype=None, **config) -> str:
    """A random Qwen3-MoE written by transformers (real weights, seed 0) with `config`'s
    fields, saved in `dtype` (None: fp32); returns the directory."""
    import warnings

    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).eval()
    if dtype is not None:
        model = model.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, safe_serialization=True)
    return str(path)
