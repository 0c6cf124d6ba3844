"""Engine behaviour on the bundled model (real tokenizer): seeded sampling, stop strings and
stop tokens, aborts, n > 1, logprobs, and the KV integrity check after each test."""
from __future__ import annotations

import pytest

from wideserve import LLM, SamplingParams
from wideserve.types.messages import EngineCoreRequest


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, dtype="float32", block_size=64, max_num_batched_tokens=256)


@pytest.fixture(autouse=True)
def idle_integrity(llm):
    yield
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.usage == 0.0


PROMPTS = ["ROMEO.\n", "KING HENRY.\nMy lord,", "To be, or not to be,", "JULIET.\nO Romeo,"]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=13, ignore_eos=True)
              for s in (7, 8, 9)]
    mixed = llm.generate(PROMPTS[1:] + PROMPTS[:1], others + [sp], use_tqdm=False)
    assert alone == again == mixed[-1].outputs[0].token_ids
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    draws = {tuple(o.outputs[0].token_ids)
             for o in llm.generate([PROMPTS[0]] * 4, unseeded, use_tqdm=False)}
    assert len(draws) > 1          # unseeded requests really sample


def test_stop_string_is_cut_and_request_aborted(llm):
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40,
                                                   ignore_eos=True), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop],
                                                  ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[:text.index(stop)]
    assert len(c.token_ids) < len(free.outputs[0].token_ids)


def test_stop_token_ids_and_eos(llm):
    free = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30,
                                                   ignore_eos=True), use_tqdm=False)[0]
    ids = free.outputs[0].token_ids
    target = ids[10]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30,
                                                  stop_token_ids=[target]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == target
    assert c.token_ids == ids[:ids.index(target) + 1]
    # min_tokens keeps the stop token from ending the request early.
    late = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30,
                                                   stop_token_ids=[target], min_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    assert late.finish_reason == "length" and len(late.token_ids) == 30


def test_abort_frees_blocks(llm):
    core = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    tok = llm.get_tokenizer()
    for i, p in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"abort-{i}", tok.encode(p * 20), sp))
    core.step()
    core.step()
    assert core.kv_manager.usage > 0
    # What a DP front end asks a rank when a request never finishes (dp_offline._whereabouts).
    assert sorted(core.request_ids()) == [f"abort-{i}" for i in range(len(PROMPTS))]
    core.abort_requests([f"abort-{i}" for i in range(len(PROMPTS))])
    finished = [o for o in core.step() if o.finish_reason == "abort"]
    assert {o.request_id for o in finished} == {f"abort-{i}" for i in range(len(PROMPTS))}
    assert core.kv_manager.usage == 0.0 and core.request_ids() == []


def test_n_and_logprobs(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, logprobs=2,
                        ignore_eos=True)
    out = llm.generate(PROMPTS[2], sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for c in out.outputs:
        assert len(c.token_ids) == 8 and len(c.logprobs) == 8
        for tid, entry in zip(c.token_ids, c.logprobs):
            assert tid in entry and 2 <= len(entry) <= 3
            assert entry[tid].logprob <= 0.0
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_chat_uses_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Speak, Horatio."}],
                   SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt_token_ids == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "Speak, Horatio."}]),
        add_special_tokens=False)
    assert out.outputs[0].token_ids


def test_bad_requests_are_rejected_without_leaking(llm):
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate({"prompt_token_ids": [5] * 10},
                     SamplingParams(max_tokens=llm.engine.max_model_len), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [10**7]}, SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(), use_tqdm=False)


def test_prompt_logprobs_cover_a_cached_prefix(llm):
    tok = llm.get_tokenizer()
    prompt = tok.encode("ROMEO.\n" * 40)
    assert len(prompt) > 2 * 64        # spans full 64-token blocks (the fixture's block size)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)   # fills the cache
    hits = llm.engine.get_stats().prefix_hits
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    assert llm.engine.get_stats().prefix_hits == hits      # no hit for prompt logprobs
    lps = first.prompt_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    assert all(prompt[i] in lps[i] and len(lps[i]) <= 2 for i in range(1, len(prompt)))
    # Same numbers when the prompt is chunked over several steps.
    chunked = LLM(None, dtype="float32", block_size=64, max_num_batched_tokens=48)
    again = chunked.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    for a, b in zip(lps[1:], again.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank


def test_prompt_logprobs_in_bounded_slices(llm, monkeypatch):
    """Logits for prompt logprobs are made a few rows at a time, never [chunk, vocab] at
    once; the numbers are those of the whole chunk."""
    prompt = llm.get_tokenizer().encode("To be, or not to be, that is the question:\n" * 6)
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    whole = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    model = llm.engine.model
    rows_per_slice = 5
    monkeypatch.setattr(llm.engine.worker, "prompt_logprobs_slice_bytes",
                        rows_per_slice * 4 * llm.engine.vocab_size)
    seen: list[int] = []
    real = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: seen.append(h.shape[0]) or real(h))
    sliced = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    assert max(seen) <= max(rows_per_slice, 1) and len(seen) > len(prompt) // rows_per_slice
    assert sliced.outputs[0].token_ids == whole.outputs[0].token_ids
    for a, b in zip(whole.prompt_logprobs[1:], sliced.prompt_logprobs[1:], strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert abs(a[t].logprob - b[t].logprob) < 1e-5 and a[t].rank == b[t].rank
