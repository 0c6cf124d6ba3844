"""OpenAI-compatible request and response models.

Requests are parsed straight from the raw body with `model_validate_json(strict=True)`: JSON
types must match (no "5" for an int, no NaN), and unknown fields are rejected as OpenAI does
("Unrecognized request argument"). Field names are OpenAI's; the extras after the OpenAI
block are vLLM's sampling extensions, spelled the same way.

Range checks live here, so any value that reaches the engine is one it can take: numbers are
bounded (a seed past 64 bits would not survive msgpack or torch.Generator), lists are
bounded, and limits that depend on the model (vocabulary, context) are checked by the
serving code, which knows them.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from wideserve.entrypoints.openai.validation import integral, integral_list, integral_lists

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# Accepted and ignored (with a warning), see _SamplingFields._drop_ignored_fields.
IGNORED_FIELDS = frozenset({
    "modalities", "prediction", "web_search_options", "safety_identifier", "prompt_cache_key",
    "verbosity", "cache_salt", "request_id", "spaces_between_special_tokens"})
logger = logging.getLogger(__name__)

_REQUEST_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

# Integers also accept integral floats (1.0), as JSON Schema's "integer" and vLLM do.
Int = Annotated[int, BeforeValidator(integral)]
NonNegInt = Annotated[Int, Field(ge=0, le=INT32_MAX)]
PosInt = Annotated[Int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # vLLM: usage on every chunk


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` extension: exactly one constraint (checked when served)."""
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    # Accepted as vLLM does, and ignored here (llguidance keeps JSON whitespace compact).
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model_config = _REQUEST_CONFIG

    model: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    seed: Annotated[Int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None       # how many and how long: limits.py
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: Annotated[Int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: Annotated[list[NonNegInt], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Annotated[Int, Field(ge=-(2**31), le=INT32_MAX)] = 0
    # P/D disaggregation (vLLM's field): set by `wideserve router`, see docs/disaggregation.md.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's structured outputs, and its older guided_* spellings of the same.
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None            # ignored: one engine here
    guided_whitespace_pattern: str | None = None          # ignored, as above

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored_fields(cls, data: Any) -> Any:
        """Fields OpenAI or vLLM clients send that mean nothing for this server (metadata,
        hints, text-only modalities): accepted and logged as ignored, as vLLM does. Any other
        unknown field is still a 400, so typos are not silently lost."""
        if not isinstance(data, dict) or not IGNORED_FIELDS.intersection(data):
            return data
        modalities = data.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise ValueError("modalities: only ['text'] is supported by this model")
        ignored = sorted(IGNORED_FIELDS.intersection(data))
        logger.warning("request fields ignored by this server: %s", ", ".join(ignored))
        return {k: v for k, v in data.items() if k not in IGNORED_FIELDS}

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if isinstance(self.stop, str) or self.stop is None:
            stops = [self.stop] if self.stop else []
        else:
            stops = self.stop
        if any(len(s) == 0 for s in stops):
            raise ValueError("stop: stop strings must not be empty")
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# --------------------------------------------------------------------------- completions

PromptInput = Annotated[
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)],
    BeforeValidator(integral_lists)]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: PosInt | None = 16
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if self.suffix:
            raise ValueError("suffix: not supported by this model")
        return self


# --------------------------------------------------------------------------- chat

class TextContentPart(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _REQUEST_CONFIG
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _REQUEST_CONFIG
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextContentPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: required for a {self.role} message")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required for a tool message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_tool_call(tc) for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    """Templates (HF's and ours) expect `arguments` as a mapping; as vLLM does, a JSON-object
    string is handed over parsed, anything else as given."""
    out = call.model_dump()
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return out
    if isinstance(args, dict):
        out["function"]["arguments"] = args
    return out


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PosInt | None = None                 # deprecated by OpenAI, still accepted
    max_completion_tokens: PosInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with "
                             "add_generation_prompt")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be an "
                             "assistant message")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


# --------------------------------------------------------------------------- tokenize

class TokenizeCompletionRequest(BaseModel):
    model_config = _REQUEST_CONFIG
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(BaseModel):
    model_config = _REQUEST_CONFIG
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST_CONFIG
    model: str | None = None
    tokens: Annotated[list[TokenId], BeforeValidator(integral_list)]


# --------------------------------------------------------------------------- responses

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "wideserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
