"""The P/D router's own behaviour, against mock upstreams (httpx.MockTransport): a decode
stream cut mid-way ends with an SSE error event and [DONE]; the in-flight gauge comes back
to zero on every path; /health reports 503 without a reachable prefill or decode instance;
the API server's body limit, Content-Type check and nesting limit apply; /v1/models forwards
Authorization; /v1/responses goes prefill then decode; clients cannot send KV handles."""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from wideserve.disagg.peer_auth import HEADER, PeerAuth, sign_request
from wideserve.serving.openai.pd_router import RouterConfig, build_app

P, D = "http://prefill.test", "http://decode.test"
SECRET = b"router-unit-test-secret-0123456789"
HANDLE = {"do_remote_prefill": True, "remote_request_id": "x", "remote_mac": "m"}
EVENT = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'


class Chunks(httpx.AsyncByteStream):
    """A streamed response body: `chunks`, then (cut) a failure as a dying upstream's."""

    def __init__(self, chunks: list[bytes], cut: bool = False) -> None:
        self.chunks, self.cut = chunks, cut

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c
        if self.cut:
            raise httpx.RemoteProtocolError("peer closed connection without sending "
                                            "complete message body")


def Cut(chunks: list[bytes]) -> Chunks:
    return Chunks(chunks, cut=True)


class Upstreams:
    """Mock prefill and decode instances; records what each received."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict, httpx.Headers]] = []
        self.raw: list[bytes] = []
        self.decode: Callable[[dict], httpx.Response] = self.sse
        self.health = {P: 200, D: 200}

    def sse(self, body: dict) -> httpx.Response:
        if body.get("stream"):
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  stream=Chunks([EVENT, b"data: [DONE]\n\n"]))
        return httpx.Response(200, headers={"content-type": "application/json"},
                              stream=Chunks([b'{"choices": [{"text": "ok"}]}']))

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        path = request.url.path
        if path == "/health":
            code = self.health[base]
            if code is None:
                raise httpx.ConnectError("connection refused")
            return httpx.Response(code)
        body = json.loads(request.content) if request.content else {}
        self.seen.append((base + path, body, request.headers))
        self.raw.append(request.content)
        if path == "/v1/models":
            return httpx.Response(200, json={"auth": request.headers.get("authorization")})
        if base == P:
            return httpx.Response(200, json={"kv_transfer_params": HANDLE})
        return self.decode(body)


def _run(up: Upstreams, calls: Callable, **cfg) -> tuple[object, object]:
    config = RouterConfig([P], [D], **{"max_request_bytes": 1 << 20,
                                       "body_read_timeout_s": 5.0, "kv_secret": SECRET, **cfg})
    app = build_app(config, httpx.MockTransport(up))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router") as client:
            return await calls(client)
    return asyncio.run(go()), app.state.router


def _in_flight(router) -> list[int]:
    return [i.in_flight for pool in (router.prefill, router.decode) for i in pool.instances]


def _events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("cut_at", [EVENT, EVENT + b'data: {"choi'])
def test_decode_dying_mid_stream_ends_with_an_error_event_and_done(cut_at):
    up = Upstreams()
    up.decode = lambda body: httpx.Response(200, headers={"content-type": "text/event-stream"},
                                            stream=Cut([cut_at]))

    async def calls(c):
        return await c.post("/v1/completions", json={"prompt": "hi", "stream": True})
    r, router = _run(up, calls)
    assert r.status_code == 200
    events = _events(r.text)
    assert events[0] == EVENT.decode()[6:].strip()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]          # its own event, parseable
    assert "stopped mid-stream" in error["message"] and error["code"] == 502
    assert _in_flight(router) == [0, 0]
    metrics = router.metrics.registry.get_sample_value
    assert metrics("wideserve_router_upstream_errors_total",
                   {"role": "decode", "url": D}) == 1
    assert metrics("wideserve_router_in_flight", {"role": "decode", "url": D}) == 0


def test_in_flight_gauge_returns_to_zero_on_every_path():
    up = Upstreams()
    bodies = {
        "ok_stream": (lambda b: up.sse(b), True),
        "ok_json": (lambda b: up.sse(b), False),
        "unreachable": (lambda b: (_ for _ in ()).throw(httpx.ConnectError("refused")), False),
        "json_cut": (lambda b: httpx.Response(200, headers={"content-type": "application/json"},
                                              stream=Cut([b'{"choi'])), False),
    }
    status = {}
    for name, (decode, stream) in bodies.items():
        up.decode = decode

        async def calls(c, stream=stream):
            return await c.post("/v1/completions", json={"prompt": "hi", "stream": stream})
        r, router = _run(up, calls)
        status[name] = r.status_code
        assert _in_flight(router) == [0, 0], name
    assert status == {"ok_stream": 200, "ok_json": 200, "unreachable": 502, "json_cut": 502}


@pytest.mark.parametrize("prefill,decode,code", [(200, 200, 200), (None, 200, 503),
                                                 (200, 503, 503), (None, None, 503)])
def test_health_needs_a_reachable_prefill_and_decode(prefill, decode, code):
    up = Upstreams()
    up.health = {P: prefill, D: decode}
    r, _ = _run(up, lambda c: c.get("/health"))
    assert r.status_code == code
    assert r.json() == {"prefill": {P: prefill == 200}, "decode": {D: decode == 200}}


def test_body_limit_and_content_type_are_the_servers():
    up = Upstreams()

    async def calls(c):
        big = await c.post("/v1/completions", json={"prompt": "x" * 5000})
        text = await c.post("/v1/completions", content=b'{"prompt": "x"}',
                            headers={"content-type": "text/plain"})
        return big, text
    (big, text), _ = _run(up, calls, max_request_bytes=4096)
    assert big.status_code == 413 and "exceeds the limit of 4096" in big.text
    assert text.status_code == 415 and "Content-Type must be application/json" in text.text
    assert up.seen == []                                   # nothing reached an upstream


@pytest.mark.parametrize("depth", [50000, 400000])
def test_deeply_nested_json_is_a_400(depth):
    up = Upstreams()

    async def calls(c):
        return await c.post("/v1/chat/completions",
                            content=b'{"messages": ' + b"[" * depth + b"]" * depth + b"}",
                            headers={"content-type": "application/json"})
    r, _ = _run(up, calls)
    assert r.status_code == 400 and "nested too deeply" in r.text
    assert up.seen == []


def test_models_forwards_authorization():
    up = Upstreams()
    r, _ = _run(up, lambda c: c.get("/v1/models", headers={"authorization": "Bearer k"}))
    assert r.status_code == 200 and r.json() == {"auth": "Bearer k"}


def test_responses_go_prefill_then_decode_with_the_handle():
    up = Upstreams()

    async def calls(c):
        return await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 9,
                                                   "background": True})
    r, _ = _run(up, calls)
    assert r.status_code == 200
    (p_url, p_body, _), (d_url, d_body, _) = up.seen
    assert p_url == P + "/v1/responses" and d_url == D + "/v1/responses"
    # The decode leg's response is the stored (or background) one; the prefill leg's is not.
    assert p_body == {"input": "hi", "max_output_tokens": 1, "stream": False, "store": False,
                      "kv_transfer_params": {"do_remote_decode": True}}
    assert d_body == {"input": "hi", "max_output_tokens": 9, "background": True,
                      "kv_transfer_params": HANDLE}


def test_stored_responses_live_on_the_decode_instance_that_stored_them():
    """Two decode instances, `resp_b` stored on the second: a continuation skips the
    prefill leg and goes there, and so do GET / DELETE / input_items / cancel (query string,
    Authorization and method as they came); an unknown id gets the first's 404."""
    d2 = "http://decode2.test"
    seen: list[tuple[str, str, str]] = []

    async def upstream(request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}"
        seen.append((request.method, base + request.url.path, request.url.query.decode()))
        assert request.headers.get("authorization") == "Bearer k"
        if request.url.path.startswith("/v1/responses/"):
            held = base == d2 and "/resp_b" in request.url.path
            return httpx.Response(200 if held else 404, json={"from": base})
        return httpx.Response(200, json={"from": base})

    config = RouterConfig([P], [D, d2], max_request_bytes=1 << 20, body_read_timeout_s=5.0,
                          kv_secret=SECRET)
    app = build_app(config, httpx.MockTransport(upstream))
    auth = {"authorization": "Bearer k"}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://router", headers=auth) as c:
            out = [await c.post("/v1/responses", json={"input": "more",
                                                       "previous_response_id": "resp_b"})]
            continued = [url for method, url, _ in seen if method == "POST"]
            for method, path in [("GET", "/v1/responses/resp_b"),
                                 ("GET", "/v1/responses/resp_b/input_items?order=asc"),
                                 ("POST", "/v1/responses/resp_b/cancel"),
                                 ("DELETE", "/v1/responses/resp_b"),
                                 ("GET", "/v1/responses/resp_x")]:
                seen.clear()
                out.append(await c.request(method, path))
                out.append(seen[-1])
            return out, continued
    out, continued = asyncio.run(go())
    assert out[0].status_code == 200 and out[0].json() == {"from": d2}
    assert continued == [d2 + "/v1/responses"]                  # no prefill leg
    assert [r.status_code for r in out[1::2]] == [200, 200, 200, 200, 404]
    assert out[2::2] == [("GET", d2 + "/v1/responses/resp_b", ""),
                         ("GET", d2 + "/v1/responses/resp_b/input_items", "order=asc"),
                         ("POST", d2 + "/v1/responses/resp_b/cancel", ""),
                         ("DELETE", d2 + "/v1/responses/resp_b", ""),
                         ("GET", D + "/v1/responses/resp_x", "")]


def test_the_prefill_leg_is_signed_with_the_kv_secret():
    """Only the router may ask a prefill instance for a KV handle: its leg carries a header
    that verifies, once, with the secret over exactly the body sent (the decode leg, which
    asks for none, carries none)."""
    up = Upstreams()

    async def calls(c):
        return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9})
    r, _ = _run(up, calls)
    assert r.status_code == 200
    (p_url, p_body, p_headers), (_, _, d_headers) = up.seen
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True}
    digest = hashlib.sha256(up.raw[0]).digest()
    auth = PeerAuth(SECRET)
    assert auth.problem(p_headers[HEADER], "POST", "/v1/completions", digest) is None
    assert "already used" in auth.problem(p_headers[HEADER], "POST", "/v1/completions", digest)
    assert "does not verify" in PeerAuth(b"x" * 32).problem(p_headers[HEADER], "POST",
                                                            "/v1/completions", digest)
    assert HEADER not in d_headers
    old = sign_request(SECRET, "POST", "/v1/completions", up.raw[0], now=time.time() - 3600)
    assert "stale" in auth.problem(old, "POST", "/v1/completions", digest)


@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"prompt": ["a", "b"]}, {"prompt": "hi",
                                                                              "n": 2}])
def test_clients_cannot_send_kv_handles(body):
    up = Upstreams()

    async def calls(c):
        return await c.post("/v1/completions", json={**body, "kv_transfer_params": HANDLE})
    r, _ = _run(up, calls)
    assert r.status_code == 400 and "set by the router, not by clients" in r.text
    assert up.seen == []


def test_the_router_does_not_start_without_the_kv_secret(monkeypatch, capsys, tmp_path):
    """It could not sign a prefill leg (each would get a 403): a one-line error naming the
    environment variable and the flag, before anything listens."""
    from wideserve.entrypoints import cli
    from wideserve.entrypoints import router as router_cli
    monkeypatch.delenv("WIDESERVE_KV_SECRET", raising=False)
    argv = ["router", "--prefill", "http://a", "--decode", "http://b"]
    args = cli.build_parser(argv).parse_args(argv)
    assert router_cli.run(args) == 2
    err = capsys.readouterr().err
    assert "$WIDESERVE_KV_SECRET" in err and "--kv-secret-file" in err
    args.kv_secret_file = str(tmp_path / "missing")
    assert router_cli.run(args) == 2
    assert "--kv-secret-file" in capsys.readouterr().err
