"""The bundled models' config.json load in Hugging Face transformers (what `vllm bench
--tokenizer DIR`, HF tooling and conversion scripts read), and say the same as wideserve's own
readers: V4 as transformers' DeepseekV4Config, V4.1 (a model type transformers does not have)
through the config class shipped beside it (`auto_map`, trust_remote_code)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from wideserve.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from wideserve.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "wideserve" / "assets"
V4, V41 = ASSETS / "shakespeare-v4-tiny", ASSETS / "shakespeare-v41-tiny"


def test_v4_config_loads_in_transformers_as_wideserve_reads_it():
    hf = transformers.AutoConfig.from_pretrained(V4)
    ours = DeepseekV4Config.from_dict(json.loads((V4 / "config.json").read_text()))
    assert type(hf).__name__ == "DeepseekV4Config"
    assert list(hf.mlp_layer_types) == ours.mlp_layer_types == ["hash_moe", "moe", "moe", "moe"]
    assert list(hf.layer_types) == ours.layer_types
    assert (hf.num_hidden_layers, hf.vocab_size, hf.hidden_size) == \
        (ours.num_hidden_layers, ours.vocab_size, ours.hidden_size)


def test_v41_config_loads_in_transformers_through_its_auto_map():
    raw = json.loads((V41 / "config.json").read_text())
    hf = transformers.AutoConfig.from_pretrained(V41, trust_remote_code=True)
    ours = DeepseekV41Config.from_dict(raw)
    assert hf.model_type == "deepseek_v41"
    assert (hf.vocab_size, hf.num_hidden_layers) == (ours.vocab_size, ours.num_hidden_layers)
    assert hf.text_config["compress_ratios"] == raw["text_config"]["compress_ratios"]
    assert ours.extra.get("auto_map") == raw["auto_map"]       # ours ignores the HF hook


@pytest.mark.parametrize("model", [V4, V41], ids=["v4", "v41"])
def test_tokenizer_loads_in_transformers(model):
    tok = transformers.AutoTokenizer.from_pretrained(model)
    assert tok.decode(tok("To be, or not to be")["input_ids"],
                      skip_special_tokens=True).strip() == "To be, or not to be"
