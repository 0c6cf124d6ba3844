"""The P/D router: an OpenAI-compatible proxy over prefill and decode instances.

Per request (/v1/completions, /v1/chat/completions):
  1. prefill leg: the body with max_tokens = 1, stream off and
     `kv_transfer_params: {"do_remote_decode": true}` to the least-loaded prefill instance;
     its response carries the KV handle (`kv_transfer_params`).
  2. decode leg: the original body plus that handle to the least-loaded decode instance; its
     response (SSE passed through as it arrives, or JSON) goes to the client.
A prefill leg that fails with a 4xx is the client's error and is returned as is. One that
fails otherwise (instance down, 5xx, no handle) sends the request to decode without a
handle: the decode instance computes the prompt itself, and `wideserve_router_remote_kv`
counts it as not used (so P/D silently running as plain serving shows in the metrics).
Requests P/D cannot serve (n > 1, several prompts) go straight to decode.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.background import BackgroundTask

logger = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(slots=True)
class RouterConfig:
    prefill: list[str]
    decode: list[str]
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
    def __init__(self, config: RouterConfig) -> None:
        if not config.prefill or not config.decode:
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        self.config = config
        self.prefill = Pool([Instance(u, "prefill") for u in config.prefill])
        self.decode = Pool([Instance(u, "decode") for u in config.decode])
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None))

    def _enter(self, inst: Instance) -> None:
        inst.in_flight += 1
        self.metrics.in_flight.labels(inst.role, inst.url).set(inst.in_flight)

    def _leave(self, inst: Instance) -> None:
        inst.in_flight -= 1
        self.metrics.in_flight.labels(inst.role, inst.url).set(inst.in_flight)

    async def handle(self, route: str, body: dict[str, Any], headers: dict[str, str]
                     ) -> Response:
        arrival = time.monotonic()
        params = None
        if _pd_capable(body):
            early, params = await self._prefill(route, body, headers)
            if early is not None:
                self.metrics.requests.labels(route, "prefill_rejected").inc()
                return early
        self.metrics.remote_kv.labels("true" if params else "false").inc()
        decode_body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        if params:
            decode_body["kv_transfer_params"] = params
        return await self._decode(route, decode_body, headers, arrival)

    async def _prefill(self, route: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> tuple[Response | None, dict[str, Any] | None]:
        leg = {k: v for k, v in body.items() if k != "stream_options"}
        leg.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
        inst = self.prefill.pick()
        self._enter(inst)
        start = time.monotonic()
        try:
            r = await self.client.post(inst.url + route, json=leg, headers=headers)
        except httpx.HTTPError as e:
            logger.warning("prefill leg on %s failed: %s", inst.url, e)
            self.metrics.upstream_errors.labels("prefill", inst.url).inc()
            return None, None
        finally:
            self._leave(inst)
        self.metrics.prefill_s.observe(time.monotonic() - start)
        if 400 <= r.status_code < 500:
            return Response(r.content, r.status_code, media_type="application/json"), None
        if r.status_code != 200:
            self.metrics.upstream_errors.labels("prefill", inst.url).inc()
            return None, None
        params = r.json().get("kv_transfer_params")
        return None, params if isinstance(params, dict) else None

    async def _decode(self, route: str, body: dict[str, Any], headers: dict[str, str],
                      arrival: float) -> Response:
        inst = self.decode.pick()
        self._enter(inst)
        try:
            req = self.client.build_request("POST", inst.url + route, json=body,
                                            headers=headers)
            r = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            self._leave(inst)
            self.metrics.upstream_errors.labels("decode", inst.url).inc()
            self.metrics.requests.labels(route, "decode_unreachable").inc()
            return JSONResponse({"error": {"message": f"decode instance unreachable: {e}",
                                           "type": "upstream_error", "code": 502}}, 502)
        self.metrics.requests.labels(route, str(r.status_code)).inc()
        first = True

        async def relay():
            nonlocal first
            async for chunk in r.aiter_raw():
                if first:
                    self.metrics.ttft_s.observe(time.monotonic() - arrival)
                    first = False
                yield chunk

        async def close() -> None:
            await r.aclose()
            self._leave(inst)

        return StreamingResponse(relay(), status_code=r.status_code,
                                 media_type=r.headers.get("content-type"),
                                 background=BackgroundTask(close))

    async def models(self) -> Response:
        inst = self.decode.pick()
        try:
            r = await self.client.get(inst.url + "/v1/models")
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"decode instance unreachable: {e}",
                                           "type": "upstream_error", "code": 502}}, 502)
        return Response(r.content, r.status_code, media_type="application/json")


def _pd_capable(body: dict[str, Any]) -> bool:
    if body.get("n", 1) != 1:
        return False
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return not (several and len(prompt) > 1)


def build_app(config: RouterConfig) -> FastAPI:
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.client.aclose()

    app = FastAPI(title="wideserve router", lifespan=lifespan)
    app.state.router = router

    async def proxy(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return JSONResponse({"error": {"message": f"invalid JSON body: {e}",
                                           "type": "invalid_request_error", "code": 400}}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body must be a JSON object",
                                           "type": "invalid_request_error", "code": 400}}, 400)
        if "kv_transfer_params" in body:
            # Only the router passes KV handles, minted by a prefill instance: a client's could
            # name another request's KV (docs/disaggregation.md, "Threat model").
            return JSONResponse({"error": {"message": "kv_transfer_params is set by the router, "
                                           "not by clients", "type": "invalid_request_error",
                                           "param": "kv_transfer_params", "code": 400}}, 400)
        auth = request.headers.get("authorization")
        headers = {"authorization": auth} if auth else {}
        return await router.handle(request.url.path, body, headers)

    for route in ROUTES:
        app.add_api_route(route, proxy, methods=["POST"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])

    async def health() -> Response:
        return JSONResponse({"prefill": [i.url for i in router.prefill.instances],
                             "decode": [i.url for i in router.decode.instances]})

    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry),
                        media_type="text/plain; version=0.0.4")

    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
