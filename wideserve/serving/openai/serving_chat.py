"""POST /v1/chat/completions: messages -> chat template -> one engine request (n choices).

Each choice's text goes through the output pipeline (`ChoiceOutput`): the reasoning parser
(--reasoning-parser) splits <think>...</think> into `reasoning_content`, then the tool-call
parser (tool_choice "auto" with --tool-call-parser) turns calls into `tool_calls`. Streams
send each piece as it becomes certain; the role rides on a choice's first delta, as vLLM
sends it (benchmark clients time the first token from the first chunk with choices).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import Response

from wideserve.serving.engine_client import EngineDeadError
from wideserve.serving.openai.async_engine import RequestFailed, StreamItem
from wideserve.serving.openai.protocol import ChatCompletionRequest, ChatMessage, random_id
from wideserve.serving.openai.reasoning import ReasoningParser, TextDiff, get_reasoning_parser
from wideserve.serving.openai.serving import (SSE_DONE, ApiError, ChatOptions, ServingContext,
                                              chat_logprobs, final_item, now_s, serve_request, sse,
                                              stream_error_event, usage_dict)
from wideserve.serving.openai.input_prep import INLINE_CHARS
from wideserve.serving.openai.images import expand_images, prepare_chat_images
from wideserve.serving.openai.legacy_functions import legacy_delta, legacy_message
from wideserve.serving.openai.logprobs_format import prompt_logprobs_json
from wideserve.serving.openai.truncation import encode_keep_last, resolve_keep
from wideserve.serving.openai.structured import has_constraint, structured_params
from wideserve.serving.openai.tool_parsers import (ToolCallStream, ToolParser, calls_to_openai,
                                                   get_tool_parser)
from wideserve.serving.openai.tool_parsers.json_formats import NamedCallParser, RequiredCallsParser
from wideserve.serving.openai.tools import ToolSetup, resolve_tools
from wideserve.types.multimodal import ImageInput
from wideserve.types.sampling_params import SamplingParams
from wideserve.types.structured_params import StructuredOutputsParams

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
    tools: ToolSetup
    tool_parser: Callable[[], ToolParser] | None   # set when calls are read out of the text
    reasoning: Callable[[], ReasoningParser] | None   # None: no reasoning parser
    images: list[ImageInput] | None = None   # the prompt's image spans (images.py)


def render_prompt(ctx: ServingContext, messages: list[ChatMessage],
                  add_generation_prompt: bool, continue_final_message: bool,
                  tools: list[dict[str, Any]] | None,
                  template_kwargs: dict[str, Any] | None,
                  documents: list[dict[str, str]] | None = None) -> str:
    """The chat template applied to the messages; any failure is the request's fault (the
    template raised on these messages), so it is a 400 naming `messages`. `documents` is
    vLLM's: handed to the template as `documents` (RAG templates read it)."""
    kwargs = {k: v for k, v in (template_kwargs or {}).items()
              if k not in _RESERVED_TEMPLATE_KWARGS}
    if documents is not None:
        kwargs["documents"] = documents
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


def chat_options(args: Any) -> ChatOptions:
    """The chat flags of `wideserve serve` (absent ones off, for callers without them)."""
    return ChatOptions(bool(getattr(args, "enable_auto_tool_choice", False)),
                       getattr(args, "tool_call_parser", None),
                       getattr(args, "reasoning_parser", None))


def _tool_parser(ctx: ServingContext, setup: ToolSetup) -> Callable[[], ToolParser] | None:
    """auto: the server's parser reads the model's own call syntax; required / named: the
    output is constrained to a call in JSON, read by a parser for that JSON."""
    if setup.mode == "named":
        assert setup.named is not None
        return partial(NamedCallParser, setup.named)
    if setup.mode == "required":
        return RequiredCallsParser
    if setup.mode != "auto" or ctx.chat.tool_call_parser is None:
        return None
    return get_tool_parser(ctx.chat.tool_call_parser)


def _keeps_markers(ctx: ServingContext, parser: Callable[[], ToolParser]) -> bool:
    """Whether a parser's markers are special tokens (which detokenising would drop)."""
    markers = getattr(parser, "markers", ())
    if not markers:
        return False
    special = set(ctx.tokenizer.all_special_ids)
    ids = ctx.tokenizer.convert_tokens_to_ids(markers)
    return any(i is not None and i in special for i in ids)


def _is_light(req: ChatCompletionRequest) -> bool:
    """Nothing worth a thread hop: no tools or output constraint to validate, a template over
    a few short messages (microseconds)."""
    return (not req.tools and not has_constraint(req) and len(req.messages) <= 32
            and sum(len(m.text()) for m in req.messages) <= INLINE_CHARS)


def _checked_and_rendered(ctx: ServingContext, req: ChatCompletionRequest
                          ) -> tuple[ToolSetup, StructuredOutputsParams | None, str]:
    """The tools and the output constraint validated, and the prompt rendered: the work
    that grows with the request, run off the event loop (ctx.off_loop)."""
    setup = resolve_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          ctx.chat.enable_auto_tool_choice and ctx.chat.tool_call_parser is not None)
    constraint = structured_params(req, setup)
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:        # templates of reasoning models read it
        template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":      # no reasoning: the templates' own switches
            template_kwargs.setdefault("thinking", False)
            template_kwargs.setdefault("enable_thinking", False)
    prompt = render_prompt(ctx, req.messages, req.add_generation_prompt,
                           req.continue_final_message, setup.tools, template_kwargs,
                           req.documents)
    return setup, constraint, prompt


async def prepare(ctx: ServingContext, req: ChatCompletionRequest) -> _Call:
    ctx.check_model(req.model)
    ctx.check_priority(req.priority)
    ctx.check_sequences(1, req.n)
    if _is_light(req):
        setup, constraint, prompt = _checked_and_rendered(ctx, req)
    else:
        setup, constraint, prompt = await ctx.off_loop(_checked_and_rendered, ctx, req)
    keep = resolve_keep(ctx, req.truncate_prompt_tokens)
    prepared = await chat_images(ctx, req)
    images = None
    if prepared:
        if keep is not None:
            raise ApiError(400, "truncate_prompt_tokens: not available with image inputs (a "
                                "cut could split an image)", param="truncate_prompt_tokens")
        ids, images = await expand_images(ctx, prompt, prepared, req.add_special_tokens)
    elif keep is None:
        ids = await ctx.encode(prompt, req.add_special_tokens, "messages")
    else:
        ids = (await encode_keep_last(ctx, [prompt], req.add_special_tokens, keep,
                                      "messages"))[0]
    max_tokens = ctx.resolve_max_tokens(len(ids), req.effective_max_tokens, "messages")
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = ctx.sampling_params(req, max_tokens, num_logprobs)
    params.prompt_logprobs = req.prompt_logprobs
    ctx.check_kv_handle(params, ids, images)
    params.structured_outputs = constraint
    params.logit_bias = ctx.logit_bias(req.logit_bias)
    parser = _tool_parser(ctx, setup)
    if parser is not None and _keeps_markers(ctx, parser):
        params.skip_special_tokens = False
    reasoning = None
    if ctx.chat.reasoning_parser is not None:
        cls = get_reasoning_parser(ctx.chat.reasoning_parser)
        reasoning = partial(cls, cls.starts_inside(prompt))
    last = req.messages[-1]
    echo_prefix = last.text() if req.echo and last.role == "assistant" else ""
    ctx.check_alive()
    call = _Call(random_id("chatcmpl"), now_s(), req, prompt, ids, params, num_logprobs,
                 echo_prefix, setup, parser, reasoning, images)
    ctx.log_request(call.request_id, len(ids), req.user, prompt)
    return call


async def chat_images(ctx: ServingContext, req: ChatCompletionRequest) -> list[Any]:
    """The request's images decoded and preprocessed (off the event loop), or []."""
    if not any(isinstance(m.content, list) and m.images() for m in req.messages):
        return []
    return await ctx.off_loop(prepare_chat_images, ctx.images, req.messages)


class ChoiceOutput:
    """One choice's text -> reasoning, content and tool calls (whole or as deltas)."""

    def __init__(self, call: _Call) -> None:
        self.think = call.reasoning() if call.reasoning is not None else None
        self.tools = ToolCallStream(call.tool_parser()) if call.tool_parser else None
        self.parallel = call.tools.parallel
        self.text = ""
        self.echo = call.echo_prefix
        self._reasoning, self._content = TextDiff(), TextDiff()
        self.role_sent = False

    def _split(self, final: bool) -> tuple[str, str]:
        if self.think is None:
            return "", self.text
        return self.think.parse(self.text, final)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """The new delta fields after `text` (final: the choice's last text)."""
        self.text += text
        reasoning, content = self._split(final)
        out: dict[str, Any] = {}
        new_reasoning = self._reasoning.new(reasoning)
        if new_reasoning:
            out["reasoning_content"] = new_reasoning
        new_content = self._content.new(content)
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            new_content, calls = self.tools.feed(new_content, final)
            if not self.parallel:
                calls = [c for c in calls if c["index"] == 0]
        if self.echo and (new_content or final):
            new_content, self.echo = self.echo + new_content, ""
        if new_content:
            out["content"] = new_content
        if calls:
            out["tool_calls"] = calls
        if out and not self.role_sent:
            out = {"role": "assistant", **out}
            self.role_sent = True
        return out

    def message(self) -> dict[str, Any]:
        reasoning, content = self._split(True)
        msg: dict[str, Any] = {"role": "assistant", "content": self.echo + content}
        if self.tools is not None:
            result = self.tools.parser.parse(content, True)
            calls = calls_to_openai(result.calls)
            if calls:
                msg["content"] = (self.echo + result.content) or None
                msg["tool_calls"] = calls if self.parallel else calls[:1]
        if self.think is not None:
            msg["reasoning_content"] = reasoning or None
        return msg

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.has_calls


def _finish(reason: str | None, called_tools: bool) -> str | None:
    return "tool_calls" if called_tools and reason == "stop" else reason


def _stream_of(ctx: ServingContext, call: _Call) -> AsyncIterator[StreamItem]:
    return ctx.engine.generate(call.request_id, call.prompt, call.token_ids, call.params,
                               call.req.priority, images=call.images)


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest,
                                 raw: Request) -> Response:
    return await serve_request(ctx, req, raw, prepare, _stream, _full)


async def _full(ctx: ServingContext, call: _Call) -> dict[str, Any]:
    final = await final_item(_stream_of(ctx, call))
    out = final.output
    choices = []
    for co in out.outputs:
        logprobs = None
        if call.num_logprobs is not None and co.logprobs is not None:
            logprobs = chat_logprobs(ctx.tokenizer, co.logprobs, co.token_ids,
                                     call.num_logprobs, call.req.return_tokens_as_token_ids)
        choice = ChoiceOutput(call)
        choice.text = co.text
        message = choice.message()
        finish = _finish(co.finish_reason, "tool_calls" in message)
        if call.req.uses_legacy_functions:
            message, finish = legacy_message(message, finish)
        choices.append({"index": co.index, "message": message, "logprobs": logprobs,
                        "finish_reason": finish, "stop_reason": co.stop_reason})
    completion = sum(len(co.token_ids) for co in out.outputs)
    body = {"id": call.request_id, "object": "chat.completion", "created": call.created,
            "model": ctx.model_name, "choices": choices,
            "usage": usage_dict(len(call.token_ids), completion, out.num_cached_tokens)}
    if call.req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(ctx.tokenizer, out.prompt_logprobs)
    if out.kv_transfer_params is not None:
        body["kv_transfer_params"] = out.kv_transfer_params
    return body


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
    choices = [ChoiceOutput(call) for _ in range(req.n)]
    stream = _stream_of(ctx, call)
    try:
        async for item in stream:
            for d in item.deltas.values():
                completion_tokens += len(d.token_ids)
                logprobs = None
                if call.num_logprobs is not None and d.logprobs:
                    logprobs = chat_logprobs(ctx.tokenizer, d.logprobs, d.token_ids,
                                             call.num_logprobs, req.return_tokens_as_token_ids)
                choice = choices[d.index]
                done = d.finish_reason is not None
                delta = choice.delta(d.text, done)
                if done and not choice.role_sent:          # nothing was ever said
                    delta, choice.role_sent = {"role": "assistant", "content": ""}, True
                if not delta and not done and logprobs is None:
                    continue
                finish = _finish(d.finish_reason, choice.called_tools)
                if req.uses_legacy_functions:
                    delta, finish = legacy_delta(delta, finish)
                chunk = _chunk(ctx, call, d.index, delta, logprobs, finish, d.stop_reason)
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
