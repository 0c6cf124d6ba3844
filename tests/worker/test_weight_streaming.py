"""Whether an engine streams its MoE weights (ParallelConfig.weight_streaming,
worker/weight_streaming.py): the decision on given facts and timings, the idle cores of a
thread plan, and a real engine that starts the helper, logs why, and generates the same
greedy tokens with it as without."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from wideserve import LLM, SamplingParams
from wideserve.config import engine_config_from_kwargs
from wideserve.kernels import weight_stream
from wideserve.utils.threads import ThreadPlan, plan_engine
from wideserve.worker import weight_streaming as wsm


def _never():
    raise AssertionError("timed although the decision did not need it")


@pytest.mark.parametrize("mode,ops,demotes,idle,measurable,on,why", [
    ("off", True, True, True, True, False, "--weight-streaming off"),
    ("on", True, False, False, False, True, "--weight-streaming on"),
    ("on", False, True, True, True, False, "do not load"),
    ("auto", False, True, True, True, False, "do not load"),
    ("auto", True, False, True, True, False, "no CLDEMOTE"),
    ("auto", True, True, False, True, False, "no core is left idle"),
    ("auto", True, True, True, False, False, "not measured here"),
])
def test_decision_without_timing(mode, ops, demotes, idle, measurable, on, why) -> None:
    d = wsm.decide(mode, ops, demotes, idle, (3,), measurable, _never)
    assert d.on is on and why in d.note and d.cpus == (3,)


@pytest.mark.parametrize("timings,on", [((0.100, 0.080, 24), True), ((0.100, 0.095, 3), True),
                                        ((0.100, 0.096, 24), False), ((0.100, 0.120, 24), False),
                                        ((0.100, 0.050, 0), False), (None, False)])
def test_auto_follows_the_timings(timings, on) -> None:
    d = wsm.decide("auto", True, True, True, (), True, lambda: timings)
    assert d.on is on
    if timings is None:
        assert "no prefill step fits" in d.note
    elif timings[2] == 0:          # faster by chance, but no call posted anything to stream
        assert "reads enough weights" in d.note
    else:
        assert f"{timings[0] * 1e3:.1f} ms without" in d.note


def test_idle_cores_of_a_plan() -> None:
    served = plan_engine(cpus=[0, 1], env={}, core_id=lambda c: (0, c))
    assert served.cpus == (1,) and served.spare == (0,)
    assert wsm.idle_cores(served, 1) == (True, (0,))
    alone = plan_engine(cpus=[0], env={}, core_id=lambda c: (0, c))
    assert alone.spare == () and wsm.idle_cores(alone, 1) == (False, ())
    offline = plan_engine(cpus=[0, 1, 2, 3], env={}, core_id=lambda c: (0, c),
                          front_end=False)
    assert offline.cpus == (0, 1, 2, 3) and wsm.idle_cores(offline, 4) == (False, ())
    # unbound (LLM(), a set count): idle when fewer threads than usable cores, not bound
    unbound = ThreadPlan(1, (), "auto")
    assert wsm.idle_cores(unbound, 1, usable=2) == (True, ())
    assert wsm.idle_cores(None, 2, usable=2) == (False, ())


def test_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="weight_streaming must be 'auto', 'on' or 'off'"):
        engine_config_from_kwargs(weight_streaming="sometimes")


def _checkpoint(tmp_path):
    from tiny_families import qwen3_moe_checkpoint
    return qwen3_moe_checkpoint(
        tmp_path, torch.bfloat16, vocab_size=96, hidden_size=64, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False)


def _greedy(path, mode: str) -> list[list[int]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, dtype="bfloat16", block_size=16, kv_cache_memory=1 << 24,
                  skip_tokenizer_init=True, weight_streaming=mode)
    prompts = [[(5 * i + 3 * j) % 95 + 1 for j in range(20 + 7 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_streams_when_told_and_outputs_do_not_change(tmp_path, monkeypatch,
                                                             caplog) -> None:
    path = _checkpoint(tmp_path)
    monkeypatch.setattr(weight_stream, "MIN_PLAN_BYTES", 0)   # the tiny model's calls too
    try:
        with caplog.at_level(logging.INFO, logger="wideserve.engine.engine_core"):
            on = _greedy(path, "on")
        assert weight_stream.stats().running and weight_stream.stats().plans > 0
        assert any("weight streaming: on (--weight-streaming on)" in r.getMessage()
                   for r in caplog.records)
        off = _greedy(path, "off")
        assert not weight_stream.stats().running    # a later engine's "off" stops it
        assert on == off
    finally:
        weight_stream.stop()


@pytest.mark.parametrize("timings,running", [((0.1, 0.05, 12), True), ((0.1, 0.1, 12), False)])
def test_auto_is_timed_at_start(tmp_path, monkeypatch, caplog, timings, running) -> None:
    path = _checkpoint(tmp_path)
    calls = []
    real_measure = wsm.measure

    def measure(*a, **k):
        calls.append(real_measure(*a, **k))      # the real steps run, their verdict is given
        return timings
    monkeypatch.setattr(wsm, "measure", measure)
    monkeypatch.setattr(wsm, "idle_cores", lambda plan, threads, usable=None: (True, ()))
    monkeypatch.setattr(weight_stream, "demotes", lambda: True)
    try:
        with caplog.at_level(logging.INFO, logger="wideserve.engine.engine_core"):
            _greedy(path, "auto")
        # the real steps: timed, and the tiny model's calls are under the floor (none posted)
        assert len(calls) == 1 and calls[0][0] > 0 and calls[0][1] > 0 and calls[0][2] == 0
        assert weight_stream.stats().running is running
        assert any("weight streaming: " + ("on" if running else "off") in r.getMessage()
                   for r in caplog.records)
    finally:
        weight_stream.stop()


def test_the_flag_reaches_the_config_and_bad_values_name_it(capsys) -> None:
    import argparse

    from wideserve.entrypoints import serve
    from wideserve.entrypoints.engine_args import engine_config_from_args
    server = serve.add_parser(argparse.ArgumentParser().add_subparsers())
    assert engine_config_from_args(server.parse_args(["m"])).parallel.weight_streaming == "auto"
    for mode in ("on", "off", "auto"):
        args = server.parse_args(["m", "--weight-streaming", mode])
        assert engine_config_from_args(args).parallel.weight_streaming == mode
    with pytest.raises(SystemExit):
        server.parse_args(["m", "--weight-streaming", "always"])
    assert "--weight-streaming" in capsys.readouterr().err
