"""POST /v1/completions: the legacy text completion API.

A list of prompts becomes one engine request per prompt (each fanned out to n choices);
choice indices are prompt_index * n + sample_index, as OpenAI numbers them.

Text and token prompts only, as in vLLM (whose /v1/completions takes no media): a request
carrying images in a field other servers use (`multi_modal_data`, `media_urls`, ...) is a
400 pointing to chat, never a completion of the text with the image silently dropped
(docs/deepseek_v41.md, "Images").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from wideserve.serving.engine_client import EngineDeadError
from wideserve.serving.openai.async_engine import RequestFailed, StreamItem
from wideserve.serving.openai.input_prep import num_prompts
from wideserve.serving.openai.protocol import CompletionRequest, random_id
from wideserve.serving.openai.serving import (SSE_DONE, ApiError, ServingContext,
                                              completion_logprobs, engine_unavailable,
                                              merge_streams, now_s, request_failed_error,
                                              serve_request, sse, stream_error_event, usage_dict)
from wideserve.serving.openai.logprobs_format import prompt_logprobs_json
from wideserve.serving.openai.structured import has_constraint, structured_params
from wideserve.serving.openai.truncation import encode_keep_last, keep_last, resolve_keep
from wideserve.types.sampling_params import SamplingParams


@dataclass(slots=True)
class _Prompt:
    text: str | None
    token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Call:
    """One /v1/completions call, validated and ready to run."""
    request_id: str
    created: int
    req: CompletionRequest
    prompts: list[_Prompt]
    num_logprobs: int | None
    text_lens: dict[int, int] = field(default_factory=dict)  # choice -> chars so far


async def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[tuple[str | None,
                                                                             list[int]]]:
    """(text, ids) per prompt; cut to the last truncate_prompt_tokens tokens when set."""
    p = req.prompt
    keep = resolve_keep(ctx, req.truncate_prompt_tokens)
    if isinstance(p, str) or (p and isinstance(p[0], str)):
        texts: list[str] = [p] if isinstance(p, str) else list(p)   # type: ignore[arg-type]
        if keep is not None:
            encoded = await encode_keep_last(ctx, texts, req.add_special_tokens, keep)
            return [(None if len(ids) == keep else t, ids) for t, ids in zip(texts, encoded)]
        return list(zip(texts, await ctx.encode_many(texts, req.add_special_tokens)))
    lists = [list(p)] if isinstance(p[0], int) else [list(x) for x in p]  # type: ignore
    out: list[tuple[str | None, list[int]]] = []
    for ids in lists:
        ids = keep_last(ids, keep)
        ctx.check_token_ids(ids, "prompt")
        out.append((None, ids))
    return out


# Where other servers or vLLM's closed proposals put media on a completions request.
MEDIA_FIELDS = ("multi_modal_data", "media_urls", "image_url", "image_urls", "images",
                "image_data", "multimodal_data")


def check_no_media(req: CompletionRequest) -> None:
    extra = req.model_extra or {}
    field = next((f for f in MEDIA_FIELDS if f in extra), None)
    if field is not None:
        raise ApiError(400, f"{field}: /v1/completions takes no images (as in vLLM); send "
                            f"them to /v1/chat/completions as image_url content parts (or "
                            f"offline: LLM.generate's multi_modal_data)", param=field)


async def prepare(ctx: ServingContext, req: CompletionRequest) -> _Call:
    check_no_media(req)
    ctx.check_model(req.model)
    ctx.check_priority(req.priority)
    ctx.check_sequences(num_prompts(req.prompt), req.n)
    prompts = []
    constraint = await ctx.off_loop(structured_params, req) if has_constraint(req) else None
    for text, ids in await _prompts(ctx, req):
        # max_tokens 0 (echo only): one token is generated and dropped, as vLLM does, so
        # the prompt's logprobs are computed by the same path.
        max_tokens = ctx.resolve_max_tokens(len(ids), req.max_tokens or (
            None if req.max_tokens is None else 1), "prompt")
        params = ctx.sampling_params(req, max_tokens, req.logprobs)
        ctx.check_kv_handle(params, ids)
        params.structured_outputs = constraint
        params.logit_bias = ctx.logit_bias(req.logit_bias)
        wanted = [n for n in (req.prompt_logprobs,
                              req.logprobs if req.echo else None) if n is not None]
        if wanted:                                     # echo + logprobs: the prompt's too
            params.prompt_logprobs = max(wanted)
        if req.echo and text is None:
            text = ctx.tokenizer.decode(ids, skip_special_tokens=False)
        prompts.append(_Prompt(text, ids, params))
    ctx.check_alive()
    call = _Call(random_id("cmpl"), now_s(), req, prompts, req.logprobs)
    ctx.log_request(call.request_id, sum(len(p.token_ids) for p in prompts), req.user,
                    req.prompt)
    return call


def _streams(ctx: ServingContext, call: _Call) -> list[AsyncIterator[StreamItem]]:
    # One group for all the prompts: admission is fair across client requests.
    return [ctx.engine.generate(f"{call.request_id}-{i}", p.text, p.token_ids, p.params,
                                call.req.priority, group_id=call.request_id)
            for i, p in enumerate(call.prompts)]


async def create_completion(ctx: ServingContext, req: CompletionRequest,
                            raw: Request) -> Response:
    return await serve_request(ctx, req, raw, prepare, _stream, _full)


async def _full(ctx: ServingContext, call: _Call) -> dict[str, Any]:
    finals: dict[int, StreamItem] = {}
    try:
        async for i, item in merge_streams(_streams(ctx, call)):
            finals[i] = item
    except EngineDeadError as e:
        raise engine_unavailable(str(e)) from None
    except RequestFailed as e:
        raise request_failed_error(e) from None
    n = call.req.n
    choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
    for i, prompt in enumerate(call.prompts):
        out = finals[i].output
        prompt_tokens += len(prompt.token_ids)
        cached += out.num_cached_tokens
        echo_only = call.req.max_tokens == 0
        for co in out.outputs:
            token_ids = [] if echo_only else co.token_ids
            completion_tokens += len(token_ids)
            prefix = (prompt.text or "") if call.req.echo else ""
            logprobs = None
            if call.num_logprobs is not None and co.logprobs is not None:
                logprobs = completion_logprobs(ctx.tokenizer, co.logprobs, token_ids,
                                               call.num_logprobs, len(prefix),
                                               call.req.return_tokens_as_token_ids)
                if call.req.echo:
                    logprobs = _with_prompt(ctx, call, prompt.token_ids, out.prompt_logprobs,
                                            logprobs)
            choice = {"index": i * n + co.index, "text": prefix + ("" if echo_only else co.text),
                      "logprobs": logprobs,
                      "finish_reason": "length" if echo_only else co.finish_reason,
                      "stop_reason": None if echo_only else co.stop_reason}
            if call.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(ctx.tokenizer,
                                                                 out.prompt_logprobs)
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    body = {"id": call.request_id, "object": "text_completion", "created": call.created,
            "model": ctx.model_name, "choices": choices,
            "usage": usage_dict(prompt_tokens, completion_tokens, cached)}
    if finals[0].output.kv_transfer_params is not None:
        body["kv_transfer_params"] = finals[0].output.kv_transfer_params
    return body



def _with_prompt(ctx: ServingContext, call: _Call, prompt_ids: list[int],
                 prompt_lps: Any, generated: dict[str, Any]) -> dict[str, Any]:
    """echo + logprobs: the prompt's tokens first (the first has no logprob, as in vLLM's
    and OpenAI's answers), then the generated ones; text offsets run over both."""
    if not prompt_lps or not prompt_ids:
        return generated
    first = ctx.tokenizer.decode(prompt_ids[:1], skip_special_tokens=False)
    as_ids = call.req.return_tokens_as_token_ids
    if as_ids:
        first = f"token_id:{prompt_ids[0]}"
    rest = completion_logprobs(ctx.tokenizer, list(prompt_lps[1:]), prompt_ids[1:],
                               call.num_logprobs or 0, len(first), as_ids)
    return {"tokens": [first] + rest["tokens"] + generated["tokens"],
            "token_logprobs": [None] + rest["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": [None] + rest["top_logprobs"] + generated["top_logprobs"],
            "text_offset": [0] + rest["text_offset"] + generated["text_offset"]}


async def _stream(ctx: ServingContext, call: _Call) -> AsyncIterator[str]:
    req, n = call.req, call.req.n
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = include_usage and bool(opts and opts.continuous_usage_stats)
    prompt_tokens = sum(len(p.token_ids) for p in call.prompts)
    completion_tokens, cached = 0, 0
    merged = merge_streams(_streams(ctx, call))
    try:
        async for i, item in merged:
            for d in item.deltas.values():
                index = i * n + d.index
                completion_tokens += len(d.token_ids)
                text = d.text
                if req.echo and index not in call.text_lens:
                    text = (call.prompts[i].text or "") + text
                offset = call.text_lens.get(index, 0)
                call.text_lens[index] = offset + len(text)
                logprobs = None
                if call.num_logprobs is not None and d.logprobs:
                    logprobs = completion_logprobs(ctx.tokenizer, d.logprobs, d.token_ids,
                                                   call.num_logprobs, offset + len(text)
                                                   - len(d.text),
                                                   req.return_tokens_as_token_ids)
                    if req.echo and offset == 0:
                        logprobs = _with_prompt(ctx, call, call.prompts[i].token_ids,
                                                item.output.prompt_logprobs, logprobs)
                if not text and d.finish_reason is None and logprobs is None:
                    continue
                chunk = _chunk(ctx, call, index, text, logprobs, d.finish_reason,
                               d.stop_reason)
                if continuous:
                    chunk["usage"] = usage_dict(prompt_tokens, completion_tokens, cached)
                yield sse(chunk)
            if item.finished:
                cached += item.output.num_cached_tokens
        if include_usage:
            yield sse({"id": call.request_id, "object": "text_completion",
                       "created": call.created, "model": ctx.model_name, "choices": [],
                       "usage": usage_dict(prompt_tokens, completion_tokens, cached)})
    except (EngineDeadError, RequestFailed, ApiError) as e:
        yield stream_error_event(e)
    finally:
        await merged.aclose()
    yield SSE_DONE


def _chunk(ctx: ServingContext, call: _Call, index: int, text: str, logprobs: Any,
           finish_reason: str | None, stop_reason: Any) -> dict[str, Any]:
    return {"id": call.request_id, "object": "text_completion", "created": call.created,
            "model": ctx.model_name,
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish_reason, "stop_reason": stop_reason}]}
