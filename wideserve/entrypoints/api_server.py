"""The HTTP front end: FastAPI routes over an AsyncEngine, and `serve_forever` (startup and
orderly shutdown of both processes).

    client --HTTP--> [this process: parse, tokenise, template, detokenise, stream]
                          |  ZMQ + msgpack (engine_ipc)
                          v
                     [engine-core process: schedule, execute, sample]

Errors are always OpenAI's shape. Only /health, /metrics, /version and /ping are reachable
without the API key when one is set.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
import uvicorn
import uvloop
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from wideserve import __version__
from wideserve.text.chat_templates import load_chat_template
from wideserve.config import EngineConfig
from wideserve.disagg.peer_auth import peer_auth_for
from wideserve.serving.arrivals import ArrivalMiddleware
from wideserve.serving.engine_client import EngineCoreClient, EngineStartupError
from wideserve.serving.dp_client import DPEngineClient
from wideserve.serving.dp_metrics import DPStatsCollector
from wideserve.serving.anthropic import serving as anthropic_serving
from wideserve.serving.anthropic.convert import error_body as anthropic_error_body
from wideserve.serving.openai import serving_chat, serving_completions, serving_responses
from wideserve.serving.openai.serving_chat import chat_options
from wideserve.serving.openai.images import ImageSupport
from wideserve.serving.openai.async_engine import AsyncEngine
from wideserve.serving.openai.server_metrics import ServerMetrics, cache_config_info
from wideserve.serving.openai.supervision import ExitOnEngineDeath
from wideserve.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                               DetokenizeRequest, TokenizeChatRequest,
                                               TokenizeCompletionRequest)
from wideserve.serving.openai.serving import (ApiError, ServingContext, engine_unavailable,
                                              load_generation_defaults, shutting_down)
from wideserve.serving.openai.serving import read_body as serving_read_body
from wideserve.serving.openai.limits import request_limits_from_args
from wideserve.serving.openai.openapi import build_openapi
from wideserve.serving.openai.transport import protocol_with_header_timeout
from wideserve.serving.startup import startup_summary
from wideserve.text.tokenizer import Tokenizer

logger = logging.getLogger("wideserve.server")
DP_FAILURE_GRACE_S = 2.0
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping", "/openapi.json"})
# Seconds uvicorn waits for open responses after SIGTERM before cancelling them.
SHUTDOWN_GRACE_S = 5


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): it must not touch the body or disconnect events."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()          # x-api-key, as Anthropic clients send it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if secrets.compare_digest(headers.get(b"authorization", b""), self.expected) \
                or secrets.compare_digest(headers.get(b"x-api-key", b""), self.key):
            await self.app(scope, receive, send)
            return
        error = ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' "
                              "or 'x-api-key: <key>'", code="invalid_api_key")
        body = anthropic_error_body(401, error.message) \
            if scope["path"].startswith("/v1/messages") else error.body()
        await JSONResponse(body, status_code=401)(scope, receive, send)


def build_app(ctx: ServingContext, *, api_key: str | None = None,
              max_request_bytes: int = 64 << 20, debug_endpoints: bool = False,
              on_shutdown: Any = None, body_timeout: float | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        if on_shutdown is not None:
            await on_shutdown()

    app = FastAPI(title="wideserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    # Set when shutdown begins: open streams then end with an error event and [DONE].
    app.state.stopping = asyncio.Event()
    _add_error_handlers(app, ctx)
    _add_routes(app, ctx, max_request_bytes, debug_endpoints, body_timeout)
    arrivals = getattr(ctx.engine, "arrivals", None)
    if arrivals is not None:        # inside the API-key check: refused requests never count
        app.add_middleware(ArrivalMiddleware, counter=arrivals)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def _add_error_handlers(app: FastAPI, ctx: ServingContext) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        if ctx.metrics is not None and request.url.path.startswith("/v1/") \
                and 400 <= exc.status < 500:
            ctx.metrics.observe_rejected()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        # 405 carries Allow (RFC 9110); Starlette puts it on the exception.
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        err = ApiError(500, f"Internal server error ({type(exc).__name__})",
                       type_="server_error")
        return JSONResponse(err.body(), status_code=500)


ReadBody = Callable[[Request], Awaitable[bytes]]
Parse = Callable[[Any, Request], Awaitable[Any]]


def _add_routes(app: FastAPI, ctx: ServingContext, limit: int, debug: bool,
                body_timeout: float | None) -> None:
    """Every route, in this order: OpenAI, Anthropic, service (schema, models, health,
    metrics), tokenizer, and the debug routes when asked for."""

    async def read_body(request: Request) -> bytes:
        return await serving_read_body(request, limit, body_timeout)

    async def parse(model: Any, request: Request) -> Any:
        body = await read_body(request)
        req = await ctx.parse(model, body)
        await ctx.check_kv_peer(req, request, body)        # a KV handle: the router's only
        return req

    _add_openai_routes(app, ctx, parse)
    anthropic_serving.add_routes(app, ctx, read_body)     # /v1/messages
    _add_service_routes(app, ctx)
    _add_tokenizer_routes(app, ctx, read_body)
    if debug:
        _add_debug_routes(app, ctx)


def _add_openai_routes(app: FastAPI, ctx: ServingContext, parse: Parse) -> None:
    """/v1/completions, /v1/chat/completions, /v1/responses (serving/openai/), and a clear
    404 for /v1/embeddings."""

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse(CompletionRequest, request)
        return await serving_completions.create_completion(ctx, req, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await parse(ChatCompletionRequest, request)
        return await serving_chat.create_chat_completion(ctx, req, request)

    serving_responses.add_response_routes(app, ctx, parse)    # POST, GET, DELETE, ...

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        raise ApiError(404, f"/v1/embeddings: {ctx.model_name!r} is a generative model; this "
                            "server does not compute embeddings", type_="not_found_error",
                       code="embeddings_not_supported")


def _add_service_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The schema, the model list, health, version and the Prometheus metrics."""
    created = int(time.time())
    schema = build_openapi({"/v1/responses": serving_responses.ResponsesRequest})

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(schema)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        root = str(ctx.engine.client.model_info.get("name", ctx.model_name))
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "wideserve",
             "root": root, "parent": None, "max_model_len": ctx.max_model_len}
            for name in ctx.served_names]}

    @app.get("/health")
    async def health() -> Response:
        ok, detail = ctx.engine.client.health()
        if ok:
            return Response(status_code=200)
        return JSONResponse(engine_unavailable(detail).body(), status_code=503)

    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = ctx.metrics.render() if ctx.metrics is not None else b""
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_tokenizer_routes(app: FastAPI, ctx: ServingContext, read_body: ReadBody) -> None:
    """vLLM's /tokenize (a prompt or chat messages) and /detokenize."""
    tok = ctx.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        try:   # only the top-level keys (Raw values: nothing below them is built)
            keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            keys = {}                       # ctx.parse below reports the malformed body
        is_chat = "messages" in keys
        if is_chat:
            chat_req = await ctx.parse(TokenizeChatRequest, body)
            ctx.check_model(chat_req.model)
            prompt = await ctx.within_deadline(ctx.off_loop(
                serving_chat.render_prompt, ctx, chat_req.messages,
                chat_req.add_generation_prompt, chat_req.continue_final_message, None,
                chat_req.chat_template_kwargs))
            ids = await ctx.encode(prompt, False, "messages")
        else:
            text_req = await ctx.parse(TokenizeCompletionRequest, body)
            ctx.check_model(text_req.model)
            ids = await ctx.encode(text_req.prompt, text_req.add_special_tokens)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await ctx.parse(DetokenizeRequest, await read_body(request))
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        return {"prompt": tok.decode(req.tokens)}


def _add_debug_routes(app: FastAPI, ctx: ServingContext) -> None:
    """--enable-debug-endpoints: the KV pool's integrity check and the engine's counters."""

    @app.get("/debug/kv_integrity")
    async def kv_integrity() -> JSONResponse:
        """The KV pool's idle invariant (free + cached + used == pool) and the stats."""
        ctx.check_alive()
        try:
            await ctx.engine.client.call_utility("check_integrity")
            ok, detail = True, "ok"
        except RuntimeError as e:
            ok, detail = False, str(e)
        stats = await ctx.engine.client.call_utility("get_stats")
        return JSONResponse({"ok": ok, "detail": detail, "stats": stats,
                             "in_flight": ctx.engine.num_in_flight})

    @app.get("/debug/stats")
    async def debug_stats() -> JSONResponse:
        """The engine's scheduler and KV-cache counters."""
        ctx.check_alive()
        stats = await ctx.engine.client.call_utility("get_stats")
        return JSONResponse({"stats": stats, "in_flight": ctx.engine.num_in_flight})


# ----------------------------------------------------------------------------- startup

def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it the first body write after the headers waits for a delayed ACK (~40 ms).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # inherited by accepted ones
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def _model_path(config: EngineConfig) -> Path:
    """The model directory (or .gguf file), found without importing torch when given."""
    if config.load.model is not None:
        path = Path(config.load.model).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model path {config.load.model!r} does not exist")
        return path
    from wideserve.worker.model_loader import resolve_model_path
    return resolve_model_path(None)


def _load_frontend(args: Any, config: EngineConfig) -> tuple[Tokenizer, dict[str, Any]]:
    model_path = _model_path(config)
    tokenizer = Tokenizer.from_pretrained(config.load.tokenizer or model_path)
    if getattr(args, "chat_template", None):
        tokenizer.chat_template = load_chat_template(args.chat_template)
    defaults = load_generation_defaults(args.generation_config,
                                        model_path if model_path.is_dir() else None)
    return tokenizer, defaults


class _Server(uvicorn.Server):
    """uvicorn.Server that, when shutdown begins, first sets `stopping` and fails every open
    request: streams end with an error event and [DONE] well inside the grace period, not
    as cut bodies (and no CancelledError from uvicorn cancelling them)."""

    def __init__(self, config: uvicorn.Config, stopping: asyncio.Event,
                 engine: AsyncEngine) -> None:
        super().__init__(config)
        self.stopping = stopping
        self.engine = engine

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.stopping.set()
        self.engine.fail_all(shutting_down())
        await super().shutdown(sockets)


def serve_forever(args: Any, config: EngineConfig) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"wideserve serve: error: cannot listen on {args.host}:{args.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 1
    try:
        # uvloop, as vLLM's server runs: the event loop's own overhead per wake-up (each
        # streamed token of each request) is a part of the front end's per-token cost.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_serve(args, config, sock))
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()


EngineClient = EngineCoreClient | DPEngineClient


def _engine_client(args: Any, config: EngineConfig) -> EngineClient:
    timeouts = {"stale_after_s": args.engine_heartbeat_timeout,
                "stall_timeout_s": args.engine_stall_timeout}    # every rank's too
    if config.parallel.enabled:
        return DPEngineClient(config, prefix_affinity=getattr(args, "dp_prefix_affinity", False),
                              **timeouts)
    return EngineCoreClient(config, **timeouts)


async def _start_engine(args: Any, config: EngineConfig, client: EngineClient
                        ) -> tuple[Tokenizer, dict[str, Any], dict[str, Any]]:
    """Start the engine; the tokenizer loads here meanwhile. (tokenizer, sampling defaults,
    the engine's model info)."""
    starting = asyncio.create_task(client.start())
    try:
        tokenizer, defaults = await asyncio.to_thread(_load_frontend, args, config)
    except BaseException:
        starting.cancel()
        raise
    return tokenizer, defaults, await starting


def _serving_context(args: Any, config: EngineConfig, client: EngineClient,
                     tokenizer: Tokenizer, defaults: dict[str, Any],
                     info: dict[str, Any]) -> ServingContext:
    """The metrics, the async engine and what every route reads."""
    names = list(args.served_model_name or [str(info.get("name", "model"))])
    metrics = ServerMetrics(names[0], lambda: client.stats, int(info["max_model_len"]),
                            cache_config_info(info, config))
    if isinstance(client, DPEngineClient):
        metrics.registry.register(DPStatsCollector(
            lambda: client.rank_stats, names[0], lambda: client.balancer.picks))
    engine = AsyncEngine(client, tokenizer, metrics)
    client.on_step_times = metrics.observe_step_times
    kv = config.kv_transfer
    return ServingContext(engine, tokenizer, names, int(info["max_model_len"]),
                          int(info["vocab_size"]), config.scheduler.policy, defaults,
                          metrics, chat_options(args),
                          request_limits=request_limits_from_args(args),
                          kv_secret=kv.consumer_secret() if kv else None,
                          kv_peer_auth=peer_auth_for(kv) if kv else None,
                          images=ImageSupport.from_info(
                              info, config.load.limit_mm_per_prompt.image))


def _uvicorn_server(args: Any, app: FastAPI, ctx: ServingContext) -> _Server:
    return _Server(uvicorn.Config(
        app, log_level=args.log_level, access_log=args.log_level == "debug",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S, lifespan="on",
        http=protocol_with_header_timeout(args.header_read_timeout,
                                          ctx.request_limits.max_header_bytes),
        limit_concurrency=args.max_connections), app.state.stopping, ctx.engine)


async def _serve(args: Any, config: EngineConfig, sock: socket.socket) -> int:
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):        # until uvicorn takes over
        loop.add_signal_handler(sig, main_task.cancel)
    client = _engine_client(args, config)
    ctx: ServingContext | None = None
    try:
        print(f"wideserve | loading {config.load.model or 'the bundled model'} ...",
              flush=True)
        try:
            tokenizer, defaults, info = await _start_engine(args, config, client)
        except (EngineStartupError, OSError, ValueError) as e:
            print(f"wideserve serve: error: {e}", file=sys.stderr)
            return 1
        ctx = _serving_context(args, config, client, tokenizer, defaults, info)

        async def on_shutdown() -> None:
            assert ctx.pool is not None and ctx.prep is not None
            ctx.pool.close()
            ctx.prep.close()
            await client.shutdown()

        app = build_app(ctx, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                        debug_endpoints=args.enable_debug_endpoints, on_shutdown=on_shutdown,
                        body_timeout=args.body_read_timeout)
        try:
            serving_responses.configure_store(app, args)
        except ValueError as e:
            print(f"wideserve serve: error: {e}", file=sys.stderr)
            return 1
        assert ctx.pool is not None
        await asyncio.to_thread(ctx.pool.start)
        # Everything loaded so far lives as long as the server: out of the collector's sight,
        # a full collection (triggered by a request that builds many objects) stays cheap.
        gc.collect()
        gc.freeze()
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(startup_summary(info, config, ctx.served_names, ctx.max_model_len,
                              f"http://{host}:{args.port}"), flush=True)
        if defaults:
            print(f"wideserve | default sampling from generation_config: {defaults}",
                  flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            # uvicorn restores these after its graceful shutdown and re-raises the signal it
            # caught; a no-op keeps SIGTERM from killing us before the engine is shut down.
            signal.signal(sig, lambda *_: None)
        server = _uvicorn_server(args, app, ctx)
        # Data-parallel ranks fail together and are not restarted in place
        # (docs/distributed.md, "Failure"); either way the server exits non-zero.
        death = ExitOnEngineDeath(client, server, grace_s=DP_FAILURE_GRACE_S
                                  if isinstance(client, DPEngineClient) else 1.0)
        await server.serve(sockets=[sock])
        return death.exit_code
    except asyncio.CancelledError:
        return 0
    finally:
        if ctx is not None and ctx.pool is not None:
            ctx.pool.close()
        await client.shutdown()
