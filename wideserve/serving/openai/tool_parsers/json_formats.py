"""Tool calls written as JSON objects: Hermes/Qwen (`<tool_call>{...}</tool_call>`) and
Llama 3 (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several
separated by `;`)."""
from __future__ import annotations

import json

from wideserve.serving.openai.tool_parsers.base import (ParsedCall, ParseResult, ToolParser,
                                                        trim_partial)
from wideserve.serving.openai.tool_parsers.partial_json import held_back, object_members, skip_ws

_ARG_KEYS = ("arguments", "parameters")


def call_from_object(text: str, i: int, limit: int, closed: bool) -> tuple[ParsedCall, int | None]:
    """The call in the JSON object at text[i] (text[:limit] is all of it that belongs to the
    call); closed: nothing more will be written into it. Returns the call and the object's end."""
    body = text[:limit]
    members, end = object_members(body, i)
    name = None
    args_raw, args_done = "", False
    for m in members:
        if m.key == "name" and m.end is not None:
            try:
                value = json.loads(body[m.start:m.end])
            except json.JSONDecodeError:
                value = None
            name = value if isinstance(value, str) else None
        elif m.key in _ARG_KEYS and not args_raw:
            args_done = m.end is not None or closed
            args_raw = body[m.start:m.end if m.end is not None else limit]
    complete = end is not None or closed
    if complete and not args_raw:
        args_raw, args_done = "{}", True
    return ParsedCall(name, trim_partial(args_raw, args_done), complete), end


class HermesToolParser(ToolParser):
    """Hermes 2 Pro / Qwen 2.5+: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN, CLOSE)

    def parse(self, text: str, final: bool) -> ParseResult:
        start = text.find(self.OPEN)
        if start < 0:
            if final:
                return ParseResult(text)
            return ParseResult(text[:len(text) - held_back(text, self.OPEN)].rstrip())
        result = ParseResult(text[:start].rstrip())
        pos = start
        while True:
            pos = text.find(self.OPEN, pos)
            if pos < 0:
                break
            body = pos + len(self.OPEN)
            close = text.find(self.CLOSE, body)
            closed = close >= 0 or final
            limit = close if close >= 0 else len(text)
            if close < 0 and not final:
                limit -= held_back(text[body:], self.CLOSE)
            i = skip_ws(text, body)
            if i >= limit or text[i] != "{":
                if closed and i < limit:
                    pos = limit            # not a JSON object: skip this block
                    continue
                break
            call, _ = call_from_object(text, i, limit, closed)
            result.calls.append(call)
            if close < 0 or call.name is None:
                break
            pos = close + len(self.CLOSE)
        return result


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calls: the whole output is the call(s)."""
    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or self.TAG.startswith(rest)):
            return ParseResult("")
        if rest.startswith(self.TAG):
            i = skip_ws(text, i + len(self.TAG))
        elif not rest.startswith("{"):
            return ParseResult(text if final else text.rstrip())
        return ParseResult("", _calls_from(text, i, ";", final))


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the output (constrained to the function's parameters
    schema) is that call's arguments. Made per request, not chosen by flag."""
    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> ParseResult:
        return ParseResult("", [ParsedCall(self.function, trim_partial(text, final), final)])


class RequiredCallsParser(ToolParser):
    """tool_choice "required": the output (constrained) is `[{"name": ..., "parameters":
    {...}}, ...]`."""
    name = "required"

    def parse(self, text: str, final: bool) -> ParseResult:
        result = ParseResult("")
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return result
        result.calls = _calls_from(text, skip_ws(text, i + 1), ",", final)
        return result


def _calls_from(text: str, i: int, sep: str, final: bool) -> list[ParsedCall]:
    """The JSON call objects from text[i:], separated by `sep`; stops at the first partial
    object or missing separator (shared by the Llama 3 and "required" formats)."""
    calls: list[ParsedCall] = []
    while i < len(text) and text[i] == "{":
        call, end = call_from_object(text, i, len(text), final)
        calls.append(call)
        if end is None or call.name is None:
            break
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != sep:
            break
        i = skip_ws(text, i + 1)
    return calls
