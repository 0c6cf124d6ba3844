"""A tiny DeepSeek-V4 checkpoint in the ORIGINAL quantised layout (docs/deepseek_v4.md, "Checkpoint names",
§5.3): FP8 e4m3 + UE8M0 128x128 block scales, packed FP4 experts + per-32 UE8M0, `.scale`
names, per-expert tensors, an `mtp.0.*` block, top-level `expert_dtype`. wideserve must load
exactly an independent dequantisation of it, the same tensors as transformers 5.23's
`from_pretrained` of the same directory, and the same logits (reference §9.3-9.4)."""
from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from paged_harness import PagedHarness
from wideserve.config import LoadConfig
from wideserve.worker.model_loader import load_model
from wideserve.layers import quant

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Dims are < 128 or multiples of 128 where FP8 applies: transformers infers the block size as
# rows / scale_rows, which is only right then. hidden 256 gives multi-block scale grids.
CONFIG = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", vocab_size=128,
    hidden_size=256, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    layer_types=[SWA, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8}, num_hash_layers=1,
    sliding_window=8, index_n_heads=2, index_head_dim=32, index_topk=16, hc_mult=2,
    hc_sinkhorn_iters=3, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5,
    swiglu_limit=10.0, rms_norm_eps=1e-6, rope_theta=10000, compress_rope_theta=160000,
    max_position_embeddings=4096, topk_method="noaux_tc", tie_word_embeddings=False,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024,
                  "beta_fast": 32, "beta_slow": 1},
    num_nextn_predict_layers=1, torch_dtype="bfloat16", expert_dtype="fp4",
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "scale_fmt": "ue8m0", "weight_block_size": [128, 128]})
TOKENS = 37          # index_topk 16 >= 37 // 4 entries: no indexer ties to break

# HF module path (inside a block) -> original; written from §5.2 independently of the loader.
_INNER = [
    (r"input_layernorm", "attn_norm"), (r"post_attention_layernorm", "ffn_norm"),
    (r"attn_hc\.(fn|base|scale)", r"hc_attn_\1"), (r"ffn_hc\.(fn|base|scale)", r"hc_ffn_\1"),
    (r"hc_head\.hc_(fn|base|scale)", r"hc_head_\1"),
    (r"self_attn\.compressor\.indexer\.scorer\.weights_proj", "attn.indexer.weights_proj"),
    (r"self_attn\.compressor\.indexer\.q_b_proj", "attn.indexer.wq_b"),
    (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"self_attn\.", "attn."), (r"mlp\.", "ffn."),
    (r"(compressor\.)kv_proj", r"\1wkv"), (r"(compressor\.)gate_proj", r"\1wgate"),
    (r"(compressor\.)position_bias", r"\1ape"), (r"(compressor\.)kv_norm", r"\1norm"),
    (r"attn\.q_a_proj", "attn.wq_a"), (r"attn\.q_a_norm", "attn.q_norm"),
    (r"attn\.q_b_proj", "attn.wq_b"), (r"attn\.kv_proj", "attn.wkv"),
    (r"attn\.o_a_proj", "attn.wo_a"), (r"attn\.o_b_proj", "attn.wo_b"),
    (r"attn\.sinks", "attn.attn_sink"), (r"gate\.e_score_correction_bias", "gate.bias"),
    (r"shared_experts\.gate_proj", "shared_experts.w1"),
    (r"shared_experts\.up_proj", "shared_experts.w3"),
    (r"shared_experts\.down_proj", "shared_experts.w2"),
]
_TOP = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
        "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
        "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
_FP8 = re.compile(r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$"
                  r"|shared_experts\.w[123]\.weight$|[eh]_proj\.weight$")
_FP32 = re.compile(r"hc_|attn_sink$|ape$|gate\.bias$")


def original_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    m = re.match(r"^(?:model\.layers|(mtp))\.(\d+)\.(.+)$", hf)
    rest = m[3]
    for pattern, repl in _INNER:
        rest = re.sub(pattern, repl, rest)
    return f"{'mtp' if m[1] else 'layers'}.{m[2]}.{rest}"


def ref_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 by its bit fields and UE8M0 as 2^(byte-127), per 128x128 tile, in float64."""
    raw = q.view(torch.uint8).long()
    sign = 1.0 - 2.0 * (raw >> 7).double()
    exp, man = ((raw >> 3) & 0xF).double(), (raw & 7).double()
    mag = torch.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * torch.pow(2.0, exp - 7))
    s = torch.pow(2.0, scale.view(torch.uint8).double() - 127)
    s = s.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]
    return sign * mag * s


def ref_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    raw = packed.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(raw.shape[0], -1)
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).double()
    exp, man = ((codes >> 1) & 3).double(), (codes & 1).double()
    mag = torch.where(exp == 0, man * 0.5, (1 + man / 2) * torch.pow(2.0, exp - 1))
    factor = torch.pow(2.0, scale.view(torch.uint8).double() - 127).repeat_interleave(32, 1)
    return sign * mag * factor


def write_original(root: Path, truth: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Write `truth` (HF names) in the original layout, 2 shards + index. Returns what a
    correct loader must produce in float32 (independently dequantised)."""
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for hf, t in truth.items():
        orig = original_name(hf)
        if hf.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base, inter = orig.rsplit(".", 1)[0], t.shape[1] // 2
            parts = ({"w1": t[:, :inter], "w3": t[:, inter:]} if "gate_up" in hf
                     else {"w2": t})
            deq = {}
            for proj, stack in parts.items():
                deq[proj] = []
                for e in range(stack.shape[0]):
                    packed, scale = quant.quantize_fp4(stack[e])
                    tensors[f"{base}.{e}.{proj}.weight"] = packed
                    tensors[f"{base}.{e}.{proj}.scale"] = scale
                    deq[proj].append(ref_fp4(packed, scale))
            expected[hf] = (torch.stack([torch.cat([a, b]) for a, b in zip(deq["w1"], deq["w3"])])
                            if "gate_up" in hf else torch.stack(deq["w2"])).float()
        elif _FP8.search(orig):
            q, scale = quant.quantize_fp8_block(t)
            tensors[orig], tensors[orig[: -len("weight")] + "scale"] = q, scale
            expected[hf] = ref_fp8(q, scale).float()
        elif not t.is_floating_point():
            tensors[orig] = expected[hf] = t
        else:
            tensors[orig] = t.float() if _FP32.search(orig) else t.to(torch.bfloat16)
            expected[hf] = tensors[orig].float()
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(tensors)
    weight_map = {}
    for s, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{s + 1}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, root / fname)
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return expected


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("v4")
    (tmp / "cfg").mkdir()
    (tmp / "cfg" / "config.json").write_text(json.dumps(CONFIG))
    truth = load_model(LoadConfig(model=str(tmp / "cfg"), load_format="dummy", seed=5,
                                  dtype="float32")).model.state_dict()
    assert any(n.startswith("mtp.0.") for n in truth)
    return tmp / "original", write_original(tmp / "original", truth)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    """Dequantised at load (the routed experts too): what these tests compare tensor by tensor.
    By default FP4 experts stay packed (layers/experts.py), tested below and in
    tests/layers/test_quant_experts.py."""
    return load_model(LoadConfig(model=str(checkpoint[0]), dtype="float32"),
                      packed_experts=False).model


def test_original_layout_loads_to_independent_dequantisation(checkpoint, loaded):
    _, expected = checkpoint
    state = loaded.state_dict()
    assert set(state) == set(expected)
    for name, want in expected.items():
        assert torch.equal(state[name], want.to(state[name].dtype)), name
    assert state["model.layers.1.self_attn.sinks"].dtype == torch.float32


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import DeepseekV4ForCausalLM as HFModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return HFModel.from_pretrained(str(checkpoint[0]), dtype=torch.float32).float().eval()


def test_same_tensors_as_transformers(loaded, hf_model):
    ours, theirs = loaded.state_dict(), hf_model.state_dict()
    assert set(theirs) == {n for n in ours if not n.startswith("mtp.")}
    for name, t in theirs.items():
        assert torch.equal(ours[name].to(t.dtype), t), name


def test_same_logits_as_transformers(loaded, hf_model):
    ids = torch.randint(0, CONFIG["vocab_size"], (TOKENS,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        want = hf_model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    harness = PagedHarness(loaded, max_reqs=1, max_len=64)
    got = torch.cat([harness.step([0], [ids[:20]]), harness.step([0], [ids[20:]])])
    assert want.abs().max() > 0.1                                 # informative logits
    assert (got - want).abs().max().item() <= 1e-4


def test_packed_experts_same_logits_as_transformers(checkpoint, hf_model):
    """The default load keeps the FP4 experts packed and computes the same logits."""
    packed = load_model(LoadConfig(model=str(checkpoint[0]), dtype="float32")).model
    assert packed.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.uint8
    test_same_logits_as_transformers(packed, hf_model)


def test_hf_named_bf16_sharded_roundtrip(tmp_path, loaded):
    """The loaded model saved with HF names in bf16 (3 shards, mtp included) loads back."""
    state = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
             for n, t in loaded.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for s in range(3):
        fname = f"part{s}.safetensors"
        save_file({n: state[n].contiguous() for n in names[s::3]}, tmp_path / fname)
        weight_map.update(dict.fromkeys(names[s::3], fname))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    config = {k: v for k, v in CONFIG.items() if k not in ("quantization_config", "expert_dtype")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    again = load_model(LoadConfig(model=str(tmp_path)))
    assert again.dtype == torch.bfloat16
    for name, t in again.model.state_dict().items():
        assert torch.equal(t, state[name].to(t.dtype)), name
    assert again.model.state_dict()["model.layers.0.attn_hc.fn"].dtype == torch.float32


def test_v4_dummy_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    a = load_model(LoadConfig(model=str(tmp_path), load_format="dummy", seed=9)).model
    b = load_model(LoadConfig(model=str(tmp_path), load_format="dummy", seed=9)).model
    sa, sb = a.state_dict(), b.state_dict()
    for name, t in sa.items():
        assert torch.equal(t, sb[name]), name
        if t.is_floating_point():
            assert t.abs().min() > 0 if t.numel() == 1 else t.float().std() > 0, name
    table = sa["model.layers.0.mlp.gate.tid2eid"]
    assert table.shape == (CONFIG["vocab_size"], CONFIG["num_experts_per_tok"])
    assert all(len(set(row)) == len(row) for row in table.tolist())
    assert len({tuple(r) for r in table.tolist()}) > 1
    harness = PagedHarness(a, max_reqs=1, max_len=32)
    logits = harness.step([0], [[1, 2, 3, 4, 5, 6]])
    assert torch.isfinite(logits).all() and logits.std(dim=-1).min() > 0.1


def test_mtp_checkpoint_tensors_need_mtp_or_are_ignored(tmp_path, checkpoint):
    """A model built with num_nextn_predict_layers=0 ignores the checkpoint's mtp.* tensors."""
    root = tmp_path / "m"
    root.mkdir()
    src = checkpoint[0]
    for f in src.iterdir():
        (root / f.name).symlink_to(f)
    (root / "config.json").unlink()
    (root / "config.json").write_text(json.dumps({**CONFIG, "num_nextn_predict_layers": 0}))
    model = load_model(LoadConfig(model=str(root), dtype="float32")).model
    assert not any(n.startswith("mtp.") for n in model.state_dict())


def test_bundled_model_format(tmp_path, monkeypatch):
    """The layout tools/tiny_v4.py writes for the bundled model (HF names, `mtp.0.*`, the
    HF-saved config.json, bf16) loads completely and runs like the transformers model."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "tools"))
    import tiny_v4

    sizes = tiny_v4.TinySizes(hidden=64, layers=3, heads=2, head_dim=32, rope_dim=8, q_lora=32,
                              o_lora=16, experts=4, expert_width=32, sinkhorn_iters=2, window=8,
                              hca_ratio=8, index_dim=16, max_positions=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = tiny_v4.TinyV4WithMTP(tiny_v4.build_config(sizes, 96, 0, 1, 2))
        tiny_v4.init_hash_tables(ref, torch.Generator().manual_seed(0))
        tiny_v4.save_model(ref, str(tmp_path / "tiny"))
        ref = tiny_v4.load_model(str(tmp_path / "tiny")).eval()
    loaded = load_model(LoadConfig(model=str(tmp_path / "tiny"), dtype="float32")).model
    for name, t in ref.mtp.state_dict().items():
        assert torch.equal(loaded.state_dict()[f"mtp.{name}"], t), name
    ids = list(range(3, 40))
    with torch.no_grad():
        want = ref(torch.tensor([ids]), None)[0][0].float()
    got = PagedHarness(loaded, max_reqs=1, max_len=64).step([0], [ids])
    assert (got - want).abs().max().item() <= 1e-4
