"""Llama / Qwen2 / Qwen3 over the paged harness vs transformers 5.23 (fp32, random weights)."""
from __future__ import annotations

import pytest
import torch
import transformers

from paged_harness import PagedHarness, schedule_steps
from wideserve.kv_cache.spec import CacheKind
from wideserve.layers.rope_rotate_half import RopeScaling, parse_rope_config
from wideserve.models.registry import resolve_model_class

TOL = 1e-4
BASE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, attn_implementation="eager")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
VARIANTS = {
    # biases everywhere, llama3 frequency scaling
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE)),
    # plain MHA, tied embeddings, linear scaling
    "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(num_key_value_heads=4, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "linear", "rope_theta": 1000.0,
                                         "factor": 2.0})),
    # q/k/v bias; layers >= 1 use a 5-position sliding window
    "qwen2-window": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                     dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                          tie_word_embeddings=True)),
    # q/k norm, head_dim that is not hidden / heads
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}
# Per request: new tokens per step (0 = idle that step). Two requests of different lengths.
SCHEDULES = {
    "prefill": [[11], [7]],
    "chunked": [[4, 4, 3], [3, 0, 4]],
    "decode": [[6] + [1] * 5, [3] + [1] * 5],
    "single-decode": [[9] + [1] * 4],
}


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """O(1) logits: transformers' 0.02 init would make any attention bug look tiny."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * noise)   # spread router scores: no near-ties in top-k
            else:
                p.copy_(0.1 * noise)


def build_pair(cfg_cls, hf_cls, overrides: dict, seed: int = 0):
    hf = hf_cls(cfg_cls(**{**BASE, **overrides})).eval()
    randomize_(hf, seed)
    config_json = hf.config.to_dict()
    model_cls = resolve_model_class(config_json)
    model = model_cls(model_cls.config_class.from_dict(config_json)).eval()
    loaded = model.load_weights(hf.state_dict().items())
    assert loaded == {n for n, _ in model.named_parameters()}
    return hf, model


def check_schedule(hf, model, schedule: list[list[int]], seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, BASE["vocab_size"], (sum(chunks),), generator=g).tolist()
            for chunks in schedule]
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


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request):
    cfg_cls, hf_cls, overrides = VARIANTS[request.param]
    return build_pair(cfg_cls, hf_cls, overrides)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_matches_transformers(pair, schedule):
    check_schedule(*pair, SCHEDULES[schedule])


def test_sliding_window_specs():
    _, model = build_pair(*VARIANTS["qwen2-window"])
    specs = model.kv_cache_specs()
    assert specs["model.layers.0.self_attn.kv"].kind is CacheKind.FULL
    for i in (1, 2):
        spec = specs[f"model.layers.{i}.self_attn.kv"]
        assert spec.kind is CacheKind.SLIDING_WINDOW and spec.window == 5
        assert spec.width == 2 * 2 * 16


def test_kv_specs_and_counts():
    hf, model = build_pair(*VARIANTS["qwen3"])
    specs = model.kv_cache_specs()
    assert list(specs) == [f"model.layers.{i}.self_attn.kv" for i in range(3)]
    assert all(s.kind is CacheKind.FULL and s.role == "kv" and s.width == 2 * 2 * 24
               and s.dtype == torch.float32 for s in specs.values())
    assert model.kv_cache_specs("bf16")["model.layers.0.self_attn.kv"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        model.kv_cache_specs("fp8")
    total = sum(p.numel() for p in hf.parameters())
    assert model.param_counts() == (total, total)


def test_bf16_cache_close_to_fp32():
    """A bf16 KV cache under an fp32 model stays close (catches a dtype mismatch on write)."""
    hf, model = build_pair(*VARIANTS["llama"])
    seq = list(range(10))
    harness = PagedHarness(model, max_reqs=1, max_len=16, block_size=4)
    harness.specs = model.kv_cache_specs("bf16")
    harness.kv_caches = {n: torch.zeros_like(c, dtype=torch.bfloat16)
                         for n, c in harness.kv_caches.items()}
    got = torch.cat([harness.step([0], [seq[:6]]), harness.step([0], [seq[6:]])])
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0]
    assert (got - want).abs().max().item() < 5e-2


def test_bad_checkpoint_names_and_shapes():
    _, model = build_pair(*VARIANTS["llama"])
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_proj.weight"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        model.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(3, 3))])


def test_rope_config_parsing():
    legacy = {"rope_theta": 5e5, "max_position_embeddings": 4096,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0}}
    theta, scaling = parse_rope_config(legacy)
    assert theta == 5e5 and scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 4096)
    assert parse_rope_config({}) == (10000.0, RopeScaling())
    with pytest.raises(ValueError, match="yarn"):
        parse_rope_config({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_size"):
        resolve_model_class({"model_type": "llama"}).config_class.from_dict(
            {"model_type": "llama", "vocab_size": 8})


def test_replayed_prefix_is_not_rewritten():
    """kv_write_start: positions below it keep their cached FULL entries (bounded replay)."""
    _, model = build_pair(*VARIANTS["llama"])
    harness = PagedHarness(model, max_reqs=1, max_len=16, block_size=4)
    harness.step([0], [list(range(8))])
    before = {n: c.clone() for n, c in harness.kv_caches.items()}
    harness.reset(0)
    harness.seq_lens[0] = 4
    batch = harness.build_batch([0], [[50, 51, 52, 53, 54]])   # positions 4..8, replay 4..7
    batch.kv_write_start = torch.tensor([8])
    with torch.no_grad():
        model.forward(batch)
    for name, cache in harness.kv_caches.items():
        flat, old = cache.view(-1, cache.shape[-1]), before[name].view(-1, cache.shape[-1])
        slots = batch.kv_groups[0].slot_mapping
        assert torch.equal(flat[slots[:4]], old[slots[:4]]), name
        assert not torch.equal(flat[slots[4]], old[slots[4]]), name
