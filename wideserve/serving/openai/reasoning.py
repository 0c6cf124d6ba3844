"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` off the answer.

DeepSeek R1/V3.1/V4 and Qwen3 write their reasoning between <think> and </think>. When the
prompt itself ends with "<think>" (a thinking-mode generation prompt) the output starts
inside the reasoning; otherwise it is reasoning only if it opens with <think>. Text after
</think> is the content (leading whitespace dropped); an output that never closes the tag
is all reasoning. Like the tool parsers this is one pure function of the text so far, and
streaming sends what is new (see tool_parsers/base.py).

A parser is a `ReasoningParser` registered under its `--reasoning-parser` names in
REASONING_PARSERS; `get_reasoning_parser(name)` looks one up (a ValueError names the known).
"""
from __future__ import annotations

import abc

from wideserve.serving.openai.tool_parsers.partial_json import held_back

START, END = "<think>", "</think>"


class ReasoningParser(abc.ABC):
    """One choice's reasoning/content split; a new instance per choice."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        """starts_in_reasoning: the prompt opened the reasoning (see `starts_inside`)."""
        self.starts_in_reasoning = starts_in_reasoning

    @classmethod
    @abc.abstractmethod
    def starts_inside(cls, prompt: str) -> bool:
        """Whether a generation from `prompt` starts inside the reasoning."""

    @abc.abstractmethod
    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far, as far as `text` says for sure;
        final: the output is complete (nothing held back)."""


class ThinkParser(ReasoningParser):
    """Reasoning between <think> and </think> (DeepSeek R1/V3.x/V4, Qwen3)."""

    @classmethod
    def starts_inside(cls, prompt: str) -> bool:
        return prompt.rstrip().endswith(START)

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) as far as text says for sure."""
        i = 0
        if not self.starts_in_reasoning:
            stripped = text.lstrip()
            if stripped.startswith(START):
                i = len(text) - len(stripped) + len(START)
            elif not final and START.startswith(stripped):
                return "", ""                        # may still become <think>
            else:
                return "", text if final else text.rstrip()
        end = text.find(END, i)
        if end < 0:
            rest = text[i:]
            return (rest if final else rest[:len(rest) - held_back(rest, END)]), ""
        return text[i:end], text[end + len(END):].lstrip()


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    name: ThinkParser
    for name in ("deepseek_r1", "deepseek_v3", "deepseek_v31", "deepseek_v4", "qwen3")}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; choose one of "
                         f"{', '.join(REASONING_PARSERS)}") from None


class TextDiff:
    """Sends only the new part of a string that only ever grows."""

    def __init__(self) -> None:
        self.sent = 0

    def new(self, text: str) -> str:
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out
