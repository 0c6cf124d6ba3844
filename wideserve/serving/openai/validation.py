"""Turning a pydantic ValidationError into one message that says what is wrong and what is
allowed, and the lenient integer parsing OpenAI clients expect.

pydantic reports a union field (prompt, stop, content) once per branch, and its first error
is usually the least useful ("Input should be a valid string" for a list of token ids with one
id out of range). We pick the branch that got furthest: the deepest location, then the one
that validated the most items, then a value error over a type error; and we append what the
field accepts. Echoed input is clipped: a 1 MB bad value must not come back whole.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

ECHO_CHARS = 64

# What a union field accepts, said once in words (the branch errors alone cannot say it).
_ALLOWED = {
    "prompt": "a string, a list of strings, a list of token ids (integers in "
              "[0, 2147483647]) or a list of non-empty token-id lists",
    "stop": "a string or a list of non-empty strings (at most 16 by default, --max-stop)",
    "content": "a string or a non-empty list of {\"type\": \"text\", \"text\": ...} parts "
               "(only text parts are supported)",
}
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
_PARAM_PREFIX = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*): ")


def clip(value: Any, limit: int = ECHO_CHARS) -> str:
    """repr(value) cut to `limit` characters, saying how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, (str, bytes, list, dict)) else len(text)
    return f"{text[:limit]}... ({size} long)"


def integral(value: Any) -> Any:
    """1.0 -> 1 (JSON Schema's integer allows it, and so does vLLM); anything else as is, for
    the strict int check to judge (so 1.5, "1" and true are still rejected)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def integral_list(value: Any) -> Any:
    """`integral` over a token-id list, in one pass, copying only when a float is present."""
    if type(value) is list and any(type(v) is float for v in value):
        return [integral(v) for v in value]
    return value


def integral_lists(value: Any) -> Any:
    if type(value) is list and value and type(value[0]) is list:
        return [integral_list(v) for v in value]
    return integral_list(value)


def _is_field_part(part: object) -> bool:
    if isinstance(part, int):
        return True
    text = str(part)
    return text.replace("_", "a").isalnum() and text not in _TYPE_TAGS \
        and text == text.lower()


def _branch(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The location up to and including the first union-branch tag ('list[str]', ...)."""
    for i, part in enumerate(loc):
        if not _is_field_part(part):
            return loc[:i + 1]
    return loc


def _pick(errors: list[dict[str, Any]]) -> dict[str, Any]:
    per_branch: dict[tuple[Any, ...], int] = {}
    for e in errors:
        per_branch[_branch(e["loc"])] = per_branch.get(_branch(e["loc"]), 0) + 1

    def score(e: dict[str, Any]) -> tuple[int, int, int, int]:
        fields = [p for p in e["loc"] if _is_field_part(p)]
        progress = sum(p for p in fields if isinstance(p, int))
        return (len(fields), progress, -per_branch[_branch(e["loc"])],
                0 if str(e["type"]).endswith("_type") else 1)

    return max(errors, key=score)


def _describe(error: dict[str, Any]) -> str:
    kind, msg, value = str(error["type"]), str(error["msg"]), error.get("input")
    if msg.startswith("Value error, "):
        return msg[len("Value error, "):]
    if kind == "int_type" and type(value) is float:
        return f"Input should be an integer, got {clip(value)}"
    if kind == "extra_forbidden":
        return msg
    if (kind.endswith("_type") or kind in ("literal_error", "enum")) \
            and not isinstance(value, (dict, list)):
        return f"{msg}, got {clip(value)}"
    return msg


def _json_message(error: dict[str, Any], body: bytes) -> str:
    detail = str(error.get("ctx", {}).get("error") or error["msg"])
    if "hex escape" in detail or "surrogate" in detail:
        return ("Malformed JSON body: strings must be valid Unicode; a lone UTF-16 surrogate "
                "escape (\\ud800-\\udfff without its pair) is not allowed "
                f"({detail})")
    if "recursion" in detail.lower():
        return "Malformed JSON body: nested too deeply"
    return f"Malformed JSON body: {detail}"


def validation_error_to_param_message(err: ValidationError, body: bytes = b""
                                      ) -> tuple[str | None, str]:
    """The most useful error of a ValidationError as (param, message), both naming the
    field; a model-level check's message names its field, which becomes the param."""
    errors = err.errors(include_url=False)
    if errors[0]["type"] == "json_invalid":
        return None, _json_message(errors[0], body)
    first = _pick(errors)
    parts = [str(p) for p in first["loc"] if _is_field_part(p)]
    param = ".".join(parts) or None
    if first["type"] == "extra_forbidden":
        return param, f"Unrecognized request argument supplied: {parts[-1] if parts else ''}"
    msg = _describe(first)
    if param is None:
        return param_of(msg), msg
    text = msg if msg.startswith(param) else f"{param}: {msg}"
    field = next((p for p in reversed(parts) if p in _ALLOWED), None)
    if field is not None and not all(_is_field_part(p) for p in first["loc"]):
        text += f"; {field} must be {_ALLOWED[field]}"
    return param, text


def param_of(message: str) -> str | None:
    """The field a message of the form 'field: ...' names."""
    match = _PARAM_PREFIX.match(message)
    return match.group(1) if match else None


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def int64_json(value: Any) -> Any:
    """A free-form JSON object passed on to the engine (kv_transfer_params) as is, refused when
    an integer anywhere in it is outside int64: the engine link (msgspec) cannot carry it, and
    a request must fail as a 400 naming the field, not as a 500 at the send."""
    stack = [value]
    while stack:
        item = stack.pop()
        if type(item) is int and not INT64_MIN <= item <= INT64_MAX:
            raise ValueError(f"integer {clip(item)} is outside the 64-bit range")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value
