"""Checkpoint directories for the speculative-decoding engine tests: a tiny DeepSeek-V4 with
one random MTP block (transformers' weights + ours for `mtp.0.*`), and a tiny Llama draft."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from models import v4_configs
from models.v4_helpers import hf_model, randomize_, ws_model
from safetensors.torch import save_file


def v4_mtp_checkpoint(path: Path, kw: dict | None = None, seed: int = 3):
    """Save a V4 (config A unless `kw`) whose MTP block is random; returns the HF model."""
    kw = dict(v4_configs.A) if kw is None else kw
    hf = hf_model(kw, seed=seed)
    ws = ws_model(kw, hf, mtp_layers=1)
    randomize_(ws.mtp, seed=seed + 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(path, safe_serialization=True)
    for f in path.glob("*.safetensors*"):
        f.unlink()
    for f in path.glob("*.index.json"):
        f.unlink()
    save_file({k: v.detach().contiguous() for k, v in ws.state_dict().items()},
              str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return hf


def llama_checkpoint(path: Path, vocab: int, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
        tie_word_embeddings=False)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(path, safe_serialization=True)
    return path
