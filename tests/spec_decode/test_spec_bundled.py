"""Speculative decoding on the bundled model (a trained MTP head): greedy outputs and logprobs
equal the non-speculative engine's, acceptance is a regression-tested number, counters add up,
seeded sampling is reproducible, and forced acceptance does what it says."""
from __future__ import annotations

import math
import warnings

import pytest

from wideserve import LLM, SamplingParams

PROMPTS = ["Romeo.\n", "KING HENRY.\nMy lord,", "To be, or not to be", "HAMLET.\n",
           "First Citizen.\nBefore we proceed any further, hear me speak."]
MAX_NEW = 40


def _llm(spec: dict | None, **kw) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(None, dtype="float32", speculative_config=spec, **kw)


def _run(llm: LLM, sp: SamplingParams, prompts=PROMPTS):
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


@pytest.fixture(scope="module")
def base():
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    return _run(_llm(None, max_num_batched_tokens=32), sp)


# Greedy acceptance floors: what this checkpoint reaches on these prompts (deterministic; see
# BENCHMARKS.md for k = 1..3 on more text) less a margin, so a regression in the MTP path
# (window filling, chaining, positions) fails here rather than only in benchmarks.
@pytest.mark.parametrize("spec,min_al", [
    ({"method": "mtp", "num_speculative_tokens": 1}, 1.5),
    ({"method": "mtp", "num_speculative_tokens": 3}, 2.2),
    ({"method": "ngram", "num_speculative_tokens": 3}, 2.0),
])
def test_greedy_and_logprobs_equal_and_acceptance_floor(base, spec, min_al):
    llm = _llm(spec, max_num_batched_tokens=32)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    outs = _run(llm, sp)
    for o, b in zip(outs, base):
        assert o.token_ids == b.token_ids
        assert len(o.logprobs) == len(b.logprobs) == MAX_NEW
        for lo, lb in zip(o.logprobs, b.logprobs):
            assert lo.keys() == lb.keys()
            for t in lo:
                assert lo[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
                assert lo[t].rank == lb[t].rank
    sd = llm.engine.get_stats().spec_decode
    k = spec["num_speculative_tokens"]
    assert sd.num_accepted_tokens == sum(sd.num_accepted_tokens_per_pos)
    assert all(a >= b for a, b in zip(sd.num_accepted_tokens_per_pos,
                                      sd.num_accepted_tokens_per_pos[1:]))
    assert sd.mean_acceptance_length == pytest.approx(1 + sd.num_accepted_tokens / sd.num_drafts)
    assert min_al <= sd.mean_acceptance_length <= k + 1
    # Tokens = one per prefill + (accepted + 1) per draft verified + one per step without
    # drafts (MTP proposes whenever a draft fits: at most the last token of each request).
    total, p = sum(len(o.token_ids) for o in outs), len(PROMPTS)
    lo = p + sd.num_drafts + sd.num_accepted_tokens
    assert lo <= total <= lo + (p if spec["method"] == "mtp" else total)
    llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible():
    sp = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=s, ignore_eos=True)
          for s in range(3)]
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    first = [o.outputs[0].token_ids for o in _llm(spec).generate(PROMPTS[:3], sp,
                                                                 use_tqdm=False)]
    # Other requests in the batch do not change a seeded request's tokens.
    again = _llm(spec).generate(PROMPTS[:3] + PROMPTS[3:], sp + [SamplingParams(
        temperature=1.0, max_tokens=24)] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again[:3]] == first


def test_forced_acceptance_length_is_met():
    al = 2.5
    spec = {"method": "mtp", "num_speculative_tokens": 3, "forced_acceptance_length": al}
    llm = _llm(spec)
    sp = SamplingParams(temperature=0.0, max_tokens=61, ignore_eos=True)
    outs = _run(llm, sp, PROMPTS[:2])
    assert all(len(o.token_ids) == 61 for o in outs)
    sd = llm.engine.get_stats().spec_decode
    assert sd.forced_acceptance_length == al
    # Error diffusion: 1, 2, 1, 2, ... drafts per step; 61 = 1 (prefill) + 24 steps x 2.5.
    assert sd.num_drafts == 2 * 24
    assert sd.mean_acceptance_length == pytest.approx(al)
    assert math.isclose(sd.num_accepted_tokens_per_pos[0], sd.num_drafts)


def test_greedy_with_penalties_min_tokens_and_stops_equal():
    """Penalties and min_tokens see each draft row's own history; a stop inside accepted
    drafts ends the request there."""
    sps = [SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3,
                          frequency_penalty=0.2, presence_penalty=0.1),
           SamplingParams(temperature=0.0, max_tokens=40, min_tokens=10, stop_token_ids=[204])]
    spec_llm = _llm({"method": "ngram", "num_speculative_tokens": 4}, max_model_len=64)
    plain_llm = _llm(None, max_model_len=64)
    for sp in sps:
        got, want = _run(spec_llm, sp, PROMPTS[:4]), _run(plain_llm, sp, PROMPTS[:4])
        assert [(o.token_ids, o.finish_reason) for o in got] == \
            [(o.token_ids, o.finish_reason) for o in want]
    assert any(o.finish_reason == "stop" for o in got)
