"""Scheduler: the prefill cap (`max_prefill_tokens`): the prompt tokens of one step, over
running requests still in their prompt and admitted ones (no model); and the cap a server
measures at start (worker/prefill_cap.py), on a real engine."""
from __future__ import annotations

import pytest
from sched_harness import make_request, run_to_completion, staggered_greedy_outputs, step

from wideserve.worker import prefill_cap


def _shares(out) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]


def test_a_burst_on_an_idle_engine_is_split_at_the_cap(make):
    sched, _ = make(max_num_batched_tokens=1024, max_prefill_tokens=20)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=3))
    # 20 prompt tokens: two whole prompts and 4 tokens of the third.
    assert _shares(step(sched)) == [("r0", 8), ("r1", 8), ("r2", 4)]
    # Decodes are not capped; the third prompt's rest counts against the cap first.
    assert _shares(step(sched)) == [("r0", 1), ("r1", 1), ("r2", 4), ("r3", 8), ("r4", 8)]


def test_a_running_prompt_chunk_takes_the_cap_before_new_prompts(make):
    sched, _ = make(max_num_batched_tokens=256, max_prefill_tokens=40)
    sched.add_request(make_request("long", 100, max_tokens=2))
    assert _shares(step(sched)) == [("long", 40)]
    sched.add_request(make_request("b", 10, seed=1, max_tokens=2))
    assert _shares(step(sched)) == [("long", 40)]          # nothing left for "b"
    assert _shares(step(sched)) == [("long", 20), ("b", 10)]


def test_the_cap_and_the_share_while_decoding_both_hold(make):
    sched, _ = make(max_num_batched_tokens=1024, max_prefill_tokens=24,
                    max_prefill_tokens_while_decoding=8)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=4))
    assert _shares(step(sched)) == [("r0", 8), ("r1", 8), ("r2", 8)]   # idle: the cap
    assert _shares(step(sched)) == [("r0", 1), ("r1", 1), ("r2", 1), ("r3", 8)]   # the share


def test_zero_and_auto_before_measuring_leave_the_budget(make):
    for cap in (0, "auto"):
        sched, _ = make(max_num_batched_tokens=1024, max_prefill_tokens=cap)
        for i in range(5):
            sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=2))
        assert step(sched).num_batched_tokens == 40
        run_to_completion(sched)


@pytest.mark.parametrize("cap", [1, 7, 64])
def test_greedy_outputs_are_the_same_with_any_cap(make, cap):
    assert staggered_greedy_outputs(make, max_prefill_tokens=cap) \
        == staggered_greedy_outputs(make)


@pytest.mark.parametrize("bad", [-1, "half", 1.5])
def test_a_bad_cap_is_rejected(bad):
    from sched_harness import make_kv_manager

    from wideserve.config import SchedulerConfig
    from wideserve.engine.scheduler import Scheduler
    with pytest.raises(ValueError, match="max_prefill_tokens must be >= 0 or 'auto'"):
        Scheduler(SchedulerConfig(max_prefill_tokens=bad), make_kv_manager(8, 4), 64)


# ------------------------------------------------------------------ choosing the cap

def test_an_arithmetic_bound_step_is_split():
    # t ~ tokens: halves and quarters return first tokens sooner on average.
    times = {256: 0.14, 512: 0.23, 1024: 0.40, 2048: 0.69}
    # mean waits: 256 -> 0.63, 512 -> 0.575, 1024 -> 0.60 (within 5%: the larger one)
    assert prefill_cap.choose_cap(times, 2048) == 1024
    assert prefill_cap.choose_cap(times, 2048, near=1.0) == 512


def test_a_bandwidth_bound_step_is_not_split():
    # The weights' read time dominates: a split only adds steps.
    times = {256: 0.090, 512: 0.095, 1024: 0.105, 2048: 0.125}
    assert prefill_cap.choose_cap(times, 2048) == 0


def test_a_gain_inside_the_margin_is_not_taken():
    times = {1024: 0.62, 2048: 1.0}      # mean wait 0.93: 7% better, inside the 10% margin
    assert prefill_cap.choose_cap(times, 2048) == 0
    assert prefill_cap.choose_cap(times, 2048, margin=0.95) == 1024
    assert prefill_cap.choose_cap({1024: 0.1}, 2048) == 0      # the budget was not timed


def test_sizes_and_prompt_lengths_respect_the_limits():
    from wideserve.config import SchedulerConfig
    assert prefill_cap.cap_sizes(2048) == [2048, 1024, 512, 256]
    assert prefill_cap.cap_sizes(200) == [200, 100]
    sched = SchedulerConfig(max_num_seqs=4)
    assert prefill_cap.prompt_lengths(1000, sched, 4096) == [250, 250, 250, 250]
    assert prefill_cap.prompt_lengths(512, sched, 100) == []          # 4 x 99 < 512
    assert prefill_cap.prompt_lengths(300, SchedulerConfig(), 100) == [75, 75, 75, 75]


def test_the_flag_defaults_to_auto_for_serve_only_and_bad_values_name_it(capsys):
    import argparse

    from wideserve.entrypoints import serve
    from wideserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
    offline = argparse.ArgumentParser()
    add_engine_args(offline)
    assert engine_config_from_args(offline.parse_args(["m"])).scheduler.max_prefill_tokens == 0
    server = serve.add_parser(argparse.ArgumentParser().add_subparsers())
    assert engine_config_from_args(server.parse_args(["m"])).scheduler.max_prefill_tokens \
        == "auto"
    for text, want in (("512", 512), ("0", 0), ("AUTO", "auto")):
        args = server.parse_args(["m", "--max-prefill-tokens", text])
        assert engine_config_from_args(args).scheduler.max_prefill_tokens == want
    for bad in ("-1", "half", "1.5"):
        with pytest.raises(SystemExit):
            server.parse_args(["m", "--max-prefill-tokens", bad])
        err = capsys.readouterr().err
        assert "--max-prefill-tokens" in err and "'auto'" in err
