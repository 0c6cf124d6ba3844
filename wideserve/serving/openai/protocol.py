"""OpenAI-compatible request and response models.

Requests are parsed straight from the raw body with `model_validate_json(strict=True)`: JSON
types must match (no "5" for an int, no NaN). Unknown fields are accepted and dropped, as vLLM
does, with a warning and a response header naming them (lenient.py); the fields clients echo
back from the server's own messages (`refusal`, `annotations`, ...) are dropped silently. Field
names are OpenAI's; the extras after the OpenAI block are vLLM's, spelled the same way.

Range checks live here, so any value that reaches the engine is one it can take: numbers are
bounded (a seed past 64 bits would not survive msgpack or torch.Generator), lists are
bounded, and limits that depend on the model (vocabulary, context) are checked by the
serving code, which knows them.
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      model_validator)

from wideserve.serving.openai.lenient import LenientModel

from wideserve.serving.openai.validation import (int64_json, integral, integral_list,
                                                 integral_lists)
from wideserve.types.multimodal import IMAGE_PLACEHOLDER

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

# OpenAI fields without meaning for this server: accepted and dropped like any unknown field
# (lenient.py: a warning once, and the response header); listed for docs/api-compatibility.md.
IGNORED_FIELDS = frozenset({
    "prediction", "web_search_options", "safety_identifier", "prompt_cache_key",
    "verbosity", "cache_salt", "request_id", "audio", "prompt_cache_retention"})
# What OpenAI's reasoning_effort may be (the SDK's ReasoningEffort).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
logger = logging.getLogger(__name__)

# Integers also accept integral floats (1.0), as JSON Schema's "integer" and vLLM do.
Int = Annotated[int, BeforeValidator(integral)]
NonNegInt = Annotated[Int, Field(ge=0, le=INT32_MAX)]
PosInt = Annotated[Int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# A JSON object the engine receives as is: its integers must fit int64 (the IPC's encoding).
EngineJson = Annotated[dict[str, Any], AfterValidator(int64_json)]


class StreamOptions(LenientModel):
    _ECHOED = frozenset({"include_obfuscation"})     # no obfuscation padding is sent here
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None   # vLLM: usage on every chunk


class StructuredOutputsRequest(LenientModel):
    """vLLM's `structured_outputs` extension: exactly one constraint (checked when served)."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    # Accepted as vLLM does, and ignored here (llguidance keeps JSON whitespace compact).
    disable_any_whitespace: bool | None = None
    whitespace_pattern: str | None = None


class _SamplingFields(LenientModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

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
    # vLLM's: only its slow-tokenizer detokenizer reads it; tokenizers here are fast ones, so
    # accepted with no effect, as in vLLM.
    spaces_between_special_tokens: bool = True
    # vLLM's: keep only the last k prompt tokens (-1: the context length); see truncation.py.
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1, le=INT32_MAX)] | None = None
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool = False
    modalities: list[str] | None = None
    priority: Annotated[Int, Field(ge=-(2**31), le=INT32_MAX)] = 0
    # P/D disaggregation (vLLM's field): set by `wideserve router`, see docs/disaggregation.md.
    kv_transfer_params: EngineJson | None = None
    # vLLM's structured outputs, and its older guided_* spellings of the same.
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None            # ignored: one engine here
    guided_whitespace_pattern: str | None = None          # ignored, as above

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingFields":
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError("modalities: only ['text'] is supported by this model")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true (as in vLLM)")
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


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    # 0 only with echo (vLLM: the prompt back, with its logprobs, nothing generated).
    max_tokens: NonNegInt | None = 16
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Annotated[Int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None
    # vLLM's completions extras.
    add_special_tokens: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if self.suffix:
            raise ValueError("suffix: not supported by this model")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo (the prompt back, "
                             "nothing generated)")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens: 0 (echo only) is not available when stream is true")
        return self


# --------------------------------------------------------------------------- chat

class TextContentPart(LenientModel):
    _ECHOED = frozenset({"cache_control"})
    type: Literal["text"]
    text: str


class RefusalContentPart(LenientModel):
    """An assistant message's refusal part, echoed back: carries no text for the model."""
    type: Literal["refusal"]
    refusal: str


class ImageUrl(LenientModel):
    url: str
    detail: str | None = None        # OpenAI's; the model's processor decides the size


class ImageUrlContentPart(LenientModel):
    """An image (serving/openai/images.py): a base64 `data:` URL; the server fetches none."""
    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(LenientModel):
    _ECHOED = frozenset({"parsed_arguments"})
    name: str
    arguments: str


class ToolCall(LenientModel):
    _ECHOED = frozenset({"index"})
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# What the openai SDK (and LangChain, LiteLLM, Anthropic-style clients) put on a message they
# echo back, meaningless to a text chat template.
_MESSAGE_ECHOES = frozenset({"refusal", "annotations", "audio", "parsed", "cache_control",
                             "stop_reason", "provider_specific_fields"})


class ChatMessage(LenientModel):
    _ECHOED = _MESSAGE_ECHOES
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[TextContentPart | RefusalContentPart | ImageUrlContentPart],
                             Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    # vLLM's newer spelling of reasoning_content (what its responses carry).
    reasoning: str | None = None
    # Legacy (pre-tools) OpenAI: an assistant's call; null when echoed from a modern reply.
    function_call: FunctionCall | None = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatMessage":
        if self.reasoning_content is None and self.reasoning is not None:
            self.reasoning_content = self.reasoning
        if self.content is None and not (self.role == "assistant" and (
                self.tool_calls or self.function_call)):
            if self.role != "assistant":
                raise ValueError(f"content: required for a {self.role} message")
            self.content = ""        # an echoed refusal, or an empty turn
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required for a tool message")
        if self.role == "function" and not self.name:
            raise ValueError("name: required for a function message")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def images(self) -> list[ImageUrlContentPart]:
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if isinstance(p, ImageUrlContentPart)]

    def template_text(self) -> str:
        """The text with each image part as IMAGE_PLACEHOLDER, in order."""
        if not isinstance(self.content, list):
            return self.text()
        return "".join(p.text if isinstance(p, TextContentPart) else IMAGE_PLACEHOLDER
                       for p in self.content if not isinstance(p, RefusalContentPart))

    def to_template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.template_text()}
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
    out = {"id": call.id, "type": call.type,          # the known fields only, no extras
           "function": {"name": call.function.name, "arguments": call.function.arguments}}
    try:
        args = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return out
    if isinstance(args, dict):
        out["function"]["arguments"] = args
    return out


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
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None      # type: ignore[valid-type]
    # Legacy OpenAI function calling (before tools): turned into tools, see legacy_functions.
    functions: Annotated[list[dict[str, Any]], Field(min_length=1)] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's chat extras.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False         # the template already wrote BOS (vLLM's default)
    documents: list[dict[str, str]] | None = None      # handed to the template (RAG)

    @property
    def uses_legacy_functions(self) -> bool:
        return self.functions is not None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        legacy_functions(self)
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


def legacy_functions(req: ChatCompletionRequest) -> None:
    """OpenAI's pre-tools function calling, as tools: `functions` -> `tools`, `function_call`
    -> `tool_choice`, an assistant's `function_call` -> a tool call, and a `function` message
    -> the tool message answering the latest call of that name. The reply then carries
    `function_call` instead of `tool_calls` (serving_chat)."""
    if req.functions is not None:
        if req.tools is not None:
            raise ValueError("functions: cannot be combined with tools (functions is the "
                             "legacy spelling of tools)")
        req.tools = [{"type": "function", "function": f} for f in req.functions]
    if req.function_call is not None:
        if req.tool_choice is not None:
            raise ValueError("function_call: cannot be combined with tool_choice")
        fc = req.function_call
        if isinstance(fc, dict) and isinstance(fc.get("name"), str):
            req.tool_choice = {"type": "function", "function": {"name": fc["name"]}}
        elif fc in ("none", "auto"):
            req.tool_choice = fc
        else:
            raise ValueError("function_call: must be 'none', 'auto' or {\"name\": ...}")
    last_call: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        if m.role == "assistant" and m.function_call is not None and not m.tool_calls:
            call_id = f"call_legacy_{i}"
            m.tool_calls = [ToolCall(id=call_id, function=m.function_call)]
            last_call[m.function_call.name] = call_id
        elif m.role == "function":
            assert m.name is not None
            m.role, m.tool_call_id = "tool", last_call.get(m.name, f"call_{m.name}")


# --------------------------------------------------------------------------- tokenize

class TokenizeCompletionRequest(LenientModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(LenientModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(LenientModel):
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


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
