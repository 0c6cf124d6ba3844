"""The security probe's cases against one API server (benchmarks/security_probe.py)."""
from __future__ import annotations

import json
import secrets
import socket
import threading
import time
from typing import Any, Callable

import httpx

from security_probe_harness import (
    MODEL, Row, SECRET_PROMPT, SECRET_USER, Server, Sizes, StreamWatch, hostile_client,
    is_4xx, message, run_case, status_case)


# ------------------------------------------------------------------- the API server's cases

def _chat(content: str = "Hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 4, **extra}


def _big_body(prefix: str, items: str, count: int, suffix: str) -> bytes:
    """A JSON body built as text: millions of items without a Python object for each."""
    return (prefix + ",".join([items] * count) + suffix).encode()


def server_cases(srv: Server, sizes: Sizes, watch: StreamWatch) -> None:
    url, h, limit = srv.url, srv.headers, sizes.case_timeout_s
    hc = hostile_client(limit)
    jh = {**h, "Content-Type": "application/json"}

    def case(name: str, expected: str, fn: Callable[[], tuple[str, bool]],
             timeout_s: float = limit) -> None:
        run_case(Row(name, expected), fn, timeout_s + 5, watch, srv)

    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "does a thing " * 4,
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
        for i in range(sizes.tools)]
    case(f"{sizes.tools:,} tool definitions", "4xx (tool limit) in < 5 s",
         lambda: status_case(hc, "POST", url + "/v1/chat/completions", ok=is_4xx,
                              limit_s=5, json=_chat(tools=tools, tool_choice="none"),
                              headers=h))

    per = '{"type":"object","properties":{"k%d":{"type":"string","maxLength":%d}}}'
    n_any = sizes.schema_mb * 2**20 // len(per % (10**6, 10**6))
    schema = ('{"type":"json_schema","json_schema":{"name":"s","schema":{"anyOf":['
              + ",".join(per % (i, i) for i in range(n_any)) + ']}}}')
    body = json.dumps(_chat("Give JSON"))[:-1] + ',"response_format":' + schema + "}"
    case(f"{len(body) / 2**20:.0f} MB anyOf JSON schema", "4xx (schema limit) in < 10 s",
         lambda: status_case(hc, "POST", url + "/v1/chat/completions", ok=is_4xx,
                              limit_s=10, content=body.encode(), headers=jh))

    # Parsing the entries is the cost: most are past a small vocabulary, as they may be.
    bias = ('{"model":"%s","prompt":"hi","max_tokens":2,"logit_bias":{' % MODEL
            + ",".join(f'"{i}":1' for i in range(sizes.logit_bias)) + "}}").encode()
    case(f"logit_bias with {sizes.logit_bias:,} entries", "4xx (entry limit) in < 5 s",
         lambda: status_case(hc, "POST", url + "/v1/completions", ok=is_4xx, limit_s=5,
                              content=bias, headers=jh))

    case('logit_bias non-integer key {"²": 1}', "400",
         lambda: status_case(hc, "POST", url + "/v1/completions", ok=lambda c: c == 400,
                              limit_s=5, json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                               "logit_bias": {"²": 1}}, headers=h))

    bad_input = {"model": MODEL, "max_output_tokens": 4, "input": [
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": 5}]}]}
    case("Responses input_text with text 5", "400",
         lambda: status_case(hc, "POST", url + "/v1/responses", ok=lambda c: c == 400,
                              limit_s=5, json=bad_input, headers=h))

    prompts = _big_body('{"model":"%s","max_tokens":1,"prompt":[' % MODEL, "[7]",
                        sizes.prompts, "]}")
    case(f"{sizes.prompts:,} one-token prompts", "4xx in < 5 s",
         lambda: status_case(hc, "POST", url + "/v1/completions", ok=is_4xx, limit_s=5,
                              content=prompts, headers=jh))

    case(f"{sizes.header_mb} MB request header", "refused (431/400/closed) in < 5 s",
         lambda: _huge_header(srv.port, sizes.header_mb, h))

    case("n=128: the next user's wait", "next request done in < 5 s (or n refused 4xx)",
         lambda: _fanout(hc, url, h))

    case(f"{sizes.choices:,}-choice schema, then a small structured request",
         "small request done in < 3 s (no head-of-line)",
         lambda: _head_of_line(hc, url, h, sizes.choices))

    case("unsatisfiable schema (integer, minimum 5, maximum 3)",
         "4xx or an error; never 200 with unconstrained text",
         lambda: _unsatisfiable(hc, url, h))

    case("Responses without max_output_tokens", "no more output tokens than chat's default",
         # Both may run to the full context (1K tokens): a slow machine needs the time.
         lambda: _responses_cap(hostile_client(LONG_S), url, h), LONG_S)

    case("user field and prompt at info log level", "neither appears in the server log",
         lambda: _logged(hc, srv))


LONG_S = 150.0


def _huge_header(port: int, mb: int, headers: dict[str, str]) -> tuple[str, bool]:
    start = time.monotonic()
    auth = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: "
            f"application/json\r\nX-Junk: ").encode()
    junk = b"a" * (1 << 20)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(head)
            for _ in range(mb):
                s.sendall(junk)
            s.sendall(f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        except OSError as e:
            return f"connection closed after {time.monotonic() - start:.1f} s ({e.__class__.__name__})", True
        try:
            status = s.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as e:
            status = f"closed ({e.__class__.__name__})"
    took = time.monotonic() - start
    code = status.split(" ")[1] if status.startswith("HTTP/") else ""
    refused = code in ("431", "400", "413") or not code
    return f"{status or 'closed'} in {took:.1f} s", refused and took < 5


def _fanout(hc: httpx.Client, url: str, h: dict[str, str]) -> tuple[str, bool]:
    result: list[httpx.Response] = []
    big = threading.Thread(target=lambda: result.append(hc.post(
        url + "/v1/completions", headers=h, json={
            "model": MODEL, "prompt": "To be", "n": 128, "max_tokens": 16,
            "ignore_eos": True, "temperature": 1.0})), daemon=True)
    big.start()
    time.sleep(0.5)
    start = time.monotonic()
    r = hc.post(url + "/v1/completions", headers=h,
                json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    wait = time.monotonic() - start
    big.join(60)
    fan = result[0].status_code if result else "no answer"
    return (f"n=128 -> {fan}; next user {r.status_code} after {wait:.1f} s",
            r.status_code == 200 and (wait < 5 or (result and is_4xx(result[0].status_code))))


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def _head_of_line(hc: httpx.Client, url: str, h: dict[str, str], choices: int
                  ) -> tuple[str, bool]:
    enum = [f"choice-{i}-{secrets.token_hex(3)}" for i in range(choices)]
    result: list[httpx.Response] = []
    big = threading.Thread(target=lambda: result.append(hc.post(
        url + "/v1/chat/completions", headers=h, json=_chat(
            "Pick", response_format=_json_schema({"type": "string", "enum": enum})))),
        daemon=True)
    big.start()
    time.sleep(0.5)
    start = time.monotonic()
    r = hc.post(url + "/v1/chat/completions", headers=h, json=_chat(
        "Pick", response_format=_json_schema({"type": "string", "enum": ["yes", "no"]})))
    wait = time.monotonic() - start
    big.join(5)
    big_status = result[0].status_code if result else "still running"
    return (f"big -> {big_status}; small {r.status_code} after {wait:.1f} s",
            r.status_code == 200 and wait < 3)


def _unsatisfiable(hc: httpx.Client, url: str, h: dict[str, str]) -> tuple[str, bool]:
    r = hc.post(url + "/v1/chat/completions", headers=h, json=_chat(
        "A number", max_tokens=8,
        response_format=_json_schema({"type": "integer", "minimum": 5, "maximum": 3})))
    if r.status_code != 200:
        return f"{r.status_code}: {message(r)}", r.status_code < 500
    choice = r.json()["choices"][0]
    text = choice["message"].get("content")
    if choice.get("finish_reason") == "error":
        return f"200 with finish_reason error: {text!r}", True
    return f"200 with text {text!r} (no integer is in [5, 3])", False


def _responses_cap(hc: httpx.Client, url: str, h: dict[str, str]) -> tuple[str, bool]:
    """Both without a cap, side by side: the Responses answer may not be the longer one."""
    text = "Tell me a long story"
    out: dict[str, int] = {}

    def ask(path: str, body: dict[str, Any], key: str) -> None:
        try:
            r = hc.post(url + path, headers=h, json=body)
        except httpx.HTTPError:
            return                                      # no answer in time: stays absent
        out[path] = r.json().get("usage", {}).get(key, -1) if r.status_code == 200 \
            else -r.status_code
    threads = [threading.Thread(target=ask, args=a, daemon=True) for a in (
        ("/v1/responses", {"model": MODEL, "input": text}, "output_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": text}]}, "completion_tokens"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got, chat = out.get("/v1/responses"), out.get("/v1/chat/completions")
    shown = ["no answer" if n is None else f"{n} tokens" for n in (got, chat)]
    return (f"responses {shown[0]}, chat {shown[1]}",
            got is not None and chat is not None and 0 <= got <= chat)


def _logged(hc: httpx.Client, srv: Server) -> tuple[str, bool]:
    hc.post(srv.url + "/v1/completions", headers=srv.headers, json={
        "model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 2, "user": SECRET_USER})
    time.sleep(0.5)
    log = srv.output()
    found = [what for what, s in (("user", SECRET_USER), ("prompt", SECRET_PROMPT)) if s in log]
    return (f"logged: {', '.join(found)}" if found else "neither logged"), not found
