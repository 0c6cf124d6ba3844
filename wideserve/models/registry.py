"""Architecture name (config.json "architectures"[0] or model_type) -> model class.

Each model module exposes a class deriving from `wideserve.models.interface.CausalLM`:
  - `config_class`: a dataclass with `from_dict(config_json: dict)`
  - `__init__(self, config)`: builds the module on the current default device/dtype
  - the contract's abstract methods, and overrides of the optional capabilities it has
The class is checked when it is resolved: one that misses part of the contract is refused
with an error naming what is missing.
"""
from __future__ import annotations

import importlib

from wideserve.models.interface import check_model_class

_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "DeepseekV4ForCausalLM": ("wideserve.models.deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "deepseek_v4": ("wideserve.models.deepseek_v4.model", "DeepseekV4ForCausalLM"),
    "DeepseekV41ForCausalLM": ("wideserve.models.deepseek_v41.model", "DeepseekV41ForCausalLM"),
    "deepseek_v41": ("wideserve.models.deepseek_v41.model", "DeepseekV41ForCausalLM"),
    "LlamaForCausalLM": ("wideserve.models.llama.model", "LlamaForCausalLM"),
    "llama": ("wideserve.models.llama.model", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("wideserve.models.llama.model", "Qwen2ForCausalLM"),
    "qwen2": ("wideserve.models.llama.model", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("wideserve.models.llama.model", "Qwen3ForCausalLM"),
    "qwen3": ("wideserve.models.llama.model", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("wideserve.models.qwen3_moe.model", "Qwen3MoeForCausalLM"),
    "qwen3_moe": ("wideserve.models.qwen3_moe.model", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(k for k in _ARCHITECTURES if k[0].isupper())


def resolve_model_class(config_json: dict):
    """Pick the model class for a parsed config.json; raise a clear error when unknown."""
    names = list(config_json.get("architectures") or []) + [config_json.get("model_type", "")]
    for name in names:
        if name in _ARCHITECTURES:
            module, cls_name = _ARCHITECTURES[name]
            cls = getattr(importlib.import_module(module), cls_name)
            check_model_class(cls)
            return cls
    raise ValueError(
        f"unknown architecture {names[0] if names else '<none>'!r}; "
        f"wideserve supports {', '.join(supported_architectures())}")
