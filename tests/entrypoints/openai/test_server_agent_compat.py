"""What an agent does on its second turn, through the real openai SDK, on the bundled model:
the SDK's own message objects appended to `messages` (streamed and not, with `parsed` and
`parsed_arguments` from the SDK's stream helper), every field OpenAI or the SDKs echo,
unknown fields accepted and named in a header, legacy function calling, and the newer
knobs (reasoning_effort "none", continuous usage). One server for the module."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from oai_server_utils import RemoteServer, served

BUNDLED = "shakespeare-v4-tiny"
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The hour", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["Verona", "Mantua"]}},
    "required": ["tz"], "additionalProperties": False}}}
HEADER = "x-wideserve-ignored-fields"


@pytest.fixture(scope="module")
def server(request):
    srv = RemoteServer(["--device", "cpu", "--kv-cache-memory", "64MiB",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "deepseek_r1"], log_level="info")
    yield from served(request, srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _turn(client, messages, stream: bool, **kw):
    """One turn; returns the SDK's message object, as an agent would append it."""
    if not stream:
        r = client.chat.completions.create(model=BUNDLED, messages=messages, **kw)
        return r.choices[0].message, r.choices[0].finish_reason
    with client.chat.completions.stream(model=BUNDLED, messages=messages, **kw) as s:
        final = s.get_final_completion()          # ParsedChatCompletionMessage: `parsed`, ...
    return final.choices[0].message, final.choices[0].finish_reason


# Later turns answer from a closed set, so they end with "stop" (the SDK's stream helper
# refuses a reply cut by max_tokens).
ANSWER = {"guided_choice": ["It is midnight.", "It is noon."]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_sdk_agent_loop_appends_its_own_messages(client, stream):
    messages: list = [{"role": "user", "content": "What hour is it in Verona?"}]
    msg, finish = _turn(client, messages, stream, tools=[CLOCK], tool_choice="required",
                        parallel_tool_calls=False, max_tokens=100, temperature=0.0)
    assert finish == "tool_calls" and msg.tool_calls[0].function.name == "clock"
    messages.append(msg)                                       # turn 2 carries the echo
    messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                     "content": "midnight"})
    msg, finish = _turn(client, messages, stream, tools=[CLOCK], max_tokens=20,
                        temperature=0.0, extra_body=ANSWER)
    assert finish == "stop" and msg.content in ANSWER["guided_choice"]
    messages.append(msg)
    messages.append({"role": "user", "content": "And in Mantua?"})
    msg, finish = _turn(client, messages, stream, tools=[CLOCK], max_tokens=20,
                        extra_body=ANSWER)
    assert finish == "stop" and msg.content in ANSWER["guided_choice"]


def test_every_echoed_field_is_accepted(server, client):
    echoed = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
              "audio": None, "function_call": None, "parsed": None, "reasoning": "hmm",
              "reasoning_content": "hmm", "cache_control": {"type": "ephemeral"},
              "tool_calls": [{"id": "c1", "type": "function", "index": 0, "function": {
                  "name": "clock", "arguments": "{\"tz\": \"Verona\"}",
                  "parsed_arguments": {"tz": "Verona"}}}]}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hour?",
                                              "cache_control": {"type": "ephemeral"}}]},
                echoed, {"role": "tool", "tool_call_id": "c1", "content": "midnight"},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                {"role": "user", "content": "Again?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=BUNDLED, messages=messages, max_tokens=2, tools=[CLOCK])
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    assert HEADER not in raw.headers                  # known echoes are not "unknown"


def test_unknown_fields_are_accepted_warned_once_and_named_in_a_header(server, client):
    for _ in range(2):
        raw = client.chat.completions.with_raw_response.create(
            model=BUNDLED, max_tokens=2, extra_body={"frobnicate_xyz": 1},
            messages=[{"role": "user", "content": "Hi", "mood": "happy"}])
        assert raw.headers[HEADER] == "frobnicate_xyz, messages.0.mood"
    raw = client.completions.with_raw_response.create(model=BUNDLED, prompt="Hi", max_tokens=2,
                                                      extra_body={"frobnicate_xyz": 1})
    assert raw.headers[HEADER] == "frobnicate_xyz"
    log = server.read_output()
    assert log.count("'frobnicate_xyz' is not known") == 1
    assert log.count("'messages.*.mood' is not known") == 1


def test_legacy_functions(client):
    fn = CLOCK["function"]
    r = client.chat.completions.create(
        model=BUNDLED, max_tokens=60, temperature=0.0, functions=[fn],
        function_call={"name": "clock"},
        messages=[{"role": "user", "content": "What hour is it?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls
    assert choice.message.function_call.name == "clock"
    assert json.loads(choice.message.function_call.arguments)["tz"] in ("Verona", "Mantua")
    chunks = list(client.chat.completions.create(
        model=BUNDLED, max_tokens=60, temperature=0.0, functions=[fn], stream=True,
        function_call={"name": "clock"}, messages=[{"role": "user", "content": "Hour?"}]))
    args = "".join(c.choices[0].delta.function_call.arguments or "" for c in chunks
                   if c.choices and c.choices[0].delta.function_call)
    assert args == choice.message.function_call.arguments
    assert chunks[-1].choices[0].finish_reason == "function_call"
    # The next turn, in the legacy spelling: the assistant's function_call and a function
    # message with its result.
    r = client.chat.completions.create(model=BUNDLED, max_tokens=4, functions=[fn],
                                       function_call="none", messages=[
        {"role": "user", "content": "What hour is it?"},
        {"role": "assistant", "content": None,
         "function_call": {"name": "clock", "arguments": "{\"tz\": \"Verona\"}"}},
        {"role": "function", "name": "clock", "content": "midnight"}])
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="functions"):
        client.chat.completions.create(model=BUNDLED, max_tokens=2, functions=[fn],
                                       tools=[CLOCK], messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "high", "xhigh"])
def test_reasoning_effort_values(client, effort):
    r = client.chat.completions.create(model=BUNDLED, max_completion_tokens=2,
                                       reasoning_effort=effort, parallel_tool_calls=False,
                                       messages=[{"role": "user", "content": "Hi"}])
    assert r.usage.completion_tokens <= 2


def test_continuous_usage_stats(client):
    chunks = list(client.chat.completions.create(
        model=BUNDLED, max_completion_tokens=5, stream=True, temperature=0.0,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        messages=[{"role": "user", "content": "Hi"}]))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 == chunks[-1].usage.completion_tokens


def test_wrong_model_is_404(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "gpt-17", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
