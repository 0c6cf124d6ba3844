"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` off the answer.

DeepSeek R1/V3.1/V4 and Qwen3 write their reasoning between <think> and </think>. When the
prompt itself ends with "<think>" (a thinking-mode generation prompt) the output starts
inside the reasoning; otherwise it is reasoning only if it opens with <think>. Text after
</think> is the content (leading whitespace dropped); an output that never closes the tag
is all reasoning. Like the tool parsers this is one pure function of the text so far, and
streaming sends what is new (see tool_parsers/base.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from wideserve.entrypoints.openai.tool_parsers.partial_json import held_back

START, END = "<think>", "</think>"


@dataclass(slots=True)
class ThinkParser:
    starts_in_reasoning: bool = False

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


REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "deepseek_v31", "deepseek_v4", "qwen3")


def check_reasoning_parser(name: str) -> str:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; choose one of "
                         f"{', '.join(REASONING_PARSERS)}")
    return name


class TextDiff:
    """Sends only the new part of a string that only ever grows."""

    def __init__(self) -> None:
        self.sent = 0

    def new(self, text: str) -> str:
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out
