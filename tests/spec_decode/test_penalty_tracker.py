"""The incremental penalty state (worker/penalties.py) equals the one rebuilt from the full
histories (sampler._build_penalties): on random histories that grow, with draft tokens ahead
of verification rows, after a drop and after an output that shrank; and at every step of a
real engine run with repetition/frequency/presence penalties under speculation (rejected
drafts), preemption and prefix-cache hits."""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field

import pytest
import torch
from spec_models import llama_checkpoint

from wideserve import LLM, SamplingParams
from wideserve.worker.penalties import PenaltyTracker
from wideserve.worker.sampler import PenaltyState, _build_penalties

VOCAB = 64


@dataclass
class _Req:
    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)


def _assert_equal(got: PenaltyState | None, ref: PenaltyState | None) -> None:
    assert (got is None) == (ref is None)
    if ref is None:
        return
    for name in ("rows", "presence", "frequency", "repetition", "output_counts"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert (got.seen is None) == (ref.seen is None)
    if ref.seen is not None:
        assert torch.equal(got.seen, ref.seen)


def _rebuilt(rows, vocab: int) -> PenaltyState | None:
    return _build_penalties([r.sampling_params for r, _ in rows],
                            [list(r.output_token_ids) + list(x) for r, x in rows],
                            [r.prompt_token_ids for r, _ in rows], torch.device("cpu"), vocab)


def test_tracker_equals_rebuild_on_random_histories():
    rng = random.Random(0)
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.3),
              SamplingParams(frequency_penalty=0.5, presence_penalty=-0.2),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=0.1)]
    tracker = PenaltyTracker(VOCAB, "cpu")
    reqs = [_Req(f"r{i}", params[i % 4], [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))])
            for i in range(6)]
    for step in range(40):
        live = rng.sample(reqs, rng.randint(1, len(reqs)))
        rows = []
        for r in live:      # a verification step: k drafts -> rows see drafts[:j]
            drafts = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
            rows += [(r, drafts[:j]) for j in range(len(drafts) + 1)]
        _assert_equal(tracker.state(rows), _rebuilt(rows, VOCAB))
        for r in live:
            r.output_token_ids += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))]
        if step == 20:          # a finished request's id comes back as a new request
            tracker.drop([reqs[1].request_id])
            reqs[1] = _Req(reqs[1].request_id, params[1], [5, 6, 7])
        if step == 30:          # a history that shrank is rebuilt, not trusted
            del reqs[2].output_token_ids[1:]
    assert len(tracker) == sum(r.sampling_params.has_penalties for r in reqs)   # others: no row


def test_tracker_rejects_out_of_range_ids():
    r = _Req("a", SamplingParams(presence_penalty=1.0), [1], [VOCAB])
    with pytest.raises(ValueError, match="output_token_ids"):
        PenaltyTracker(VOCAB, "cpu").state([(r, ())])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(llama_checkpoint(tmp_path_factory.mktemp("llama_pen"), vocab=VOCAB, seed=4))


def _prompts() -> list[list[int]]:
    """Repeated segments (the n-gram proposer finds matches) sharing a 40-token prefix."""
    rng = random.Random(1)
    prefix = [rng.randrange(2, VOCAB) for _ in range(40)]
    out = []
    for n in (3, 5, 4, 6, 2, 7, 3, 5):
        seg = [rng.randrange(2, VOCAB) for _ in range(n)]
        out.append(prefix + seg * 4)
    return out


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3,
                                         "prompt_lookup_max": 2, "batch_token_budget": 0}])
def test_engine_state_equals_rebuild_every_step(llama, spec):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(llama, dtype="float32", block_size=16, skip_tokenizer_init=True,
                  kv_cache_memory=1 << 24, num_blocks_override=14, max_num_seqs=8,
                  max_num_batched_tokens=64, enable_prefix_caching=True,
                  speculative_config=spec)
    tracker = llm.engine.worker.penalties
    original, checked = tracker.state, [0]

    def state(rows):
        got = original(rows)
        _assert_equal(got, _rebuilt(rows, VOCAB))
        checked[0] += got is not None
        return got

    tracker.state = state
    prompts = _prompts()
    params = [SamplingParams(temperature=t, repetition_penalty=rp, frequency_penalty=fp,
                             presence_penalty=pp, max_tokens=24, ignore_eos=True, seed=i)
              for i, (t, rp, fp, pp) in enumerate(
                  [(0.0, 1.2, 0.0, 0.0), (0.9, 1.0, 0.4, 0.3), (0.0, 0.9, 0.2, 0.0),
                   (0.7, 1.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.5), (1.0, 1.3, 0.1, 0.1),
                   (0.0, 1.0, 0.0, 0.0), (0.8, 1.1, 0.0, 0.2)])]
    llm.generate([{"prompt_token_ids": p} for p in prompts[:1]], params[:1], use_tqdm=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params[1:], use_tqdm=False)
    stats = llm.engine.get_stats()
    assert checked[0] > 20
    assert stats.num_preemptions > 0 and stats.prefix_hits > 0
    if spec is not None:
        sd = stats.spec_decode
        assert 0 < sd.num_accepted_tokens < sd.num_draft_tokens      # drafts were rejected
    assert len(tracker) == 0                                          # finished: dropped
    llm.engine.check_integrity()
