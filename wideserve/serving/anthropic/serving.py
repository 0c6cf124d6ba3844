"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A request is checked as an Anthropic request (protocol.py), translated into a chat request
(convert.py) and prepared by the chat path (`serving_chat.prepare`: template, tokens, tools,
output constraint, reasoning parser); its output goes through the chat path's `ChoiceOutput`
and is written out as Anthropic content blocks. Streams follow Anthropic's event sequence:

    message_start, ping,
    (content_block_start, content_block_delta*, content_block_stop)*   thinking/text/tool_use
    message_delta (stop_reason, usage), message_stop

Every error is Anthropic's shape, {"type": "error", "error": {"type", "message"}}, with the
status the OpenAI routes would give (convert.ERROR_TYPES names each); a failure after the
stream began is an `error` event.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from wideserve.serving.engine_client import EngineDeadError
from wideserve.serving.anthropic import convert
from wideserve.serving.anthropic.protocol import CountTokensRequest, MessagesRequest
from wideserve.serving.openai import serving_chat
from wideserve.serving.openai.async_engine import RequestFailed
from wideserve.serving.openai.images import expand_images
from wideserve.serving.openai.protocol import ChatCompletionRequest
from wideserve.serving.openai.serving import (ApiError, ServingContext, as_api_error,
                                              collect_or_disconnect, final_item, parse_body,
                                              shutting_down)
from wideserve.serving.openai.tools import check_tool_list

logger = logging.getLogger("wideserve.server")
ReadBody = Callable[[Request], Awaitable[bytes]]


def error_response(ctx: ServingContext, error: ApiError) -> JSONResponse:
    if ctx.metrics is not None and 400 <= error.status < 500:
        ctx.metrics.observe_rejected()
    return JSONResponse(convert.error_body(error.status, error.message),
                        status_code=error.status)


def add_routes(app: FastAPI, ctx: ServingContext, read_body: ReadBody) -> None:
    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        try:
            return await create_message(ctx, await read_body(request), request)
        except ApiError as e:
            return error_response(ctx, e)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            return JSONResponse(await count_message_tokens(ctx, await read_body(request)))
        except ApiError as e:
            return error_response(ctx, e)


def _chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, msgspec.json.encode(fields))


async def count_message_tokens(ctx: ServingContext, body: bytes) -> dict[str, int]:
    req = await ctx.parse(CountTokensRequest, body)
    ctx.check_model(req.model)
    chat = _chat_request(convert.prompt_fields(req))
    if chat.tools:
        check_tool_list(chat.tools)

    def render() -> str:
        return serving_chat.render_prompt(ctx, chat.messages, chat.add_generation_prompt,
                                          chat.continue_final_message, chat.tools,
                                          chat.chat_template_kwargs)

    prompt = await ctx.within_deadline(ctx.off_loop(render))
    prepared = await serving_chat.chat_images(ctx, chat)
    if prepared:            # each image counts its span's positions, as /v1/messages does
        ids, _ = await expand_images(ctx, prompt, prepared, False)
        return {"input_tokens": len(ids)}
    return {"input_tokens": len(await ctx.encode(prompt, False, "messages"))}


async def create_message(ctx: ServingContext, body: bytes, raw: Request) -> Response:
    req = await ctx.parse(MessagesRequest, body)
    chat = _chat_request(convert.chat_request_body(req))
    call = await ctx.within_deadline(serving_chat.prepare(ctx, chat))
    message_id = convert.new_id("msg")
    if req.stream:
        stopping = getattr(raw.app.state, "stopping", None) or asyncio.Event()
        return StreamingResponse(_stream(ctx, call, req, message_id, stopping),
                                 media_type="text/event-stream")
    result = await collect_or_disconnect(raw, _full(ctx, call, req, message_id))
    if result is None:
        return Response(status_code=499)
    return JSONResponse(result)


def _generate(ctx: ServingContext, call: Any) -> AsyncIterator[Any]:
    return ctx.engine.generate(call.request_id, call.prompt, call.token_ids, call.params,
                               call.req.priority, images=call.images)


def _message(req: MessagesRequest, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": req.model,
            "content": [], "stop_reason": None, "stop_sequence": None}


async def _full(ctx: ServingContext, call: Any, req: MessagesRequest,
                message_id: str) -> dict[str, Any]:
    final = await final_item(_generate(ctx, call))
    co = final.output.outputs[0]
    choice = serving_chat.ChoiceOutput(call)
    choice.text = co.text
    message = choice.message()
    reason, sequence = convert.stop_reason(co.finish_reason, co.stop_reason,
                                           bool(message.get("tool_calls")), req.stop_sequences)
    return {**_message(req, message_id), "content": convert.content_blocks(message),
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": convert.usage(len(call.token_ids), len(co.token_ids),
                                   final.output.num_cached_tokens)}


def event(payload: dict[str, Any]) -> str:
    return f"event: {payload['type']}\ndata: {msgspec.json.encode(payload).decode()}\n\n"


class BlockWriter:
    """Chat deltas (reasoning_content, content, tool_calls) -> content block events: a block
    opens when a new kind of output starts and closes when another one does."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [event({"type": "content_block_start", "index": self.index,
                             "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event({"type": "content_block_delta", "index": self.index, "delta": delta})

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.index})]

    def feed(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta",
                                    "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:                               # a new call begins
                out += self._start({"type": "tool_use", "id": convert.new_id("toolu"),
                                    "name": fn.get("name", ""), "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta",
                                        "partial_json": fn["arguments"]}))
        return out


def _error_event(error: BaseException) -> str:
    api = as_api_error(error)
    return event(convert.error_body(api.status, api.message))


async def _stream(ctx: ServingContext, call: Any, req: MessagesRequest, message_id: str,
                  stopping: asyncio.Event) -> AsyncIterator[str]:
    prompt_tokens, output_tokens, cached = len(call.token_ids), 0, 0
    choice = serving_chat.ChoiceOutput(call)
    blocks = BlockWriter()
    stream = _generate(ctx, call)
    started = False
    try:
        async for item in stream:
            if stopping.is_set():
                raise shutting_down()
            if not started:           # after the prefill: the cached-token count is known
                started = True
                cached = item.output.num_cached_tokens
                yield event({"type": "message_start", "message": {
                    **_message(req, message_id),
                    "usage": convert.usage(prompt_tokens, 1, cached)}})
                yield event({"type": "ping"})
            d = item.deltas.get(0)
            if d is None:
                continue
            output_tokens += len(d.token_ids)
            for line in blocks.feed(choice.delta(d.text, d.finish_reason is not None)):
                yield line
            if d.finish_reason is None:
                continue
            for line in blocks.close():
                yield line
            reason, sequence = convert.stop_reason(d.finish_reason, d.stop_reason,
                                                   choice.called_tools, req.stop_sequences)
            yield event({"type": "message_delta",
                         "delta": {"stop_reason": reason, "stop_sequence": sequence},
                         "usage": convert.usage(prompt_tokens, output_tokens, cached)})
            yield event({"type": "message_stop"})
    except (EngineDeadError, RequestFailed, ApiError) as e:
        yield _error_event(e)
    finally:
        await stream.aclose()                                # type: ignore[attr-defined]
