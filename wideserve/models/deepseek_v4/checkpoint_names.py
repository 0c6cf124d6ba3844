"""Original DeepSeek-V4 checkpoint names -> the HF names wideserve models use.

docs/deepseek_v4.md, "Checkpoint names". The original layout has no `model.` prefix, per-layer blocks
`layers.{i}.*`, MTP blocks `mtp.{j}.*` (a decoder block plus e_proj/h_proj/enorm/hnorm/norm and
its own hc_head), and per-expert `ffn.experts.{e}.w{1,2,3}` that the reader stacks (see
weights.py). Inside a block the MTP tensors are renamed by the same rules as a layer's.
`.scale` companions are renamed to `.weight_scale_inv`, though the reader consumes them itself.
"""
from __future__ import annotations

import re

# transformers' save_pretrained writes a hybrid: original block names under a `model.` prefix
# (`model.layers.0.attn.wq_a.weight`, `head.weight`) beside HF top-level names
# (`model.embed_tokens.weight`, `model.hc_head.hc_fn`); both spellings are accepted.
EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:model\.)?(?:layers|mtp)\.\d+\.ffn\.experts)\.(?P<expert>\d+)\."
    r"(?P<proj>w[123])\.weight$")

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Module paths inside a decoder block (longest prefixes first is not needed: matched whole).
_BLOCK_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn.wq_a": "self_attn.q_a_proj",
    "attn.q_norm": "self_attn.q_a_norm",
    "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj",
    "attn.kv_norm": "self_attn.kv_norm",
    "attn.norm": "self_attn.kv_norm",        # transformers' save_pretrained spelling
    "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "attn.compressor.wkv": "self_attn.compressor.kv_proj",
    "attn.compressor.wgate": "self_attn.compressor.gate_proj",
    "attn.compressor.norm": "self_attn.compressor.kv_norm",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "attn.indexer.weights_proj": "self_attn.compressor.indexer.scorer.weights_proj",
    "attn.indexer.compressor.wkv": "self_attn.compressor.indexer.kv_proj",
    "attn.indexer.compressor.wgate": "self_attn.compressor.indexer.gate_proj",
    "attn.indexer.compressor.norm": "self_attn.compressor.indexer.kv_norm",
    "ffn.gate": "mlp.gate",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
}

# Bare tensors inside a block (no `.weight` suffix in the original names).
_BLOCK_TENSORS = {
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    **{f"hc_{site}_{p}": f"{site}_hc.{p}"
       for site in ("attn", "ffn") for p in ("fn", "base", "scale")},
}

# Extra modules/tensors of an MTP block.
_MTP_MODULES = {m: m for m in ("e_proj", "h_proj", "enorm", "hnorm", "norm")}
_MTP_TENSORS = {f"hc_head_{p}": f"hc_head.hc_{p}" for p in ("fn", "base", "scale")}

_HF_TOP_LEVEL = frozenset(_TOP_LEVEL.values())

_BLOCK_RE = re.compile(r"^(?:model\.)?(?P<kind>layers|mtp)\.(?P<idx>\d+)\.(?P<rest>.+)$")
_LEAVES = {"weight": "weight", "scale": "weight_scale_inv"}


def _rename_in_block(rest: str, is_mtp: bool) -> str | None:
    tensors = {**_BLOCK_TENSORS, **(_MTP_TENSORS if is_mtp else {})}
    if rest in tensors:
        return tensors[rest]
    module, _, leaf = rest.rpartition(".")
    modules = {**_BLOCK_MODULES, **(_MTP_MODULES if is_mtp else {})}
    if module in modules and leaf in _LEAVES:
        return f"{modules[module]}.{_LEAVES[leaf]}"
    m = re.fullmatch(r"ffn\.experts\.(\d+)\.(w[123])", module)
    if m and leaf in _LEAVES:
        return f"mlp.experts.{m[1]}.{m[2]}.{_LEAVES[leaf]}"
    return None


def is_original_block_name(name: str) -> bool:
    """A per-layer name in the original spelling (with or without a `model.` prefix); names
    both layouts share (e.g. `mtp.0.e_proj.weight`) do not count."""
    m = _BLOCK_RE.match(name)
    if m is None:
        return False
    inner = _rename_in_block(m["rest"], m["kind"] == "mtp")
    return inner is not None and inner != m["rest"]


def rename_deepseek_v4(name: str, mtp_prefix: str = "mtp") -> str:
    """Original DeepSeek-V4 tensor name -> HF name; ValueError for a name it does not know.

    Per-expert names map to `...mlp.experts.{e}.w{1,2,3}.weight`; callers stack them.
    """
    if name in _HF_TOP_LEVEL:
        return name
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _BLOCK_RE.match(name)
    if m is not None:
        is_mtp = m["kind"] == "mtp"
        inner = _rename_in_block(m["rest"], is_mtp)
        if inner is not None:
            prefix = f"{mtp_prefix}.{m['idx']}" if is_mtp else f"model.layers.{m['idx']}"
            return f"{prefix}.{inner}"
    raise ValueError(f"unknown tensor name {name!r} in an original-layout DeepSeek-V4 checkpoint")
