"""Reading a vLLM-style JSON flag (`--speculative-config`, `--eplb-config`) into a dataclass:
a JSON string or a dict, an error naming the flag for bad JSON, a non-object or an unknown
key. No torch import: the CLI parses flags before anything heavy loads."""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any


def json_object(value: str | dict[str, Any], what: str, cls: type) -> dict[str, Any]:
    """value (JSON text or a dict) -> a dict whose keys are all fields of dataclass `cls`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        # ValueError, not TypeError: the CLI turns ValueErrors into a flag error.
        raise ValueError(f"{what} must be a JSON object, got "  # noqa: TRY004
                         f"{type(value).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{what}: unknown key {unknown[0]!r} (known: "
                         f"{', '.join(sorted(known))})")
    return value
