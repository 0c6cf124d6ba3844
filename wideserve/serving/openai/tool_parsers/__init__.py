"""Tool-call parsers, chosen by name as vLLM's `--tool-call-parser NAME` does."""
from __future__ import annotations

from wideserve.serving.openai.tool_parsers.base import (ParsedCall, ParseResult, ToolCallStream,
                                                        ToolParser, calls_to_openai)
from wideserve.serving.openai.tool_parsers.deepseek import (DeepSeekDSMLToolParser,
                                                            DeepSeekV4ToolParser,
                                                            DeepSeekV31ToolParser)
from wideserve.serving.openai.tool_parsers.json_formats import (HermesToolParser,
                                                                Llama3JsonToolParser)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, DeepSeekV31ToolParser,
                              DeepSeekDSMLToolParser, DeepSeekV4ToolParser)}
# vLLM's other spellings of the same formats.
TOOL_PARSERS["qwen"] = HermesToolParser
TOOL_PARSERS["llama4_json"] = Llama3JsonToolParser


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; choose one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ParseResult", "ParsedCall", "ToolCallStream", "ToolParser",
           "calls_to_openai", "get_tool_parser"]
