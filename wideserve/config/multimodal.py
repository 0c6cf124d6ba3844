"""`--limit-mm-per-prompt` (vLLM's flag and forms): the most items of each modality one prompt
may carry. `image=0` serves a vision-language checkpoint as its text model alone: the vision
tower is neither built nor read (docs/deepseek_v41.md, "Images"). No torch import: the CLI
parses flags before anything heavy loads."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from typing import Any

MODALITIES = ("image",)


@dataclass(frozen=True, slots=True)
class MultiModalLimits:
    image: int = 999         # vLLM's default per modality

    @property
    def text_only(self) -> bool:
        return self.image == 0

    @classmethod
    def parse(cls, value: Any, what: str = "--limit-mm-per-prompt") -> MultiModalLimits:
        """None (the defaults), a MultiModalLimits, a dict, JSON text ('{"image": 0}') or
        vLLM's key=value list ('image=0'); a ValueError naming `what` otherwise."""
        if value is None or isinstance(value, MultiModalLimits):
            return value or cls()
        if isinstance(value, str):
            value = _from_text(value, what)
        if not isinstance(value, dict):
            raise ValueError(f"{what}: expected image=N or a JSON object like "  # noqa: TRY004
                             f'{{"image": N}}, got {value!r}')
        known = {f.name for f in fields(cls)}
        for key, count in value.items():
            if key not in known:
                raise ValueError(f"{what}: unknown modality {key!r} (this engine takes "
                                 f"{', '.join(MODALITIES)})")
            if type(count) is not int or count < 0:
                raise ValueError(f"{what}: {key} must be a non-negative integer, got "
                                 f"{count!r}")
        return cls(**value)


def _from_text(text: str, what: str) -> dict[str, Any]:
    text = text.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    out: dict[str, Any] = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*=\s*(\S+)\s*", item)
        if m is None:
            raise ValueError(f"{what}: expected image=N or a JSON object like "
                             f'{{"image": N}}, got {text!r}')
        key, count = m[1], m[2]
        if not re.fullmatch(r"\d+", count):
            raise ValueError(f"{what}: {key} must be a non-negative integer, got {count!r}")
        out[key] = int(count)
    return out
