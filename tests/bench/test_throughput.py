"""`wideserve bench throughput`: the JSON it writes, the engine-side extras, and the side-by-side
transformers run on identical token ids (equal greedy outputs where the model has no tie
ambiguity: a dummy-weight Qwen3-MoE whose weights both backends share)."""
from __future__ import annotations

import json

import pytest

from wideserve.entrypoints.cli import main as cli_main

COMMON = ["--dtype", "float32", "--threads", "1", "--no-progress"]


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "t.json"
    assert cli_main(["bench", "throughput", *args, *COMMON, "--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_bundled_model_both_backends(tmp_path):
    res = _run(tmp_path, "--num-prompts", "3", "--input-len", "16", "--output-len", "4",
               "--backend", "both")
    assert {"command", "machine", "model", "architecture", "dtype", "workload", "backends",
            "ratio_output_tokens_per_s", "identical_outputs"} <= res.keys()
    for name in ("wideserve", "transformers"):
        b = res["backends"][name]
        assert (b["num_requests"], b["input_tokens"], b["output_tokens"]) == (3, 48, 12)
        assert b["output_tokens_per_s"] == pytest.approx(12 / b["elapsed_s"])
        assert b["total_tokens_per_s"] == pytest.approx(60 / b["elapsed_s"])
    ws = res["backends"]["wideserve"]
    sb = ws["step_breakdown"]
    assert sb["steps"] >= 4 and sb["batched_tokens"] == 48 + 3 * 3   # last token never fed
    assert set(sb["seconds"]) == {"schedule", "prepare", "forward", "sample", "output"}
    assert sum(sb["seconds"].values()) <= ws["elapsed_s"]
    assert ws["prefix_cache"]["prompt_tokens_computed"] == 48
    assert ws["kv_blocks"]["peak_blocks_in_use"] > 0
    assert res["ratio_output_tokens_per_s"] == pytest.approx(
        ws["output_tokens_per_s"] / res["backends"]["transformers"]["output_tokens_per_s"])
    assert len(res["wideserve_outputs"]) == 3


def test_shared_prefix_hits_and_v4_padding_refused(tmp_path):
    res = _run(tmp_path, "--dataset", "shared-prefix", "--num-prompts", "4", "--prefix-len",
               "512", "--num-prefixes", "1", "--input-len", "8", "--output-len", "2",
               "--max-num-batched-tokens", "520")
    pc = res["backends"]["wideserve"]["prefix_cache"]
    # Only the first request computes the prefix (520-token prompts, 520-token budget: it runs
    # alone in step 1); the three others hit both 256-token blocks.
    assert pc["hits"] == 3 * 512 and pc["prompt_tokens_computed"] == 4 * 520 - 3 * 512
    assert cli_main(["bench", "throughput", "--backend", "both", "--hf-batch-size", "2",
                     *COMMON]) == 2


def test_dummy_qwen3_moe_matches_transformers(tmp_path):
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
           "vocab_size": 160, "hidden_size": 48, "intermediate_size": 96,
           "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
           "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "torch_dtype": "float32", "pad_token_id": 0}
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    res = _run(tmp_path, str(model), "--load-format", "dummy", "--num-prompts", "4",
               "--input-len", "12", "--output-len", "6", "--backend", "both",
               "--hf-batch-size", "2")
    assert res["identical_outputs"] == 4
    assert "shared by both" in res["notes"][0]
    assert "left-padded batches of 2" in res["backends"]["transformers"]["notes"][0]
