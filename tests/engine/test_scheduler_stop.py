"""Scheduler: stop conditions, the speculative-decoding hooks, lookahead slots (no model)."""
from __future__ import annotations

import pytest
from sched_harness import (EOS, Trace, make_request, next_token,
                           run_to_completion, step)

from wideserve.types.request import RequestStatus


def _sample_at(tokens: dict[int, int]):
    """A 'model' that emits tokens[k] as output token k (0-based) and next_token otherwise."""
    def sample(request):
        return tokens.get(request.num_output_tokens, next_token(request))
    return sample


def _run_one(make, sample, max_model_len: int = 8192, prompt_len: int = 6, **params):
    sched, _ = make(max_model_len=max_model_len)
    r = make_request("r", prompt_len, **params)
    sched.add_request(r)
    trace = run_to_completion(sched, sample=sample)
    return r, trace.tokens("r"), trace.final("r")


def test_eos_stops(make):
    r, toks, final = _run_one(make, _sample_at({2: EOS}), max_tokens=10)
    assert len(toks) == 3 and toks[-1] == EOS            # EOS is part of the output
    assert final.finish_reason == "stop" and final.stop_reason is None
    assert r.status is RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_model_eos_ids(make, ignore_eos):
    # The model's EOS ids (here two) stop a request that has no eos_token_id of its own.
    sched, _ = make(eos=(EOS, 998))
    r = make_request("r", 6, max_tokens=8, ignore_eos=ignore_eos)
    r.eos_token_id = None
    sched.add_request(r)
    trace = run_to_completion(sched, sample=_sample_at({1: 998, 3: EOS}))
    if ignore_eos:
        assert len(trace.tokens("r")) == 8 and trace.final("r").finish_reason == "length"
    else:
        assert trace.tokens("r")[-1] == 998 and len(trace.tokens("r")) == 2
        assert trace.final("r").finish_reason == "stop"


def test_ignore_eos(make):
    _, toks, final = _run_one(make, _sample_at({2: EOS, 4: EOS}), max_tokens=6, ignore_eos=True)
    assert len(toks) == 6 and toks[2] == EOS and final.finish_reason == "length"


def test_min_tokens_defers_eos_and_stop_ids(make):
    # EOS at outputs 1 and 5, stop id 7 at output 2: nothing ends before 4 tokens exist.
    _, toks, final = _run_one(make, _sample_at({1: EOS, 2: 7, 5: EOS}), max_tokens=10,
                              min_tokens=4, stop_token_ids=[7])
    assert len(toks) == 6 and final.finish_reason == "stop" and final.stop_reason is None
    # With min_tokens reached exactly on an EOS, the EOS ends it.
    _, toks, final = _run_one(make, lambda r: EOS, max_tokens=10, min_tokens=4)
    assert toks == [EOS] * 4 and final.finish_reason == "stop"


def test_stop_token_ids(make):
    _, toks, final = _run_one(make, _sample_at({3: 42}), max_tokens=10, stop_token_ids=[42, 43])
    assert len(toks) == 4 and toks[-1] == 42
    assert final.finish_reason == "stop" and final.stop_reason == 42


def test_max_tokens(make):
    _, toks, final = _run_one(make, next_token, max_tokens=5)
    assert len(toks) == 5 and final.finish_reason == "length" and final.stop_reason is None


def test_max_model_len(make):
    r, toks, final = _run_one(make, next_token, max_model_len=20, prompt_len=15, max_tokens=None)
    assert len(toks) == 5 and r.num_tokens == 20 and final.finish_reason == "length"


def test_stop_wins_over_length_on_the_same_token(make):
    _, toks, final = _run_one(make, _sample_at({4: EOS}), max_tokens=5)
    assert len(toks) == 5 and final.finish_reason == "stop"


def _decoding_request(make, **cfg):
    sched, kv = make(**cfg)
    r = make_request("r", 6, max_tokens=30)
    sched.add_request(r)
    while r.num_tokens == 6:
        step(sched)
    assert r.num_computed_tokens == 6 and r.num_tokens == 7
    return sched, kv, r


def test_draft_verification_and_rejection_hook(make):
    sched, _, r = _decoding_request(make)
    r.spec_token_ids = [11, 12, 13]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 4 and s.spec_token_ids == [11, 12, 13]
    assert r.spec_token_ids == [] and r.num_computed_tokens == 10
    # One draft accepted plus the bonus token: two drafts' slots are rewound.
    outs = sched.update_from_output(out, {"r": [11, 55]})
    assert outs[0].new_token_ids == [11, 55]
    assert r.num_tokens == 9 and r.num_computed_tokens == 8
    # All rejected: only the bonus token.
    r.spec_token_ids = [1, 2]
    out = sched.schedule()
    sched.update_from_output(out, {"r": [77]})
    assert r.num_tokens == 10 and r.num_computed_tokens == 9
    with pytest.raises(ValueError, match="drafts"):
        r.spec_token_ids = [1]
        sched.update_from_output(sched.schedule(), {"r": [1, 2, 3]})
    sched.abort_requests(["r"])


def test_drafts_cut_by_budget_and_max_model_len(make):
    sched, _, r = _decoding_request(make, max_num_batched_tokens=3)
    r.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 3 and s.spec_token_ids == [1, 2]
    sched.abort_requests(["r"])
    assert sched.update_from_output(out, {"r": [1, 2, 3]})[0].finish_reason == "abort"

    sched, _, r = _decoding_request(make, max_model_len=9)
    r.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.num_new_tokens == 3 and s.spec_token_ids == [1, 2]   # positions 6..8 < 9
    # All accepted: 6 prompt + 3 tokens reach max_model_len, the bonus token is dropped.
    (o,) = sched.update_from_output(out, {"r": [1, 2, 3]})
    assert o.new_token_ids == [1, 2] and o.finish_reason == "length" and r.num_tokens == 9


def test_tokens_after_a_stop_are_dropped(make):
    sched, _, r = _decoding_request(make)
    r.spec_token_ids = [5, EOS, 6]
    out = sched.schedule()
    (o,) = sched.update_from_output(out, {"r": [5, EOS, 6, 8]})
    assert o.new_token_ids == [5, EOS] and o.finish_reason == "stop"
    assert r.output_token_ids[-2:] == [5, EOS] and r.status is RequestStatus.FINISHED_STOPPED


@pytest.mark.parametrize("lookahead", [0, 2, 5])
def test_lookahead_slots_reserved(make, lookahead):
    sched, kv = make(block_size=4, num_lookahead_tokens=lookahead)
    sched.add_request(make_request("a", 7, max_tokens=4))
    for _ in range(3):
        step(sched)
        # Slots for every computed token plus the lookahead drafts, in 4-slot blocks.
        r = sched.requests["a"]
        assert [len(row) for row in kv.block_rows("a")] == [-(-(r.num_computed_tokens + lookahead) // 4)]


def test_sampled_tokens_must_match_the_plan(make):
    sched, _ = make(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 10, max_tokens=4))
    out = sched.schedule()
    with pytest.raises(ValueError, match="partial prefill"):
        sched.update_from_output(out, {"a": [1]})
    sched.abort_requests(["a"])
    sched, _ = make()
    sched.add_request(make_request("b", 3, max_tokens=4))
    out = sched.schedule()
    with pytest.raises(ValueError, match="has no token"):
        sched.update_from_output(out, {})
    sched.abort_requests(["b"])


def test_stats(make):
    sched, kv = make(max_num_seqs=1)
    sched.add_request(make_request("a", 10, max_tokens=3))
    sched.add_request(make_request("b", 10, seed=1, max_tokens=3))
    trace = Trace()
    step(sched, trace)
    st = sched.make_stats()
    assert (st.num_running, st.num_waiting, st.num_steps, st.last_num_batched_tokens) == \
        (1, 1, 1, 10)
    assert 0 < st.kv_usage <= 1 and st.kv_stats == kv.stats
