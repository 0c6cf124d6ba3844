"""Responses output items (serving/openai/responses_protocol.py, responses_stream.py): a turn
always answers with an output item, also when the model produced no text, reasoning or call
(an end-of-sequence first), in the whole response and in the stream alike."""
from __future__ import annotations

import json

from wideserve.serving.openai.responses_protocol import output_items
from wideserve.serving.openai.responses_stream import Events


def _types(items: list[dict]) -> list[str]:
    return [i["type"] for i in items]


def test_an_empty_turn_is_an_empty_assistant_message():
    for message in ({"content": ""}, {"content": None}, {}):
        (item,) = output_items(message, None, None, None)
        assert item["type"] == "message" and item["role"] == "assistant"
        assert item["content"][0]["text"] == ""


def test_text_reasoning_and_calls_are_not_joined_by_an_empty_message():
    call = {"id": "c1", "function": {"name": "clock", "arguments": "{}"}}
    assert _types(output_items({"content": "hi"}, None, None, None)) == ["message"]
    assert _types(output_items({"tool_calls": [call]}, None, None, None)) == ["function_call"]
    assert _types(output_items({"reasoning_content": "r"}, None, None, None)) == ["reasoning"]


def _events(raw: list[str]) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in raw]


def test_an_empty_stream_closes_with_an_empty_assistant_message():
    events = Events()
    done = _events(events.close_all())
    assert [e["type"] for e in done] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert _types(events.items) == ["message"] and events.items[0]["content"][0]["text"] == ""
    assert [e["sequence_number"] for e in done] == list(range(len(done)))


def test_a_stream_with_text_gets_no_second_message():
    events = Events()
    events.on_delta({"content": "hi"}, None, None)
    events.close_all()
    assert _types(events.items) == ["message"]
