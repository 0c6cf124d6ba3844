"""SpeculativeConfig parsing (LLM keyword, CLI flag, engine-process JSON), the counters and
their Prometheus export, and the n-gram lookup."""
from __future__ import annotations

import argparse
import json

import msgspec
import numpy as np
import pytest

from wideserve.config import EngineConfig, engine_config_from_kwargs
from wideserve.engine.engine_core import EngineStats
from wideserve.engine.engine_ipc import to_builtins
from wideserve.config.speculative import SpeculativeConfig
from wideserve.spec_decode.acceptance_metrics import SpecDecodeStats
from wideserve.spec_decode.ngram import find_continuation


@pytest.mark.parametrize("bad,field", [
    ({"method": "eagle"}, "method"),
    ({"num_speculative_tokens": 2}, "method"),
    ({"method": "mtp", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "mtp", "model": "x"}, "model"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance_length": 4.5},
     "forced_acceptance_length"),
    ({"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance_length": 0.5},
     "forced_acceptance_length"),
    ({"method": "mtp", "k": 3}, "'k'"),
])
def test_bad_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(bad)


def test_llm_keyword_and_engine_process_json():
    for value in ({"method": "ngram", "num_speculative_tokens": 4},
                  '{"method": "ngram", "num_speculative_tokens": 4}'):
        cfg = engine_config_from_kwargs(model=None, speculative_config=value)
        assert cfg.speculative == SpeculativeConfig("ngram", 4)
    assert engine_config_from_kwargs(model=None).speculative is None
    with pytest.raises(ValueError, match="not valid JSON"):
        engine_config_from_kwargs(speculative_config="{method: mtp}")
    # The server hands EngineConfig to the engine process as JSON (msgspec).
    cfg = engine_config_from_kwargs(speculative_config={
        "method": "mtp", "num_speculative_tokens": 3, "forced_acceptance_length": 2})
    back = msgspec.json.decode(msgspec.json.encode(cfg), type=EngineConfig)
    assert back.speculative == cfg.speculative
    assert back.speculative.forced_acceptance_length == 2.0


def test_cli_flag_errors_name_the_flag(capsys):
    from wideserve.entrypoints.engine_args import (
        add_engine_args,
        engine_config_from_args,
        one_line_error,
    )
    parser = argparse.ArgumentParser(prog="wideserve serve")
    parser.error = one_line_error.__get__(parser)      # type: ignore[method-assign]
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              json.dumps({"method": "mtp", "num_speculative_tokens": 3})])
    assert engine_config_from_args(args).speculative == SpeculativeConfig("mtp", 3)
    assert engine_config_from_args(parser.parse_args([])).speculative is None
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--speculative-config",
                           '{"method": "mtp", "num_speculative_tokens": -1}'])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "num_speculative_tokens" in err


def test_stats_per_position_and_means():
    s = SpecDecodeStats("mtp", 3)
    s.observe(np.array([3, 3, 0, 2, 3]), np.array([0, 3, 0, 2, 1]))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 11, 6)
    assert s.num_accepted_tokens_per_pos == [3, 2, 1]
    assert s.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert s.acceptance_rate == pytest.approx(6 / 11)
    snap = s.snapshot()
    s.observe(np.array([1]), np.array([1]))
    assert snap.num_drafts == 4 and s.num_drafts == 5


def test_prometheus_export_reads_back_under_vllm_names():
    from prometheus_client import generate_latest

    from wideserve.bench.prometheus import parse_metrics
    from wideserve.serving.openai.server_metrics import ServerMetrics
    sd = SpecDecodeStats("mtp", 2, forced_acceptance_length=2.0)
    sd.observe(np.array([2, 2, 1]), np.array([2, 0, 1]))
    stats = to_builtins(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, spec_decode=sd))
    metrics = ServerMetrics("m", lambda: stats)
    text = generate_latest(metrics.registry).decode()
    got = parse_metrics(text)
    assert got["spec_decode_num_drafts"] == 3
    assert got["spec_decode_num_draft_tokens"] == 5
    assert got["spec_decode_num_accepted_tokens"] == 3
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0' \
        in text
    assert got["spec_decode_forced_acceptance_length"] == 2.0
    # Without speculation nothing spec-related is exported.
    plain = to_builtins(EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0))
    assert "spec_decode" not in generate_latest(ServerMetrics("m", lambda: plain).registry
                                                ).decode()


@pytest.mark.parametrize("tokens,lo,hi,k,expected", [
    ([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], 1, 3, 3, [4, 9, 2]),    # longest n-gram wins
    ([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], 1, 1, 3, [5, 7, 1]),    # most recent 1-gram
    ([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], 2, 2, 5, [5, 7, 1, 2, 3]),
    ([1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], 4, 4, 3, []),           # no 4-gram repeats
    ([5, 6, 7], 1, 3, 2, []),
    ([7, 7, 7, 7], 1, 3, 3, [7]),                                   # overlapping match
    ([4], 1, 2, 2, []),
])
def test_ngram_lookup(tokens, lo, hi, k, expected):
    assert find_continuation(np.array(tokens), lo, hi, k).tolist() == expected
