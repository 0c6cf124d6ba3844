"""Llama / Qwen2 / Qwen3 / Qwen3-MoE: the "batched" paged attention backend against the
"reference" one through whole models (fp32, random weights, poisoned sliding windows)."""
from __future__ import annotations

import pytest
import torch

from paged_harness import PagedHarness, schedule_steps
from wideserve.layers.attention.registry import (
    DEFAULT_PAGED_ATTENTION_BACKEND,
    ENV_VAR,
    resolve_paged_attention_backend,
)
from wideserve.models.registry import resolve_model_class

TOL = 1e-5
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5)
MOE = dict(architectures=["Qwen3MoeForCausalLM"], head_dim=16, num_experts=8,
           num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
VARIANTS = {
    "llama": dict(architectures=["LlamaForCausalLM"], attention_bias=True),
    "llama-mha": dict(architectures=["LlamaForCausalLM"], num_key_value_heads=4),
    # layers >= 1 attend through a 5-position window
    "qwen2-window": dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                         sliding_window=5, max_window_layers=1),
    # three query heads per KV head
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], num_attention_heads=6, head_dim=24),
    "qwen3-moe": MOE,
    "qwen3-moe-window": {**MOE, "use_sliding_window": True, "sliding_window": 6},
}
# Per request: new tokens per step (0 = idle that step).
SCHEDULES = {
    "prefill": [[11], [7], [4]],
    "chunked": [[4, 4, 3], [3, 0, 4]],
    "decode": [[6] + [1] * 5, [3] + [1] * 5, [1] * 6],
    "mixed": [[9, 1, 1, 1, 1], [0, 7, 1, 1, 1], [2, 1, 6, 1, 1], [1, 1, 1, 1, 12]],
    "past-window": [[13, 1, 9, 1, 1], [2, 11, 1, 1, 8]],
}


def build(variant: str, backend: str, seed: int = 0):
    config_json = {**BASE, **VARIANTS[variant]}
    cls = resolve_model_class(config_json)
    model = cls(cls.config_class.from_dict(config_json), attention_backend=backend).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            # O(1) logits; router scores spread wide so top-k has no near-ties
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else
                    0.5 * noise if name.endswith("mlp.gate.weight") else 0.1 * noise)
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def models(request):
    return build(request.param, "reference"), build(request.param, "batched")


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_batched_matches_reference(models, schedule):
    ref, bat = models
    assert (ref.attention_backend, bat.attention_backend) == ("reference", "batched")
    plan = SCHEDULES[schedule]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, BASE["vocab_size"], (sum(c),), generator=g).tolist() for c in plan]
    harnesses = [PagedHarness(m, max_reqs=len(seqs), max_len=40, block_size=4)
                 for m in (ref, bat)]
    for step, slots, new in schedule_steps(plan, seqs):
        want, got = (h.step(slots, new) for h in harnesses)
        assert torch.isfinite(got).all(), f"step {step}: non-finite logits"
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"step {step}: max |logit diff| {diff:.3g}"


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_paged_attention_backend() == DEFAULT_PAGED_ATTENTION_BACKEND == "batched"
    monkeypatch.setenv(ENV_VAR, "reference")
    assert resolve_paged_attention_backend() == "reference"
    assert resolve_paged_attention_backend("batched") == "batched"
    model = build("llama", None)
    assert model.attention_backend == "reference"
    model.set_attention_backend("batched")
    assert {m.self_attn.backend for m in model.model.layers} == {"batched"}
    monkeypatch.setenv(ENV_VAR, "nope")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_paged_attention_backend()
    with pytest.raises(ValueError, match="not a paged attention backend"):
        model.set_attention_backend("fast")
