"""The /v1/responses request, and its translation to a chat request and back.

A Responses request becomes a chat request (instructions -> system message; the stored
conversation of `previous_response_id`, then input messages, function_call and
function_call_output items -> assistant tool calls and tool messages; flat function tools ->
chat tools; text.format -> structured outputs) served by serving_chat's pipeline. The answer
becomes output items: reasoning, message (output_text), function_call.

Every field OpenAI's API defines is either used, accepted without effect (said in
docs/api-compatibility.md), or refused with a 400 naming it (`check_refused`).
"""
from __future__ import annotations

import base64
import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from wideserve.serving.openai.lenient import LenientModel
from wideserve.serving.openai.protocol import (REASONING_EFFORTS, ChatCompletionRequest,
                                              EngineJson)
from wideserve.serving.openai.serving import ApiError

_TEXT_PARTS = ("input_text", "output_text", "text")
_NON_TEXT_PARTS = ("input_image", "input_file", "input_audio")
# `include` values that do something here; the others belong to built-in tools (not served).
SUPPORTED_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")


class ResponsesRequest(LenientModel):
    # Accepted without effect: hints for OpenAI's own infrastructure.
    _ECHOED = frozenset({"safety_identifier", "prompt_cache_retention"})
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    max_tool_calls: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None     # include_obfuscation: no padding sent
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = True
    background: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_key: str | None = None      # prefix caching here is automatic
    service_tier: str | None = None          # one tier here: answered as "default"
    # vLLM's extras.
    ignore_eos: bool = False
    # P/D disaggregation (set by `wideserve router`, docs/disaggregation.md), as on chat.
    kv_transfer_params: EngineJson | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or \
            "message.output_text.logprobs" in (self.include or [])


def check_refused(req: ResponsesRequest) -> None:
    """The fields this server cannot honour: a 400 naming each, never a silent no-op."""
    if req.conversation is not None:
        raise ApiError(400, "conversation: the Conversations API is not served here; chain "
                            "responses with previous_response_id instead",
                       param="conversation")
    if req.prompt is not None:
        raise ApiError(400, "prompt: stored prompt templates are not served here; send the "
                            "input and instructions", param="prompt")
    for value in req.include or []:
        if value not in SUPPORTED_INCLUDES:
            raise ApiError(400, f"include: {value!r} is not supported (it belongs to a "
                                f"built-in tool, not served here); supported: "
                                f"{', '.join(SUPPORTED_INCLUDES)}", param="include")
    if req.background and not req.store:
        raise ApiError(400, "background: a background response must be stored (store: "
                            "false cannot be polled)", param="background")
    if req.background and req.stream:
        raise ApiError(400, "background: streaming a background response is not supported; "
                            "poll GET /v1/responses/{id}", param="background")
    if req.input is None and req.previous_response_id is None:
        raise ApiError(400, "input: required", param="input")
    effort = (req.reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ApiError(400, f"reasoning.effort: must be one of {', '.join(REASONING_EFFORTS)}",
                       param="reasoning.effort")


def rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, param: str) -> str:
    """A message's text: a string, or the text of its text parts (each text a string)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _NON_TEXT_PARTS:
                raise ApiError(400, f"{param}.content[{j}].type: {kind!r} is not supported "
                                    f"(this model reads text only)", param=f"{param}.content")
            if kind not in _TEXT_PARTS:
                continue                           # refusal parts and the like: no text
            text = part.get("text", "")
            if not isinstance(text, str):
                raise ApiError(400, f"{param}.content[{j}].text: must be a string, got "
                                    f"{type(text).__name__}", param=f"{param}.content")
            texts.append(text)
        return "".join(texts)
    raise ApiError(400, f"{param}.content: message content must be a string or a list of "
                        "text parts", param=f"{param}.content")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as chat messages (no instructions, no earlier turns)."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    msgs: list[dict[str, Any]] = []
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


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as OpenAI lists it (GET /v1/responses/{id}/input_items): items with ids."""
    if req.input is None:
        return []
    if isinstance(req.input, str):
        return [{"type": "message", "id": rid("msg"), "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": req.input}]}]
    out = []
    for item in req.input:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        item.setdefault("id", rid({"message": "msg", "function_call": "fc",
                                   "reasoning": "rs"}.get(item["type"], "item")))
        out.append(item)
    return out


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


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request: instructions, the stored conversation, then this input."""
    msgs = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    msgs += history + input_messages(req)
    tool_choice = _tool_choice(req.tool_choice)
    parallel = req.parallel_tool_calls
    if req.max_tool_calls == 0 and req.tools:
        tool_choice = "none"
    elif req.max_tool_calls == 1:
        parallel = False
    body: dict[str, Any] = {
        "model": req.model, "messages": msgs, "tools": _chat_tools(req.tools),
        "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "stream": req.stream, "user": req.user,
        "ignore_eos": req.ignore_eos or None, "kv_transfer_params": req.kv_transfer_params,
        "reasoning_effort": (req.reasoning or {}).get("effort")}
    if req.wants_logprobs:
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs or 0
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


def encrypted_reasoning(text: str) -> str:
    """`reasoning.encrypted_content`: the reasoning as an opaque token a stateless client
    sends back (store: false). Not secret (the client already has the text): reasoning
    items sent back are accepted and, like all earlier reasoning, not shown to the model."""
    return base64.b64encode(json.dumps({"reasoning": text}).encode()).decode()


def output_items(message: dict[str, Any], include: list[str] | None,
                 logprobs: list[dict[str, Any]] | None, max_calls: int | None
                 ) -> list[dict[str, Any]]:
    """A chat message as Responses output items."""
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        item = {"type": "reasoning", "id": rid("rs"), "summary": [], "content": [
            {"type": "reasoning_text", "text": message["reasoning_content"]}]}
        if "reasoning.encrypted_content" in (include or []):
            item["encrypted_content"] = encrypted_reasoning(message["reasoning_content"])
        items.append(item)
    calls = message.get("tool_calls") or []
    # The assistant's message, even an empty one when the turn produced no text, reasoning or
    # call (an end-of-sequence first): a turn always answers with an output item.
    if message.get("content") or not (calls or items):
        part: dict[str, Any] = {"type": "output_text", "text": message.get("content") or "",
                                "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        items.append({"type": "message", "id": rid("msg"), "status": "completed",
                      "role": "assistant", "content": [part]})
    for call in calls[:max_calls] if max_calls is not None else calls:
        items.append({"type": "function_call", "id": rid("fc"), "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": "completed"})
    return items


def history_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Output items back as the assistant chat message of a stored conversation."""
    text = "".join(part.get("text", "") for item in items if item["type"] == "message"
                   for part in item["content"])
    reasoning = "".join(part.get("text", "") for item in items if item["type"] == "reasoning"
                        for part in item.get("content", []))
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning_content"] = reasoning
    return msg
