"""The published OpenAPI schema (GET /openapi.json), built explicitly.

The routes read their raw bodies (size limit, deadline, pre-scan, strict parsing), so FastAPI
cannot see their types; this module says them: each POST body is the pydantic model the route
validates with (so new request fields appear by themselves), each answer is its JSON shape or
an SSE stream, and every error is OpenAI's error object with the statuses the server uses.
Clients and fuzzers (the suite's schemathesis run) read it.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from wideserve import __version__
from wideserve.serving.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                               DetokenizeRequest, ErrorResponse,
                                               TokenizeChatRequest, TokenizeCompletionRequest)

_REF = "#/components/schemas/{model}"
# Statuses a POST route may answer besides 200, with what they mean here.
_POST_ERRORS = {
    "400": "invalid request (the message names the field)", "401": "missing or bad API key",
    "404": "not supported by this model", "408": "body not received in time",
    "413": "body too large", "415": "not application/json", "499": "client went away",
    "503": "engine unavailable or server shutting down",
    "500": "internal error (a bug: please report it)"}

_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {k: {"type": "integer"} for k in
                         ("prompt_tokens", "completion_tokens", "total_tokens")}}


def _completion_like(obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice},
                           "usage": _USAGE}}


_COMPLETION = _completion_like("text_completion", {
    "type": "object", "required": ["index", "text", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "text": {"type": "string"}}})
_CHAT = _completion_like("chat.completion", {
    "type": "object", "required": ["index", "message", "finish_reason"],
    "properties": {"index": {"type": "integer"}, "message": {"type": "object"}}})
_TOKENIZE = {"type": "object", "required": ["count", "max_model_len", "tokens"],
             "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                            "tokens": {"type": "array", "items": {"type": "integer"}}}}
_DETOKENIZE = {"type": "object", "required": ["prompt"],
               "properties": {"prompt": {"type": "string"}}}
_MODELS = {"type": "object", "required": ["object", "data"],
           "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
               "type": "object", "required": ["id", "object"],
               "properties": {"id": {"type": "string"}, "object": {"const": "model"}}}}}}


def _error_responses(codes: dict[str, str]) -> dict[str, Any]:
    body = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    return {code: {"description": text, "content": body} for code, text in codes.items()}


def _post(summary: str, body: dict[str, Any], ok: dict[str, Any],
          stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": ok}}
    if stream:
        # One server-sent event: `data:` is a JSON chunk (or [DONE]); responses name `event:`.
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": body}}},
                     "responses": {"200": {"description": "OK", "content": content},
                                   **_error_responses(_POST_ERRORS)}}}


def _get(summary: str, ok: dict[str, Any] | None, media: str = "application/json",
         errors: dict[str, str] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": "OK"}
    if ok is not None:
        response["content"] = {media: {"schema": ok}}
    return {"get": {"summary": summary, "responses": {
        "200": response, **_error_responses(errors or {"401": "missing or bad API key"})}}}


_RESPONSE = {"type": "object", "required": ["id", "object", "status"],
             "properties": {"id": {"type": "string"}, "object": {"const": "response"},
                            "status": {"type": "string"}, "output": {"type": "array"}}}
_ID_PARAM = {"name": "response_id", "in": "path", "required": True,
             "schema": {"type": "string"}}
_STORED_ERRORS = {"400": "invalid request (the message names the field)",
                  "401": "missing or bad API key", "404": "no response with this id"}


def _stored(method: str, summary: str, ok: dict[str, Any],
            query: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    params = [_ID_PARAM] + [{"name": k, "in": "query", "required": False, "schema": v}
                            for k, v in (query or {}).items()]
    return {method: {"summary": summary, "parameters": params, "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": ok}}},
        **_error_responses(_STORED_ERRORS)}}}


def responses_routes() -> dict[str, Any]:
    """The stored-response routes of the Responses API (serving_responses.py)."""
    deleted = {"type": "object", "required": ["id", "object", "deleted"],
               "properties": {"id": {"type": "string"}, "object": {"const": "response.deleted"},
                              "deleted": {"type": "boolean"}}}
    items = {"type": "object", "required": ["object", "data", "has_more"],
             "properties": {"object": {"const": "list"}, "data": {"type": "array"},
                            "first_id": {"type": ["string", "null"]},
                            "last_id": {"type": ["string", "null"]},
                            "has_more": {"type": "boolean"}}}
    return {
        "/v1/responses/{response_id}": {
            **_stored("get", "A stored response (or a background one as it stands)",
                      _RESPONSE, {"stream": {"type": "boolean"}}),
            **_stored("delete", "Delete a stored response (stops a running one)", deleted)},
        "/v1/responses/{response_id}/input_items": _stored(
            "get", "A stored response's input items", items,
            {"limit": {"type": "integer", "minimum": 1, "maximum": 100},
             "order": {"enum": ["asc", "desc"]}, "after": {"type": "string"}}),
        "/v1/responses/{response_id}/cancel": _stored(
            "post", "Cancel a background response", _RESPONSE)}


def build_openapi(extra_models: dict[str, type[BaseModel]] | None = None) -> dict[str, Any]:
    """The schema; `extra_models` are further POST routes' bodies by path (e.g. the
    Responses API), described with the same error set."""
    models: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest,
                                     TokenizeCompletionRequest, TokenizeChatRequest,
                                     DetokenizeRequest, ErrorResponse,
                                     *(extra_models or {}).values()]
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)

    def ref(model: type[BaseModel]) -> dict[str, str]:
        return {"$ref": _REF.format(model=model.__name__)}

    paths = {
        "/v1/completions": _post("Text completion", ref(CompletionRequest), _COMPLETION,
                                 stream=True),
        "/v1/chat/completions": _post("Chat completion", ref(ChatCompletionRequest), _CHAT,
                                      stream=True),
        "/tokenize": _post("Token ids of a prompt or of rendered messages",
                           {"anyOf": [ref(TokenizeCompletionRequest),
                                      ref(TokenizeChatRequest)]}, _TOKENIZE),
        "/detokenize": _post("Text of token ids", ref(DetokenizeRequest), _DETOKENIZE),
        "/v1/models": _get("Served model names", _MODELS),
        "/health": _get("200 when the engine is alive and answering", None,
                        errors={"503": "engine dead or not answering"}),
        "/ping": _get("Same as /health", None, errors={"503": "engine dead or not answering"}),
        "/version": _get("Server version", {"type": "object", "required": ["version"],
                                            "properties": {"version": {"type": "string"}}}),
        "/metrics": _get("Prometheus metrics", {"type": "string"}, media="text/plain"),
    }
    for path, model in (extra_models or {}).items():
        paths[path] = _post(model.__doc__.split("\n")[0] if model.__doc__ else path,
                            ref(model), {"type": "object"}, stream=True)
    if "/v1/responses" in (extra_models or {}):
        paths.update(responses_routes())
    return {"openapi": "3.1.0",
            "info": {"title": "wideserve", "version": __version__,
                     "description": "OpenAI-compatible API; errors are OpenAI's error object."},
            "paths": paths, "components": {"schemas": defs.get("$defs", {})}}
