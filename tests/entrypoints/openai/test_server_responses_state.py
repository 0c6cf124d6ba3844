"""The Responses API with state, through the openai SDK's `client.responses.*`, on the bundled
model with a SQLite store: previous_response_id (earlier turns in the prompt, served from the
prefix cache), retrieve / delete / input_items, unknown ids as OpenAI's 404, store: false,
background with polling and cancel, `event:` lines on the stream, and every parameter
openai-agents sends either working or refused by name. Also vLLM's extras on chat and
completions (same server, to keep the module to one start-up)."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from oai_server_utils import RemoteServer, served

BUNDLED = "shakespeare-v4-tiny"
# Longer than one 64-token KV block, so a follow-up's prefix-cache hit is visible.
LONG = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet "
        "is the sun. Arise, fair sun, and kill the envious moon. ") * 3
LONG_TOKENS = 200           # an upper bound on one turn of LONG, with its chat framing


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    db = tmp_path_factory.mktemp("store") / "responses.sqlite"
    srv = RemoteServer(["--device", "cpu", "--kv-cache-memory", "64MiB",
                        "--response-store", "sqlite", "--response-store-path", str(db)])
    yield from served(request, srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_previous_response_id_continues_from_the_prefix_cache(client):
    first = client.responses.create(model=BUNDLED, input=LONG, max_output_tokens=6,
                                    temperature=0.0, instructions="Be brief.")
    second = client.responses.create(model=BUNDLED, input="And then?", max_output_tokens=6,
                                     previous_response_id=first.id, instructions="Be brief.")
    # The earlier turn (its input and its answer) is in the prompt, and served from cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 64
    assert second.previous_response_id == first.id
    # Without the chain the same input is a short prompt: the chain is what made it long.
    alone = client.responses.create(model=BUNDLED, input="And then?", max_output_tokens=2)
    assert alone.usage.input_tokens < 30
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = client.responses.input_items.list(second.id).data
    assert [i.content[0].text for i in items] == ["And then?"]


def test_unknown_ids_are_openai_404s(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=BUNDLED, input="x", previous_response_id="resp_nope")
    assert e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id"
    for call in (lambda: client.responses.retrieve("resp_nope"),
                 lambda: client.responses.delete("resp_nope"),
                 lambda: client.responses.input_items.list("resp_nope"),
                 lambda: client.responses.cancel("resp_nope")):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "invalid_request_error" and "resp_nope" in \
            e.value.body["message"]


def test_delete_and_store_false(client):
    r = client.responses.create(model=BUNDLED, input="Hi", max_output_tokens=2)
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(model=BUNDLED, input="Hi", max_output_tokens=2,
                                       store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=BUNDLED, input="x", previous_response_id=unstored.id)


def test_background_poll_and_cancel(client):
    done = client.responses.create(model=BUNDLED, input="Hi", max_output_tokens=4,
                                   background=True)
    assert done.status in ("queued", "in_progress") and done.background
    deadline = time.monotonic() + 60
    while done.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.1)
        done = client.responses.retrieve(done.id)
    assert done.status == "incomplete" and done.usage.output_tokens == 4
    slow = client.responses.create(model=BUNDLED, input="Hi", max_output_tokens=900,
                                   background=True, extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(slow.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(client.responses.create(model=BUNDLED, input="Hi",
                                                        max_output_tokens=1).id)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.create(model=BUNDLED, input="Hi", background=True, store=False)


def test_stream_has_event_lines_and_is_stored(server, client):
    with httpx.stream("POST", server.url + "/v1/responses", timeout=60, json={
            "model": BUNDLED, "input": "Hi", "max_output_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    events = [(a[len("event: "):], json.loads(b[len("data: "):]))
              for a, b in zip(lines[::2], lines[1::2])]
    assert all(name == data["type"] for name, data in events) and events
    assert events[0][0] == "response.created" and events[-1][0] == "response.incomplete"
    rid = events[-1][1]["response"]["id"]
    assert client.responses.retrieve(rid).output_text == "".join(
        d["delta"] for n, d in events if n == "response.output_text.delta")
    streamed = list(client.responses.create(model=BUNDLED, input="Hi", stream=True,
                                            max_output_tokens=3, previous_response_id=rid))
    assert streamed[-1].type == "response.incomplete"
    assert streamed[-1].response.status == "incomplete"


def test_agent_parameters_work_or_are_refused_by_name(client):
    r = client.responses.create(
        model=BUNDLED, input="Hi", max_output_tokens=3, top_logprobs=2,
        include=["reasoning.encrypted_content", "message.output_text.logprobs"],
        prompt_cache_key="agent-1", service_tier="auto", max_tool_calls=1,
        extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.service_tier == "default"
    raw = client.responses.with_raw_response.create(
        model=BUNDLED, input="Hi", max_output_tokens=1,
        extra_body={"safety_identifier": "u1", "frobnicate": True})
    assert raw.headers["x-wideserve-ignored-fields"] == "frobnicate"    # echoes not named
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == 3 and all(len(lp.top_logprobs) == 2 for lp in logprobs)
    streamed = list(client.responses.create(model=BUNDLED, input="Hi", max_output_tokens=2,
                                            stream=True,
                                            stream_options={"include_obfuscation": False}))
    assert streamed[-1].type == "response.incomplete"
    for kwargs, name in (({"conversation": "conv_1"}, "conversation"),
                         ({"include": ["file_search_call.results"]}, "include"),
                         ({"prompt": {"id": "pmpt_1"}}, "prompt")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=BUNDLED, input="Hi", **kwargs)
        assert e.value.body["param"] == name and name in e.value.body["message"]


def test_truncation_auto_drops_the_earliest_items_to_fit(client):
    """A conversation over the 1024-token context: `disabled` (the default) is a 400,
    `auto` drops items from the start until it fits, keeping the latest (OpenAI's rule)."""
    turns = [{"role": "user", "content": f"{i}: {LONG}"} for i in range(12)]
    turns.append({"role": "user", "content": "And then?"})
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=BUNDLED, input=turns, max_output_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.responses.create(model=BUNDLED, input=turns, max_output_tokens=4,
                                temperature=0.0, truncation="auto")
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert 1024 - LONG_TOKENS <= r.usage.input_tokens + 4 <= 1024   # as few dropped as needed
    # The stored input is the whole input, as sent (truncation is of the prompt only).
    assert len(client.responses.input_items.list(r.id, limit=100).data) == len(turns)
    # One item alone over the context cannot be truncated: still a 400.
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=BUNDLED, input=LONG * 40, max_output_tokens=4,
                                truncation="auto")
    assert e.value.body["code"] == "context_length_exceeded"


# ---- vLLM's extras -------------------------------------------------------------------------

def test_prompt_logprobs_and_token_ids(client):
    r = client.completions.create(model=BUNDLED, prompt="To be, or not", max_tokens=2,
                                  logprobs=1, extra_body={"prompt_logprobs": 1,
                                                          "return_tokens_as_token_ids": True})
    choice = r.choices[0]
    prompt_lps = choice.model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == r.usage.prompt_tokens
    assert all(isinstance(v["logprob"], float) for e in prompt_lps[1:] for v in e.values())
    assert all(t.startswith("token_id:") for t in choice.logprobs.tokens)
    chat = client.chat.completions.create(
        model=BUNDLED, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        logprobs=True, extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    assert chat.choices[0].logprobs.content[0].token.startswith("token_id:")


def test_echo_with_max_tokens_zero(client):
    r = client.completions.create(model=BUNDLED, prompt="To be, or not", max_tokens=0,
                                  echo=True, logprobs=0)
    assert r.choices[0].text == "To be, or not" and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens
    assert r.choices[0].logprobs.token_logprobs[0] is None


def test_truncate_prompt_tokens(client):
    huge = "word " * 3000                             # far beyond the 1024-token context
    r = client.completions.create(model=BUNDLED, prompt=huge, max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 100})
    assert r.usage.prompt_tokens == 100
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=BUNDLED, prompt="x", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": 5000})
    chat = client.chat.completions.create(
        model=BUNDLED, messages=[{"role": "user", "content": huge}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50


def test_response_format_on_completions_and_sampling_extras(client):
    schema = {"type": "object", "properties": {"hour": {"enum": ["midnight", "noon"]}},
              "required": ["hour"], "additionalProperties": False}
    r = client.completions.create(model=BUNDLED, prompt="The hour:", max_tokens=30,
                                  extra_body={"response_format": {
                                      "type": "json_schema",
                                      "json_schema": {"name": "h", "schema": schema}}})
    assert json.loads(r.choices[0].text)["hour"] in ("midnight", "noon")
    r = client.completions.create(model=BUNDLED, prompt="Hi", max_tokens=6, extra_body={
        "min_tokens": 6, "ignore_eos": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False})
    assert r.usage.completion_tokens == 6
    r = client.chat.completions.create(
        model=BUNDLED, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        extra_body={"documents": [{"title": "a", "text": "b"}],
                    "chat_template_kwargs": {"thinking": False},
                    "guided_regex": "(yes|no)"})
    assert r.choices[0].message.content in ("yes", "no")
