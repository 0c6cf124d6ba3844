"""Tool-call parsers on recorded model outputs: whole, and streamed split at every position
(and one character at a time), assembled as the OpenAI SDK assembles deltas."""
from __future__ import annotations

import json

import pytest

from wideserve.serving.openai.tool_parsers import (TOOL_PARSERS, ToolCallStream, calls_to_openai,
                                                   get_tool_parser)

WEATHER = {"city": "Verona", "days": 3, "units": {"temp": "C", "wind": ["km/h"]},
           "note": "quote \" brace } and <tag> \\ ü"}
W = json.dumps(WEATHER, ensure_ascii=False)

RECORDED = {
    "hermes": [
        ("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": " + W +
         "}\n</tool_call>", "Let me check.", [("get_weather", W)]),
        ("<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
         "<tool_call>\n{\"arguments\": {\"y\": [1, 2]}, \"name\": \"b\"}\n</tool_call>",
         "", [("a", '{"x": 1}'), ("b", '{"y": [1, 2]}')]),
        ("<tool_call>{\"name\": \"noargs\"}</tool_call>", "", [("noargs", "{}")]),
        ("No tools needed: 1 < 2 and <tool_ is not a call.", None, []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": ' + W + "}", "", [("get_weather", W)]),
        ('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
         "", [("a", '{"x": 1}'), ("b", "{}")]),
        ("Plain answer {with braces}.", None, []),
    ],
    "deepseek_v31": [
        ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" + W +
         "<｜tool▁call▁end｜><｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
         "<｜tool▁calls▁end｜>", "Checking.", [("get_weather", W), ("b", "{}")]),
        ("Just text <｜tool", None, []),
    ],
    "deepseek_v4": [
        ("I will look.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
         "<｜DSML｜parameter name=\"city\" string=\"true\">Verona \"old\"</｜DSML｜parameter>\n"
         "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
         "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"now\">\n</｜DSML｜invoke>\n"
         "</｜DSML｜function_calls>", "I will look.",
         [("get_weather", '{"city": "Verona \\"old\\"", "days": 3}'), ("now", "{}")]),
    ],
}


def assemble(parser_cls, pieces: list[str]) -> tuple[str, list[tuple[str, str]], set[str]]:
    """Feed the pieces as a stream; rebuild content and calls the way the SDK does."""
    stream = ToolCallStream(parser_cls())
    content, calls, ids = "", {}, set()
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, final=k == len(pieces) - 1)
        content += text
        for d in deltas:
            if d["index"] not in calls:
                assert d["id"] and d["type"] == "function" and d["function"]["name"]
                assert d["index"] == len(calls), "calls must arrive in order"
                ids.add(d["id"])
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]][1] += d["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())], ids


CASES = [(name, *case) for name, cases in RECORDED.items() for case in cases]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_whole_output(name, text, content, calls):
    result = get_tool_parser(name)().parse(text, final=True)
    assert result.content == (text if content is None else content)
    got = [(c["function"]["name"], c["function"]["arguments"])
           for c in calls_to_openai(result.calls)]
    assert got == calls
    for _, args in got:
        json.loads(args)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_split_anywhere_assembles_to_the_whole(name, text, content, calls):
    parser = get_tool_parser(name)
    whole = parser().parse(text, final=True)
    expect_calls = [(c.name, c.arguments) for c in whole.calls if c.name is not None]
    for cut in range(len(text) + 1):
        got_content, got_calls, _ = assemble(parser, [text[:cut], text[cut:]])
        assert (got_content, got_calls) == (whole.content, expect_calls), cut
    got_content, got_calls, ids = assemble(parser, list(text) + [""])
    assert (got_content, got_calls) == (whole.content, expect_calls)
    assert len(ids) == len(expect_calls)


def test_markers_are_never_streamed_as_content():
    parser = get_tool_parser("hermes")
    content, calls, _ = assemble(parser, ["Sure. <tool", "_call>{\"name\": \"f\", ",
                                          "\"arguments\": {}}</tool_call>"])
    assert content == "Sure." and calls == [("f", "{}")]


def test_unknown_parser_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match="--tool-call-parser.*hermes"):
        get_tool_parser("nope")
    assert {"hermes", "llama3_json", "deepseek_v31", "deepseek_v32", "deepseek_v4"} <= set(TOOL_PARSERS)
