"""The agentic chat surface end to end through the openai SDK, on the bundled model served
with vLLM's tool flags: tools validated (400s naming the field), tool_choice variants, the
role riding on the first streamed delta, structured outputs in every spelling (outputs
validated with jsonschema), forced tool calls, and auto calls parsed whole and streamed (the
SDK's own stream assembly)."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from oai_server_utils import RemoteServer, served
from wideserve.serving.openai.serving import ApiError
from wideserve.serving.openai.tools import resolve_tools

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
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--reasoning-parser", "deepseek_r1"])
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


# ---- structured outputs and forced tool calls ---------------------------------------------

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "age"], "additionalProperties": False}
HERMES_CALLS = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Verona|Mantua)"\}'
                r'\}</tool_call><tool_call>\{"name": "clock", "arguments": \{"tz": '
                r'"(Verona|Mantua)"\}\}</tool_call>')


def _streamed(client, **kw):
    """The SDK's own assembly of a streamed completion (deltas, tool-call arguments)."""
    with client.chat.completions.stream(model=BUNDLED, **kw) as stream:
        return stream.get_final_completion()


def test_response_format_json_schema_whole_and_streamed(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                 "strict": True}}
    full = client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=48,
                                          temperature=0.0, response_format=rf)
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
    streamed = _streamed(client, messages=ASK, max_tokens=48, temperature=0.0,
                         response_format=rf)
    assert streamed.choices[0].message.content == full.choices[0].message.content
    obj = client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=48,
                                         temperature=0.0, response_format={"type": "json_object"},
                                         extra_body={"max_tokens": 48})
    assert obj.choices[0].finish_reason == "length" or \
        isinstance(json.loads(obj.choices[0].message.content), dict)


def test_vllm_spellings_regex_choice_and_guided_aliases(client):
    r = client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=8,
                                       temperature=0.0,
                                       extra_body={"structured_outputs": {"choice": ["yea", "nay"]}})
    assert r.choices[0].message.content in ("yea", "nay")
    r = client.completions.create(model=BUNDLED, prompt="ROMEO:", max_tokens=12, temperature=0.0,
                                  extra_body={"guided_regex": r"[A-Z][a-z]{2,5}!"})
    assert re.fullmatch(r"[A-Z][a-z]{2,5}!", r.choices[0].text)
    r = client.completions.create(model=BUNDLED, prompt="ROMEO:", max_tokens=48, temperature=0.0,
                                  extra_body={"guided_json": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
])
def test_bad_constraints_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param


def _calls(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice_guarantee_valid_calls(client, stream):
    make = (lambda **kw: _streamed(client, **kw)) if stream else \
        (lambda **kw: client.chat.completions.create(model=BUNDLED, **kw))
    named = make(messages=ASK, tools=[WEATHER_TOOL, CLOCK_TOOL], max_tokens=40, temperature=0.0,
                 tool_choice={"type": "function", "function": {"name": "clock"}})
    ((name, args),) = _calls(named.choices[0].message)
    assert name == "clock" and named.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(args, CLOCK_TOOL["function"]["parameters"])
    required = make(messages=ASK, tools=[WEATHER_TOOL, CLOCK_TOOL], max_tokens=60,
                    temperature=0.0, tool_choice="required", parallel_tool_calls=False)
    ((name, args),) = _calls(required.choices[0].message)
    tool = {"get_weather": WEATHER_TOOL, "clock": CLOCK_TOOL}[name]
    jsonschema.validate(args, tool["function"]["parameters"])
    assert required.choices[0].message.content is None


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_parallel_hermes_calls(client, stream):
    # The regex makes the tiny model write two Hermes calls; the server's parser reads them.
    kw = dict(messages=ASK, tools=[WEATHER_TOOL, CLOCK_TOOL], max_tokens=200, temperature=0.0,
              extra_body={"structured_outputs": {"regex": HERMES_CALLS}})
    r = _streamed(client, **kw) if stream else client.chat.completions.create(model=BUNDLED, **kw)
    calls = _calls(r.choices[0].message)
    assert [c[0] for c in calls] == ["get_weather", "clock"]
    assert calls[0][1]["city"] in ("Verona", "Mantua") and r.choices[0].finish_reason == "tool_calls"
    assert len({c.id for c in r.choices[0].message.tool_calls}) == 2


# ---- reasoning ----------------------------------------------------------------------------

THINK_THEN_CALL = (r'<think>[a-z]{2,6}( [a-z]{2,6}){0,2}</think><tool_call>\{"name": "clock", '
                   r'"arguments": \{"tz": "Verona"\}\}</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_content_then_answer_and_then_a_call(client, stream):
    kw = dict(messages=ASK, max_tokens=60, temperature=0.0, extra_body={
        "structured_outputs": {"regex": r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>\n"
                                        r"[A-Z][a-z]{2,8}\."}})
    if stream:
        chunks = list(client.chat.completions.create(model=BUNDLED, stream=True, **kw))
        deltas = [ch.delta for c in chunks for ch in c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        assert deltas[0].role == "assistant"
        assert all("<think>" not in (d.content or "") for d in deltas)
    else:
        msg = client.chat.completions.create(model=BUNDLED, **kw).choices[0].message
        reasoning, content = msg.reasoning_content, msg.content
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", reasoning), reasoning
    assert re.fullmatch(r"[A-Z][a-z]{2,8}\.", content), content   # leading newline dropped
    r = client.chat.completions.create(
        model=BUNDLED, messages=ASK, tools=[CLOCK_TOOL], max_tokens=80, temperature=0.0,
        extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}})
    msg = r.choices[0].message
    assert msg.reasoning_content and _calls(msg) == [("clock", {"tz": "Verona"})]
    assert r.choices[0].finish_reason == "tool_calls"


# ---- vLLM compatibility: ignored fields, metric names, embeddings -------------------------

def test_ignored_fields_unknown_fields_and_embeddings(server, client):
    r = client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2,
                                       extra_body={"modalities": ["text"], "verbosity": "low",
                                                   "prompt_cache_key": "k"})
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="modalities"):
        client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=2,
                                       extra_body={"modalities": ["audio"]})
    # Unknown fields are accepted as vLLM accepts them, and named in a response header.
    raw = client.chat.completions.with_raw_response.create(
        model=BUNDLED, messages=ASK, max_tokens=2, extra_body={"temprature": 0.5})
    assert raw.headers["x-wideserve-ignored-fields"] == "temprature"
    with pytest.raises(openai.NotFoundError, match="generative model"):
        client.embeddings.create(model=BUNDLED, input="hi")


def test_metrics_under_vllm_names_too(server, client):
    client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=3)
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for vllm, ours in (("vllm:num_requests_running", "wideserve:num_requests_running"),
                       ("vllm:prefix_cache_queries_total", "wideserve:prefix_cache_queries_total"),
                       ("vllm:generation_tokens_total", "wideserve:generation_tokens_total"),
                       ("vllm:time_to_first_token_seconds_count",
                        "wideserve:time_to_first_token_seconds_count")):
        assert values[f'{vllm}{{engine="0",model_name="{BUNDLED}"}}'] \
            == values[f'{ours}{{model_name="{BUNDLED}"}}']
    assert values['vllm:request_success_total{engine="0",finished_reason="length",'
                  f'model_name="{BUNDLED}"}}'] \
        == values[f'wideserve:requests_total{{model_name="{BUNDLED}",outcome="length"}}'] >= 1
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text


def test_vllm_dashboard_series_live(server, client):
    """Every series vLLM's Grafana dashboard reads is in a live scrape, with this model's
    name, after one request; the per-request and per-step histograms have observations."""
    client.chat.completions.create(model=BUNDLED, messages=ASK, max_tokens=4)
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "data" / "grafana"
                            / "vllm_dashboard.json").read_text())
    wanted = {m for p in dashboard["panels"] for t in p["targets"]
              for m in re.findall(r"vllm:[A-Za-z0-9_:]+", t["expr"])}
    deadline = time.monotonic() + 10      # engine stats reach the front end within a beat
    while True:
        text = httpx.get(server.url + "/metrics").text
        live = {line.split("{")[0]: line for line in text.splitlines()
                if line.startswith("vllm:") and f'model_name="{BUNDLED}"' in line}
        if "vllm:iteration_tokens_total_count" in live or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert wanted - set(live) == set()
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_inference_time_seconds",
                 "iteration_tokens_total"):
        assert float(live[f"vllm:{name}_count"].rsplit(" ", 1)[1]) >= 1, name
    assert "vllm:cache_config_info" in live and 'enable_prefix_caching="True"' in text


# ---- /v1/responses --------------------------------------------------------------------------

RESP_TOOL = {"type": "function", "name": "clock", "description": "The hour",
             "parameters": CLOCK_TOOL["function"]["parameters"]}


def test_responses_text_whole_and_streamed(client):
    full = client.responses.create(model=BUNDLED, input="Speak, friend.", max_output_tokens=8,
                                   temperature=0.0, instructions="Be brief.")
    assert full.status == "incomplete" and full.output[0].type == "message"
    assert full.output_text and full.usage.output_tokens == 8
    events = list(client.responses.create(model=BUNDLED, input="Speak, friend.", stream=True,
                                          max_output_tokens=8, temperature=0.0,
                                          instructions="Be brief."))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    # Cut by max_output_tokens: OpenAI's terminal event for that is response.incomplete.
    assert types[-1] == "response.incomplete" and "response.output_text.delta" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-1].response.output_text


def test_responses_function_calls_and_the_next_turn(client):
    with client.responses.stream(model=BUNDLED, input="What hour is it?", tools=[RESP_TOOL],
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=60,
                                 temperature=0.0) as stream:
        final = stream.get_final_response()
    (fc,) = [o for o in final.output if o.type == "function_call"]
    assert fc.name == "clock" and json.loads(fc.arguments)["tz"] in ("Verona", "Mantua")
    nxt = client.responses.create(model=BUNDLED, max_output_tokens=4, tools=[RESP_TOOL], input=[
        {"role": "user", "content": "What hour is it?"},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name,
         "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "midnight"}],
        tool_choice="none")
    assert nxt.output[0].type == "message"


def test_logit_bias_steers_the_sampler(server, client):
    (bang,) = httpx.post(server.url + "/tokenize", json={"model": BUNDLED, "prompt": "!",
                                                         "add_special_tokens": False}
                         ).json()["tokens"]
    r = client.completions.create(model=BUNDLED, prompt="ROMEO:", max_tokens=3, temperature=0.0,
                                  logit_bias={str(bang): 100})
    assert r.choices[0].text == "!!!"
    plain = client.completions.create(model=BUNDLED, prompt="ROMEO:", max_tokens=3,
                                      temperature=0.0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    (first_id,) = httpx.post(server.url + "/tokenize", json={
        "model": BUNDLED, "prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = client.completions.create(model=BUNDLED, prompt="ROMEO:", max_tokens=1,
                                       temperature=0.0, logprobs=0,
                                       logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first


def test_echo_with_logprobs_returns_the_prompt_logprobs_too(server, client):
    prompt = "ROMEO: But soft"
    ids = httpx.post(server.url + "/tokenize", json={"model": BUNDLED, "prompt": prompt}
                     ).json()["tokens"]
    r = client.completions.create(model=BUNDLED, prompt=prompt, max_tokens=2, temperature=0.0,
                                  echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=BUNDLED, prompt=prompt, max_tokens=2, temperature=0.0, echo=True, logprobs=1,
        stream=True) if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), [])[1:] == pytest.approx(
        lp.token_logprobs[1:], abs=1e-4)
