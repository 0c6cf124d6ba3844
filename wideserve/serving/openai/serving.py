"""What the completion and chat handlers share: errors, body parsing, prompt checks, sampling
parameters, logprob formatting, and stream plumbing.

Every way a request can be wrong is turned into an ApiError (OpenAI's error shape) before
anything reaches the engine: the model name, the body's size and JSON, the fields (protocol),
token ids against the vocabulary, and the prompt plus max_tokens against the context length.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from wideserve.serving.openai.lenient import note_ignored
from wideserve.serving.engine_client import EngineDeadError
from wideserve.disagg.params import client_handle_problem
from wideserve.disagg.peer_auth import HEADER as KV_PEER_HEADER, PeerAuth
from wideserve.serving.openai.async_engine import AsyncEngine, RequestFailed, StreamItem
from wideserve.serving.openai.input_prep import (PRESCAN_BYTES, Limits, TokenizerPool, prescan,
                                                 sequences_overflow, too_long_text)
from wideserve.serving.openai.limits import RequestLimits
from wideserve.serving.openai.logprobs_format import chat_logprobs, completion_logprobs
from wideserve.serving.openai.server_metrics import ServerMetrics
from wideserve.serving.openai.validation import clip, param_of, validation_error_to_param_message
from wideserve.types.sampling_params import SamplingParams
from wideserve.types.multimodal import ImageInput
from wideserve.text.tokenizer import Tokenizer

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
logger = logging.getLogger("wideserve.server")
# Bodies from this size on have their limits checked in a prep thread (below: inline, a few
# microseconds); from PRESCAN_BYTES on, in the tokenisation worker process.
_THREAD_CHECK_BYTES = 16 << 10
_GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                            "max_new_tokens")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        # A message of the form "field: ..." names its field; so does `param`.
        self.param = param if param is not None else param_of(message)
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def engine_unavailable(reason: str) -> ApiError:
    return ApiError(503, f"The engine is not available: {reason}", type_="service_unavailable",
                    code="engine_unavailable")


def context_error(max_len: int, prompt_len: int, max_tokens: int | None,
                  param: str) -> ApiError:
    if max_tokens is None:
        msg = (f"This model's maximum context length is {max_len} tokens. However, your "
               f"prompt has {prompt_len} tokens, which leaves no room for a completion. "
               f"Please reduce the length of the prompt.")
    else:
        msg = (f"This model's maximum context length is {max_len} tokens. However, you "
               f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
               f"{max_tokens} for the completion). Please reduce the length of the prompt "
               f"or the completion.")
    return ApiError(400, msg, param=param, code="context_length_exceeded")


def check_json_content_type(request: Request) -> None:
    """Only application/json: a browser page can POST text/plain or a form to any origin
    without a CORS preflight, so accepting those would let any web page spend our compute."""
    declared = request.headers.get("content-type")
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        got = f"got {clip(declared)}" if declared is not None else "none was sent"
        raise ApiError(415, f"Content-Type must be application/json ({got})",
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout: float | None = None) -> bytes:
    """The whole body, at most `limit` bytes, within `timeout` seconds (408 after: a client
    trickling a body must not hold a connection and a handler forever)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"Request body of {declared} bytes exceeds the limit of "
                            f"{limit} bytes", code="request_too_large")
    check_json_content_type(request)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"Request body exceeds the limit of {limit} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "Client disconnected while sending the body") from None
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within {timeout:g} s "
                            f"(--body-read-timeout)", code="request_timeout") from None
    return b"".join(chunks)


def parse_body(model: type[M], body: bytes) -> M:
    if not body.strip():
        raise ApiError(400, "Request body is empty; expected a JSON object")
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        param, message = validation_error_to_param_message(e, body)
        raise ApiError(400, message, param=param) from None
    except RecursionError:
        raise ApiError(400, "Malformed JSON body: nested too deeply") from None


def load_generation_defaults(setting: str, model_dir: Path | None) -> dict[str, Any]:
    """--generation-config: 'auto' = the model's generation_config.json, 'vllm'/'none' = no
    defaults, otherwise a directory with a generation_config.json."""
    if setting in ("vllm", "none"):
        return {}
    folder = model_dir if setting == "auto" else Path(setting)
    if folder is None or not folder.is_dir():
        if setting != "auto":
            raise ValueError(f"--generation-config: {setting!r} is not a directory")
        return {}
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config: no generation_config.json in {folder}")
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return {k: data[k] for k in _GENERATION_DEFAULT_KEYS if data.get(k) is not None}


@dataclass(slots=True)
class ChatOptions:
    """The server's chat flags (vLLM's spellings): --enable-auto-tool-choice,
    --tool-call-parser, --reasoning-parser."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


class PrepPool:
    """Request preparation off the event loop: validating tools and output constraints
    (llguidance, which drops the GIL while it builds a grammar), chat templates, the limit
    checks of mid-sized bodies. Bounded: at most `workers` run at once and a slot is freed
    only when its work has really ended (a thread cannot be stopped), so work that outlived
    its request's deadline still counts and later requests wait or time out (503) instead of
    piling up threads."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._executor = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="wideserve-prep")
        self._slots: asyncio.Semaphore | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        slots = self._slots
        await slots.acquire()
        loop = asyncio.get_running_loop()

        def release(_: Any) -> None:
            try:
                loop.call_soon_threadsafe(slots.release)
            except RuntimeError:           # the loop is closed: nothing waits any more
                pass

        try:
            future = self._executor.submit(fn, *args)
        except BaseException:
            slots.release()
            raise
        future.add_done_callback(release)
        return await asyncio.wrap_future(future)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class ServingContext:
    """Everything a handler needs; one per server."""
    engine: AsyncEngine
    tokenizer: Tokenizer
    served_names: list[str]
    max_model_len: int
    vocab_size: int
    scheduling_policy: str = "fcfs"
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    metrics: ServerMetrics | None = None
    chat: ChatOptions = field(default_factory=ChatOptions)
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    pool: TokenizerPool | None = None
    prep: PrepPool | None = None
    kv_secret: bytes | None = None      # P/D consumer: checks kv_transfer_params (disagg/)
    kv_peer_auth: PeerAuth | None = None    # P/D producer: who may ask for a KV handle
    # Image inputs: an images.ImageSupport (None: the model takes none; images.py imports this
    # module, hence Any).
    images: Any = None

    def __post_init__(self) -> None:
        if self.pool is None:
            self.pool = TokenizerPool(self.tokenizer, self.max_model_len)
        if self.prep is None:
            self.prep = PrepPool(self.request_limits.prep_workers)

    @property
    def limits(self) -> Limits:
        assert self.pool is not None
        return Limits(self.max_model_len, self.pool.chars_bound,
                      self.request_limits.max_sequences, self.request_limits)

    def log_request(self, request_id: str, num_prompt_tokens: int, user: str | None,
                    content: Any) -> None:
        """Ids and sizes only; the end user and the prompt only at debug level, and only
        with --log-request-content (prompts and user ids are the clients' data)."""
        if not logger.isEnabledFor(logging.DEBUG):
            return
        logger.debug("request %s: %d prompt tokens, user field %s", request_id,
                     num_prompt_tokens, f"of {len(user)} characters" if user else "absent")
        if self.request_limits.log_request_content:
            logger.debug("request %s content: user=%r prompt=%r", request_id, user, content)

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the bounded prep pool (see PrepPool)."""
        assert self.prep is not None
        return await self.prep.run(fn, *args)

    async def within_deadline(self, work: Awaitable[T]) -> T:
        """A request's preparation (checks, template, tokens, constraint) within
        --request-prep-timeout: past it the request is answered 503, whatever still runs."""
        timeout = self.request_limits.prep_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await work
        except TimeoutError:
            raise ApiError(503, f"The request could not be prepared (checked, templated, "
                                f"tokenised, its output constraint compiled) within "
                                f"{timeout:g} s (--request-prep-timeout): the server is busy "
                                f"or the request too complex", type_="service_unavailable",
                           code="preparation_timeout") from None

    @property
    def model_name(self) -> str:
        return self.served_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise ApiError(404, f"The model {clip(name)} does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.served_names)}",
                           param="model", code="model_not_found")

    def check_alive(self) -> None:
        ok, reason = self.engine.client.health()    # dead, or its heartbeat is stale
        if not ok:
            raise engine_unavailable(reason)

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.scheduling_policy != "priority":
            raise ApiError(400, "priority: only allowed with --scheduling-policy priority",
                           param="priority")

    async def parse(self, model: type[M], body: bytes) -> M:
        """parse_body, after a pre-scan (off the event loop) of a large body: one that cannot
        fit is rejected before pydantic spends seconds building it on the loop."""
        assert self.pool is not None
        limits = self.limits
        if len(body) >= PRESCAN_BYTES:
            rejected = await self.pool.prescan(body, limits)
        elif len(body) >= _THREAD_CHECK_BYTES:
            rejected = await self.off_loop(prescan, body, limits, False)
        else:
            rejected = prescan(body, limits, False)
        if rejected is not None:
            raise ApiError(400, rejected[1], code=rejected[0], param=rejected[2])
        return parse_body(model, body)

    def check_sequences(self, num_prompts: int, n: int) -> None:
        why = sequences_overflow(num_prompts, n, self.limits)
        if why is not None:
            raise ApiError(400, why, param="n", code="too_many_sequences")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        if len(ids) > self.max_model_len:        # O(1), before the O(n) vocabulary check
            raise context_error(self.max_model_len, len(ids), None, param)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{param}: token id {bad} is outside the vocabulary "
                                f"[0, {self.vocab_size})", param=param)

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, param: str) -> int:
        if prompt_len == 0:
            raise ApiError(400, f"{param}: the prompt is empty (0 tokens)", param=param)
        if max_tokens is None:
            default = self.generation_defaults.get("max_new_tokens")
            room = self.max_model_len - prompt_len
            if room < 1:
                raise context_error(self.max_model_len, prompt_len, None, param)
            return min(room, default) if isinstance(default, int) and default > 0 else room
        if prompt_len + max_tokens > self.max_model_len:
            raise context_error(self.max_model_len, prompt_len, max_tokens, param)
        return max_tokens

    def sampling_params(self, req: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
        d = self.generation_defaults

        def pick(value: Any, key: str, fallback: Any) -> Any:
            return value if value is not None else d.get(key, fallback)

        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        try:
            return SamplingParams(
                n=req.n, temperature=float(pick(req.temperature, "temperature", 1.0)),
                top_p=float(pick(req.top_p, "top_p", 1.0)), top_k=int(pick(req.top_k, "top_k", 0)),
                min_p=float(pick(req.min_p, "min_p", 0.0)), seed=req.seed,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop_list,
                stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                presence_penalty=float(req.presence_penalty or 0.0),
                frequency_penalty=float(req.frequency_penalty or 0.0),
                repetition_penalty=float(pick(req.repetition_penalty, "repetition_penalty", 1.0)),
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                kv_transfer_params=req.kv_transfer_params)
        except ValueError as e:
            raise ApiError(400, str(e), param=param_of(str(e)) or str(e).split(" ", 1)[0]) \
                from None

    async def check_kv_peer(self, req: Any, request: Request, body: bytes) -> None:
        """do_remote_decode (a KV handle) only for the router (disagg/peer_auth.py)."""
        why = self.kv_peer_auth and await self.kv_peer_auth.refusal(
            getattr(req, "kv_transfer_params", None), request.headers.get(KV_PEER_HEADER),
            request.method, request.url.path, body)
        if why:
            raise ApiError(403, why, param="kv_transfer_params", code="kv_peer_unauthenticated")

    def check_kv_handle(self, params: SamplingParams, ids: list[int],
                        images: list[ImageInput] | None = None) -> None:
        """A KV handle is admitted only as its producer signed it, for this prompt (its
        token ids and images)."""
        why = client_handle_problem(self.kv_secret, params.kv_transfer_params, ids, images)
        if why is not None:
            raise ApiError(400, why, param="kv_transfer_params")

    def logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias (string token ids) checked against the vocabulary."""
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            # ASCII digits only: str.isdigit() is also true for '²', which int() refuses.
            if not (key.isascii() and key.isdigit()) or int(key) >= self.vocab_size:
                raise ApiError(400, f"logit_bias: {key!r} is not a token id in "
                                    f"[0, {self.vocab_size})", param="logit_bias")
            out[int(key)] = float(value)
        return out

    async def encode(self, text: str, add_special_tokens: bool,
                     param: str = "prompt") -> list[int]:
        return (await self.encode_many([text], add_special_tokens, param))[0]

    async def encode_many(self, texts: list[str], add_special_tokens: bool,
                          param: str = "prompt") -> list[list[int]]:
        """Token ids of each text, off the event loop when long; a text that cannot fit in
        the context is a 400 (in O(1) when its length alone says so)."""
        assert self.pool is not None
        for i, text in enumerate(texts):
            why = too_long_text(param if len(texts) == 1 else f"{param}.{i}", len(text),
                                self.limits)
            if why is not None:
                raise ApiError(400, why, param=param, code="context_length_exceeded")
        out = []
        for result in await self.pool.encode_many(texts, add_special_tokens):
            if isinstance(result, int):
                raise context_error(self.max_model_len, result, None, param)
            out.append(result)
        return out

# ----------------------------------------------------------------------------- streams

async def merge_streams(gens: list[AsyncIterator[StreamItem]]
                        ) -> AsyncIterator[tuple[int, StreamItem]]:
    """Interleave several request streams (a completions call with a list of prompts).
    Closing the merged iterator closes (and so aborts) every unfinished stream."""
    if len(gens) == 1:
        try:
            async for item in gens[0]:
                yield 0, item
        finally:
            await gens[0].aclose()                   # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, StreamItem | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[StreamItem]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item, None))
            await queue.put((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the body must already have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_or_disconnect(request: Request, coro: Any) -> Any:
    """Run a non-streaming handler; if the client disconnects first, cancel it (which aborts
    its requests) and return None."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone anyway
        pass
    return None


def as_api_error(error: BaseException) -> ApiError:
    """The API error a failure mid-stream is reported as (any API's stream error event)."""
    if isinstance(error, EngineDeadError):
        return engine_unavailable(str(error))
    if isinstance(error, RequestFailed):
        return request_failed_error(error)
    if isinstance(error, ApiError):
        return error
    return ApiError(500, f"Internal error: {type(error).__name__}", type_="server_error")


def stream_error_event(error: BaseException) -> str:
    return sse(as_api_error(error).body())


def request_failed_error(error: RequestFailed) -> ApiError:
    text = str(error)
    if error.internal:
        return ApiError(500, text, type_="server_error")
    code = "context_length_exceeded" if "maximum context length" in text else None
    return ApiError(400, text, code=code)


async def final_item(stream: AsyncIterator[StreamItem]) -> StreamItem:
    """Drain one request's stream to its last item (a non-streamed response), mapping a dead
    engine to 503 and a failed request to its 4xx/5xx; the stream is closed either way."""
    final: StreamItem | None = None
    try:
        async for item in stream:
            final = item
    except EngineDeadError as e:
        raise engine_unavailable(str(e)) from None
    except RequestFailed as e:
        raise request_failed_error(e) from None
    finally:
        await stream.aclose()                                # type: ignore[attr-defined]
    assert final is not None
    return final


def sse(payload: Any) -> str:
    return f"data: {msgspec.json.encode(payload).decode()}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def shutting_down() -> ApiError:
    return ApiError(503, "The server is shutting down; this request was ended before it "
                         "finished", type_="service_unavailable", code="server_shutting_down")


async def until_shutdown(events: AsyncIterator[str], stopping: asyncio.Event
                         ) -> AsyncIterator[str]:
    """A stream's events until the server starts shutting down; then an error event and
    [DONE], so a client sees why its stream ended instead of a cut body. Checked between
    events (no task per event); a stream waiting for its first token is woken by the
    engine's fail_all at shutdown. Closing the inner stream aborts its requests."""
    try:
        async for event in events:
            if stopping.is_set():
                break
            yield event
        else:
            return
        yield sse(shutting_down().body())
        yield SSE_DONE
    finally:
        await events.aclose()                        # type: ignore[attr-defined]


def now_s() -> int:
    return int(time.time())


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's `usage` object, with the prefix-cache hit as cached_tokens."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def respond(raw: Request, stream: bool, sse: Callable[[], AsyncIterator[str]],
                  full: Callable[[], Awaitable[Any]]) -> Response:
    """Stream `sse()` (SSE lines), or await `full()` (the JSON body) unless the client
    disconnects first (then 499: cancelling `full` aborts its requests)."""
    if stream:
        stopping = getattr(raw.app.state, "stopping", None)
        events = sse() if stopping is None else until_shutdown(sse(), stopping)
        return StreamingResponse(events, media_type="text/event-stream")
    result = await collect_or_disconnect(raw, full())
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result)


async def serve_request(ctx: ServingContext, req: Any, raw: Request,
                        prepare: Callable[[ServingContext, Any], Awaitable[Any]],
                        sse: Callable[[ServingContext, Any], AsyncIterator[str]],
                        full: Callable[[ServingContext, Any], Awaitable[Any]]) -> Response:
    """One generation route (chat, completions): prepare within the deadline, stream or
    answer whole, and name the request's ignored fields in the response header."""
    ignored = note_ignored(req)
    call = await ctx.within_deadline(prepare(ctx, req))
    response = await respond(raw, req.stream, lambda: sse(ctx, call), lambda: full(ctx, call))
    response.headers.update(ignored)
    return response
