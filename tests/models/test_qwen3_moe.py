"""Qwen3-MoE over the paged harness vs transformers 5.23 (fp32, random weights)."""
from __future__ import annotations

import pytest
import torch
import transformers

from paged_harness import PagedHarness, schedule_steps
from wideserve.layers.experts import RoutedExperts
from wideserve.models.qwen3_moe.model import Qwen3MoeForCausalLM
from wideserve.models.registry import resolve_model_class

TOL = 1e-4
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-6, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, attn_implementation="eager")
VARIANTS = {
    # layer 1 dense via mlp_only_layers, renormalised top-k, q/k/v/o bias
    "mlp-only": dict(mlp_only_layers=[1], norm_topk_prob=True, attention_bias=True),
    # sparse every 2nd layer, raw softmax weights, tied head, sliding window on every layer
    "sparse-step": dict(decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True,
                        use_sliding_window=True, sliding_window=6),
}
SCHEDULES = {
    "prefill": [[11], [7]],
    "chunked": [[4, 4, 3], [3, 0, 4]],
    "decode": [[6] + [1] * 5, [3] + [1] * 5],
    "single-decode": [[9] + [1] * 4],
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """O(1) logits; router scores spread wide so top-k has no near-ties."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.1 * noise)


def build_pair(overrides: dict, per_expert: bool = False):
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**BASE, **overrides}))
    hf.eval()
    randomize_(hf)
    config_json = hf.config.to_dict()
    model_cls = resolve_model_class(config_json)
    assert model_cls is Qwen3MoeForCausalLM
    model = model_cls(model_cls.config_class.from_dict(config_json)).eval()
    state = hf.state_dict()
    weights = split_experts(state) if per_expert else state.items()
    assert model.load_weights(weights) == {n for n, _ in model.named_parameters()}
    return hf, model


def split_experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """The per-expert names of the released Qwen3-MoE checkpoints, derived from HF's fused ones."""
    out = []
    for name, t in state.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{prefix}.{e}.up_proj.weight", t[e, inter:]),
                        (f"{prefix}.{e}.gate_proj.weight", t[e, :inter])]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            out += [(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out[::-1]   # any order must work


def run_schedule(hf, model, schedule: list[list[int]], seed: int = 1) -> int:
    """Compare all logits; return the number of tokens run."""
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, BASE["vocab_size"], (sum(c),), generator=g).tolist()
            for c in schedule]
    harness = PagedHarness(model, max_reqs=len(seqs), max_len=32, block_size=4)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _, slots, new in schedule_steps(schedule, seqs):
        logits = harness.step(slots, new)
        offset = 0
        for r, toks in zip(slots, new):
            got[r].append(logits[offset:offset + len(toks)])
            offset += len(toks)
    with torch.no_grad():
        for r, seq in enumerate(seqs):
            want = hf(torch.tensor([seq])).logits[0].float()
            diff = (torch.cat(got[r]) - want).abs().max().item()
            assert diff <= TOL, f"request {r}: max |logit diff| {diff:.3g}"
    return sum(len(s) for s in seqs)


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    return build_pair(VARIANTS[request.param])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_matches_transformers(pair, schedule):
    run_schedule(*pair, SCHEDULES[schedule])


def test_layer_kinds_and_load_counters():
    hf, model = build_pair(VARIANTS["mlp-only"])
    moe = [isinstance(getattr(layer.mlp, "experts", None), RoutedExperts)
           for layer in model.model.layers]
    assert moe == [True, False, True]
    tokens = run_schedule(hf, model, SCHEDULES["prefill"])
    for layer in (model.model.layers[0], model.model.layers[2]):
        # every token is counted once per chosen expert
        assert int(layer.mlp.experts.expert_load.sum()) == tokens * BASE["num_experts_per_tok"]


def test_per_expert_checkpoint_names():
    hf, model = build_pair(VARIANTS["sparse-step"], per_expert=True)
    fused = hf.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p, fused[name]), name
    run_schedule(hf, model, SCHEDULES["chunked"])


def test_partial_per_expert_load_is_not_reported():
    _, model = build_pair(VARIANTS["mlp-only"])
    first = model.load_weights([("model.layers.0.mlp.experts.3.gate_proj.weight",
                                 torch.zeros(32, 64))])
    assert first == set()
    with pytest.raises(ValueError, match="expert 8 out of range"):
        model.load_weights([("model.layers.0.mlp.experts.8.down_proj.weight",
                             torch.zeros(64, 32))])
    with pytest.raises(ValueError, match="no routed experts"):
        model.load_weights([("model.layers.1.mlp.experts.0.down_proj.weight",
                             torch.zeros(64, 32))])


def test_param_counts():
    hf, model = build_pair(VARIANTS["mlp-only"])
    total = sum(p.numel() for p in hf.parameters())
    per_expert = 3 * 32 * 64
    routed = 2 * 8 * per_expert                       # two MoE layers, 8 experts each
    assert model.param_counts() == (total, total - routed + 2 * 2 * per_expert)


def test_compiled_forward_matches_transformers():
    """LoadConfig.enforce_eager=False: the compiled layer stack (attention eager between the
    graphs) gives transformers' logits on prefill, chunked and decode steps, single-token
    batches included (a size the compiler specialises separately)."""
    hf, model = build_pair(VARIANTS["mlp-only"])
    model.compile_forward()
    run_schedule(hf, model, SCHEDULES["single-decode"])      # a 9-token prefill, then T = 1
