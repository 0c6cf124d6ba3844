"""Engine-level check of the fused routed-experts C++ op: greedy outputs through the whole
engine (prefill, chunked prefill, decode batches) with every expert layer on "fused" equal
transformers' greedy generate (fp32: the op's portable path, widths that need padding)."""
from __future__ import annotations

import warnings

import torch

from oracle import hf_greedy, mixed_prompts, save_hf
from wideserve import LLM, SamplingParams
from wideserve.layers.expert_packs import FusedPack
from wideserve.layers.experts import RoutedExperts


def test_fused_experts_greedy_matches_transformers(tmp_path) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=160, hidden_size=40, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False)).eval()
    prompts = mixed_prompts(160, [3, 17, 30, 9, 41, 5], seed=1)
    expected = hf_greedy(hf, prompts, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(str(save_hf(hf, tmp_path)), dtype="float32", block_size=16,
                  kv_cache_memory=1 << 26, skip_tokenizer_init=True, max_num_batched_tokens=32)
    experts = [m for m in llm.engine.model.modules() if isinstance(m, RoutedExperts)]
    assert len(experts) == 2
    for m in experts:
        m.impl = "fused"
        m._resolved.clear()
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(isinstance(m._packs, FusedPack) for m in experts)   # it ran


def test_first_request_packs_nothing(tmp_path, monkeypatch) -> None:
    """Weights are packed for the CPU kernels at start-up (EngineCore's warm-up step), not in
    the first request's step: that first-use work once took longer than the server's stall
    timeout on a loaded machine, and the front end killed the engine at its first request."""
    from tiny_families import qwen3_moe_checkpoint
    from wideserve.kernels import gemm, moe
    path = qwen3_moe_checkpoint(
        tmp_path, torch.bfloat16, vocab_size=96, hidden_size=512, intermediate_size=64,
        moe_intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, dtype="bfloat16", block_size=16, kv_cache_memory=1 << 24,
                  skip_tokenizer_init=True)
    experts = [m for m in llm.engine.model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all(isinstance(m._packs, FusedPack) for m in experts)
    packed = []
    for module in (gemm, moe):
        real = module.pack_panels
        monkeypatch.setattr(module, "pack_panels",
                            lambda *a, real=real, **k: packed.append(a[0].shape) or real(*a, **k))
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert packed == []
