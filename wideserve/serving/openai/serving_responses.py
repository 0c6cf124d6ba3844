"""The OpenAI Responses API with state: POST /v1/responses, GET / DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel.

A request is translated to chat (responses_protocol.py) and served by serving_chat's
pipeline; the answer goes back as output items, whole, streamed (responses_stream.py), or in
the background (`background: true`: answered at once with status "queued", then polled with
GET and stopped with cancel). Unless `store: false`, the response, its input items and the
conversation so far are kept in the response store (response_store.py), so a later request's
`previous_response_id` continues it: its prompt is the stored conversation plus the new input,
which starts with the earlier prompt, so the prefix cache serves it.
"""
from __future__ import annotations

import asyncio
import logging
import sqlite3
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from wideserve.serving.engine_client import EngineDeadError
from wideserve.serving.openai.async_engine import RequestFailed
from wideserve.serving.openai.lenient import note_ignored
from wideserve.serving.openai.logprobs_format import chat_logprobs
from wideserve.serving.openai.response_store import (MemoryResponseStore, ResponseStore,
                                                     StoreConfig, make_store,
                                                     store_config_from_args)
from wideserve.serving.openai.responses_protocol import (ResponsesRequest, check_refused,
                                                         history_message, input_items,
                                                         input_messages, output_items, rid, to_chat)
from wideserve.serving.openai.responses_stream import Events
from wideserve.serving.openai.serving import (ApiError, ServingContext, engine_unavailable,
                                              final_item, request_failed_error, respond)
from wideserve.serving.openai.serving_chat import ChoiceOutput, _Call, _stream_of, prepare

logger = logging.getLogger("wideserve.server")
_INPUT_ITEMS_MAX = 100


@dataclass(slots=True)
class ResponsesState:
    """The store, and the background responses still running (their latest object)."""
    store: ResponseStore
    running: dict[str, tuple[asyncio.Task[Any], dict[str, Any]]] = field(default_factory=dict)


@dataclass(slots=True)
class _Turn:
    """One /v1/responses call, prepared."""
    ctx: ServingContext
    state: ResponsesState
    req: ResponsesRequest
    call: _Call
    rid: str
    items_in: list[dict[str, Any]]
    history_in: list[dict[str, Any]]      # the stored conversation + this input

    @property
    def max_calls(self) -> int | None:
        return self.req.max_tool_calls or None


def not_found(response_id: str, param: str | None = None) -> ApiError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    return ApiError(404, f"{what} with id {response_id!r} not found.", param=param,
                    code="previous_response_not_found" if param else "response_not_found")


def _response(turn: _Turn, status: str, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, incomplete: str | None = None,
              error: dict[str, Any] | None = None) -> dict[str, Any]:
    req, call = turn.req, turn.call
    return {
        "id": turn.rid, "object": "response", "created_at": call.created, "status": status,
        "background": req.background, "model": turn.ctx.model_name, "output": output,
        "usage": usage, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "parallel_tool_calls": call.tools.parallel, "temperature": req.temperature,
        "top_p": req.top_p, "top_logprobs": req.top_logprobs,
        "tool_choice": call.tools.mode if call.tools.mode != "named" else {
            "type": "function", "name": call.tools.named},
        "tools": [{"type": "function", **t["function"]} for t in call.tools.tools or []],
        "max_output_tokens": req.max_output_tokens, "max_tool_calls": req.max_tool_calls,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "reasoning": req.reasoning, "text": req.text or {"format": {"type": "text"}},
        "truncation": req.truncation or "disabled", "user": req.user,
        "service_tier": "default", "prompt_cache_key": req.prompt_cache_key}


def _usage(call: _Call, completion: int, cached: int) -> dict[str, Any]:
    n = len(call.token_ids)
    return {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n + completion}


async def _save(turn: _Turn, body: dict[str, Any]) -> None:
    if turn.req.store:
        await turn.state.store.put(turn.rid, {
            "response": body, "input_items": turn.items_in,
            "history": turn.history_in + [history_message(body["output"])]})


async def _history(state: ResponsesState, previous: str | None) -> list[dict[str, Any]]:
    if previous is None:
        return []
    if previous in state.running:
        raise ApiError(400, f"previous_response_id: response {previous!r} is still in "
                            "progress", param="previous_response_id")
    record = await state.store.get(previous)
    if record is None:
        raise not_found(previous, "previous_response_id")
    status = record["response"]["status"]
    if status not in ("completed", "incomplete"):
        raise ApiError(400, f"previous_response_id: response {previous!r} is {status}; only "
                            "a completed response can be continued",
                       param="previous_response_id")
    return list(record["history"])


async def create_response(ctx: ServingContext, state: ResponsesState, req: ResponsesRequest,
                          raw: Request) -> Response:
    ignored = note_ignored(req)
    check_refused(req)
    history = await _history(state, req.previous_response_id)
    call = await _prepare(ctx, req, history)
    turn = _Turn(ctx, state, req, call, rid("resp"), input_items(req),
                 history + input_messages(req))
    if req.background:
        response: Response = JSONResponse(_start_background(turn))
    else:
        response = await respond(raw, req.stream, lambda: _stream(turn),
                                 lambda: _full(turn))
    response.headers.update(ignored)
    return response


async def _prepare(ctx: ServingContext, req: ResponsesRequest,
                   history: list[dict[str, Any]]) -> _Call:
    """The chat call for this turn. With `truncation: "auto"`, a conversation over the
    context drops its earliest messages (stored turns first, then input items; the
    instructions stay), as few as needed, as OpenAI does; `disabled` (the default) leaves it
    a 400 `context_length_exceeded`."""
    try:
        return await ctx.within_deadline(prepare(ctx, to_chat(req, history)))
    except ApiError as e:
        if req.truncation != "auto" or e.code != "context_length_exceeded":
            raise
        overflow = e
    conversation = history + input_messages(req)
    bare = req.model_copy(update={"input": None})

    async def fits(drop: int) -> _Call | None:
        kept = conversation[drop:]
        while kept and kept[0]["role"] == "tool":   # a tool result without its call
            kept = kept[1:]
        if not kept:
            return None
        try:
            return await ctx.within_deadline(prepare(ctx, to_chat(bare, kept)))
        except ApiError as err:
            if err.code != "context_length_exceeded":
                raise
            return None
    # Fewer messages, shorter prompt: the fewest to drop is found by bisection.
    lo, hi, best = 1, len(conversation) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        call = await fits(mid)
        if call is None:
            lo = mid + 1
        else:
            best, hi = call, mid - 1
    if best is None:        # even the last message alone is over the context
        raise overflow
    return best


async def _full(turn: _Turn) -> dict[str, Any]:
    ctx, call = turn.ctx, turn.call
    final = await final_item(_stream_of(ctx, call))
    co = final.output.outputs[0]
    choice = ChoiceOutput(call)
    choice.text = co.text
    logprobs = None
    if turn.req.wants_logprobs and co.logprobs is not None:
        logprobs = chat_logprobs(ctx.tokenizer, co.logprobs, co.token_ids,
                                 call.num_logprobs or 0)["content"]
    length = co.finish_reason == "length"
    body = _response(turn, "incomplete" if length else "completed",
                     output_items(choice.message(), turn.req.include, logprobs,
                                  turn.max_calls),
                     _usage(call, len(co.token_ids), final.output.num_cached_tokens),
                     "max_output_tokens" if length else None)
    if final.output.kv_transfer_params is not None:     # a prefill instance's KV handle
        body["kv_transfer_params"] = final.output.kv_transfer_params
    await _save(turn, body)
    return body


def _error_event(ev: Events, error: BaseException) -> str:
    if isinstance(error, EngineDeadError):
        api = engine_unavailable(str(error))
    elif isinstance(error, RequestFailed):
        api = request_failed_error(error)
    else:
        assert isinstance(error, ApiError)
        api = error
    return ev.event("error", code=api.code or api.type, message=api.message, param=api.param)


async def _stream(turn: _Turn) -> AsyncIterator[str]:
    ctx, call = turn.ctx, turn.call
    ev = Events(turn.req.include)
    choice = ChoiceOutput(call)
    yield ev.event("response.created", response=_response(turn, "in_progress", [], None))
    yield ev.event("response.in_progress", response=_response(turn, "in_progress", [], None))
    stream = _stream_of(ctx, call)
    completion, cached, finish = 0, 0, None
    try:
        async for item in stream:
            for d in item.deltas.values():
                completion += len(d.token_ids)
                finish = d.finish_reason or finish
                logprobs = None
                if turn.req.wants_logprobs and d.logprobs:
                    logprobs = chat_logprobs(ctx.tokenizer, d.logprobs, d.token_ids,
                                             call.num_logprobs or 0)["content"]
                delta = choice.delta(d.text, d.finish_reason is not None)
                for line in ev.on_delta(delta, logprobs, turn.max_calls):
                    yield line
            if item.finished:
                cached = item.output.num_cached_tokens
        for line in ev.close_all():
            yield line
        length = finish == "length"
        body = _response(turn, "incomplete" if length else "completed", ev.items,
                         _usage(call, completion, cached),
                         "max_output_tokens" if length else None)
        await _save(turn, body)
        # OpenAI's terminal event names the status: response.incomplete when cut short.
        yield ev.event("response.incomplete" if length else "response.completed",
                       response=body)
    except (EngineDeadError, RequestFailed, ApiError) as e:
        yield _error_event(ev, e)
    finally:
        await stream.aclose()                                # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- background

def _start_background(turn: _Turn) -> dict[str, Any]:
    body = _response(turn, "queued", [], None)
    task = asyncio.create_task(_background(turn))
    turn.state.running[turn.rid] = (task, body)
    return body


async def _background(turn: _Turn) -> None:
    """Runs a background response to its end, whatever the client does meanwhile; the
    final object (completed, incomplete, failed or cancelled) goes to the store."""
    turn.state.running[turn.rid][1]["status"] = "in_progress"
    try:
        await _full(turn)
    except asyncio.CancelledError:
        await _save(turn, _response(turn, "cancelled", [], None))
    except ApiError as e:
        await _save(turn, _response(turn, "failed", [], None,
                                    error={"code": e.code or e.type, "message": e.message}))
    except Exception as e:  # noqa: BLE001 - recorded as the response's failure
        logger.exception("background response %s failed", turn.rid)
        await _save(turn, _response(turn, "failed", [], None, error={
            "code": "server_error", "message": f"Internal error ({type(e).__name__})"}))
    finally:
        turn.state.running.pop(turn.rid, None)


async def _stop(state: ResponsesState, response_id: str) -> bool:
    """Cancel a running background response and wait until its final state is stored."""
    entry = state.running.get(response_id)
    if entry is None:
        return False
    entry[0].cancel()
    await asyncio.gather(entry[0], return_exceptions=True)
    return True


# ----------------------------------------------------------------------------- routes

async def _lookup(state: ResponsesState, response_id: str) -> dict[str, Any]:
    entry = state.running.get(response_id)
    if entry is not None:
        return {"response": dict(entry[1]), "input_items": None}
    record = await state.store.get(response_id)
    if record is None:
        raise not_found(response_id)
    return record


def _page(items: list[dict[str, Any]], request: Request) -> dict[str, Any]:
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order: must be 'asc' or 'desc'", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= _INPUT_ITEMS_MAX:
        raise ApiError(400, f"limit: must be an integer in [1, {_INPUT_ITEMS_MAX}]",
                       param="limit")
    ordered = items if order == "asc" else items[::-1]
    after = q.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ApiError(400, f"after: no input item {after!r} in this response",
                           param="after")
        ordered = ordered[ids.index(after) + 1:]
    data = ordered[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(ordered) > limit}


def add_response_routes(app: FastAPI, ctx: ServingContext,
                        parse: Callable[[Any, Request], Any]) -> ResponsesState:
    """The /v1/responses routes, over an in-memory store until `configure_store` replaces
    it (the server's flags). `parse(model, request)` is the server's body reader and
    validator, which also checks that a KV-handle request comes from the router."""
    state = ResponsesState(MemoryResponseStore(StoreConfig()))
    app.state.responses = state

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        req = await parse(ResponsesRequest, request)
        return await create_response(ctx, state, req, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request) -> JSONResponse:
        if request.query_params.get("stream", "false").lower() == "true":
            raise ApiError(400, "stream: a stored response cannot be streamed again; "
                                "retrieve it whole", param="stream")
        return JSONResponse((await _lookup(state, response_id))["response"])

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        stopped = await _stop(state, response_id)
        if not await state.store.delete(response_id) and not stopped:
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted",
                             "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> JSONResponse:
        record = await _lookup(state, response_id)
        if record["input_items"] is None:          # still running: not stored yet
            raise ApiError(400, f"response {response_id!r} is still in progress",
                           param="response_id")
        return JSONResponse(_page(record["input_items"], request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> JSONResponse:
        if await _stop(state, response_id):
            return JSONResponse((await _lookup(state, response_id))["response"])
        body = (await _lookup(state, response_id))["response"]
        if not body.get("background"):
            raise ApiError(400, "Only responses created with background=true can be "
                                "cancelled", param="response_id")
        return JSONResponse(body)                  # already finished: as it ended

    return state


def configure_store(app: FastAPI, args: Any) -> None:
    """The store the server's flags ask for (ValueError naming the flag when it cannot be
    opened)."""
    config: StoreConfig = store_config_from_args(args)
    try:
        app.state.responses.store = make_store(config)
    except (OSError, sqlite3.Error) as e:
        raise ValueError(f"--response-store-path: cannot open {config.path!r} ({e})") from e
