"""DeepSeek-V4 config parsing, KV cache specs and bytes, parameter counts, weight loading
errors, and the small layers' rules (router, tie-break, Sinkhorn)."""
from __future__ import annotations

import warnings

import pytest
import torch
import v4_configs as cfgs
from paged_harness import PagedHarness
from v4_helpers import random_tokens, ws_model

from wideserve.kv_cache.spec import CacheKind
from wideserve.layers.attention.indexer import stable_topk_indices
from wideserve.layers.mhc import sinkhorn
from wideserve.layers.moe import DeepseekV4MoE
from wideserve.layers.rope_interleaved import RotaryTable
from wideserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from wideserve.models.deepseek_v4.config import DeepseekV4Config
from wideserve.models.registry import resolve_model_class

ALL = ("A", "B", "C", "D", "E", "FLASH")


def _hf_config(kw: dict):
    from transformers import DeepseekV4Config as HFConfig
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HFConfig(**kw)


@pytest.mark.parametrize("name", ALL)
def test_config_matches_hf_reading(name):
    """Layer schedule, rates, rope dims and both rope tables agree with transformers."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    kw = getattr(cfgs, name)
    hf = _hf_config(kw)
    ours = DeepseekV4Config.from_dict(kw)
    assert ours.layer_types == hf.layer_types
    assert ours.mlp_layer_types == hf.mlp_layer_types
    assert ours.compress_rates == hf.compress_rates
    assert ours.qk_rope_head_dim == hf.qk_rope_head_dim
    rope = DeepseekV4RotaryEmbedding(hf)
    pos = torch.tensor([0, 1, 7, 1000, 65535, 1048575])
    for label in ("main", "compress"):
        table = RotaryTable(ours.rope_parameters[label], ours.qk_rope_head_dim)
        assert torch.equal(table.inv_freq, getattr(rope, f"{label}_inv_freq"))
        assert table.scale == getattr(rope, f"{label}_attention_scaling")
        cos, sin = table.cos_sin(pos)
        ref_cos, ref_sin = rope(torch.zeros(1), pos[None], layer_type=label)
        assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    # An HF-saved config.json (nested rope_parameters, explicit layer_types) reads the same.
    again = DeepseekV4Config.from_dict(hf.to_dict())
    for field in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor",
                  "hidden_size", "index_topk", "sliding_window"):
        assert getattr(again, field) == getattr(ours, field), field
    for label in ("main", "compress"):
        a = RotaryTable(again.rope_parameters[label], again.qk_rope_head_dim)
        assert torch.equal(a.inv_freq, RotaryTable(ours.rope_parameters[label],
                                                   ours.qk_rope_head_dim).inv_freq)


def test_flash_config_legacy_keys():
    cfg = DeepseekV4Config.from_dict(cfgs.FLASH)
    assert resolve_model_class(cfgs.FLASH) is DeepseekV4ForCausalLM
    assert len(cfg.layer_types) == 43       # the trailing MTP slot of compress_ratios is dropped
    counts = {t: cfg.layer_types.count(t) for t in (cfgs.SWA, cfgs.CSA, cfgs.HCA)}
    assert counts == {cfgs.SWA: 2, cfgs.CSA: 21, cfgs.HCA: 20}
    assert cfg.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert cfg.qk_rope_head_dim == 64
    compress = cfg.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["attention_factor"] == 1.0
    assert compress["rope_theta"] == 160000.0 and cfg.rope_parameters["main"]["rope_theta"] == 1e4
    assert cfg.quantization_config["expert_dtype"] == "fp4"
    assert cfg.quantization_config["weight_block_size"] == [128, 128]
    assert cfg.extra["topk_method"] == "noaux_tc" and cfg.num_nextn_predict_layers == 1


@pytest.mark.parametrize("change,key", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"layer_types": [cfgs.SWA] * 3}, "layer_types"),
    ({"layer_types": [cfgs.SWA, "full_attention", cfgs.CSA, cfgs.HCA]}, "layer_types"),
    ({"layer_types": None, "compress_ratios": [0, 4, 7, 8]}, r"compress_ratios\[2\]"),
    ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "mlp_layer_types"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"o_groups": 3}, "o_groups"),
    ({"partial_rotary_factor": 0.3}, "partial_rotary_factor"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "original_max_position_embeddings"),
    ({"compress_rates": {cfgs.CSA: 0, cfgs.HCA: 8}}, "compress rate"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_size": "64"}, "hidden_size"),
])
def test_config_errors_name_the_key(change, key):
    kw = {**cfgs.A, **change}
    kw = {k: v for k, v in kw.items() if v is not None}
    with pytest.raises(ValueError, match=key):
        DeepseekV4Config.from_dict(kw)


def test_flash_on_meta_kv_bytes_and_param_counts():
    cfg = DeepseekV4Config.from_dict(cfgs.FLASH)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    assert all(p.is_meta for p in model.parameters())
    bf16 = model.kv_cache_specs("bf16")
    fp8 = model.kv_cache_specs("fp8")
    assert sum(s.bytes_per_token for s in bf16.values()) == 6880
    # 21 CSA * (584 + 68) / 4 + 20 HCA * 584 / 128 = 3514.25 (reference §6.3: 3,514 B/token)
    assert sum(s.bytes_per_token for s in fp8.values()) == 3514.25
    assert len(bf16) == 43 + 21 * 4 + 20 * 2
    assert len(set(bf16.values())) == 7     # window, 2x compressed, indexer, 3x state kinds
    csa, hca = "model.layers.2.self_attn.", "model.layers.3.self_attn."
    assert bf16[csa + "state"].window == 8 and bf16[csa + "state"].width == 4 * 512
    assert bf16[csa + "state"].dtype == torch.float32
    assert bf16[csa + "indexer_state"].width == 4 * 128
    assert bf16[hca + "state"].window == 128 and bf16[hca + "state"].width == 2 * 512
    assert bf16[hca + "compressed"].compress_ratio == 128
    assert fp8[csa + "window"].record_format == "fp8_ds_mla" and fp8[csa + "window"].rope_dim == 64
    assert fp8[csa + "indexer"].record_format == "mxfp4_index"
    assert fp8[csa + "state"].record_format == "raw"
    assert all(s.kind is CacheKind.SLIDING_WINDOW for n, s in bf16.items()
               if n.endswith(("window", "state")))
    assert model.mtp_kv_cache_specs("fp8") == {"mtp.0.self_attn.window": fp8[csa + "window"]}
    total, active = model.param_counts()
    assert abs(total - 284.33e9) < 0.006e9          # HF's meta count of V4-Flash (no MTP)
    routed = (total - active) * 256 // 250
    assert abs(routed - 277.0e9) < 0.06e9
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.kv_cache_specs("fp4")


def test_load_weights_errors_and_quantised_cache():
    model = ws_model(cfgs.C)
    state = model.state_dict()
    assert model.load_weights([("lm_head.weight", state["lm_head.weight"])]) == {"lm_head.weight"}
    with pytest.raises(ValueError, match="model.layers.9.mlp.gate.weight"):
        model.load_weights([("model.layers.9.mlp.gate.weight", torch.zeros(4, 32))])
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(31,\)"):
        model.load_weights([("model.norm.weight", torch.zeros(31))])
    with pytest.raises(ValueError, match="mtp.0.e_proj.weight"):
        model.load_weights([("mtp.0.e_proj.weight", torch.zeros(32, 32))])
    for t in model.state_dict(keep_vars=True).values():
        if t.is_floating_point():
            torch.nn.init.normal_(t.data, std=0.1)
    h = PagedHarness(model, 1, 16)
    name = "model.layers.1.self_attn.state"     # compressor state: always raw fp32
    h.kv_caches[name] = torch.zeros_like(h.kv_caches[name], dtype=torch.uint8)   # no codec
    with pytest.raises(ValueError, match="quantised"):
        h.step([0], [random_tokens(8, 256, 0)])


def _moe(scoring: str, hash_routed: bool = False) -> DeepseekV4MoE:
    moe = DeepseekV4MoE(8, 4, 4, 2, scoring, 2.0, 10.0, hash_routed, vocab_size=5)
    torch.manual_seed(0)
    for t in moe.state_dict(keep_vars=True).values():
        if t.is_floating_point():
            torch.nn.init.normal_(t.data)
    return moe


def test_routers():
    x = torch.randn(3, 8)
    ids = torch.tensor([0, 4, 2])
    # Correction bias selects but does not weight; non-softmax weights renormalise to scale.
    moe = _moe("sigmoid")
    moe.gate.e_score_correction_bias.copy_(torch.tensor([100.0, 0, 0, 100.0]))
    chosen, weights = moe.gate(x, ids)
    assert sorted(chosen[0].tolist()) == [0, 3]
    s = torch.sigmoid(x @ moe.gate.weight.T)
    picked = s.gather(1, chosen)
    assert torch.allclose(weights, 2.0 * picked / picked.sum(-1, keepdim=True))
    # Softmax scores are not renormalised (official rule).
    moe = _moe("softmax")
    chosen, weights = moe.gate(x, ids)
    assert torch.allclose(weights, 2.0 * torch.softmax(x @ moe.gate.weight.T, -1).gather(1, chosen))
    # Hash routing follows tid2eid by token id.
    moe = _moe("sqrtsoftplus", hash_routed=True)
    moe.gate.tid2eid.copy_(torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [1, 3]]))
    chosen, _ = moe.gate(x, ids)
    assert chosen.tolist() == [[0, 1], [1, 3], [2, 3]]
    assert moe(x, ids).shape == (3, 8)
    assert moe.experts.expert_load.sum().item() == 6


def test_stable_topk_and_sinkhorn():
    scores = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    assert stable_topk_indices(scores, 4).tolist() == [[1, 2, 4, 0]]
    comb = sinkhorn(torch.rand(5, 4, 4) + 0.1, iters=50, eps=0.0)
    assert torch.allclose(comb.sum(-1), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(5, 4), atol=1e-6)
