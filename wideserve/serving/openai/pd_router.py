"""The P/D router: an OpenAI-compatible proxy over prefill and decode instances.

Per request (/v1/completions, /v1/chat/completions, /v1/responses):
  1. prefill leg: the body with one output token, stream off and
     `kv_transfer_params: {"do_remote_decode": true}` to the least-loaded prefill instance;
     its response carries the KV handle (`kv_transfer_params`, signed by the instance).
  2. decode leg: the original body plus that handle to the least-loaded decode instance; its
     response (SSE passed through as it arrives, or JSON) goes to the client. A stream the
     decode instance cuts (it died) ends with an SSE error event and `data: [DONE]`.
Clients never send `kv_transfer_params` (400): a handle only ever comes from a prefill leg.
The router signs each prefill leg with the shared KV secret (disagg/peer_auth.py): a prefill
instance mints handles for nobody else.
The body limit, its read timeout and the Content-Type check are the API server's own
(serving/openai/serving.py).
A prefill leg that fails with a 4xx is the client's error and is returned as is. One that
fails otherwise (instance down, 5xx, no handle) sends the request to decode without a
handle: the decode instance computes the prompt itself, and `wideserve_router_remote_kv`
counts it as not used (so P/D silently running as plain serving shows in the metrics).
Requests P/D cannot serve (n > 1, several prompts) go straight to decode.

The Responses API's state lives on the decode instances (docs/disaggregation.md, "The
Responses API with state"): a prefill leg is sent with `store: false` and without
`background`, so nothing is stored on a prefill instance; a request that continues a stored
conversation (`previous_response_id`) goes straight to the decode instance that holds it,
which has the conversation and, in its prefix cache, the KV of all but the new input; and
GET / DELETE /v1/responses/{id}, its input_items and cancel go to that instance too.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.background import BackgroundTask

from wideserve.disagg import peer_auth
from wideserve.serving.openai.serving import ApiError, read_body

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
HEALTH_TIMEOUT_S = 2.0


@dataclass(slots=True)
class RouterConfig:
    prefill: list[str]
    decode: list[str]
    max_request_bytes: int                  # the API server's limits (entrypoints/serve.py)
    body_read_timeout_s: float | None
    kv_secret: bytes                        # signs the prefill legs (disagg/peer_auth.py)
    timeout_s: float = 600.0


@dataclass(slots=True)
class Instance:
    url: str
    role: str
    in_flight: int = 0


@dataclass(slots=True)
class Pool:
    """Least in-flight requests first; ties rotate so equal instances share the load."""

    instances: list[Instance]
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> Instance:
        start = next(self._turn) % len(self.instances)
        order = self.instances[start:] + self.instances[:start]
        return min(order, key=lambda i: i.in_flight)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("wideserve_router_requests", "Requests by route and outcome",
                                ["route", "outcome"], registry=r)
        self.remote_kv = Counter("wideserve_router_remote_kv",
                                 "Requests decoded with (used=true) or without a KV handle",
                                 ["used"], registry=r)
        self.upstream_errors = Counter("wideserve_router_upstream_errors",
                                       "Failed upstream calls", ["role", "url"], registry=r)
        self.in_flight = Gauge("wideserve_router_in_flight", "Requests in flight per instance",
                               ["role", "url"], registry=r)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.prefill_s = Histogram("wideserve_router_prefill_seconds",
                                   "Prefill leg latency", registry=r, buckets=buckets)
        self.ttft_s = Histogram("wideserve_router_time_to_first_byte_seconds",
                                "Arrival to the decode leg's first response byte",
                                registry=r, buckets=buckets)


class Router:
    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        if not config.prefill or not config.decode:
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        self.config = config
        self.prefill = Pool([Instance(u, "prefill") for u in config.prefill])
        self.decode = Pool([Instance(u, "decode") for u in config.decode])
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None),
                                        transport=transport)

    def _enter(self, inst: Instance) -> Callable[[], None]:
        """Count a call in flight on `inst`; returns its leave, safe to call more than once
        (every path out of a call calls it: errors, a cut stream, a client gone)."""
        inst.in_flight += 1
        self.metrics.in_flight.labels(inst.role, inst.url).set(inst.in_flight)
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                inst.in_flight -= 1
                self.metrics.in_flight.labels(inst.role, inst.url).set(inst.in_flight)
        return leave

    async def owner(self, response_id: str, headers: dict[str, str]) -> Instance:
        """The decode instance that stores `response_id` (each instance has its own store);
        with one decode instance, that one. None answering 200: the first, whose 404 the
        client then gets."""
        instances = self.decode.instances
        if len(instances) == 1:
            return instances[0]

        async def holds(inst: Instance) -> bool:
            try:
                r = await self.client.get(f"{inst.url}/v1/responses/{response_id}",
                                          headers=headers, timeout=HEALTH_TIMEOUT_S)
            except httpx.HTTPError:
                return False
            return r.status_code == 200
        found = await asyncio.gather(*(holds(i) for i in instances))
        return next((i for i, ok in zip(instances, found) if ok), instances[0])

    async def handle(self, route: str, body: dict[str, Any], headers: dict[str, str]
                     ) -> Response:
        arrival = time.monotonic()
        params = None
        target = None
        previous = body.get("previous_response_id") if route == "/v1/responses" else None
        if isinstance(previous, str):
            # The conversation and most of its KV are on the decode instance that stored it.
            target = await self.owner(previous, headers)
        elif _pd_capable(body):
            early, params = await self._prefill(route, body, headers)
            if early is not None:
                self.metrics.requests.labels(route, "prefill_rejected").inc()
                return early
        self.metrics.remote_kv.labels("true" if params else "false").inc()
        decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params:
            decode_body["kv_transfer_params"] = params
        return await self._decode(route, decode_body, headers, arrival, target)

    async def _prefill(self, route: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> tuple[Response | None, dict[str, Any] | None]:
        leg = {k: v for k, v in body.items() if k != "stream_options"}
        leg.update(stream=False, kv_transfer_params={"do_remote_decode": True})
        if route == "/v1/responses":
            # The decode leg's response is the one stored (or run in the background).
            leg.pop("background", None)
            leg.update(max_output_tokens=1, store=False)
        else:
            leg["max_tokens"] = 1
            if "max_completion_tokens" in leg:
                leg["max_completion_tokens"] = 1
        inst = self.prefill.pick()
        url = inst.url + route
        content = json.dumps(leg).encode()
        signed = {**headers, "content-type": "application/json", peer_auth.HEADER:
                  peer_auth.sign_request(self.config.kv_secret, "POST", httpx.URL(url).path,
                                         content)}
        leave = self._enter(inst)
        start = time.monotonic()
        try:
            r = await self.client.post(url, content=content, headers=signed)
        except httpx.HTTPError as e:
            logger.warning("prefill leg on %s failed: %s", inst.url, e)
            self.metrics.upstream_errors.labels("prefill", inst.url).inc()
            return None, None
        finally:
            leave()
        self.metrics.prefill_s.observe(time.monotonic() - start)
        if 400 <= r.status_code < 500:
            return Response(r.content, r.status_code, media_type="application/json"), None
        if r.status_code != 200:
            self.metrics.upstream_errors.labels("prefill", inst.url).inc()
            return None, None
        try:
            params = r.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        return None, params if isinstance(params, dict) else None

    async def _decode(self, route: str, body: dict[str, Any], headers: dict[str, str],
                      arrival: float, inst: Instance | None = None) -> Response:
        inst = inst or self.decode.pick()
        leave = self._enter(inst)
        try:
            req = self.client.build_request("POST", inst.url + route, json=body,
                                            headers=headers)
            r = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            leave()
            return self._decode_failed(route, inst, e)
        self.metrics.requests.labels(route, str(r.status_code)).inc()
        media = r.headers.get("content-type", "")
        if not media.startswith("text/event-stream"):
            # A JSON answer is read whole: a decode instance that dies mid-body gets a 502,
            # not a truncated 200.
            try:
                content = await r.aread()
            except httpx.HTTPError as e:
                return self._decode_failed(route, inst, e)
            finally:
                await r.aclose()
                leave()
            self.metrics.ttft_s.observe(time.monotonic() - arrival)
            return Response(content, r.status_code, media_type=media or None)
        return StreamingResponse(self._relay(r, route, inst, arrival, leave),
                                 status_code=r.status_code, media_type=media,
                                 background=BackgroundTask(_close, r, leave))

    async def _relay(self, r: httpx.Response, route: str, inst: Instance, arrival: float,
                     leave: Callable[[], None]) -> AsyncIterator[bytes]:
        """The decode leg's SSE, passed through; if the instance cuts it, an error event and
        `[DONE]` end it properly (clients see why, instead of a stream that just stops)."""
        first, tail = True, b"\n\n"
        try:
            async for chunk in r.aiter_raw():
                if first:
                    self.metrics.ttft_s.observe(time.monotonic() - arrival)
                    first = False
                tail = (tail + chunk)[-2:]
                yield chunk
        except httpx.HTTPError as e:
            logger.warning("decode stream from %s was cut: %s", inst.url, e)
            self.metrics.upstream_errors.labels("decode", inst.url).inc()
            self.metrics.requests.labels(route, "decode_stream_cut").inc()
            error = {"error": {"message": f"the decode instance stopped mid-stream: "
                                          f"{type(e).__name__}", "type": "upstream_error",
                               "code": 502}}
            # Finish a half-sent event first, so the error is an event of its own.
            pad = b"" if tail == b"\n\n" else b"\n\n" if not tail.endswith(b"\n") else b"\n"
            yield pad + b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await _close(r, leave)

    def _decode_failed(self, route: str, inst: Instance, e: Exception) -> Response:
        self.metrics.upstream_errors.labels("decode", inst.url).inc()
        self.metrics.requests.labels(route, "decode_unreachable").inc()
        return JSONResponse({"error": {"message": f"decode instance unreachable: {e}",
                                       "type": "upstream_error", "code": 502}}, 502)

    async def models(self, request: Request) -> Response:
        inst = self.decode.pick()
        auth = request.headers.get("authorization")
        try:
            r = await self.client.get(inst.url + "/v1/models",
                                      headers={"authorization": auth} if auth else {})
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"decode instance unreachable: {e}",
                                           "type": "upstream_error", "code": 502}}, 502)
        return Response(r.content, r.status_code, media_type="application/json")

    async def stored(self, request: Request) -> Response:
        """GET / DELETE /v1/responses/{id}, its input_items and cancel: passed to the decode
        instance that stores the response, query string and body as they came."""
        auth = request.headers.get("authorization")
        headers = {"authorization": auth} if auth else {}
        inst = await self.owner(request.path_params["response_id"], headers)
        content = await request.body()
        if content:
            headers["content-type"] = request.headers.get("content-type", "application/json")
        try:
            r = await self.client.request(request.method, inst.url + request.url.path,
                                          params=request.query_params, content=content,
                                          headers=headers)
        except httpx.HTTPError as e:
            return self._decode_failed(request.url.path, inst, e)
        return Response(r.content, r.status_code,
                        media_type=r.headers.get("content-type") or None)

    async def _healthy(self, inst: Instance) -> bool:
        try:
            r = await self.client.get(inst.url + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def health(self) -> Response:
        """200 when at least one prefill and one decode instance answer their /health."""
        pools = (self.prefill.instances, self.decode.instances)
        checks = await asyncio.gather(*(self._healthy(i) for p in pools for i in p))
        up = dict(zip((i.url for p in pools for i in p), checks))
        body = {role: {i.url: up[i.url] for i in p} for role, p in zip(("prefill", "decode"),
                                                                        pools)}
        ok = all(any(up[i.url] for i in p) for p in pools)
        return JSONResponse(body, 200 if ok else 503)


async def _close(r: httpx.Response, leave: Callable[[], None]) -> None:
    try:
        await r.aclose()
    finally:
        leave()


def _pd_capable(body: dict[str, Any]) -> bool:
    if body.get("n", 1) != 1:
        return False
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return not (several and len(prompt) > 1)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(ApiError(status, message, param=param).body(), status)


def build_app(config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
              ) -> FastAPI:
    router = Router(config, transport)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.client.aclose()

    app = FastAPI(title="wideserve router", lifespan=lifespan)
    app.state.router = router

    async def proxy(request: Request) -> Response:
        try:        # the API server's limit, read timeout and Content-Type check
            raw = await read_body(request, config.max_request_bytes, config.body_read_timeout_s)
        except ApiError as e:
            return JSONResponse(e.body(), e.status)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _error(400, f"invalid JSON body: {e}")
        except RecursionError:
            return _error(400, "Malformed JSON body: nested too deeply")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if "kv_transfer_params" in body:
            # Only the router passes KV handles, minted by a prefill instance: a client's could
            # name another request's KV (docs/disaggregation.md, "Threat model").
            return _error(400, "kv_transfer_params is set by the router, not by clients",
                          "kv_transfer_params")
        auth = request.headers.get("authorization")
        headers = {"authorization": auth} if auth else {}
        try:
            return await router.handle(request.url.path, body, headers)
        except RecursionError:      # nested too deeply to re-encode for the upstream
            return _error(400, "Malformed JSON body: nested too deeply")

    for route in ROUTES:
        app.add_api_route(route, proxy, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", router.stored, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", router.stored,
                      methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", router.stored, methods=["POST"])

    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
