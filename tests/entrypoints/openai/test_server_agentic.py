"""The agentic chat surface end to end through the openai SDK, on the bundled model served
with vLLM's tool flags: tools validated (400s naming the field), tool_choice variants, the
role riding on the first streamed delta."""
from __future__ import annotations

import openai
import pytest

from oai_server_utils import RemoteServer, served
from wideserve.entrypoints.openai.serving import ApiError
from wideserve.entrypoints.openai.tools import resolve_tools

BUNDLED = "shakespeare-v4-tiny"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["Verona", "Mantua"]}},
    "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]


@pytest.fixture(scope="module")
def server(request):
    srv = RemoteServer(["--device", "cpu", "--kv-cache-memory", "64MiB",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    yield from served(request, srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "bogus"}, "tool_choice"),
    ({"tool_choice": {}}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/nowhere"}}}}}]},
     "tools[0].function.parameters"),
])
def test_bad_tools_are_400_naming_the_field(client, extra, param):
    body = {"tools": [WEATHER_TOOL], **extra}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2, **body)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_auto_needs_the_server_flags():
    with pytest.raises(ApiError, match="--enable-auto-tool-choice"):
        resolve_tools([WEATHER_TOOL], "auto", None, auto_enabled=False)
    assert resolve_tools([WEATHER_TOOL], None, None, auto_enabled=True).mode == "auto"
    assert resolve_tools(None, None, None, auto_enabled=False).mode == "none"
    assert resolve_tools([WEATHER_TOOL], "none", None, auto_enabled=False).mode == "none"


def test_auto_with_a_model_that_answers_in_text(client):
    r = client.chat.completions.create(model=BUNDLED, messages=ASK, tools=[WEATHER_TOOL],
                                       max_tokens=8, temperature=0.0)
    choice = r.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


def test_role_comes_with_the_first_content_delta(client):
    chunks = list(client.chat.completions.create(
        model=BUNDLED, messages=ASK, max_tokens=6, temperature=0.0, stream=True, n=2))
    firsts = {}
    for c in chunks:
        for ch in c.choices:
            firsts.setdefault(ch.index, ch.delta)
    assert set(firsts) == {0, 1}
    for delta in firsts.values():
        assert delta.role == "assistant" and delta.content     # no content-less role chunk
    full = client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=6,
                                          temperature=0.0)
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices if ch.index == 0)
    assert text == full.choices[0].message.content
