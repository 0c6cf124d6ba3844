"""DeepSeek tool-call formats.

V3.1 (special tokens of the tokenizer):
  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
V3.2 and V4 (DSML markup; `｜DSML｜` is a token of the V4 tokenizer, which V3.1's lacks):
  <｜DSML｜function_calls>
  <｜DSML｜invoke name="NAME">
  <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>
  </｜DSML｜invoke>
  </｜DSML｜function_calls>
  string="true" values are raw text (JSON-quoted here); string="false" ones are JSON.
"""
from __future__ import annotations

import json
import re

from wideserve.serving.openai.tool_parsers.base import (ParsedCall, ParseResult, ToolParser,
                                                        trim_partial)
from wideserve.serving.openai.tool_parsers.partial_json import held_back


def _content_before(text: str, marker: str, final: bool) -> tuple[str, int]:
    start = text.find(marker)
    if start >= 0:
        return text[:start].rstrip(), start
    if final:
        return text, -1
    return text[:len(text) - held_back(text, marker)].rstrip(), -1


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"
    BEGIN, CALL, SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
    END, ALL_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
    markers = (BEGIN, CALL, SEP, END, ALL_END)

    def parse(self, text: str, final: bool) -> ParseResult:
        content, start = _content_before(text, self.BEGIN, final)
        result = ParseResult(content)
        pos = start
        while pos >= 0:
            pos = text.find(self.CALL, pos)
            if pos < 0:
                break
            sep = text.find(self.SEP, pos)
            if sep < 0:
                break                                   # the name is still being written
            name = text[pos + len(self.CALL):sep].strip()
            a0 = sep + len(self.SEP)
            end = text.find(self.END, a0)
            done = end >= 0 or final
            raw = text[a0:end if end >= 0 else len(text)]
            if not done:
                raw = raw[:len(raw) - held_back(raw, self.END)]
            result.calls.append(ParsedCall(name, trim_partial(raw, done), done))
            if end < 0:
                break
            pos = end + len(self.END)
        return result


_PARAM = re.compile(r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)'
                    r'</｜DSML｜parameter>', re.DOTALL)


class DeepSeekDSMLToolParser(ToolParser):
    name = "deepseek_v32"
    OPEN = "<｜DSML｜function_calls>"
    INVOKE, INVOKE_END = '<｜DSML｜invoke name="', "</｜DSML｜invoke>"
    markers = ("｜DSML｜",)

    def parse(self, text: str, final: bool) -> ParseResult:
        content, start = _content_before(text, self.OPEN, final)
        result = ParseResult(content)
        pos = start
        while pos >= 0:
            pos = text.find(self.INVOKE, pos)
            if pos < 0:
                break
            n0 = pos + len(self.INVOKE)
            n1 = text.find('">', n0)
            if n1 < 0:
                break
            end = text.find(self.INVOKE_END, n1)
            done = end >= 0 or final
            body = text[n1 + 2:end if end >= 0 else len(text)]
            parts = [f"{json.dumps(k, ensure_ascii=False)}: "
                     f"{json.dumps(v, ensure_ascii=False) if s == 'true' else v.strip()}"
                     for k, s, v in _PARAM.findall(body)]
            args = "{" + ", ".join(parts) + ("}" if done else "")
            # While open, a parameter still to come adds ", ..." after the last one.
            result.calls.append(ParsedCall(text[n0:n1], trim_partial(args, done), done))
            if end < 0:
                break
            pos = end + len(self.INVOKE_END)
        return result


class DeepSeekV4ToolParser(DeepSeekDSMLToolParser):
    name = "deepseek_v4"
