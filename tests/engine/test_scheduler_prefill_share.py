"""Scheduler: "Prefill while decoding" (`max_prefill_tokens_while_decoding`): the new prompts'
share of a step that running requests take part in (no model)."""
from __future__ import annotations

import pytest
from sched_harness import make_request, staggered_greedy_outputs, step


def _shares(out) -> list[tuple[str, int, bool]]:
    return [(s.request_id, s.num_new_tokens, s.is_new_or_resumed) for s in out.scheduled]


def _decoding(sched) -> None:
    """One request admitted and through its prefill: from now on it decodes."""
    sched.add_request(make_request("d", 8, seed=99, max_tokens=50))
    step(sched)


def test_burst_is_admitted_a_slice_per_step_while_others_decode(make):
    sched, _ = make(max_num_batched_tokens=1024, max_prefill_tokens_while_decoding=16)
    _decoding(sched)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=3))
    # Running first (the one scheduling rule), then 16 prompt tokens: two whole prompts.
    assert _shares(step(sched)) == [("d", 1, False), ("r0", 8, True), ("r1", 8, True)]
    assert _shares(step(sched)) == [("d", 1, False), ("r0", 1, False), ("r1", 1, False),
                                    ("r2", 8, True), ("r3", 8, True)]
    assert _shares(step(sched))[-1] == ("r4", 8, True)


def test_without_the_setting_the_burst_takes_the_whole_budget(make):
    sched, _ = make(max_num_batched_tokens=1024, max_prefill_tokens_while_decoding=0)
    _decoding(sched)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=3))
    assert [s.request_id for s in step(sched).scheduled] == ["d", "r0", "r1", "r2", "r3", "r4"]


def test_an_idle_engine_gives_prompts_the_whole_budget(make):
    sched, _ = make(max_num_batched_tokens=1024, max_prefill_tokens_while_decoding=16)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 8, seed=i, max_tokens=3))
    out = step(sched)
    assert out.num_new_admitted == 5 and out.num_batched_tokens == 40


def test_a_long_prompt_is_chunked_at_admission_then_runs_with_the_budget(make):
    sched, _ = make(max_num_batched_tokens=100, max_prefill_tokens_while_decoding=30)
    _decoding(sched)
    sched.add_request(make_request("long", 90, seed=1, max_tokens=2))
    assert _shares(step(sched)) == [("d", 1, False), ("long", 30, True)]
    # Now running: its remaining prompt is a running request's share (the budget left).
    assert _shares(step(sched)) == [("d", 1, False), ("long", 60, False)]


def test_the_share_also_bounds_a_step_started_by_a_running_prefill(make):
    """A running partial prefill counts as running: prompts admitted beside it get the
    slice, not the budget it left."""
    sched, _ = make(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=8)
    sched.add_request(make_request("a", 100, max_tokens=2))
    assert _shares(step(sched)) == [("a", 64, True)]        # idle: the whole budget
    sched.add_request(make_request("b", 20, seed=1, max_tokens=2))
    assert _shares(step(sched)) == [("a", 36, False), ("b", 8, True)]


@pytest.mark.parametrize("share", [1, 7, 64])
def test_greedy_outputs_are_the_same_with_any_share(make, share):
    assert staggered_greedy_outputs(make, max_prefill_tokens_while_decoding=share) \
        == staggered_greedy_outputs(make)


def test_negative_share_is_rejected():
    from sched_harness import make_kv_manager

    from wideserve.config import SchedulerConfig
    from wideserve.engine.scheduler import Scheduler
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        Scheduler(SchedulerConfig(max_prefill_tokens_while_decoding=-1), make_kv_manager(8, 4),
                  64)
