"""Load a GGUF file (llama.cpp's format) as a wideserve model and a `tokenizers` tokenizer.

- Config: an HF-style config.json dict built from the `{arch}.*` metadata (llama, qwen2, qwen3).
- Weights: every tensor dequantised with `gguf.quants.dequantize` to fp32, renamed to the
  transformers state-dict name and cast to the requested dtype. GGUF lists shapes innermost
  first, so a tensor of GGUF shape [in, out] is the HF matrix [out, in].
  llama.cpp's converter permutes the Q/K rows of *llama* models so its interleaved (adjacent
  pair) RoPE applies; we invert that permutation, so wideserve's rotate-half RoPE applies as for
  the HF checkpoint. Qwen2/Qwen3 GGUFs are not permuted (llama.cpp runs them with NeoX RoPE).
- Tokenizer: byte-level BPE ("gpt2" tokenizer model) from the vocab and merges in the metadata,
  with the pre-tokenizer that llama.cpp uses for `tokenizer.ggml.pre`; tokens typed CONTROL are
  special added tokens, USER_DEFINED ones plain added tokens (both kept whole in text).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from wideserve.models.registry import resolve_model_class

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4
_MISSING = object()

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_PRE = ("gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion")
_DIGITS_THEN_GPT2_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                         "minerva-7b")
_SPLIT_PRE = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
              "falcon3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


@dataclass(slots=True)
class GGUFTokenizerData:
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    # "bos_token" / "eos_token" / "pad_token" / "unk_token" -> token text (when the id is set)
    special_tokens: dict[str, str] = field(default_factory=dict)
    control_tokens: list[str] = field(default_factory=list)   # all CONTROL-typed tokens


class GGUFFile:
    """An open GGUF file: typed access to its key/value fields (errors name file and key).
    Parsing the header of a large vocabulary takes seconds, so callers that need both the
    model and the tokenizer open the file once and pass this object to both loaders."""

    def __init__(self, reader: gguf.GGUFReader, path: str) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default: Any = _MISSING) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is _MISSING:
                raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
            return default
        return f.contents()


def open_gguf(path: str | os.PathLike[str] | GGUFFile) -> GGUFFile:
    if isinstance(path, GGUFFile):
        return path
    path = os.fspath(path)
    try:
        return GGUFFile(gguf.GGUFReader(path), path)
    except (OSError, ValueError, IndexError, KeyError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e


def _f32_to_decimal(x: float) -> float:
    # GGUF stores float32; the HF config it came from had a short decimal (1e-05, not 9.99e-06).
    return float(f"{x:.7g}")


def gguf_config(meta: GGUFFile) -> dict:
    """HF-style config.json dict for the model in the file."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{meta.path}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(_ARCHITECTURES)})")
    tensors = {t.name for t in meta.reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{meta.path}: per-dimension RoPE factors (rope_freqs, llama3 scaling) "
                         f"are not supported for GGUF checkpoints")
    p = f"{arch}."
    hidden = int(meta.get(p + "embedding_length"))
    heads = int(meta.get(p + "attention.head_count"))
    head_dim = int(meta.get(p + "attention.key_length", hidden // heads))
    rope_dim = int(meta.get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{meta.path}: partial RoPE ({rope_dim} of {head_dim} dims) "
                         f"is not supported")
    vocab = meta.get(p + "vocab_size", None)
    if vocab is None:   # older files: the embedding's outer (last-listed) dimension
        embed = next((t for t in meta.reader.tensors if t.name == "token_embd.weight"), None)
        if embed is None:
            raise ValueError(f"{meta.path}: no {p}vocab_size and no token_embd.weight")
        vocab = int(embed.shape[-1])
    config = {
        "architectures": [_ARCHITECTURES[arch]], "model_type": arch,
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(meta.get(p + "feed_forward_length")),
        "num_hidden_layers": int(meta.get(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(p + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32_to_decimal(meta.get(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_to_decimal(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.get(p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", None),
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    elif arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": float(meta.get(p + "rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{meta.path}: RoPE scaling {scaling!r} is not supported for GGUF")
    return config


def hf_tensor_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and kind == "weight":
        return f"{_GLOBAL_TENSORS[stem]}.weight"
    m = _BLOCK_NAME.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no wideserve counterpart")
    return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}.{m.group(3)}"


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K permutation: within each head, rows (i, pair) -> (pair, i)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(t: gguf.ReaderTensor) -> torch.Tensor:
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))          # outermost first
    arr = gguf.quants.dequantize(t.data, t.tensor_type)
    # F32 tensors come back as read-only views of the memory-mapped file.
    arr = np.require(arr, dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(arr.reshape(shape))


def iter_gguf_weights(meta: GGUFFile, config: dict, dtype: torch.dtype
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every tensor in the file, one at a time."""
    permute = config["model_type"] == "llama"
    for t in meta.reader.tensors:
        try:
            name = hf_tensor_name(t.name)
        except ValueError as e:
            raise ValueError(f"{meta.path}: {e}") from None
        w = _dequantize(t)
        if permute and ".self_attn.q_proj." in name:
            w = _unpermute_rows(w, config["num_attention_heads"])
        elif permute and ".self_attn.k_proj." in name:
            w = _unpermute_rows(w, config["num_key_value_heads"])
        yield name, w.to(dtype)


def build_model(config_json: dict, weights, dtype: torch.dtype,
                device: torch.device | str) -> torch.nn.Module:
    """Instantiate the registry's class for `config_json` in `dtype` on `device` and fill it
    from (name, tensor) pairs; every parameter must be filled."""
    model_cls = resolve_model_class(config_json)
    config = model_cls.config_class.from_dict(config_json)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    loaded = model.load_weights(weights)
    missing = sorted({n for n, _ in model.named_parameters()} - loaded)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameter(s): {', '.join(missing[:5])}")
    return model.eval()


def load_gguf_model(path: str | os.PathLike[str] | GGUFFile, dtype: torch.dtype, device
                    ) -> tuple[torch.nn.Module, dict]:
    """(model, config.json dict) from a GGUF file; tensors are dequantised one at a time."""
    meta = open_gguf(path)
    config = gguf_config(meta)
    return build_model(config, iter_gguf_weights(meta, config, dtype), dtype, device), config


def _pre_tokenizer(pre: str, path: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    supported = sorted(_GPT2_PRE + _DIGITS_THEN_GPT2_PRE + tuple(_SPLIT_PRE))
    raise ValueError(f"{path}: tokenizer.ggml.pre {pre!r} is not supported "
                     f"(supported: {', '.join(supported)})")


def load_gguf_tokenizer(path: str | os.PathLike[str] | GGUFFile) -> GGUFTokenizerData:
    meta = open_gguf(path)
    path = meta.path
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model {kind!r} is not supported "
                         f"(only byte-level BPE, 'gpt2')")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges")]
    bad = next((m for m in merges if len(m) != 2), None)
    if bad is not None:
        raise ValueError(f"{path}: malformed BPE merge {' '.join(bad)!r}")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "gpt-2"), path)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    # Already in the vocab, so adding them keeps their ids; it only stops them being split.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED])
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id", None)
           for k in ("bos", "eos", "padding", "unknown")}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    tok.post_processor = _post_processor(tokens, ids["bos"], ids["eos"], add_bos, add_eos)
    names = {"bos": "bos_token", "eos": "eos_token", "padding": "pad_token",
             "unknown": "unk_token"}
    return GGUFTokenizerData(
        tokenizer=tok, chat_template=meta.get("tokenizer.chat_template", None),
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["padding"],
        unk_token_id=ids["unknown"], add_bos_token=add_bos, add_eos_token=add_eos,
        special_tokens={names[k]: tokens[i] for k, i in ids.items() if i is not None},
        control_tokens=control)


def _post_processor(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool,
                    add_eos: bool) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    if not ((add_bos and bos is not None) or (add_eos and eos is not None)):
        return byte_level
    pre = [tokens[bos]] if add_bos and bos is not None else []
    post = [tokens[eos]] if add_eos and eos is not None else []
    special = list({i: (tokens[i], i) for i, on in ((bos, add_bos), (eos, add_eos))
                    if on and i is not None}.values())
    single = " ".join(pre + ["$A"] + post)
    pair = " ".join(pre + ["$A"] + post + [f"{t}:1" for t in pre] + ["$B:1"]
                    + [f"{t}:1" for t in post])
    return processors.Sequence([
        byte_level,
        processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)])
