"""layers/kernel_table.py: the GEMM shapes of a model and the table lines for them (forced
policy: nothing timed)."""
from __future__ import annotations

import torch

from wideserve.kernels.choice import KernelChoice, KernelPolicy
from wideserve.layers.kernel_table import kernel_table_lines, model_gemm_shapes
from wideserve.models.qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=24,
           num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
           tie_word_embeddings=False)


def test_shapes_and_lines_of_a_qwen3_moe(tmp_path) -> None:
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(CFG))
    shapes = set(model_gemm_shapes(model))
    assert ("qkv", (4 + 2 + 2) * 8, 32) in shapes          # fused q/k/v
    assert ("linear", 32, 32) in shapes                    # o_proj
    assert ("router", 4, 32) in shapes
    assert ("experts", 24, 32) in shapes
    assert ("linear", 64, 32) in shapes                    # the LM head
    assert ("attention", 4, 2 * 100000 + 8) in shapes
    lines = kernel_table_lines(model, torch.bfloat16,
                               KernelChoice(KernelPolicy(force="micro", cache_dir=tmp_path)))
    assert lines[0].startswith("GEMM kernel choice (policy micro")
    assert kernel_table_lines(model, torch.float32)[0].startswith("GEMM kernel choice: float32")
