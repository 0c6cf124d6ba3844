"""layers/kernel_table.py: the GEMM shapes of a model, the table lines for them (forced
policy: nothing timed) and the startup block's summary (fake timings)."""
from __future__ import annotations

import torch

from wideserve.kernels import choice as ch
from wideserve.kernels import describe
from wideserve.kernels.choice import KernelChoice, KernelPolicy
from wideserve.layers.gemm_shapes import AttentionShape, GemmShape
from wideserve.layers.kernel_table import kernel_summary, kernel_table_lines, model_gemm_shapes
from wideserve.models.qwen3_moe.model import Qwen3MoeConfig, Qwen3MoeForCausalLM

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=24,
           num_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
           tie_word_embeddings=False)


def test_shapes_and_lines_of_a_qwen3_moe(tmp_path) -> None:
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(CFG))
    shapes = set(model_gemm_shapes(model))
    assert GemmShape("qkv", (4 + 2 + 2) * 8, 32) in shapes      # fused q/k/v
    assert GemmShape("linear", 32, 32) in shapes                # o_proj
    assert GemmShape("router", 4, 32) in shapes
    assert GemmShape("experts", 24, 32) in shapes
    assert GemmShape("linear", 64, 32) in shapes                # the LM head
    assert AttentionShape(4, 2, 8) in shapes
    lines = kernel_table_lines(model, torch.bfloat16,
                               KernelChoice(KernelPolicy(force="micro", cache_dir=tmp_path)))
    assert lines[0].startswith("GEMM kernel choice (policy micro")
    assert kernel_table_lines(model, torch.float32)[0].startswith("GEMM kernel choice: float32")


def test_a_tied_head_is_a_linear_shape() -> None:
    """The tied LM head runs the embedding through its own GEMM (no nn.Linear): the model
    names its shape through the contract (CausalLM.tied_head_shape)."""
    with torch.device("meta"):
        tied = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(
            {**CFG, "vocab_size": 96, "tie_word_embeddings": True}))
        untied = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict({**CFG, "vocab_size": 96}))
    assert tied.tied_head_shape() == (96, 32) and untied.tied_head_shape() is None
    assert GemmShape("linear", 96, 32) in set(model_gemm_shapes(tied))
    assert GemmShape("linear", 96, 32) in set(model_gemm_shapes(untied))     # its lm_head


def test_summary_names_the_build_and_only_the_models_shapes(tmp_path, monkeypatch) -> None:
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(CFG))
    monkeypatch.setattr(KernelChoice, "runnable",
                        lambda self, family, dtype: ch.FAMILY_KERNELS[family])

    def timer(family, kernels, shape, rows):       # micro fastest up to 16 rows, then brgemm
        return {c: {"micro": rows, "brgemm": 16.5, "own": 1, "sdpa": 2}.get(c, 99) * 1e-6
                for c in kernels}

    kc = KernelChoice(KernelPolicy(cache_dir=tmp_path), timer=timer)
    kc.plan("linear", 4096, 4096, torch.bfloat16)                  # not this model's
    lines = kernel_summary(model, torch.bfloat16, "cpu", kc)
    assert lines[0] == describe("cpu") and "CPU features:" in lines[0]
    rows = {tuple(line.split()[:2]) for line in lines[2:]}
    assert rows == {(f, s) for f, s in
                    {("qkv", "64x32"), ("linear", "32x32"), ("router", "4x32"),
                     ("experts", "24x32"), ("linear", "64x32"), ("attention", "4x2x8"),
                     ("attention_ctx", "4x2x8")}}
    assert all("micro 1-16, brgemm 17+  (1 4 16 16 16 16 us)" in line
               for line in lines[2:] if not line.split()[0].startswith("attention"))
    assert kernel_summary(model, torch.bfloat16, "cuda", kc) == [
        "cuda: torch's kernels (the C++ CPU kernels serve the CPU only)"]
    assert kernel_summary(model, torch.float32, "cpu", kc)[1].startswith(
        "GEMM kernel choice: float32")
