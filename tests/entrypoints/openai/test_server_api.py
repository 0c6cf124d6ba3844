"""The OpenAI API through the real `openai` client against a `wideserve serve` subprocess
(tiny dummy-weight Llama, one server for the module).

Expected values are derived independently of the server where possible (the tokenizer file
for token counts, greedy non-streaming output as the oracle for streaming and stop strings).
"""
from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time

import httpx
import openai
import pytest

from oai_server_utils import MAX_LEN, RemoteServer, served, write_tiny_model
from wideserve.text.tokenizer import Tokenizer

NAME = "tiny-test"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def server(request, model_dir):
    srv = RemoteServer([str(model_dir), "--load-format", "dummy", "--device", "cpu",
                        "--block-size", "16", "--kv-cache-memory", "8MiB",
                        "--max-num-seqs", "64", "--served-model-name", NAME, "other-name",
                        "--enable-debug-endpoints"])
    yield from served(request, srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_pretrained(model_dir)


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def _kv_state(server) -> dict:
    return httpx.get(server.url + "/debug/kv_integrity", timeout=30).json()


def _wait_idle(server, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = _kv_state(server)
        stats = state["stats"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0:
            return state
        assert time.monotonic() < deadline, f"engine not idle: {state}"
        time.sleep(0.1)


def test_models_tokenize_detokenize(server, client, tok):
    ids = [m.id for m in client.models.list().data]
    assert ids == [NAME, "other-name"]
    text = "Hello world, the quick brown fox."
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    r2 = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert r2["prompt"] == tok.decode(r["tokens"])
    msgs = [{"role": "user", "content": "Hello"}]
    r3 = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    assert r3["tokens"] == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)


def test_completion_usage_and_stream_agree(client, tok):
    prompt = "To be, or not to be"
    full = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, **GREEDY)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tok.encode(prompt))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.completions.create(model="other-name", prompt=prompt, max_tokens=12,
                                            stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.model == NAME for c in chunks)


def test_chat_stream_and_non_stream_agree(client, tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello server"}]
    full = client.chat.completions.create(model=NAME, messages=messages,
                                          max_completion_tokens=10, **GREEDY)
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10,
                                            stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == 10


def test_echo_prepends_the_prompt(client):
    prompt = "Hello world"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, **GREEDY)
    echoed = client.completions.create(model=NAME, prompt=prompt, max_tokens=5, echo=True,
                                       **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text


def test_n_choices_and_seed(client):
    kwargs = dict(model=NAME, prompt="Hello", max_tokens=8, n=3, temperature=1.0, seed=7,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # seeded: reproducible
    assert len({c.text for c in a.choices}) > 1                         # but distinct samples
    assert a.usage.completion_tokens == 24
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4,
        stream=True, extra_body={"ignore_eos": True})
    per_choice: dict[int, str] = {}
    for c in chat:
        for ch in c.choices:
            per_choice[ch.index] = per_choice.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(per_choice) == [0, 1]
    # A list of prompts: choices are numbered prompt-major.
    multi = client.completions.create(model=NAME, prompt=["Hello", "world"], max_tokens=3,
                                      n=2, **GREEDY)
    assert sorted(c.index for c in multi.choices) == [0, 1, 2, 3]
    assert multi.choices[0].text == multi.choices[1].text   # greedy: same prompt, same text


def test_completion_logprobs(client):
    r = client.completions.create(model=NAME, prompt="The quick brown", max_tokens=6,
                                  logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for chosen_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen_lp <= 0.0 and 1 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(chosen_lp, max(top.values()), abs_tol=1e-4)
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=5, logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)


def test_stop_strings(client):
    prompt = "Hello world"
    base = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, **GREEDY)
    text = base.choices[0].text
    # A stop string taken from the greedy output (no replacement chars: those mark split bytes).
    start = next(i for i in range(4, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    stop = text[start:start + 2]
    cut = text.find(stop)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].text == text[:cut]
    assert r.choices[0].finish_reason == "stop"
    r2 = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, stop=stop,
                                   extra_body={"ignore_eos": True,
                                               "include_stop_str_in_output": True},
                                   temperature=0.0)
    assert r2.choices[0].text == text[:cut + len(stop)]
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, stop=[stop],
                                         stream=True, **GREEDY)
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == text[:cut]
    assert chunks[-1].finish_reason == "stop"


def test_prefix_cache_hits_show_in_usage(client):
    prompt = "whether 'tis nobler in the mind to suffer the slings and arrows " * 2
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, **GREEDY)
    n = first.usage.prompt_tokens
    assert n > 32
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole 16-token blocks, never the last prompt token.
    assert 0 < cached < n and cached % 16 == 0 and cached >= (n - 1) // 16 * 16 - 16


def test_64_concurrent_streams_then_kv_integrity(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                timeout=120)

    async def one(i: int) -> tuple[int, str | None]:
        stream = await client.completions.create(
            model=NAME, prompt=f"Request {i}: hello", max_tokens=12, stream=True,
            stream_options={"include_usage": True}, temperature=0.8, seed=i,
            extra_body={"ignore_eos": True})
        usage, finish = None, None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return usage, finish

    async def main():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert results == [(12, "length")] * 64
    state = _wait_idle(server)
    assert state["ok"], state["detail"]
    metrics = httpx.get(server.url + "/metrics").text
    assert _metric(metrics, "wideserve:time_to_first_token_seconds_count") >= 64
    assert _metric(metrics, "wideserve:requests_total", outcome="length") >= 64


def test_client_disconnect_aborts_and_frees_blocks(server):
    metrics = httpx.get(server.url + "/metrics").text
    aborted_before = _metric(metrics, "wideserve:requests_total", outcome="abort")
    body = {"model": NAME, "prompt": "Hello", "max_tokens": MAX_LEN - 8, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(4)]          # a few tokens, then hang up
            assert any(line.startswith("data: {") for line in got)
    # Non-streaming too: hang up once the engine runs it (n=64 long samples: seconds of work).
    payload = json.dumps({**body, "stream": False, "n": 64, "max_tokens": MAX_LEN - 16}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 20
        while _kv_state(server)["stats"]["num_running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    state = _wait_idle(server)
    assert state["ok"], state["detail"]
    deadline = time.monotonic() + 10
    while True:
        metrics = httpx.get(server.url + "/metrics").text
        if _metric(metrics, "wideserve:requests_total", outcome="abort") >= aborted_before + 2:
            break
        assert time.monotonic() < deadline, "the disconnected requests were not aborted"
        time.sleep(0.1)


def test_metrics_exposition(server, client):
    # The same long prompt twice: the second one hits the prefix cache.
    for _ in range(2):
        client.completions.create(model=NAME, prompt="metrics and more " * 6, max_tokens=3,
                                  **GREEDY)
    deadline = time.monotonic() + 10      # engine stats reach the front end with a heartbeat
    while True:
        text = httpx.get(server.url + "/metrics").text
        if _metric(text, "wideserve:prefix_cache_hits_total") > 0 \
                or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for name in ("wideserve:num_requests_running", "wideserve:num_requests_waiting",
                 "wideserve:kv_cache_usage_perc", "wideserve:prefix_cache_queries_total",
                 "wideserve:prefix_cache_hits_total", "wideserve:prompt_tokens_total",
                 "wideserve:generation_tokens_total", "wideserve:e2e_request_latency_seconds_bucket",
                 "wideserve:inter_token_latency_seconds_bucket",
                 "wideserve:engine_step_seconds_bucket"):
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    assert _metric(text, "wideserve:engine_step_phase_seconds_total", phase="forward") > 0
    assert _metric(text, "wideserve:prefix_cache_hits_total") > 0
    assert _metric(text, "wideserve:generation_tokens_total") >= 3


def test_debug_stats_endpoint_exists(server):
    # `serve --help` names it, so it must answer.
    body = httpx.get(server.url + "/debug/stats", timeout=30).json()
    assert {"num_running", "num_waiting", "kv_usage"} <= set(body["stats"])
    assert body["in_flight"] >= 0
