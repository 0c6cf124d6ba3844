"""Hostile requests and silent failures (issue 25, API side): every request limit is a 400
naming its flag, checked before anything big is built; a running stream keeps flowing while
hostile requests arrive; a request head past the cap is a 431; a constraint that fails
mid-decode ends its request with an error; one request's many sequences do not hold a later
request behind all of them; no end-user id or prompt text in the logs. One server (small
limits, priority scheduling, two sequences at a time, info logging) for the module."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from oai_server_utils import RemoteServer, served, write_tiny_model

JSON = {"Content-Type": "application/json"}
LIMIT_FLAGS = {"--max-tools": 8, "--max-tools-bytes": 8192, "--max-schema-bytes": 4096,
               "--max-schema-depth": 8, "--max-logit-bias": 16, "--max-messages": 64,
               "--max-stop": 4, "--max-stop-chars": 32, "--max-header-bytes": 8192,
               "--max-sequences-per-request": 16}
SECRET_USER, SECRET_PROMPT = "user-SECRET-4242", "PROMPT-SECRET-4242"
DEAD_END = 'start: "ab" C\nC: /x/ & /y/'     # "ab", then nothing (x & y is empty)
# Tokens per child of the fairness test's n = 8 request: its last three pairs (~5,400 steps of
# the tiny model, ~3.5 s of the test's 4.6 s here quiet) must outlast the later request's HTTP
# round trip, also when the API process is starved of CPU by a loaded machine (at 200 tokens
# they took ~0.3 s, and under the full suite's load the later request once arrived after
# all eight).
FAIR_TOKENS = 1800


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    # a long context, for the fairness test's long children (FAIR_TOKENS)
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"), max_len=2048)
    flags = [str(x) for kv in LIMIT_FLAGS.items() for x in kv]
    srv = RemoteServer([str(model), "--load-format", "dummy", "--device", "cpu",
                        "--block-size", "16", "--kv-cache-memory", "4MiB",
                        "--max-num-seqs", "2", "--scheduling-policy", "priority", *flags],
                       log_level="info")
    yield from served(request, srv)


def _tool(i: int, description: str = "") -> dict:
    return {"type": "function", "function": {"name": f"f{i}", "description": description,
                                             "parameters": {"type": "object"}}}


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


# (id, path, body, the flag the message names)
OVER_LIMIT = [
    ("tools", "/v1/chat/completions", _chat(tools=[_tool(i) for i in range(9)],
                                            tool_choice="none"), "--max-tools"),
    ("tools-bytes", "/v1/chat/completions",
     _chat(tools=[_tool(0, "d" * 9000)], tool_choice="none"), "--max-tools-bytes"),
    ("schema-bytes", "/v1/chat/completions",
     _chat(response_format=_schema_format({"enum": ["v" * 100] * 50})), "--max-schema-bytes"),
    ("schema-depth", "/v1/chat/completions",
     _chat(response_format=_schema_format(_nested(12))), "--max-schema-depth"),
    ("tool-schema-depth", "/v1/chat/completions",
     _chat(tools=[{"type": "function", "function": {"name": "f", "parameters": _nested(12)}}],
           tool_choice="none"), "--max-schema-depth"),
    ("choice-bytes", "/v1/completions",
     {"prompt": "a", "max_tokens": 1, "guided_choice": ["c" * 100] * 50}, "--max-schema-bytes"),
    ("logit-bias", "/v1/completions",
     {"prompt": "a", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(17)}},
     "--max-logit-bias"),
    ("messages", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w"}] * 65}, "--max-messages"),
    ("stop-count", "/v1/completions", {"prompt": "a", "stop": list("abcde")}, "--max-stop"),
    ("stop-chars", "/v1/completions", {"prompt": "a", "stop": "s" * 33}, "--max-stop-chars"),
    ("sequences", "/v1/completions", {"prompt": ["a"] * 5, "n": 4},
     "--max-sequences-per-request"),
    ("responses-input", "/v1/responses",
     {"input": [{"role": "user", "content": "w"}] * 65}, "--max-messages"),
    ("responses-tools", "/v1/responses",
     {"input": "hi", "tools": [{"type": "function", "name": f"f{i}"} for i in range(9)]},
     "--max-tools"),
]


@pytest.mark.parametrize("case", OVER_LIMIT, ids=[c[0] for c in OVER_LIMIT])
def test_each_limit_is_a_400_naming_its_flag(server, case):
    _, path, body, flag = case
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert flag in err["message"] and err["param"], err


def test_requests_at_the_limits_are_served(server):
    body = _chat(tools=[_tool(i) for i in range(8)], tool_choice="none",
                 logit_bias={str(i): 1 for i in range(16)}, stop=list("abcd"),
                 response_format=_schema_format(_nested(3)))   # 7 levels of JSON
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_former_500s_are_400s(server):
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": "a", "max_tokens": 1, "logit_bias": {"²": 1}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    r = httpx.post(server.url + "/v1/responses", timeout=60, json={"input": [
        {"role": "user", "content": [{"type": "input_text", "text": 5}]}]})
    assert r.status_code == 400 and "text: must be a string" in r.text, r.text


def test_ten_million_one_token_prompts_are_refused_without_building_them(server):
    body = b'{"max_tokens": 1, "prompt": [' + b",".join([b"[1]"] * 10_000_000) + b"]}"
    t = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", content=body, headers=JSON, timeout=300)
    took = time.perf_counter() - t
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences", r.text
    assert took < 30, took          # 54 s before (each prompt built first), ~2 s now


def _send_raw(port: int, head: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        data = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.parametrize("size", [10_000, 2_000_000], ids=["one-read", "many-reads"])
def test_request_head_past_the_cap_is_431(server, size):
    head = (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\n\r\n")
    answer = _send_raw(server.port, head)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert b"--max-header-bytes" in answer
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200


class _Streams:
    """Long greedy streams, one after another until closed; the longest gap between two
    events of one stream."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.events = url, 0.0, 0
        self.started, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60)

    def _run(self) -> None:
        body = {"prompt": "To be", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "temperature": 0}
        while not self.stop.is_set():
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              timeout=120) as r:
                last = None
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        self.worst = max(self.worst, now - last)
                    last = now
                    self.events += 1
                    self.started.set()

    def close(self) -> float:
        self.stop.set()
        self.thread.join(120)
        return self.worst


HOSTILE = {   # the issue's reproductions (14 s and 52.8 s of stall for every stream before)
    "10k-tools": ("/v1/chat/completions",
                  lambda: _chat(tools=[_tool(i) for i in range(10_000)], tool_choice="none")),
    "8MB-anyOf-schema": ("/v1/chat/completions", lambda: _chat(response_format=_schema_format(
        {"anyOf": [{"const": f"value-{i}"} for i in range(400_000)]}))),
    "200k-logit-bias": ("/v1/completions", lambda: {
        "prompt": "a", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(200_000)}}),
    "50k-tool-call-history": ("/v1/chat/completions", lambda: {"messages": [
        {"role": "assistant", "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]} for i in range(50_000)]}),
}


def test_a_running_stream_is_not_stalled_by_hostile_requests(server):
    """Generous bound for this loaded 2-core box; the precise number is
    benchmarks/input_stalls.py's (--cases tools,schema,logit_bias,history)."""
    bodies = {name: (path, json.dumps(make()).encode())
              for name, (path, make) in HOSTILE.items()}
    streams = _Streams(server.url)
    for name, (path, body) in bodies.items():
        r = httpx.post(server.url + path, content=body, headers=JSON, timeout=120)
        assert r.status_code == 400, (name, r.text[:300])
    worst = streams.close()
    assert streams.events >= 20
    assert worst < 2.0, f"a running stream waited {worst:.2f} s"


def test_a_constraint_that_fails_mid_decode_is_an_error_not_a_200(server):
    body = {"prompt": "a", "max_tokens": 8, "ignore_eos": True, "guided_grammar": DEAD_END}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 500 and "output constraint failed" in r.text, r.text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert "output constraint failed" in events[-1]["error"]["message"], events
    assert all(c.get("finish_reason") in (None, "error") for e in events[:-1]
               for c in e.get("choices", [])), events


def test_one_requests_many_sequences_do_not_hold_a_later_request(server):
    """n=8 at two sequences at a time: a request arriving after it is admitted with the
    first free slot, not after all eight (plain (priority, arrival) order did that)."""
    finished_a: list[float] = []
    started = threading.Event()

    def run_a() -> None:
        body = {"prompt": "To be", "n": 8, "max_tokens": FAIR_TOKENS, "ignore_eos": True,
                "stream": True, "temperature": 0}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    for c in json.loads(line[6:])["choices"]:
                        if c["finish_reason"]:
                            finished_a.append(time.perf_counter())

    a = threading.Thread(target=run_a, daemon=True)
    a.start()
    assert started.wait(120)
    r = httpx.post(server.url + "/v1/completions", timeout=300,
                   json={"prompt": "Hi", "max_tokens": 1, "temperature": 0})
    done_b = time.perf_counter()
    a.join(300)
    assert r.status_code == 200 and len(finished_a) == 8
    assert sum(t < done_b for t in finished_a) <= 4, (finished_a, done_b)


def test_logs_carry_no_end_user_id_or_prompt_text(server):
    for path, body in (("/v1/chat/completions", _chat(user=SECRET_USER, messages=[
            {"role": "user", "content": SECRET_PROMPT}])),
            ("/v1/completions", {"prompt": SECRET_PROMPT, "user": SECRET_USER,
                                 "max_tokens": 1})):
        assert httpx.post(server.url + path, json=body, timeout=60).status_code == 200
    log = server.read_output()
    assert SECRET_USER not in log and SECRET_PROMPT not in log


def test_request_content_is_logged_only_at_debug_when_asked(caplog):
    from types import SimpleNamespace

    from wideserve.serving.openai.limits import RequestLimits
    from wideserve.serving.openai.serving import ServingContext
    for opt_in in (False, True):
        ctx = SimpleNamespace(request_limits=RequestLimits(log_request_content=opt_in))
        with caplog.at_level("DEBUG", logger="wideserve.server"):
            caplog.clear()
            ServingContext.log_request(ctx, "cmpl-1", 3, SECRET_USER, SECRET_PROMPT)
        assert "cmpl-1" in caplog.text and "3 prompt tokens" in caplog.text
        assert (SECRET_USER in caplog.text) is opt_in
        assert (SECRET_PROMPT in caplog.text) is opt_in
