"""Checkpoints written by transformers' own `save_pretrained` from its default DeepSeek-V4
config (shrunk in size only): num_nextn_predict_layers stays 1, yet transformers writes no
mtp.* tensors. wideserve loads and serves them (greedy equal to transformers); MTP is simply
unavailable, and asking for MTP speculation says why."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.oracle import hf_greedy, mixed_prompts, save_hf
from models.v4_configs import A
from models.v4_helpers import hf_model, stable_topk
from wideserve import LLM, SamplingParams

# Only sizes change from transformers' defaults (A's shapes; A's init range, so that greedy
# argmaxes are not near-ties); everything else, the MTP count included, is what
# DeepseekV4Config() gives.
SIZES = {k: v for k, v in A.items() if k not in ("num_nextn_predict_layers", "scoring_func",
                                                  "routed_scaling_factor", "rms_norm_eps",
                                                  "tie_word_embeddings", "n_shared_experts",
                                                  "num_key_value_heads", "swiglu_limit")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, object]:
    model = hf_model(SIZES, seed=3)       # transformers' model, zero-initialised parts random
    assert model.config.num_nextn_predict_layers == 1
    path = save_hf(model, tmp_path_factory.mktemp("hf_default_v4"))
    from safetensors import safe_open
    names = [n for f in path.glob("*.safetensors") for n in safe_open(str(f), "pt").keys()]
    assert names and not any("mtp" in n for n in names)
    return path, model


def test_loads_and_serves_like_transformers(saved):
    path, hf = saved
    llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              block_size=16, kv_cache_memory=1 << 26)
    assert len(llm.engine.model.mtp) == 0
    prompts = mixed_prompts(SIZES["vocab_size"], [5, 23, 40], seed=1)
    want = hf_greedy(hf, prompts, 8, stable_topk)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_mtp_speculation_says_the_checkpoint_has_no_mtp(saved):
    path, _ = saved
    with pytest.raises(ValueError, match="mtp. is unavailable.*no MTP weights") as err:
        LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=256,
            block_size=16, kv_cache_memory=1 << 26,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert "ngram" in str(err.value)
