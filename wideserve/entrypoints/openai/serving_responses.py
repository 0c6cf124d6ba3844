"""POST /v1/responses: the OpenAI Responses API (what current agent clients use), over the
chat path.

A Responses request is translated into a chat request (instructions -> system message; input
messages, function_call and function_call_output items -> assistant tool calls and tool
messages; flat function tools -> chat tools) and served by serving_chat's pipeline (template,
tool and reasoning parsers, structured outputs for text.format). The answer is turned back
into output items: reasoning, message (output_text), function_call. Streaming sends the
Responses events (response.created, output_item.added, output_text.delta, function_call_
arguments.delta, ... response.completed), each with a sequence_number.
"""
from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from wideserve.core.engine_client import EngineDeadError
from wideserve.entrypoints.openai.async_engine import RequestFailed, StreamItem
from wideserve.entrypoints.openai.protocol import ChatCompletionRequest
from wideserve.entrypoints.openai.serving import (SSE_DONE, ApiError, ServingContext,
                                                  final_item, respond, sse,
                                                  stream_error_event)
from wideserve.entrypoints.openai.serving_chat import ChoiceOutput, _Call, _stream_of, prepare

_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    model_config = _CONFIG
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    # P/D disaggregation (set by `wideserve router`, docs/disaggregation.md), as on chat.
    kv_transfer_params: dict[str, Any] | None = None


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, param: str) -> str:
    """A message's text: a string, or the text of its text parts (each text a string)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                continue
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ApiError(400, f"{param}.content[{j}].text: must be a string, got "
                                    f"{type(text).__name__}", param=f"{param}.content")
            texts.append(text)
        return "".join(texts)
    raise ApiError(400, f"{param}.content: message content must be a string or a list of "
                        "text parts", param=f"{param}.content")


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.instructions:
        msgs.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return msgs + [{"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            msgs.append({"role": item.get("role", "user"),
                         "content": _text_of(item.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            call = {"id": item.get("call_id", ""), "type": "function",
                    "function": {"name": item.get("name", ""),
                                 "arguments": item.get("arguments", "")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                         "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue                            # earlier reasoning is not shown to the model
        else:
            raise ApiError(400, f"input[{i}].type: {kind!r} is not supported (message, "
                                "function_call, function_call_output, reasoning)",
                           param=f"input[{i}].type")
    return msgs


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise ApiError(400, f"tools[{i}].type: only function tools are supported",
                           param=f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    body: dict[str, Any] = {
        "model": req.model, "messages": _messages(req), "tools": _chat_tools(req.tools),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "stream": req.stream, "user": req.user,
        "kv_transfer_params": req.kv_transfer_params}
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, f"input: {loc}: {first['msg']}", param="input") from None


def _items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": _rid("rs"), "summary": [], "content": [
            {"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append({"type": "message", "id": _rid("msg"), "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": message["content"],
                           "annotations": []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": _rid("fc"), "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def _response(ctx: ServingContext, call: _Call, rid: str, created: int, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None,
              incomplete: str | None = None) -> dict[str, Any]:
    req = call.req
    return {"id": rid, "object": "response", "created_at": created, "status": status,
            "model": ctx.model_name, "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": None, "metadata": {}, "parallel_tool_calls": call.tools.parallel,
            "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": call.tools.mode if call.tools.mode != "named" else {
                "type": "function", "name": call.tools.named},
            "tools": [{"type": "function", **t["function"]} for t in call.tools.tools or []],
            "max_output_tokens": req.effective_max_tokens}


def _usage(call: _Call, completion: int, cached: int) -> dict[str, Any]:
    n = len(call.token_ids)
    return {"input_tokens": n, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n + completion}


async def create_response(ctx: ServingContext, req: ResponsesRequest, raw: Request) -> Response:
    chat = to_chat(req)
    if chat.n != 1:
        raise ApiError(400, "n: the Responses API returns one output", param="n")
    call = await ctx.within_deadline(prepare(ctx, chat))
    rid = _rid("resp")
    return await respond(raw, req.stream, lambda: _stream(ctx, call, rid),
                         lambda: _full(ctx, call, rid))


async def _full(ctx: ServingContext, call: _Call, rid: str) -> dict[str, Any]:
    final = await final_item(_stream_of(ctx, call))
    co = final.output.outputs[0]
    choice = ChoiceOutput(call)
    choice.text = co.text
    length = co.finish_reason == "length"
    body = _response(ctx, call, rid, call.created, "incomplete" if length else "completed",
                     _items(choice.message()),
                     _usage(call, len(co.token_ids), final.output.num_cached_tokens),
                     "max_output_tokens" if length else None)
    if final.output.kv_transfer_params is not None:     # a prefill instance's KV handle
        body["kv_transfer_params"] = final.output.kv_transfer_params
    return body


class _Events:
    """Responses stream events with their sequence numbers and the items built so far."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, int] = {}          # "message" / "reasoning" / call index -> item

    def event(self, type_: str, **fields: Any) -> str:
        self.seq += 1
        return sse({"type": type_, "sequence_number": self.seq - 1, **fields})

    def add(self, item: dict[str, Any], key: str) -> list[str]:
        self.open[key] = len(self.items)
        self.items.append(item)
        out = [self.event("response.output_item.added", output_index=self.open[key],
                          item=item)]
        if item["type"] in ("message", "reasoning"):
            part = ({"type": "output_text", "text": "", "annotations": []}
                    if item["type"] == "message" else {"type": "reasoning_text", "text": ""})
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=self.open[key], content_index=0, part=part))
        return out

    def close_all(self) -> list[str]:
        out = []
        for idx, item in enumerate(self.items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out.append(self.event("response.output_text.done", item_id=item["id"],
                                      output_index=idx, content_index=0, text=text))
                out.append(self.event("response.content_part.done", item_id=item["id"],
                                      output_index=idx, content_index=0,
                                      part=item["content"][0]))
            elif item["type"] == "reasoning":
                out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=idx, content_index=0,
                                      text=item["content"][0]["text"]))
            elif item["type"] == "function_call":
                out.append(self.event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=idx,
                                      arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out


def _on_delta(ev: _Events, delta: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if "reasoning_content" in delta:
        if "reasoning" not in ev.open:
            out += ev.add({"type": "reasoning", "id": _rid("rs"), "summary": [],
                           "content": [{"type": "reasoning_text", "text": ""}]}, "reasoning")
        i = ev.open["reasoning"]
        ev.items[i]["content"][0]["text"] += delta["reasoning_content"]
        out.append(ev.event("response.reasoning_text.delta", item_id=ev.items[i]["id"],
                            output_index=i, content_index=0, delta=delta["reasoning_content"]))
    if delta.get("content"):
        if "message" not in ev.open:
            out += ev.add({"type": "message", "id": _rid("msg"), "status": "in_progress",
                           "role": "assistant", "content": [
                               {"type": "output_text", "text": "", "annotations": []}]},
                          "message")
        i = ev.open["message"]
        ev.items[i]["content"][0]["text"] += delta["content"]
        out.append(ev.event("response.output_text.delta", item_id=ev.items[i]["id"],
                            output_index=i, content_index=0, delta=delta["content"]))
    for tc in delta.get("tool_calls") or []:
        key = f"call{tc['index']}"
        if key not in ev.open:
            out += ev.add({"type": "function_call", "id": _rid("fc"), "call_id": tc["id"],
                           "name": tc["function"]["name"], "arguments": "",
                           "status": "in_progress"}, key)
        i = ev.open[key]
        args = tc["function"].get("arguments") or ""
        if args:
            ev.items[i]["arguments"] += args
            out.append(ev.event("response.function_call_arguments.delta",
                                item_id=ev.items[i]["id"], output_index=i, delta=args))
    return out


async def _stream(ctx: ServingContext, call: _Call, rid: str) -> AsyncIterator[str]:
    ev = _Events()
    choice = ChoiceOutput(call)
    created = call.created
    yield ev.event("response.created",
                   response=_response(ctx, call, rid, created, "in_progress", [], None))
    yield ev.event("response.in_progress",
                   response=_response(ctx, call, rid, created, "in_progress", [], None))
    stream = _stream_of(ctx, call)
    completion, cached, finish = 0, 0, None
    try:
        async for item in stream:
            for d in item.deltas.values():
                completion += len(d.token_ids)
                finish = d.finish_reason or finish
                for line in _on_delta(ev, choice.delta(d.text, d.finish_reason is not None)):
                    yield line
            if item.finished:
                cached = item.output.num_cached_tokens
        for line in ev.close_all():
            yield line
        length = finish == "length"
        yield ev.event("response.completed", response=_response(
            ctx, call, rid, created, "incomplete" if length else "completed", ev.items,
            _usage(call, completion, cached), "max_output_tokens" if length else None))
    except (EngineDeadError, RequestFailed, ApiError) as e:
        yield stream_error_event(e)
    finally:
        await stream.aclose()                                # type: ignore[attr-defined]
    yield SSE_DONE
