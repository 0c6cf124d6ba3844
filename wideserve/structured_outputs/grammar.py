"""Requests' constraints -> llguidance grammars (the engine compiles them; see docs/structured_outputs.md)."""
from __future__ import annotations

import json
from typing import Any


def schema_error(schema: dict[str, Any]) -> str:
    """'' when llguidance can build a grammar from the JSON Schema, else its message."""
    import llguidance
    try:
        return llguidance.LLMatcher.validate_grammar(
            llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)
