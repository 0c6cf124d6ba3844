"""Reasoning parsers: one base (ReasoningParser), a registry of implementations by
`--reasoning-parser` name, and the lookup the CLI and the chat route share."""
from __future__ import annotations

import argparse

import pytest

from wideserve.serving.openai.reasoning import (REASONING_PARSERS, ReasoningParser, ThinkParser,
                                                get_reasoning_parser)
from wideserve.entrypoints.serve import _reasoning_parser_name

NAMES = ("deepseek_r1", "deepseek_v3", "deepseek_v31", "deepseek_v4", "qwen3")


def test_every_name_is_a_think_parser() -> None:
    assert set(REASONING_PARSERS) == set(NAMES)
    for name in NAMES:
        cls = get_reasoning_parser(name)
        assert cls is ThinkParser and issubclass(cls, ReasoningParser)


def test_unknown_name_is_an_error_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown parser 'r2'.*qwen3"):
        get_reasoning_parser("r2")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown parser 'r2'"):
        _reasoning_parser_name("r2")
    assert _reasoning_parser_name("qwen3") == "qwen3"


def test_the_parser_decides_where_a_generation_starts() -> None:
    cls = get_reasoning_parser("deepseek_v4")
    assert cls.starts_inside("<|Assistant|><think>\n") is True
    assert cls.starts_inside("<|Assistant|></think>") is False
    inside, outside = cls(True), cls(cls.starts_inside("user: hi"))
    assert inside.parse("plan</think> Hello", True) == ("plan", "Hello")
    assert outside.parse("<think>plan</think>Hello", True) == ("plan", "Hello")
    assert outside.parse("Hello", True) == ("", "Hello")


def test_the_base_is_abstract() -> None:
    with pytest.raises(TypeError):
        ReasoningParser()  # type: ignore[abstract]
