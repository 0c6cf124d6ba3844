"""Tool-call parsers: the model's tool-call syntax -> OpenAI `tool_calls`, whole or streamed.

A parser implements one pure function, `parse(text, final)`: what can be said for sure about
an output that so far reads `text`. Content is what precedes the first call (minus anything
that could still become a call marker); each call has a name once its name is complete, and
as much of its arguments text as is certainly part of them. Streaming (`ToolCallStream`)
re-parses the growing text and sends only what is new, so the deltas of a stream always add
up to the non-streamed answer, wherever the text was split; the tests check exactly that.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(slots=True)
class ParsedCall:
    name: str | None               # None until the name is complete
    arguments: str = ""            # certain prefix of the arguments JSON text (all when done)
    complete: bool = False


@dataclass(slots=True)
class ParseResult:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return any(c.name is not None for c in self.calls)


def trim_partial(raw: str, complete: bool) -> str:
    """A value's text: stripped when complete; while open, leading whitespace dropped and
    trailing whitespace held back (it may be the whitespace a complete value loses)."""
    return raw.strip() if complete else raw.lstrip().rstrip()


class ToolParser(ABC):
    """One per request (parsers may keep per-output state); subclasses set `name`."""
    name: ClassVar[str]
    # Strings that must survive detokenisation (the server turns skip_special_tokens off
    # when any of them is a special token of the tokenizer).
    markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParseResult:
        """What `text` says so far; with final=True, the whole output."""


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def calls_to_openai(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    return [{"id": new_call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls if c.name is not None]


class ToolCallStream:
    """Feeds deltas of one output through a parser; yields OpenAI delta fields."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self._content_sent = 0
        self._sent: list[int] = []            # arguments characters sent per call

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(new content, new tool_calls delta entries) after `delta` (final: the last one)."""
        self.text += delta
        result = self.parser.parse(self.text, final)
        content = result.content[self._content_sent:]
        self._content_sent = max(self._content_sent, len(result.content))
        out: list[dict[str, Any]] = []
        for i, call in enumerate(result.calls):
            if call.name is None:
                break
            if i == len(self._sent):
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
                self._sent.append(len(call.arguments))
            elif len(call.arguments) > self._sent[i]:
                out.append({"index": i,
                            "function": {"arguments": call.arguments[self._sent[i]:]}})
                self._sent[i] = len(call.arguments)
        return content, out

    @property
    def has_calls(self) -> bool:
        return bool(self._sent)
