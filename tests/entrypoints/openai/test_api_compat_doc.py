"""docs/api-compatibility.md names every request field the server's models know, so a field
added to a request model without saying what it does fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from wideserve.serving.openai.protocol import (IGNORED_FIELDS, ChatCompletionRequest,
                                               CompletionRequest)
from wideserve.serving.openai.responses_protocol import ResponsesRequest

DOC = Path(__file__).resolve().parents[3] / "docs" / "api-compatibility.md"


def _documented() -> set[str]:
    """Every identifier inside backticks (`text.format` gives text and format)."""
    return {word for code in re.findall(r"`([^`]+)`", DOC.read_text())
            for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code)}


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest, ResponsesRequest])
def test_every_request_field_is_in_the_table(model):
    documented = _documented()
    missing = [name for name in model.model_fields if name not in documented]
    assert not missing, f"{model.__name__}: not in {DOC.name}: {missing}"


def test_the_ignored_fields_are_listed():
    assert IGNORED_FIELDS <= _documented()
