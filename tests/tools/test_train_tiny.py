"""Smoke test of the tiny-model pipeline (tools/train_tiny.py): a few steps on a slice of the
corpus must produce a complete HF-layout directory that transformers loads, with the MTP block."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
sys.path.insert(0, os.path.abspath(TOOLS))

import train_tiny  # noqa: E402
from tiny_v4 import load_model  # noqa: E402

MTP_KEYS = [
    "mtp.0.input_layernorm.weight",
    "mtp.0.post_attention_layernorm.weight",
    *[f"mtp.0.{site}.{p}" for site in ("attn_hc", "ffn_hc") for p in ("fn", "base", "scale")],
    "mtp.0.self_attn.q_a_proj.weight",
    "mtp.0.self_attn.kv_proj.weight",
    "mtp.0.self_attn.sinks",
    "mtp.0.mlp.gate.weight",
    "mtp.0.mlp.gate.e_score_correction_bias",
    "mtp.0.mlp.experts.gate_up_proj",
    "mtp.0.mlp.experts.down_proj",
    "mtp.0.mlp.shared_experts.down_proj.weight",
    "mtp.0.e_proj.weight",
    "mtp.0.h_proj.weight",
    "mtp.0.enorm.weight",
    "mtp.0.hnorm.weight",
    "mtp.0.norm.weight",
    "mtp.0.hc_head.hc_fn",
    "mtp.0.hc_head.hc_base",
    "mtp.0.hc_head.hc_scale",
]


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("tiny") / "model")
    argv = ["--out", out, "--steps", "3", "--seed", "1", "--corpus-limit-bytes", "60000",
            "--vocab-size", "400", "--card-max-windows", "2", "--sample-tokens", "4", "--log-every", "1"]
    metrics = train_tiny.main(argv)
    return out, metrics


def test_directory_complete(trained_dir: tuple[str, dict]) -> None:
    out, metrics = trained_dir
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "README.md"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["model_type"] == "deepseek_v4"
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"]
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["torch_dtype"] == "bfloat16"
    assert set(cfg["layer_types"]) == {"sliding_attention", "compressed_sparse_attention",
                                       "heavily_compressed_attention"}
    assert cfg["mlp_layer_types"][0] == "hash_moe" and "moe" in cfg["mlp_layer_types"]
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)
    assert 0.0 < metrics["val_loss"] < 7.0 and metrics["windows"] == 2
    assert "val perplexity" in open(os.path.join(out, "README.md")).read()


def test_tensors(trained_dir: tuple[str, dict]) -> None:
    out, _ = trained_dir
    state = load_file(os.path.join(out, "model.safetensors"))
    assert all(k in state for k in MTP_KEYS), [k for k in MTP_KEYS if k not in state]
    assert "lm_head.weight" in state and "model.embed_tokens.weight" in state
    for k, t in state.items():
        if k.endswith("tid2eid"):
            assert t.dtype == torch.int64
            srt = t.sort(dim=-1).values
            assert (srt[:, 1:] != srt[:, :-1]).all(), f"{k}: experts per token must be distinct"
        else:
            assert t.dtype == torch.bfloat16, k


def test_loads_with_transformers(trained_dir: tuple[str, dict]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = trained_dir
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_model(out, torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        main, mtp = ours(ids, ids)
    torch.testing.assert_close(main, ref, rtol=0, atol=0)
    assert mtp.shape == main.shape and torch.isfinite(mtp).all()
    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>Hi<|eos|><|assistant|>"
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1


def test_loads_with_wideserve(trained_dir: tuple[str, dict]) -> None:
    from wideserve.config import LoadConfig
    from wideserve.worker.model_loader import load_model as ws_load_model

    out, _ = trained_dir
    loaded = ws_load_model(LoadConfig(model=out))
    assert loaded.dtype == torch.bfloat16
    params = loaded.model.state_dict()
    state = load_file(os.path.join(out, "model.safetensors"))
    # Every checkpoint tensor, MTP included, lands in the engine's model unchanged.
    assert set(state) <= set(params), sorted(set(state) - set(params))[:10]
    for k in MTP_KEYS:
        assert torch.equal(params[k].to(state[k].dtype), state[k]), k
