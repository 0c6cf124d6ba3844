"""Anthropic Messages API request models (`POST /v1/messages`, `/v1/messages/count_tokens`).

Parsed as strictly as the OpenAI requests (protocol.py beside the OpenAI server): JSON types
must match and unknown fields are a 400 naming them, except the fields Anthropic clients send
that mean nothing here (prompt-caching hints, service tier, citations), which are accepted
and ignored. Image blocks with a base64 source are served like chat's image_url parts (on a
model with a vision tower, docs/deepseek_v41.md "Images"); content this server cannot take
(url and file image sources, documents, Anthropic's own server tools) is refused with a
message naming it, never silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wideserve.serving.openai.protocol import INT32_MAX, Int

_CONFIG = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_UNSUPPORTED_BLOCKS = ("document", "search_result", "server_tool_use",
                       "web_search_tool_result", "container_upload")


class _Block(BaseModel):
    model_config = _CONFIG
    cache_control: dict[str, Any] | None = None      # a prompt-caching hint: ignored


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None     # ignored


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class Base64ImageSource(BaseModel):
    model_config = _CONFIG
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str

    def data_url(self) -> str:
        """As chat's image_url part carries it (serving/openai/images.py decodes it)."""
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Block):
    type: Literal["image"]
    source: Base64ImageSource


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[Annotated[Union[TextBlock, ImageBlock],
                                  Field(discriminator="type")]] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            body = ""
        elif isinstance(self.content, str):
            body = self.content
        else:
            body = "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        # The flag has no field in the chat template: it travels in the text.
        return f"Error: {body}" if self.is_error else body

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(isinstance(b, ImageBlock)
                                                      for b in self.content)


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock,
                               ThinkingBlock, RedactedThinkingBlock], Field(discriminator="type")]


def _refuse_unsupported_blocks(content: Any, where: str) -> None:
    """Before the union is tried, so the message names the block instead of listing the
    five ways it failed to be one of the supported ones."""
    if not isinstance(content, list):
        return
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        source = block.get("source") if kind == "image" else None
        if isinstance(source, dict) and source.get("type") in ("url", "file"):
            what = ("url image sources are not supported (this server does not fetch URLs)"
                    if source["type"] == "url" else
                    "file image sources (the Files API) are not supported")
            raise ValueError(f"{where}.{j}.source: {what}; send the image as a base64 source "
                             f"({{'type': 'base64', 'media_type': 'image/png', 'data': ...}})")
        if kind in _UNSUPPORTED_BLOCKS:
            raise ValueError(f"{where}.{j}.type: {kind!r} blocks are not supported "
                             f"by this server")
        if kind == "tool_result" and isinstance(block.get("content"), list):
            _refuse_unsupported_blocks(block["content"], f"{where}.{j}.content")


class Message(BaseModel):
    model_config = _CONFIG
    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            _refuse_unsupported_blocks(data.get("content"), "content")
        return data

    @model_validator(mode="after")
    def _roles(self) -> "Message":
        if isinstance(self.content, list):
            kinds = {b.type for b in self.content}
            if self.role == "user" and kinds & {"tool_use", "thinking", "redacted_thinking"}:
                raise ValueError("content: tool_use and thinking blocks belong to assistant "
                                 "messages")
            if self.role == "assistant" and kinds & {"tool_result", "image"}:
                raise ValueError("content: tool_result and image blocks belong to user "
                                 "messages")
        return self


class Tool(BaseModel):
    """A client tool. Anthropic's server tools (a `type` such as "web_search_20250305") run
    on Anthropic's side and have no counterpart here."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _server_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise ValueError(f"type: {data.get('type')!r} is one of Anthropic's server "
                             f"tools, which this server does not run; declare a client tool "
                             f"(name, description, input_schema)")
        return data


class ToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name: required with type 'tool', and only with it")
        return self


class Thinking(BaseModel):
    model_config = _CONFIG
    # budget_tokens is accepted but not a separate cap: max_tokens bounds thinking and answer.
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[Int, Field(ge=1, le=INT32_MAX)] | None = None
    display: str | None = None                          # ignored

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class OutputFormat(BaseModel):
    model_config = _CONFIG
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs (`format`, served by constrained decoding) and the reasoning
    `effort` (the chat path's reasoning_effort; xhigh and max are its "high")."""
    model_config = _CONFIG
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(BaseModel):
    model_config = _CONFIG
    user_id: str | None = None


class _Prompt(BaseModel):
    """What makes a prompt: shared by /v1/messages and /v1/messages/count_tokens."""
    model_config = _CONFIG
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | Annotated[list[TextBlock], Field(min_length=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: scheduling and placement preferences, account routing, and
    # top-level prompt-caching hints (this server's prefix cache needs none).
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    workspace_id: str | None = None
    user_profile_id: str | None = None
    diagnostics: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> "_Prompt":
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") \
                and not self.tools:
            raise ValueError(f"tool_choice: {self.tool_choice.type!r} needs at least one "
                             f"tool in `tools`")
        if self.tool_choice is not None and self.tool_choice.name is not None \
                and self.tool_choice.name not in {t.name for t in self.tools or []}:
            raise ValueError(f"tool_choice: names the tool {self.tool_choice.name!r}, "
                             f"which is not in `tools`")
        return self

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)


class MessagesRequest(_Prompt):
    max_tokens: Annotated[Int, Field(ge=1, le=INT32_MAX)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[Int, Field(ge=0, le=INT32_MAX)] | None = None
    metadata: Metadata | None = None


class CountTokensRequest(_Prompt):
    pass
