"""Sizes take units everywhere (LLM keywords and CLI flags) and a bad one names the argument;
the default served model name is the model directory's name."""
from __future__ import annotations

import argparse

import pytest

from wideserve import LLM
from wideserve.config import engine_config_from_kwargs, parse_count, parse_size
from wideserve.entrypoints.engine_args import engine_config_from_args
from wideserve.entrypoints.serve import add_parser, default_model_name


@pytest.mark.parametrize("text,expected", [
    ("64MiB", 64 * 2**20), ("4GiB", 4 * 2**30), ("4gib", 4 * 2**30), ("512MB", 512 * 10**6),
    ("4g", 4 * 10**9), ("1.5KiB", 1536), ("8589934592", 8589934592), (4096, 4096)])
def test_parse_size(text, expected: int) -> None:
    assert parse_size(text, "kv_cache_memory") == expected


@pytest.mark.parametrize("bad", ["64 parsecs", "MiB", "-4GiB", "", 0, True, None, [1]])
def test_bad_size_names_the_argument(bad) -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_memory: expected"):
        parse_size(bad, "kv_cache_memory")


@pytest.mark.parametrize("text,expected", [("4096", 4096), ("32k", 32000), ("32K", 32768),
                                           ("1M", 2**20), (128, 128)])
def test_parse_count(text, expected: int) -> None:
    assert parse_count(text, "max_model_len") == expected


def test_engine_kwargs_take_units() -> None:
    config = engine_config_from_kwargs(kv_cache_memory="64MiB", max_model_len="1k",
                                       max_num_batched_tokens="2K")
    assert config.cache.kv_cache_memory == 64 * 2**20
    assert config.scheduler.max_model_len == 1000
    assert config.scheduler.max_num_batched_tokens == 2048


def test_llm_with_a_unit_size_runs_and_a_bad_one_is_named() -> None:
    llm = LLM(kv_cache_memory="64MiB", max_model_len="512")
    assert llm.engine.config.cache.kv_cache_memory == 64 * 2**20
    with pytest.raises(ValueError, match=r"^kv_cache_memory: expected a size like 4GiB"):
        LLM(kv_cache_memory="64 parsecs")
    with pytest.raises(ValueError, match=r"^max_model_len: expected a positive integer"):
        LLM(max_model_len="long")


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wideserve")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_cli_sizes_with_units() -> None:
    config = engine_config_from_args(_serve_args(["--kv-cache-memory", "4GiB",
                                                  "--max-model-len", "32k"]))
    assert config.cache.kv_cache_memory == 4 * 2**30 and config.scheduler.max_model_len == 32000


def test_cli_bad_size_is_one_line_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _serve_args(["--kv-cache-memory", "lots"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "argument --kv-cache-memory: expected a size like 4GiB" in err


@pytest.mark.parametrize("model,name", [
    (None, "shakespeare-v4-tiny"), ("/models/DeepSeek-V4-Flash", "DeepSeek-V4-Flash"),
    ("/models/DeepSeek-V4-Flash/", "DeepSeek-V4-Flash"), ("ckpt/model.Q4_1.gguf", "model.Q4_1"),
    ("~/hf/Qwen3-0.6B", "Qwen3-0.6B")])
def test_default_served_model_name(model, name: str) -> None:
    assert default_model_name(model) == name


@pytest.mark.parametrize("value", ["image=0", '{"image": 0}', " image = 0 "])
def test_limit_mm_per_prompt_takes_vllms_forms(value) -> None:
    config = engine_config_from_args(_serve_args(["--limit-mm-per-prompt", value]))
    assert config.load.limit_mm_per_prompt.image == 0
    assert config.load.limit_mm_per_prompt.text_only
    default = engine_config_from_args(_serve_args([])).load.limit_mm_per_prompt
    assert default.image == 999 and not default.text_only
    assert engine_config_from_kwargs(limit_mm_per_prompt={"image": 2}).load \
        .limit_mm_per_prompt.image == 2
    # `serve` hands the config to the engine process as JSON (serving/engine_client.py).
    import msgspec

    from wideserve.config import EngineConfig
    again = msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig)
    assert again.load.limit_mm_per_prompt == config.load.limit_mm_per_prompt


@pytest.mark.parametrize("value, message", [
    ("image=-1", "image must be a non-negative integer"),
    ("image=two", "image must be a non-negative integer"),
    ('{"image": 1.5}', "image must be a non-negative integer"),
    ("video=1", "unknown modality 'video'"),
    ("{image: 0}", "is not valid JSON"),
    ("[0]", "expected image=N"),
])
def test_bad_limit_mm_per_prompt_is_one_line_naming_the_flag(capsys, value, message) -> None:
    with pytest.raises(SystemExit) as exc:
        _serve_args(["--limit-mm-per-prompt", value])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1
    assert "argument --limit-mm-per-prompt" in err and message in err
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        engine_config_from_kwargs(limit_mm_per_prompt={"image": -1})
