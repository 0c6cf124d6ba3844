"""Replies to a request in OpenAI's legacy function-calling spelling (`functions` /
`function_call`, protocol.legacy_functions): the reply carries one `function_call` {name,
arguments} instead of `tool_calls`, and finish_reason "function_call", as OpenAI answered
before tools existed (the legacy API has one call per turn)."""
from __future__ import annotations

from typing import Any


def legacy_message(message: dict[str, Any], finish: str | None
                   ) -> tuple[dict[str, Any], str | None]:
    calls = message.pop("tool_calls", None)
    if not calls:
        return message, finish
    message["function_call"] = dict(calls[0]["function"])
    return message, "function_call" if finish == "tool_calls" else finish


def legacy_delta(delta: dict[str, Any], finish: str | None
                 ) -> tuple[dict[str, Any], str | None]:
    """A streamed delta: the first call's name and argument pieces as `function_call`."""
    calls = delta.pop("tool_calls", None)
    if calls:
        first = [c for c in calls if c.get("index", 0) == 0]
        if first:
            fn = first[0].get("function") or {}
            delta["function_call"] = {k: fn[k] for k in ("name", "arguments") if k in fn}
    return delta, "function_call" if finish == "tool_calls" else finish
