"""The Responses API's stream events, as OpenAI sends them: each an SSE message with an
`event:` line naming its type (some clients dispatch on it) and a `data:` line with the
event, numbered by `sequence_number`; no `[DONE]` sentinel (OpenAI's Responses streams end
with response.completed).
"""
from __future__ import annotations

from typing import Any

import msgspec

from wideserve.serving.openai.responses_protocol import encrypted_reasoning, rid


def sse_event(type_: str, payload: dict[str, Any]) -> str:
    return f"event: {type_}\ndata: {msgspec.json.encode(payload).decode()}\n\n"


def _empty_message() -> dict[str, Any]:
    return {"type": "message", "id": rid("msg"), "status": "in_progress", "role": "assistant",
            "content": [{"type": "output_text", "text": "", "annotations": []}]}


class Events:
    """Stream events with their sequence numbers and the output items built so far."""

    def __init__(self, include: list[str] | None = None) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, int] = {}          # "message" / "reasoning" / call index -> item
        self.include = include or []

    def event(self, type_: str, **fields: Any) -> str:
        self.seq += 1
        return sse_event(type_, {"type": type_, "sequence_number": self.seq - 1, **fields})

    def add(self, item: dict[str, Any], key: str) -> list[str]:
        self.open[key] = len(self.items)
        self.items.append(item)
        out = [self.event("response.output_item.added", output_index=self.open[key],
                          item=item)]
        if item["type"] in ("message", "reasoning"):
            part = ({"type": "output_text", "text": "", "annotations": []}
                    if item["type"] == "message" else {"type": "reasoning_text", "text": ""})
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=self.open[key], content_index=0, part=part))
        return out

    def close_all(self) -> list[str]:
        # A turn that produced nothing visible (e.g. an end-of-sequence first) still answers
        # with an assistant message, empty, as output_items does for the whole response.
        out = [] if self.items else self.add(_empty_message(), "message")
        for idx, item in enumerate(self.items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                out.append(self.event("response.output_text.done", item_id=item["id"],
                                      output_index=idx, content_index=0, text=text))
                out.append(self.event("response.content_part.done", item_id=item["id"],
                                      output_index=idx, content_index=0,
                                      part=item["content"][0]))
            elif item["type"] == "reasoning":
                text = item["content"][0]["text"]
                if "reasoning.encrypted_content" in self.include:
                    item["encrypted_content"] = encrypted_reasoning(text)
                out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                                      output_index=idx, content_index=0, text=text))
            elif item["type"] == "function_call":
                out.append(self.event("response.function_call_arguments.done",
                                      item_id=item["id"], output_index=idx,
                                      arguments=item["arguments"]))
            item["status"] = "completed"
            out.append(self.event("response.output_item.done", output_index=idx, item=item))
        return out

    def on_delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None,
                 max_calls: int | None) -> list[str]:
        """The events for one chat delta (reasoning, content, tool-call pieces)."""
        out: list[str] = []
        if "reasoning_content" in delta:
            out += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            out += self._text(delta["content"], logprobs)
        for tc in delta.get("tool_calls") or []:
            if max_calls is not None and tc["index"] >= max_calls:
                continue
            key = f"call{tc['index']}"
            if key not in self.open:
                out += self.add({"type": "function_call", "id": rid("fc"), "call_id": tc["id"],
                                 "name": tc["function"]["name"], "arguments": "",
                                 "status": "in_progress"}, key)
            i = self.open[key]
            args = tc["function"].get("arguments") or ""
            if args:
                self.items[i]["arguments"] += args
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=self.items[i]["id"], output_index=i, delta=args))
        return out

    def _reasoning(self, text: str) -> list[str]:
        out: list[str] = []
        if "reasoning" not in self.open:
            out += self.add({"type": "reasoning", "id": rid("rs"), "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}]}, "reasoning")
        i = self.open["reasoning"]
        self.items[i]["content"][0]["text"] += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.items[i]["id"],
                              output_index=i, content_index=0, delta=text))
        return out

    def _text(self, text: str, logprobs: list[dict[str, Any]] | None) -> list[str]:
        out: list[str] = []
        if "message" not in self.open:
            out += self.add({"type": "message", "id": rid("msg"), "status": "in_progress",
                             "role": "assistant", "content": [
                                 {"type": "output_text", "text": "", "annotations": []}]},
                            "message")
        i = self.open["message"]
        part = self.items[i]["content"][0]
        part["text"] += text
        fields: dict[str, Any] = {}
        if logprobs is not None:
            part.setdefault("logprobs", []).extend(logprobs)
            fields["logprobs"] = logprobs
        out.append(self.event("response.output_text.delta", item_id=self.items[i]["id"],
                              output_index=i, content_index=0, delta=text, **fields))
        return out
