"""The DeepSeek-V4.1 config class for Hugging Face tooling (transformers has no `deepseek_v41`
model type): `AutoConfig.from_pretrained(dir, trust_remote_code=True)` loads config.json
through it (config.json's `auto_map`). wideserve itself reads config.json with
wideserve/models/deepseek_v41/config.py and never imports this file."""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class DeepseekV41Config(PretrainedConfig):
    model_type = "deepseek_v41"

    def __init__(self, text_config: dict[str, Any] | None = None,
                 vision_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.text_config = dict(text_config or {})
        self.vision_config = dict(vision_config or {})
        # The text model's sizes at the top level too, where tools look for them.
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "max_position_embeddings"):
            if key in self.text_config:
                kwargs.setdefault(key, self.text_config[key])
        super().__init__(**kwargs)
