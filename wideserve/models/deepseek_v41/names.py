"""DeepSeek-V4.1 checkpoint names: the official DeepSeek tensor names (the released
checkpoint's) -> the reference's state_dict names, which the model loads (model.py)."""
from __future__ import annotations

import re

_ROUTING_ONLY = re.compile(r"(^|\.)tid2eid$")
VISION_NAMES = re.compile(r"(^|\.)bias_vl$|^(model\.)?(vision|aligner)\.|"
                          r"^(model\.)?image_(start|end|newline)$")
ENGRAM_TABLE = ".engram.embed.weight"     # the Engram table (kept FP8 on the host)
_HC = re.compile(r"^layers\.(\d+)\.hc_(attn|ffn)_(fn|base|scale)$")
_MTP = re.compile(r"^(model\.)?mtp\.(\d+)\.")
_SHARED = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def official_to_reference(name: str, vision: bool = False) -> str | None:
    """An official DeepSeek-V4.1 tensor name -> the reference's state_dict name (reference
    names pass through). DSpark's `mtp.{s}.*` map as a block's names do, under `mtp.{s}.`.
    None for tensors wideserve does not use: hash-routing tables, and the vision tower and
    the gates' `bias_vl` of a model built without vision (`vision` False)."""
    if _ROUTING_ONLY.search(name) or (not vision and VISION_NAMES.search(name)):
        return None
    m = _MTP.match(name)
    if m:
        if name.endswith(".bias_vl"):       # the draft never sees an image position
            return None
        inner = official_to_reference(f"layers.{m[2]}.{name[m.end():]}")
        return inner and f"mtp.{m[2]}." + inner.removeprefix(f"model.layers.{m[2]}.")
    top = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
           "norm.weight": "model.norm.weight"}
    if name in top:
        return top[name]
    if name.startswith(("vision.", "aligner.", "image_")):
        return "model." + name
    if not name.startswith("layers."):
        return name
    m = _HC.match(name)
    if m:
        return f"model.layers.{m[1]}.{m[2]}_hc.{m[3]}"
    if name.endswith(".attn.attn_sink"):
        name = name.removesuffix(".attn_sink") + ".sinks_param.weight"
    name = re.sub(r"\.ffn\.shared_experts\.(w[123])\.",
                  lambda g: f".ffn.shared_experts.{_SHARED[g[1]]}.", name)
    if name.endswith(".ffn.gate.bias"):
        name = name.removesuffix(".bias") + ".e_score_correction_bias"
    return "model." + name


