"""`wideserve serve` with no MODEL serves the bundled model: real text, greedy output equal to
the offline LLM's (an independent path through the same engine), prefix-cache hits reported in
usage, and the tool-calling turns of an agent loop rendered by its template."""
from __future__ import annotations

import httpx
import openai
import pytest

from oai_server_utils import RemoteServer, served

BUNDLED = "shakespeare-v4-tiny"
PROMPT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET:"


@pytest.fixture(scope="module")
def server(request):
    srv = RemoteServer(["--device", "cpu", "--kv-cache-memory", "64MiB",
                        "--enable-debug-endpoints"])
    yield from served(request, srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_serves_the_bundled_model(server, client):
    assert [m.id for m in client.models.list().data] == [BUNDLED]
    log = server.read_output()
    assert BUNDLED in log and "DeepseekV4ForCausalLM" in log and "KV cache" in log


def test_greedy_text_equals_the_offline_llm(client):
    from wideserve import LLM, SamplingParams
    llm = LLM(kv_cache_memory=64 << 20, max_num_seqs=4)
    expected = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=24),
                            use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=BUNDLED, prompt=PROMPT, max_tokens=24,
                                    temperature=0.0)
    assert got.choices[0].text == expected.text
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert any(c.isalpha() for c in expected.text)
    streamed = client.completions.create(model=BUNDLED, prompt=PROMPT, max_tokens=24,
                                         temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_chat_and_agent_loop_turns(server, client):
    r = client.chat.completions.create(
        model=BUNDLED, messages=[{"role": "user", "content": "Speak, friend."}],
        max_tokens=16, temperature=0.0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    # An agent loop's second turn: developer, assistant tool calls and tool results render.
    r = client.chat.completions.create(model=BUNDLED, max_tokens=4, messages=[
        {"role": "developer", "content": "Answer in verse."},
        {"role": "user", "content": "What hour is it?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "clock", "arguments": "{\"tz\": \"Verona\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "midnight"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_prefix_cache_hit_in_usage_and_kv_integrity(server, client):
    long_prompt = (PROMPT + " ") * 16
    first = client.completions.create(model=BUNDLED, prompt=long_prompt, max_tokens=2)
    second = client.completions.create(model=BUNDLED, prompt=long_prompt, max_tokens=2)
    assert first.usage.prompt_tokens > 256
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    state = httpx.get(server.url + "/debug/kv_integrity", timeout=30).json()
    assert state["ok"] and state["stats"]["num_running"] == 0, state
