"""Checkpoint loading: HF-named and sharded safetensors, original DeepSeek names, errors, dummy."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from wideserve.config import LoadConfig
from wideserve.worker import model_loader as loader
from wideserve.models.deepseek_v4.checkpoint_names import rename_deepseek_v4
from wideserve.worker.dummy_weights import distinct_expert_table
from wideserve.worker.model_loader import load_model, resolve_dtype
from wideserve.worker.weights import CheckpointReader, QuantFormat
from wideserve.layers import quant

LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=96,
             hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, torch_dtype="bfloat16")
QWEN_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=96,
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                num_experts_per_tok=2, torch_dtype="float32")


def write_model(root: Path, config: dict, tensors: dict[str, torch.Tensor] | None = None,
                shards: int = 1) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if tensors is None:
        return root
    names = list(tensors)
    if shards == 1:
        save_file({n: t.contiguous() for n, t in tensors.items()}, root / "model.safetensors")
        return root
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[s::shards]}
        save_file(part, root / fname)
        weight_map.update({n: fname for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def dummy_state(tmp_path: Path, config: dict, seed: int = 7) -> dict[str, torch.Tensor]:
    model = load_model(LoadConfig(model=str(write_model(tmp_path / "cfg", config)),
                                  load_format="dummy", seed=seed)).model
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_same_state(model: torch.nn.Module, want: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), name


# --- HF-named checkpoints ---

@pytest.mark.parametrize("shards", [1, 3])
def test_hf_named_bf16_checkpoint(tmp_path, shards):
    want = dummy_state(tmp_path, LLAMA)
    assert all(t.dtype == torch.bfloat16 for t in want.values())      # auto = torch_dtype
    root = write_model(tmp_path / "m", LLAMA, want, shards=shards)
    loaded = load_model(LoadConfig(model=str(root)))
    assert loaded.dtype == torch.bfloat16 and loaded.path == root
    assert_same_state(loaded.model, want)
    as_fp32 = load_model(LoadConfig(model=str(root), dtype="float32")).model
    assert {p.dtype for p in as_fp32.parameters()} == {torch.float32}
    assert_same_state(as_fp32, want)


def test_per_expert_names_and_hf_fp8_scales(tmp_path):
    """Qwen3-MoE per-expert names pass through to the model; HF `weight_scale_inv` (fp32)
    companions are dequantised with 128x128 blocks."""
    want = dummy_state(tmp_path, QWEN_MOE)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in want.items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                tensors[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        elif name.endswith("self_attn.q_proj.weight"):
            q, s = quant.quantize_fp8_block(t)
            tensors[name], tensors[name + "_scale_inv"] = q, quant.ue8m0_to_float(s)
            want[name] = quant.dequantize_fp8_block(q, s, dtype=torch.float32)
        else:
            tensors[name] = t
    config = {**QWEN_MOE, "quantization_config": {"quant_method": "fp8",
                                                  "weight_block_size": [128, 128]}}
    model = load_model(LoadConfig(model=str(write_model(tmp_path / "m", config, tensors)))).model
    assert_same_state(model, want)


# --- errors name what is wrong ---

def test_error_missing_config_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(LoadConfig(model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(LoadConfig(model=str(tmp_path / "empty")))
    with pytest.raises(FileNotFoundError, match="no weights in .*model.safetensors"):
        load_model(LoadConfig(model=str(write_model(tmp_path / "m", LLAMA))))


def test_error_missing_shard(tmp_path):
    root = write_model(tmp_path / "m", LLAMA, dummy_state(tmp_path, LLAMA), shards=2)
    (root / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="lists model-00002-of-00002.safetensors"):
        load_model(LoadConfig(model=str(root)))


def test_error_unknown_architecture(tmp_path):
    root = write_model(tmp_path / "m", {"architectures": ["GPT7ForCausalLM"], "model_type": "gpt7"})
    with pytest.raises(ValueError, match="unknown architecture 'GPT7ForCausalLM'"):
        load_model(LoadConfig(model=str(root), load_format="dummy"))


def test_error_wrong_shape_names_tensor_and_file(tmp_path):
    state = dummy_state(tmp_path, LLAMA)
    name = "model.layers.1.mlp.up_proj.weight"
    state[name] = state[name][:-1]
    root = write_model(tmp_path / "m", LLAMA, state)
    with pytest.raises(ValueError, match=rf"model.safetensors:{name}.*\(95, 64\).*\(96, 64\)"):
        load_model(LoadConfig(model=str(root)))


def test_error_missing_and_unexpected_tensors(tmp_path):
    state = dummy_state(tmp_path, LLAMA)
    del state["model.layers.0.input_layernorm.weight"]
    root = write_model(tmp_path / "m", LLAMA, state)
    with pytest.raises(ValueError, match="no weights for 1 .*layers.0.input_layernorm.weight"):
        load_model(LoadConfig(model=str(root)))
    state = dummy_state(tmp_path, LLAMA)
    state["model.layers.0.mystery.weight"] = torch.zeros(3)
    state["model.rotary_emb.inv_freq"] = torch.zeros(8)               # ignorable
    root = write_model(tmp_path / "m2", LLAMA, state)
    with pytest.raises(ValueError, match="model.safetensors:model.layers.0.mystery.weight"):
        load_model(LoadConfig(model=str(root)))


def test_error_unsupported_quantisation(tmp_path):
    base = {"model_type": "deepseek_v4"}
    with pytest.raises(ValueError, match="unsupported quantization_config.quant_method 'awq'"):
        QuantFormat.from_config({**base, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="unsupported expert_dtype 'int3'"):
        QuantFormat.from_config({**base, "expert_dtype": "int3",
                                 "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="weight_block_size"):
        QuantFormat.from_config({"quantization_config": {"quant_method": "fp8",
                                                         "weight_block_size": [128]}})
    q, s = quant.quantize_fp8_block(torch.randn(300, 64))
    root = write_model(tmp_path / "m", base, {"layers.0.attn.wq_a.weight": q,
                                              "layers.0.attn.wq_a.scale": s[:1]})
    with pytest.raises(ValueError, match=r"layers.0.attn.wq_a.weight with layers.0.attn.wq_a"
                                         r".scale: .*scale shape \(1, 1\)"):
        list(CheckpointReader(root, {"model_type": "deepseek_v4"}, torch.float32))
    root = write_model(tmp_path / "m2", base, {"layers.0.attn.wq_a.weight": q})
    with pytest.raises(ValueError, match="FP8 tensor without a .scale companion"):
        list(CheckpointReader(root, base, torch.float32))
    root = write_model(tmp_path / "m3", base, {"layers.0.attn.wq_a.weight": q.float().half(),
                                               "layers.0.attn.wq_a.scale": s})
    with pytest.raises(ValueError, match="unsupported quantised weight dtype torch.float16"):
        list(CheckpointReader(root, base, torch.float32))


def test_bundled_model_missing_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(loader, "BUNDLED_MODEL", tmp_path / "shakespeare-v4-tiny")
    with pytest.raises(FileNotFoundError, match="bundled model is missing"):
        load_model(LoadConfig(model=None))


def test_gguf_files_go_to_the_gguf_loader(tmp_path, monkeypatch):
    from wideserve.worker import gguf_loader

    calls = []
    model = torch.nn.Linear(2, 2)

    def fake(path, dtype, device):
        calls.append((Path(path), dtype, device))
        return model, {"model_type": "llama"}

    monkeypatch.setattr(gguf_loader, "load_gguf_model", fake)
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    loaded = load_model(LoadConfig(model=str(path), dtype="bfloat16"))
    assert calls == [(path, torch.bfloat16, torch.device("cpu"))]
    assert loaded.model is model and loaded.path == path
    assert loaded.config_json["model_type"] == "llama"
    load_model(LoadConfig(model=str(path)))
    assert calls[-1][1] == torch.float32                              # auto: no torch_dtype
    with pytest.raises(ValueError, match="needs a .gguf file"):
        load_model(LoadConfig(model=str(tmp_path), load_format="gguf"))
    with pytest.raises(ValueError, match="load_format 'dummy' needs a model directory"):
        load_model(LoadConfig(model=str(path), load_format="dummy"))
    with pytest.raises(ValueError, match="unknown load_format 'pickle'"):
        load_model(LoadConfig(model=str(path), load_format="pickle"))


class _Toy(torch.nn.Module):
    keep_in_fp32 = ("special",)

    def __init__(self, config: object) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight                             # tied
        self.norm = torch.nn.LayerNorm(4).float()                        # explicit: stays fp32
        self.sinks = torch.nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.special = torch.nn.Linear(2, 2)                             # keep_in_fp32
        self.register_buffer("table", torch.arange(4) / 4, persistent=False)
        self.register_buffer("ids", torch.arange(3))


def test_build_model_dtypes_buffers_and_ties():
    model = loader.build_model(_Toy, None, torch.bfloat16, torch.device("cpu"))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes == {"embed.weight": torch.bfloat16, "norm.weight": torch.float32,
                      "norm.bias": torch.float32, "sinks": torch.float32,
                      "special.weight": torch.float32, "special.bias": torch.float32}
    assert model.head.weight is model.embed.weight
    assert torch.equal(model.table, torch.tensor([0.0, 0.25, 0.5, 0.75]))   # built for real
    assert model.ids.tolist() == [0, 1, 2]
    assert not any(p.requires_grad for p in model.parameters())
    meta = loader.build_model(_Toy, None, torch.float16, torch.device("meta"))
    assert meta.embed.weight.is_meta and meta.embed.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="no weights for 2 .*embed.weight, norm.weight"):
        loader.check_filled(model, {"norm.bias", "sinks", "special.weight", "special.bias",
                                    "ids"}, "toy")
    loader.check_filled(model, {"head.weight", "norm.weight", "norm.bias", "sinks",
                                "special.weight", "special.bias", "ids"}, "toy")  # tied alias


def test_resolve_dtype():
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype("auto", {"dtype": "float16"}) == torch.float16
    assert resolve_dtype("auto", {"torch_dtype": "float8_e4m3fn"}) == torch.float32
    assert resolve_dtype("auto", {}) == torch.float32
    assert resolve_dtype("bf16", {"torch_dtype": "float32"}) == torch.bfloat16
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", {})


# --- original DeepSeek-V4 names, FP8 / FP4, expert stacking (reader level) ---

def test_original_names_map_to_hf():
    cases = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_fn": "model.hc_head.hc_fn",
        "layers.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",
        "layers.3.ffn_norm.weight": "model.layers.3.post_attention_layernorm.weight",
        "layers.3.hc_attn_base": "model.layers.3.attn_hc.base",
        "layers.3.hc_ffn_scale": "model.layers.3.ffn_hc.scale",
        "layers.3.attn.wq_a.weight": "model.layers.3.self_attn.q_a_proj.weight",
        "layers.3.attn.wq_a.scale": "model.layers.3.self_attn.q_a_proj.weight_scale_inv",
        "layers.3.attn.q_norm.weight": "model.layers.3.self_attn.q_a_norm.weight",
        "layers.3.attn.kv_norm.weight": "model.layers.3.self_attn.kv_norm.weight",
        "layers.3.attn.wo_b.weight": "model.layers.3.self_attn.o_b_proj.weight",
        "layers.3.attn.attn_sink": "model.layers.3.self_attn.sinks",
        "layers.3.attn.compressor.ape": "model.layers.3.self_attn.compressor.position_bias",
        "layers.3.attn.compressor.norm.weight":
            "model.layers.3.self_attn.compressor.kv_norm.weight",
        "layers.3.attn.indexer.wq_b.weight":
            "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight",
        "layers.3.attn.indexer.weights_proj.weight":
            "model.layers.3.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.3.attn.indexer.compressor.wgate.weight":
            "model.layers.3.self_attn.compressor.indexer.gate_proj.weight",
        "layers.3.attn.indexer.compressor.ape":
            "model.layers.3.self_attn.compressor.indexer.position_bias",
        "layers.3.ffn.gate.bias": "model.layers.3.mlp.gate.e_score_correction_bias",
        "layers.0.ffn.gate.tid2eid": "model.layers.0.mlp.gate.tid2eid",
        "layers.3.ffn.shared_experts.w2.weight":
            "model.layers.3.mlp.shared_experts.down_proj.weight",
        "mtp.0.attn.wq_a.weight": "mtp.0.self_attn.q_a_proj.weight",
        "mtp.0.attn_norm.weight": "mtp.0.input_layernorm.weight",
        "mtp.0.e_proj.weight": "mtp.0.e_proj.weight",
        "mtp.0.h_proj.scale": "mtp.0.h_proj.weight_scale_inv",
        "mtp.0.enorm.weight": "mtp.0.enorm.weight",
        "mtp.0.norm.weight": "mtp.0.norm.weight",
        "mtp.0.hc_head_scale": "mtp.0.hc_head.hc_scale",
        "mtp.0.hc_ffn_fn": "mtp.0.ffn_hc.fn",
    }
    for original, hf in cases.items():
        assert rename_deepseek_v4(original) == hf, original
    for bad in ("layers.0.attn.wq_c.weight", "layers.0.e_proj.weight", "mtp.0.hc_head_fn.x",
                "foo.weight"):
        with pytest.raises(ValueError, match="unknown tensor name"):
            rename_deepseek_v4(bad)


def test_reader_stacks_and_dequantises_experts(tmp_path):
    """Per-expert FP4 w1/w3/w2 (+ an FP8 dense weight) -> stacked HF tensors, checked against
    an independent per-element decode."""
    g = torch.Generator().manual_seed(0)
    E, inter, d = 3, 40, 64                       # 40 rows, 64 cols: partial 32-groups not needed
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    for e in range(E):
        for proj, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
            packed, scale = quant.quantize_fp4(torch.randn(shape, generator=g))
            tensors[f"layers.1.ffn.experts.{e}.{proj}.weight"] = packed
            tensors[f"layers.1.ffn.experts.{e}.{proj}.scale"] = scale
            dense[f"{e}.{proj}"] = ref_fp4(packed, scale)
    q, s = quant.quantize_fp8_block(torch.randn(200, 64, generator=g))
    tensors["mtp.0.e_proj.weight"], tensors["mtp.0.e_proj.scale"] = q, s
    tensors["mtp.0.norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    root = write_model(tmp_path / "m", {"model_type": "deepseek_v4", "expert_dtype": "fp4"},
                       tensors, shards=2)
    got = dict(CheckpointReader(root, {"model_type": "deepseek_v4", "expert_dtype": "fp4"},
                                torch.float32))
    assert set(got) == {"model.layers.1.mlp.experts.gate_up_proj",
                        "model.layers.1.mlp.experts.down_proj", "mtp.0.e_proj.weight",
                        "mtp.0.norm.weight"}
    gate_up = torch.stack([torch.cat([dense[f"{e}.w1"], dense[f"{e}.w3"]]) for e in range(E)])
    assert torch.equal(got["model.layers.1.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(got["model.layers.1.mlp.experts.down_proj"],
                       torch.stack([dense[f"{e}.w2"] for e in range(E)]))
    assert torch.equal(got["mtp.0.e_proj.weight"], ref_fp8_block(q, s).float())
    assert got["mtp.0.norm.weight"].dtype == torch.bfloat16           # unquantised: as stored


def test_reader_hf_names_with_stacked_fp8_and_mhc_scale(tmp_path):
    """HF-named V4 tensors: stacked FP8 experts with `_scale_inv`, and `attn_hc.scale`, which
    is a parameter (no `attn_hc.weight` beside it), not a scale companion."""
    g = torch.Generator().manual_seed(1)
    q, s = quant.quantize_fp8_block(torch.randn(2, 300, 64, generator=g))
    tensors = {"model.layers.0.mlp.experts.gate_up_proj": q,
               "model.layers.0.mlp.experts.gate_up_proj_scale_inv": quant.ue8m0_to_float(s),
               "model.layers.0.attn_hc.scale": torch.tensor([0.5, 1.0, 2.0]),
               "mtp.0.enorm.weight": torch.ones(4)}
    config = {"model_type": "deepseek_v4", "quantization_config": {"quant_method": "fp8"}}
    got = dict(CheckpointReader(write_model(tmp_path / "m", config, tensors), config,
                                torch.bfloat16))
    assert set(got) == {"model.layers.0.mlp.experts.gate_up_proj",
                        "model.layers.0.attn_hc.scale", "mtp.0.enorm.weight"}
    want = torch.stack([ref_fp8_block(q[e], s[e]) for e in range(2)]).to(torch.bfloat16)
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"], want)
    assert torch.equal(got["model.layers.0.attn_hc.scale"], tensors["model.layers.0.attn_hc.scale"])


def ref_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent FP8 decode: the e4m3 bit fields, 2^(byte - 127) per 128x128 tile."""
    raw = q.view(torch.uint8).long()
    sign = 1.0 - 2.0 * (raw >> 7).double()
    exp, man = ((raw >> 3) & 0xF).double(), (raw & 7).double()
    mag = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.pow(2.0, exp - 7))
    f = torch.pow(2.0, scale.view(torch.uint8).double() - 127)
    f = f.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    return sign * mag * f


def test_reader_reports_missing_expert(tmp_path):
    tensors = {f"layers.0.ffn.experts.{e}.{p}.weight": torch.zeros(4, 4, dtype=torch.bfloat16)
               for e in (0, 2) for p in ("w1", "w2", "w3")}
    root = write_model(tmp_path / "m", {"model_type": "deepseek_v4"}, tensors)
    with pytest.raises(ValueError, match=r"expert 1 of layers.0.ffn.experts lacks .*experts.1.w1"):
        list(CheckpointReader(root, {"model_type": "deepseek_v4"}, torch.float32))


def ref_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Independent FP4 decode: e2m1 by its bit fields, UE8M0 by 2^(byte - 127) in float64."""
    raw = packed.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(raw.shape[0], -1)
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).double()
    exp, man = ((codes >> 1) & 3).double(), (codes & 1).double()
    mag = torch.where(exp == 0, man * 0.5, (1 + man / 2) * torch.pow(2.0, exp - 1))
    factor = torch.pow(2.0, scale.view(torch.uint8).double() - 127).repeat_interleave(32, dim=1)
    return (sign * mag * factor[:, : codes.shape[1]]).float()


# --- dummy weights ---

def test_dummy_weights_deterministic_and_nontrivial(tmp_path):
    root = write_model(tmp_path / "m", QWEN_MOE)
    a = load_model(LoadConfig(model=str(root), load_format="dummy", seed=1)).model.state_dict()
    b = load_model(LoadConfig(model=str(root), load_format="dummy", seed=1)).model.state_dict()
    c = load_model(LoadConfig(model=str(root), load_format="dummy", seed=2)).model.state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if a[name].is_floating_point():
            assert not torch.equal(a[name], c[name]), name
            assert a[name].std() > 0 and a[name].abs().max() > 0, name
    norm = a["model.layers.0.input_layernorm.weight"]
    assert 0.8 < norm.min() and norm.max() < 1.2                      # norms near 1


def test_distinct_expert_table():
    table = distinct_expert_table(1000, 6, 16, torch.Generator().manual_seed(0), chunk=300)
    assert table.shape == (1000, 6) and table.dtype == torch.int64
    assert ((table >= 0) & (table < 16)).all()
    assert all(len(set(row)) == 6 for row in table.tolist())
    assert len({tuple(row) for row in table.tolist()}) > 900          # rows differ
    with pytest.raises(ValueError, match="only 4"):
        distinct_expert_table(10, 6, 4, torch.Generator())
