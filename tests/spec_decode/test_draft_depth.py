"""Speculation depth per batch size: requests x (k + 1) verified tokens within the budget."""
from __future__ import annotations

import pytest

from wideserve.config.speculative import SpeculativeConfig
from wideserve.spec_decode.decoder import draft_depth


def test_depth_shrinks_with_the_batch() -> None:
    assert [draft_depth(3, b, 32) for b in (1, 4, 8, 9, 16, 17, 32, 64)] == \
        [3, 3, 3, 2, 1, 0, 0, 0]
    assert draft_depth(3, 64, 0) == 3                  # budget 0: always k
    assert draft_depth(2, 0, 32) == 2


def test_budget_is_validated() -> None:
    with pytest.raises(ValueError, match="batch_token_budget"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, batch_token_budget=-1)


def test_no_proposer_work_when_the_batch_allows_no_drafts(tmp_path) -> None:
    """Budget 8 with k = 3: four decoding requests get depth 8 // 4 - 1 = 1, five or more get
    0, and then the proposer does not run at all; outputs stay the non-speculative ones and
    drafting resumes once requests finish (over caches that miss the skipped positions)."""
    import warnings

    from spec_models import llama_checkpoint

    from wideserve import LLM, SamplingParams
    path = str(llama_checkpoint(tmp_path / "llama", vocab=64, seed=2))
    prompts = [[(7 * i + j) % 60 + 2 for j in range(5 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 4 * i, ignore_eos=True)
              for i in range(6)]

    def run(spec):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=spec,
                      max_num_seqs=8)
        calls = []
        if spec is not None:
            prop, original = llm.engine.spec.proposer, llm.engine.spec.proposer.propose
            prop.propose = lambda inp: calls.append(sum(1 for e in inp.sampled if e)) or \
                original(inp)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], calls, llm

    base, _, _ = run(None)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
            "batch_token_budget": 8}
    out, calls, llm = run(spec)
    assert out == base
    assert calls and max(calls) <= 4       # never called with 5 or 6 decoding requests
    sd = llm.engine.get_stats().spec_decode
    # Self-drafts after the skipped steps: the draft model's KV misses those positions, so
    # some drafts are rejected (without the skip all would be accepted), and none is wrong.
    assert sd.num_drafts > 0 and 0 < sd.num_accepted_tokens < sd.num_draft_tokens


def test_steps_without_drafts_take_the_plain_sampler(tmp_path) -> None:
    """A budget that never allows a draft (1 token per step): every step is a plain one (no
    rejection sampler, no proposer), and seeded random sampling, greedy rows and logprobs are
    exactly the non-speculative engine's."""
    import warnings

    from spec_models import llama_checkpoint

    from wideserve import LLM, SamplingParams
    path = str(llama_checkpoint(tmp_path / "llama", vocab=64, seed=2))
    prompts = [[(5 * i + j) % 60 + 2 for j in range(4 + i)] for i in range(4)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=10 + i, logprobs=2,
                             max_tokens=7, ignore_eos=True) for i in range(4)]

    def run(spec):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm

    base, _ = run(None)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
            "batch_token_budget": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, speculative_config=spec)
    calls = []
    llm.engine.spec.sampler = lambda *a, **k: calls.append(a)      # must never run
    llm.engine.spec.proposer.propose = lambda inp: calls.append(inp)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] == base
    assert calls == []
