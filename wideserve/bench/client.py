"""One streaming request to an OpenAI-compatible server, timed into a RequestRecord.

Works with any server that speaks the OpenAI streaming protocol (SSE `data: {...}` lines, then
`data: [DONE]`). Token counts come from the server's `usage` (requested with
`stream_options.include_usage`), as InferenceX's `--use-server-token-count` does; a server that
sends none falls back to re-tokenising the text with the benchmark's tokenizer.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wideserve.bench.datasets import BenchRequest
from wideserve.bench.latency_metrics import RequestRecord

if TYPE_CHECKING:
    import httpx

    from wideserve.text.tokenizer import Tokenizer

_OVERFLOW_MARKERS = ("maximum context length", "context_length_exceeded", "context length")


@dataclass(slots=True)
class ServeTarget:
    base_url: str                        # e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    endpoint: str = "completions"        # or "chat"
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    ignore_eos: bool = True
    tokenizer: Tokenizer | None = None

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def build_body(target: ServeTarget, req: BenchRequest, max_tokens: int | None = None
               ) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "max_tokens": max_tokens if max_tokens is not None
                            else req.output_len}
    if target.ignore_eos:
        body["ignore_eos"] = True
    if target.endpoint == "chat":
        body["messages"] = req.messages or [{"role": "user", "content": req.prompt or ""}]
    else:
        body["prompt"] = req.prompt if req.prompt is not None else req.prompt_token_ids
    body.update(target.extra_body)
    return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, target: ServeTarget, req: BenchRequest,
                       phase: str = "profiling", max_tokens: int | None = None,
                       session: str | None = None) -> RequestRecord:
    """POST one streaming request; never raises for a failed request (the record says why)."""
    body = build_body(target, req, max_tokens)
    rec = RequestRecord(start=time.perf_counter(), phase=phase, session=session)
    chat = target.endpoint == "chat"
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", target.url, json=body, headers=target.headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {_error_message(text)}"
                rec.context_overflow = any(m in text.lower() for m in _OVERFLOW_MARKERS)
                rec.end = time.perf_counter()
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    rec.error = f"stream error: {_error_message(json.dumps(payload))}"
                    break
                if payload.get("usage"):
                    usage = payload["usage"]
                for choice in payload.get("choices") or []:
                    text = _chunk_text(choice, chat)
                    if text:
                        rec.chunk_times.append(time.perf_counter())
                        pieces.append(text)
        rec.end = time.perf_counter()
    except Exception as exc:  # network errors, timeouts, bad JSON: the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.end = time.perf_counter()
        return rec
    _count_tokens(rec, target, req, usage, "".join(pieces))
    return rec


def _count_tokens(rec: RequestRecord, target: ServeTarget, req: BenchRequest,
                  usage: dict[str, Any] | None, text: str) -> None:
    if usage and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = int(usage.get("prompt_tokens") or req.prompt_len)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
        return
    rec.prompt_tokens = req.prompt_len
    tok = target.tokenizer
    rec.output_tokens = len(tok.encode(text, add_special_tokens=False)) if tok is not None \
        else len(rec.chunk_times)


def _error_message(text: str) -> str:
    try:
        data = json.loads(text)
        err = data.get("error", data)
        msg = err.get("message") if isinstance(err, dict) else str(err)
        return str(msg)[:300]
    except (json.JSONDecodeError, AttributeError):
        return text[:300]


async def resolve_model(client: httpx.AsyncClient, base_url: str,
                        headers: dict[str, str]) -> str:
    """The first model id the server lists at GET /v1/models."""
    resp = await client.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30.0)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(data[0]["id"])
