"""Anthropic's Messages API end to end through the real `anthropic` SDK, on the bundled model:
a three-turn tool loop (streamed and not; forced calls keep the tiny model's calls certain),
the exact streamed event sequence, thinking mapped to the model's reasoning, stop sequences,
count_tokens, Anthropic error shapes and statuses, and x-api-key auth beside Bearer.

The translation itself (blocks -> chat messages, tool_choice, stop reasons, block events) is
checked without a server at the end."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from oai_server_utils import RemoteServer, served
from wideserve.serving.anthropic import convert
from wideserve.serving.anthropic.protocol import MessagesRequest
from wideserve.serving.anthropic.serving import BlockWriter
from wideserve.worker.model_loader import BUNDLED_MODEL

MODEL = "shakespeare-v4-tiny"
KEY = "sk-anthropic-test"
CITIES = ["Verona", "Mantua", "Padua"]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": CITIES}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Verona?"}]
# The SDK (2.x) no longer has sampling arguments; older SDKs and Claude Code send them.
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    # The bundled template, plus DeepSeek's thinking switch: `thinking` opens a <think> block.
    template = json.loads((BUNDLED_MODEL / "tokenizer_config.json").read_text())["chat_template"]
    end = "{{ '<|assistant|>' }}{% endif %}"
    assert template.endswith(end)
    template = template[:-len(end)] + ("{{ '<|assistant|>' }}{% if thinking is defined and "
                                       "thinking %}{{ '<think>' }}{% endif %}{% endif %}")
    path = tmp_path_factory.mktemp("anthropic") / "thinking.jinja"
    path.write_text(template)
    srv = RemoteServer(["--device", "cpu", "--kv-cache-memory", "64MiB", "--api-key", KEY,
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "deepseek_r1", "--chat-template", str(path)])
    yield from served(request, srv)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _tool_turns(client, stream: bool) -> list:
    """Three turns: two forced calls (named, then any), each answered with a tool_result,
    then a plain answer. Returns each turn's final Message."""
    messages, finals = list(ASK), []
    choices = [{"type": "tool", "name": "get_weather"},
               {"type": "any", "disable_parallel_tool_use": True}, {"type": "none"}]
    for turn, choice in enumerate(choices):
        kwargs = dict(model=MODEL, max_tokens=40, messages=messages, tools=[WEATHER],
                      tool_choice=choice, extra_body=GREEDY)
        if stream:
            with client.messages.stream(**kwargs) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        finals.append(message)
        if choice["type"] == "none":
            assert [b.type for b in message.content] == ["text"]
            assert message.stop_reason in ("end_turn", "max_tokens")
            break
        assert message.stop_reason == "tool_use"
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert use.name == "get_weather" and use.input["city"] in CITIES
        assert use.id.startswith("toolu_")
        messages.append({"role": "assistant", "content": message.content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id,
             "content": f"Sunny in {use.input['city']}, turn {turn}"}]})
    return finals


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_three_turn_tool_loop(client, stream):
    finals = _tool_turns(client, stream)
    assert len(finals) == 3
    # Each turn's prompt holds the previous turns: the tool results flowed back in.
    inputs = [m.usage.input_tokens + m.usage.cache_read_input_tokens for m in finals]
    assert inputs[0] < inputs[1] < inputs[2]
    # ...and the prefix cache saw the shared start of the conversation.
    assert finals[2].usage.cache_read_input_tokens > 0


def test_tool_results_reach_the_prompt(client):
    base = ASK + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Verona"}}]}]

    def count(result: str) -> int:
        return client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=base + [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": result}]}]).input_tokens

    assert count("Sunny. " * 20) > count("Sunny.") + 20


def _events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    out = []
    for chunk in raw.strip().split("\n\n"):
        name, data = chunk.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}"
        out.append(payload)
    return out


def test_streamed_event_sequence(server):
    events = _events(server, {"model": MODEL, "max_tokens": 40, "messages": ASK,
                              "tools": [WEATHER], "temperature": 0.0,
                                  "tool_choice": {"type": "tool", "name": "get_weather"}})
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start["role"] == "assistant" and start["content"] == [] and start["id"].startswith(
        "msg_") and start["usage"]["input_tokens"] > 0
    assert events[2]["content_block"]["type"] == "tool_use" and events[2]["index"] == 0
    partial = "".join(e["delta"]["partial_json"] for e in events[3:-3])
    assert {e["delta"]["type"] for e in events[3:-3]} == {"input_json_delta"}
    assert json.loads(partial)["city"] in CITIES
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_maps_to_reasoning(client, server, stream):
    body = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    on = {"type": "enabled", "budget_tokens": 1024}
    if stream:
        events = _events(server, {"model": MODEL, "max_tokens": 12, "messages": ASK,
                                  "thinking": on})
        assert events[2]["content_block"] == {"type": "thinking", "thinking": "",
                                              "signature": ""}
        assert {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"} \
            == {"thinking_delta"}
        with client.messages.stream(**body, thinking=on) as s:
            thought = s.get_final_message()
    else:
        thought = client.messages.create(**body, thinking=on)
    # Without a </think> from the tiny model, everything it wrote is reasoning.
    assert [b.type for b in thought.content] == ["thinking"] and thought.content[0].thinking
    plain = client.messages.create(**body, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"]


def test_system_stop_sequences_and_sampling(client):
    r = client.messages.create(model=MODEL, max_tokens=60, messages=ASK,
                               system=[{"type": "text", "text": "You are terse.",
                                        "cache_control": {"type": "ephemeral"}}],
                               stop_sequences=[" "], metadata={"user_id": "u-1"},
                               extra_body={"temperature": 0.0, "top_k": 5, "top_p": 0.9})
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " "
    assert r.content[0].type == "text" and " " not in r.content[0].text
    longer = client.messages.create(model=MODEL, max_tokens=3, messages=ASK, system="S " * 30)
    assert longer.stop_reason == "max_tokens" and longer.usage.output_tokens == 3


def test_output_config_format_is_structured_output(client):
    schema = {"type": "object", "properties": {"city": {"enum": CITIES}},
              "required": ["city"], "additionalProperties": False}
    r = client.messages.create(model=MODEL, max_tokens=40, messages=ASK,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": schema},
                                              "effort": "low"})
    assert r.stop_reason == "end_turn"
    assert json.loads(r.content[0].text)["city"] in CITIES


def test_count_tokens_matches_usage(client):
    kwargs = dict(model=MODEL, messages=ASK, system="Be brief.", tools=[WEATHER])
    counted = client.messages.count_tokens(**kwargs).input_tokens
    used = client.messages.create(max_tokens=2, **kwargs,
                                  tool_choice={"type": "none"}).usage
    assert counted == used.input_tokens + used.cache_read_input_tokens


@pytest.mark.parametrize("body,status,kind,needle", [
    ({"messages": ASK}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 5, "messages": ASK, "bogus": 1}, 400, "invalid_request_error", "bogus"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": ""}}]}]},
     400, "invalid_request_error", "takes no image inputs"),
    ({"max_tokens": 5, "messages": ASK, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "server tools"),
    ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    ({"max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"max_tokens": 100000, "messages": ASK}, 400, "invalid_request_error",
     "maximum context length"),
])
def test_errors_have_anthropics_shape(server, body, status, kind, needle):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, **body},
                   headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == status
    assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()[
        "error"]["message"]}}
    assert needle in r.json()["error"]["message"]


def test_sdk_raises_its_own_exceptions(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises((anthropic.NotFoundError, anthropic.BadRequestError)) as e:
        client.messages.create(model="claude-nope", max_tokens=5, messages=ASK)
    assert "claude-nope" in e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] == convert.ERROR_TYPES[e.value.status_code]


def test_auth_x_api_key_beside_bearer(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model=MODEL, messages=ASK)
    # Bearer works on /v1/messages, x-api-key on the OpenAI routes.
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, api_key=None,
                                 max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=2, messages=ASK).content
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0,
                        default_headers={"x-api-key": KEY})
    assert oai.chat.completions.create(model=MODEL, max_tokens=2, messages=ASK).choices
    # Without any key: the OpenAI routes keep OpenAI's error shape.
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


# ----------------------------------------------------------------------------- no server

def test_blocks_become_chat_messages():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "stop_sequences": ["END"],
        "metadata": {"user_id": "u"},
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "let me look"},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Verona"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}]},
                {"type": "text", "text": "thanks"}]},
            {"role": "assistant", "content": "The weather is"}]})
    body = convert.chat_request_body(req)
    assert body["messages"] == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "hmm",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Verona"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "The weather is"}]
    assert body["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER["input_schema"]}}]
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["continue_final_message"] and not body["add_generation_prompt"]
    assert body["chat_template_kwargs"]["thinking"] is True
    assert body["stop"] == ["END"] and body["user"] == "u" and body["max_tokens"] == 5


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice_mapping(choice, expected):
    req = MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": ASK,
                                          "tools": [WEATHER], "tool_choice": choice})
    assert convert.chat_request_body(req)["tool_choice"] == expected


def test_stop_reasons_and_usage():
    assert convert.stop_reason("length", None, True, None) == ("max_tokens", None)
    assert convert.stop_reason("stop", None, True, None) == ("tool_use", None)
    assert convert.stop_reason("stop", "END", False, ["END"]) == ("stop_sequence", "END")
    assert convert.stop_reason("stop", 1, False, ["END"]) == ("end_turn", None)
    assert convert.usage(100, 7, 64) == {"input_tokens": 36, "output_tokens": 7,
                                         "cache_creation_input_tokens": 0,
                                         "cache_read_input_tokens": 64}
    assert convert.error_body(503, "x")["error"]["type"] == "overloaded_error"
    assert convert.tool_input('{"a": 1}') == {"a": 1}
    assert convert.tool_input("not json") == {"arguments": "not json"}


def test_block_writer_opens_and_closes_blocks():
    w = BlockWriter()
    lines = (w.feed({"reasoning_content": "r1"}) + w.feed({"reasoning_content": "r2"})
             + w.feed({"content": "hi"})
             + w.feed({"tool_calls": [{"index": 0, "id": "c0", "function": {
                 "name": "f", "arguments": '{"a"'}}]})
             + w.feed({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]})
             + w.feed({"tool_calls": [{"index": 1, "id": "c1", "function": {
                 "name": "g", "arguments": ""}}]})
             + w.close() + w.close())
    events = [json.loads(line.split("data: ", 1)[1]) for line in lines]
    summary = [(e["type"], e["index"], (e.get("content_block") or e.get("delta") or {})
                .get("type")) for e in events]
    assert summary == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_stop", 3, None)]
    assert events[7]["content_block"]["name"] == "f" and events[7]["content_block"]["input"] == {}


def test_stream_errors_are_anthropic_error_events():
    from wideserve.serving.engine_client import EngineDeadError
    from wideserve.serving.anthropic.serving import _error_event
    from wideserve.serving.openai.async_engine import RequestFailed

    def parsed(error: BaseException) -> dict:
        name, data = _error_event(error).strip().split("\n")
        assert name == "event: error"
        return json.loads(data.removeprefix("data: "))

    assert parsed(EngineDeadError("gone")) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "The engine is not available: gone"}}
    assert parsed(RequestFailed("too long"))["error"]["type"] == "invalid_request_error"
    assert parsed(RequestFailed("step failed", internal=True))["error"]["type"] == "api_error"
