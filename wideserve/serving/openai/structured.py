"""A request's output constraint, from whichever spelling it used, checked before the engine.

Spellings (at most one per request, else a 400): OpenAI's `response_format` (json_object,
json_schema), vLLM's `structured_outputs` (json, json_object, regex, choice, grammar) and its
older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, and tool_choice
"required" or a named function, which constrain the output to a call (see tools.py).
JSON is generated compact (see types/structured_params.py).
"""
from __future__ import annotations

import json
import logging
from typing import Any

from wideserve.serving.openai.serving import ApiError
from wideserve.serving.openai.tools import ToolSetup
from wideserve.types.structured_params import StructuredOutputsParams, cached_error

logger = logging.getLogger(__name__)


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{param}: not valid JSON ({e})", param=param) from None
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}: must be a JSON Schema object", param=param)
    return json.dumps(schema)


def _make(param: str, **kwargs: Any) -> tuple[str, StructuredOutputsParams]:
    try:
        return param, StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise ApiError(400, str(e).replace("structured_outputs", param, 1), param=param) from None


def _from_structured_outputs(so: Any) -> tuple[str, StructuredOutputsParams]:
    json_text = (None if so.json_schema is None
                 else _schema_text(so.json_schema, "structured_outputs.json"))
    return _make("structured_outputs", json=json_text, json_object=bool(so.json_object),
                 regex=so.regex, choice=so.choice, grammar=so.grammar)


def _from_response_format(rf: Any) -> tuple[str, StructuredOutputsParams] | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return _make("response_format", json_object=True)
    spec = getattr(rf, "json_schema", None)
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise ApiError(400, "response_format: type 'json_schema' needs json_schema.schema, "
                            "a JSON Schema object", param="response_format")
    if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), bool):
        raise ApiError(400, "response_format: json_schema.name must be a string and "
                            "json_schema.strict a boolean", param="response_format")
    return _make("response_format",
                 json=_schema_text(spec["schema"], "response_format.json_schema.schema"))


def tool_call_schema(setup: ToolSetup) -> dict[str, Any]:
    """named: the function's arguments object; required: a list of {name, parameters}
    (one item unless parallel_tool_calls), name first so it streams first."""
    if setup.mode == "named":
        assert setup.named is not None
        return setup.function(setup.named).get("parameters") or {"type": "object"}
    items = [{"type": "object", "properties": {
        "name": {"const": t["function"]["name"]},
        "parameters": t["function"].get("parameters") or {"type": "object"}},
        "required": ["name", "parameters"], "additionalProperties": False}
        for t in setup.tools or []]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if not setup.parallel:
        schema["maxItems"] = 1
    return schema


_CONSTRAINT_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")


def has_constraint(req: Any) -> bool:
    """Whether a request spells an output constraint (then validating it is real work, off
    the event loop). Tool choices are judged with the tools."""
    rf = getattr(req, "response_format", None)
    return any(getattr(req, f) is not None for f in _CONSTRAINT_FIELDS) or \
        (rf is not None and rf.type != "text")


def structured_params(req: Any, tools: ToolSetup | None = None
                      ) -> StructuredOutputsParams | None:
    found: list[tuple[str, StructuredOutputsParams]] = []
    if req.structured_outputs is not None:
        found.append(_from_structured_outputs(req.structured_outputs))
    for param, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, param)
        if value is not None:
            found.append(_make(param, **{kind: _schema_text(value, param) if kind == "json"
                                         else value}))
    rf = _from_response_format(getattr(req, "response_format", None))
    if rf is not None:
        found.append(rf)
    if tools is not None and tools.mode in ("required", "named"):
        found.append(_make("tool_choice", json=_schema_text(tool_call_schema(tools),
                                                            "tool_choice")))
    if req.guided_decoding_backend or req.guided_whitespace_pattern:
        logger.warning("guided_decoding_backend / guided_whitespace_pattern ignored: this "
                       "server has one structured-output engine (llguidance)")
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise ApiError(400, f"{found[1][0]}: only one output constraint per request "
                            f"(got {names})", param=found[1][0])
    param, params = found[0]
    error = cached_error(params)
    if error:
        raise ApiError(400, f"{param}: the {params.kind} constraint is not valid ({error})",
                       param=param)
    return params
