"""Anthropic requests as chat requests, and chat results as Anthropic content.

A Messages request is translated into the equivalent /v1/chat/completions request and then
served by the chat path itself (its checks, chat template, tokenizer, tool-call and reasoning
parsers): one implementation of prompts and outputs, two wire formats.

    system (string or text blocks)     -> a system message
    user text / tool_result blocks     -> tool messages (one per result), then a user message
    image blocks (base64 source)       -> image_url parts (data: URLs) where they were, in
                                          the user message or the tool_result's tool message
    assistant text / thinking / tool_use -> one assistant message (content,
                                          reasoning_content, tool_calls)
    a final assistant message          -> a prefill the model continues
                                          (continue_final_message)
    tools[].input_schema               -> function tools
    tool_choice auto/any/tool/none     -> auto/required/named/none
    thinking enabled/disabled          -> chat_template_kwargs thinking (as DeepSeek's and
                                          Qwen's templates read it)
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from wideserve.serving.anthropic.protocol import (ImageBlock, Message, MessagesRequest,
                                                  TextBlock, ThinkingBlock, ToolResultBlock,
                                                  ToolUseBlock, _Prompt)

logger = logging.getLogger("wideserve.server")

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               504: "timeout_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500
                                       else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _parts(blocks: list[Any], prefix: str = "") -> list[dict[str, Any]]:
    """Text and image blocks as chat content parts, in order: text blocks in a row joined
    by newlines (as a text-only message joins them), each image an image_url part."""
    parts: list[dict[str, Any]] = []
    text = prefix
    joined = False
    for block in blocks:
        if isinstance(block, TextBlock):
            text += ("\n" if joined else "") + block.text
            joined = True
        elif isinstance(block, ImageBlock):
            if text:
                parts.append({"type": "text", "text": text})
            parts.append({"type": "image_url", "image_url": {"url": block.source.data_url()}})
            text, joined = "", False
    if text:
        parts.append({"type": "text", "text": text})
    return parts


def _tool_message(block: ToolResultBlock) -> dict[str, Any]:
    content: Any = block.text()
    if block.has_images():
        assert isinstance(block.content, list)
        content = _parts(block.content, "Error: " if block.is_error else "")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _user_messages(msg: Message) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out: list[dict[str, Any]] = [_tool_message(b) for b in msg.content
                                 if isinstance(b, ToolResultBlock)]
    blocks = [b for b in msg.content if isinstance(b, (TextBlock, ImageBlock))]
    if any(isinstance(b, ImageBlock) for b in blocks):
        out.append({"role": "user", "content": _parts(blocks)})
    elif blocks:
        out.append({"role": "user", "content": "\n".join(b.text for b in blocks)})
    return out


def _assistant_message(msg: Message) -> dict[str, Any]:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    texts, thinking, calls = [], [], []
    for block in msg.content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name,
                                       "arguments": json.dumps(block.input)}})
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def chat_messages(req: _Prompt) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = req.system_text()
    if system is not None:
        out.append({"role": "system", "content": system})
    for msg in req.messages:
        out.extend(_user_messages(msg) if msg.role == "user" else [_assistant_message(msg)])
    return out


def _tools(req: _Prompt) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req.tools:
        out["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description or "",
            "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None and req.tools:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            out["parallel_tool_calls"] = False
    return out


def _continues_prefill(messages: list[Message]) -> bool:
    """A final assistant turn of plain text is a prefill: the answer continues it."""
    last = messages[-1]
    if last.role != "assistant":
        return False
    return isinstance(last.content, str) or all(isinstance(b, TextBlock)
                                                for b in last.content)


def prompt_fields(req: _Prompt) -> dict[str, Any]:
    """The chat request fields that shape the prompt (also what count_tokens renders)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), **_tools(req)}
    if _continues_prefill(req.messages):
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    if req.thinking is not None:
        # Both spellings: DeepSeek's templates read `thinking`, Qwen3's `enable_thinking`.
        body["chat_template_kwargs"] = {"thinking": req.thinking.enabled,
                                        "enable_thinking": req.thinking.enabled}
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is not None:
        body["reasoning_effort"] = effort if effort in ("low", "medium", "high") else "high"
    return body


def chat_request_body(req: MessagesRequest) -> dict[str, Any]:
    body = prompt_fields(req)
    body["max_tokens"] = req.max_tokens
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.metadata is not None and req.metadata.user_id is not None:
        body["user"] = req.metadata.user_id
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.schema_, "strict": True}}
    return body


# ----------------------------------------------------------------------------- outputs

def stop_reason(finish: str | None, matched: int | str | None, called_tools: bool,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the engine's finish reason and matched stop."""
    if finish == "length":
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if isinstance(matched, str) and matched in (stop_sequences or []):
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use.input (an object); text the model wrote that is not a
    JSON object (only possible with tool_choice auto) is kept under `arguments`."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    logger.warning("a tool call's arguments are not a JSON object: %.200r", arguments)
    return {"arguments": arguments}


def usage(prompt: int, output: int, cached: int) -> dict[str, Any]:
    """Anthropic's split: input_tokens excludes what was read from the (prefix) cache."""
    return {"input_tokens": prompt - cached, "output_tokens": output,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat path's assistant message as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"],
                       "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": new_id("toolu"),
                       "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks
