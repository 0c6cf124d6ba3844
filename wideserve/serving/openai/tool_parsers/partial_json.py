"""Just enough JSON scanning to stream tool calls out of text that is still being written.

The parsers never re-serialise what the model wrote: a call's `arguments` is the model's own
JSON text, sliced out of the output. So the streamed deltas concatenate to exactly the
arguments a non-streamed response reports (the OpenAI SDK assembles a call by concatenating
`function.arguments` deltas), which re-serialising a partial parse could not promise.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\r\n"
_OPEN = {"{": "}", "[": "]"}


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if the text ends
    inside it. Only the structure is checked (strings, escapes, bracket nesting)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in _OPEN:
        stack = [_OPEN[c]]
        j = i + 1
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _OPEN:
                stack.append(_OPEN[c])
            elif c in "}]":
                if not stack or c != stack.pop():
                    return j + 1 if not stack else None
                if not stack:
                    return j + 1
            j += 1
        return None
    j = i                                      # number, true, false, null
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


@dataclass(slots=True)
class Member:
    key: str
    start: int                 # where the value starts
    end: int | None            # where it ends; None while it is still being written


def object_members(text: str, i: int) -> tuple[list[Member], int | None]:
    """The members of the object whose '{' is at text[i], as far as the text goes, and the
    end of the object (None while it is open)."""
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return members, j + 1
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        kend = _string_end(text, j) if text[j] == '"' else None
        if kend is None:
            return members, None
        try:
            key = json.loads(text[j:kend])
        except json.JSONDecodeError:
            return members, None
        j = skip_ws(text, kend)
        if j >= len(text) or text[j] != ":":
            return members, None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return members, None
        end = value_end(text, j)
        members.append(Member(key, j, end))
        if end is None:
            return members, None
        j = skip_ws(text, end)
    return members, None


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: characters
    that may yet turn out to start the marker, so a stream must not emit them yet."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
