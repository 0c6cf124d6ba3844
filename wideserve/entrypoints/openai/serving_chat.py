"""POST /v1/chat/completions: messages -> chat template -> one engine request (n choices)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from wideserve.core.engine_client import EngineDeadError
from wideserve.entrypoints.openai.async_engine import RequestFailed, StreamItem
from wideserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, random_id
from wideserve.entrypoints.openai.serving import (SSE_DONE, ApiError, ServingContext,
                                                  chat_logprobs, engine_unavailable, now_s,
                                                  request_failed_error, respond, sse,
                                                  stream_error_event, usage_dict)
from wideserve.sampling_params import SamplingParams

# Template variables a request may not override through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "add_generation_prompt", "chat_template", "documents",
    "bos_token", "eos_token", "pad_token", "unk_token"})


@dataclass(slots=True)
class _Call:
    request_id: str
    created: int
    req: ChatCompletionRequest
    prompt: str
    token_ids: list[int]
    params: SamplingParams
    num_logprobs: int | None
    echo_prefix: str


def render_prompt(ctx: ServingContext, messages: list[ChatMessage],
                  add_generation_prompt: bool, continue_final_message: bool,
                  tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None) -> str:
    """The chat template applied to the messages; any failure is the request's fault (the
    template raised on these messages), so it is a 400 naming `messages`."""
    kwargs = {k: v for k, v in (template_kwargs or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS}
    dicts = [m.to_template_dict() for m in messages]
    try:
        text = ctx.tokenizer.apply_chat_template(
            dicts, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors have no common base worth naming
        raise ApiError(400, f"messages: the chat template cannot render these messages "
                            f"({type(e).__name__}: {e})", param="messages") from None
    if continue_final_message:
        # Cut whatever the template closes the last (assistant) message with, so the model
        # continues it instead of starting a new turn.
        final = messages[-1].text()
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[:cut + len(final)]
    return text


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> _Call:
    ctx.check_model(req.model)
    ctx.check_priority(req.priority)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:        # templates of reasoning models read it
        template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    prompt = render_prompt(ctx, req.messages, req.add_generation_prompt,
                           req.continue_final_message, req.tools, template_kwargs)
    ids = await ctx.encode(prompt, False)
    max_tokens = ctx.resolve_max_tokens(len(ids), req.effective_max_tokens, "messages")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, num_logprobs)
    last = req.messages[-1]
    echo_prefix = last.text() if req.echo and last.role == "assistant" else ""
    ctx.check_alive()
    return _Call(random_id("chatcmpl"), now_s(), req, prompt, ids, params, num_logprobs,
                 echo_prefix)


def _stream_of(ctx: ServingContext, call: _Call) -> AsyncIterator[StreamItem]:
    return ctx.engine.generate(call.request_id, call.prompt, call.token_ids, call.params,
                               call.req.priority)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    call = await prepare(ctx, req)
    return await respond(raw, req.stream, lambda: _stream(ctx, call),
                         lambda: _full(ctx, call))



async def _full(ctx: ServingContext, call: _Call) -> dict[str, Any]:
    final: StreamItem | None = None
    stream = _stream_of(ctx, call)
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
    out = final.output
    choices = []
    for co in out.outputs:
        logprobs = None
        if call.num_logprobs is not None and co.logprobs is not None:
            logprobs = chat_logprobs(ctx.tokenizer, co.logprobs, co.token_ids,
                                     call.num_logprobs)
        choices.append({"index": co.index,
                        "message": {"role": "assistant", "content": call.echo_prefix + co.text},
                        "logprobs": logprobs, "finish_reason": co.finish_reason,
                        "stop_reason": co.stop_reason})
    completion = sum(len(co.token_ids) for co in out.outputs)
    return {"id": call.request_id, "object": "chat.completion", "created": call.created,
            "model": ctx.model_name, "choices": choices,
            "usage": usage_dict(len(call.token_ids), completion, out.num_cached_tokens)}


def _chunk(ctx: ServingContext, call: _Call, index: int, delta: dict[str, Any],
           logprobs: Any = None, finish_reason: str | None = None,
           stop_reason: Any = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    return {"id": call.request_id, "object": "chat.completion.chunk", "created": call.created,
            "model": ctx.model_name, "choices": [choice]}


async def _stream(ctx: ServingContext, call: _Call) -> AsyncIterator[str]:
    req = call.req
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    prompt_tokens, completion_tokens, cached = len(call.token_ids), 0, 0
    stream = _stream_of(ctx, call)
    try:
        for i in range(req.n):
            # The role comes first, alone, as OpenAI sends it.
            yield sse(_chunk(ctx, call, i, {"role": "assistant", "content": call.echo_prefix}))
        async for item in stream:
            for d in item.deltas.values():
                completion_tokens += len(d.token_ids)
                logprobs = None
                if call.num_logprobs is not None and d.logprobs:
                    logprobs = chat_logprobs(ctx.tokenizer, d.logprobs, d.token_ids,
                                             call.num_logprobs)
                if not d.text and d.finish_reason is None and logprobs is None:
                    continue
                chunk = _chunk(ctx, call, d.index, {"content": d.text} if d.text else {},
                               logprobs, d.finish_reason, d.stop_reason)
                if continuous:
                    chunk["usage"] = usage_dict(prompt_tokens, completion_tokens, cached)
                yield sse(chunk)
            if item.finished:
                cached = item.output.num_cached_tokens
        if include_usage:
            yield sse({"id": call.request_id, "object": "chat.completion.chunk",
                       "created": call.created, "model": ctx.model_name, "choices": [],
                       "usage": usage_dict(prompt_tokens, completion_tokens, cached)})
    except (EngineDeadError, RequestFailed, ApiError) as e:
        yield stream_error_event(e)
    finally:
        await stream.aclose()                                # type: ignore[attr-defined]
    yield SSE_DONE
