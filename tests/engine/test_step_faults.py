"""A failed engine step fails only the requests it carried; the engine keeps serving with the
same greedy outputs, a consistent scheduler and a clean KV pool (bundled model, faults
injected in the model forward and in sampling)."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from wideserve import LLM, SamplingParams
from wideserve.engine.errors import DuplicateRequestError, EngineStateError
from wideserve.types.messages import EngineCoreRequest
from wideserve.engine import step_worker as worker_mod

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # 64-token blocks and chunks: a long prompt is prefilled over several steps.
    return LLM(None, dtype="float32", block_size=64, max_num_batched_tokens=64, max_num_seqs=2,
               kv_cache_memory=1 << 26)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    long = tok.encode("ROMEO.\nBut soft, what light through yonder window breaks?\n" * 12)
    assert len(long) > 3 * 64
    return [long, tok.encode("KING HENRY.\nMy lord,"), tok.encode("JULIET.\nO Romeo,")]


@pytest.fixture(scope="module")
def reference(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.engine.kv_manager.reset_prefix_cache()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(autouse=True)
def consistent_afterwards(llm):
    yield
    core = llm.engine
    assert not core.has_unfinished_requests()
    assert core.scheduler._in_flight is None
    core.check_integrity()
    assert core.kv_manager.usage == 0.0
    core.kv_manager.reset_prefix_cache()


class _FailOnce:
    """Raises on the `at`-th call (1-based), then gets out of the way."""

    def __init__(self, at: int, error: Exception) -> None:
        self.at, self.calls, self.error = at, 0, error

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise self.error


@contextlib.contextmanager
def _faulty_forward(model, fault: _FailOnce, half_written: bool = False):
    """The model's forward, with `fault` called first. `half_written`: the failing call
    first writes wrong KV (the forward of other tokens) into the step's slots, as a forward
    that dies midway leaves them."""
    real = model.forward

    def forward(batch, *args, **kwargs):
        if half_written and fault.calls + 1 == fault.at:
            real(dataclasses.replace(batch, input_ids=(batch.input_ids + 1) % 64), *args,
                 **kwargs)
        fault()
        return real(batch, *args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        del model.forward


def _run(core, reqs: dict[str, list[int]]) -> dict[str, list]:
    for rid, prompt in reqs.items():
        core.add_request(EngineCoreRequest(rid, prompt, GREEDY))
    got: dict[str, list] = {rid: [] for rid in reqs}
    while core.has_unfinished_requests():
        for out in core.step():
            got[out.request_id].append(out)
    return got


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_fault_in_the_model_forward_fails_only_that_steps_requests(llm, prompts, reference):
    core = llm.engine
    # The long prompt's second chunk fails after writing wrong KV: had the rollback not
    # lowered num_computed_tokens, that block would now be in the prefix cache and the rerun
    # below would read it.
    fault = _FailOnce(2, RuntimeError("injected forward fault"))
    with _faulty_forward(core.model, fault, half_written=True):
        got = _run(core, {"long": prompts[0], "short": prompts[1], "queued": prompts[2]})
    # The 64-token budget gave the failed step to the long prompt alone.
    assert got["long"][-1].finish_reason == "error" and got["long"][-1].internal_error
    assert "injected forward fault" in got["long"][-1].error and not _tokens(got["long"])
    for rid, ref in (("short", reference[1]), ("queued", reference[2])):
        assert got[rid][-1].finish_reason == "length" and _tokens(got[rid]) == ref
    # Same engine, same prompts: unchanged greedy outputs, and the prefix cache offers only
    # the block computed before the failed step (the short prompts fill no block).
    hits = core.get_stats().prefix_hits
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == reference
    assert core.get_stats().prefix_hits - hits == 64


def test_fault_in_sampling_mid_decode(llm, prompts, reference, monkeypatch):
    core = llm.engine
    real = core.worker.sampler
    fault = _FailOnce(4, ValueError("injected sampler fault"))

    def faulty(fn):
        def call(*args, **kwargs):
            fault()
            return fn(*args, **kwargs)
        return call

    # A step samples through the sampler, or through argmax_rows alone when every row is
    # plain greedy (Worker._sample): the fault is in both, a step calls one of them.
    monkeypatch.setattr(core.worker, "sampler", faulty(real))
    monkeypatch.setattr(worker_mod, "argmax_rows", faulty(worker_mod.argmax_rows))
    got = _run(core, {"a": prompts[1], "b": prompts[2]})
    for rid in ("a", "b"):
        assert got[rid][-1].finish_reason == "error"
        assert 0 < len(_tokens(got[rid])) < GREEDY.max_tokens   # failed mid-decode
        assert _tokens(got[rid]) == reference[1 if rid == "a" else 2][:len(_tokens(got[rid]))]
    # The offline LLM reports the failure per request and stays usable.
    fault.at, fault.calls = 1, 0
    failed = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)[0]
    assert failed.outputs[0].finish_reason == "error"
    ok = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in ok] == reference


def test_untrustworthy_state_is_reported_and_the_engine_refuses_work(prompts, monkeypatch):
    llm = LLM(None, dtype="float32", block_size=64, kv_cache_memory=1 << 26)
    core = llm.engine
    core.add_request(EngineCoreRequest("x", prompts[1], GREEDY))
    with _faulty_forward(core.model, _FailOnce(1, RuntimeError(
            "CUDA error: an illegal memory access was encountered"))):
        with pytest.raises(EngineStateError, match="device is unusable"):
            core.step()
    with pytest.raises(EngineStateError, match="cannot be trusted"):
        core.step()
    with pytest.raises(EngineStateError):
        core.add_request(EngineCoreRequest("y", prompts[1], GREEDY))


def test_scheduler_bookkeeping_fault_is_fatal(prompts, monkeypatch):
    llm = LLM(None, dtype="float32", block_size=64, kv_cache_memory=1 << 26)
    core = llm.engine
    monkeypatch.setattr(core.scheduler, "update_from_output",
                        lambda *a, **k: (_ for _ in ()).throw(KeyError("bookkeeping")))
    core.add_request(EngineCoreRequest("x", prompts[1], GREEDY))
    with pytest.raises(EngineStateError, match="scheduler's update"):
        core.step()


def test_duplicate_request_id_leaves_the_live_request_alone(llm, prompts):
    core = llm.engine
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=8, prompt_logprobs=1)
    ref = _run_one(core, "solo", prompts[1], seeded)
    core.add_request(EngineCoreRequest("dup", prompts[1], seeded))
    gen = core.worker.generators["dup"]
    plp = core.worker.prompt_logprobs["dup"]
    outs = core.step()
    with pytest.raises(DuplicateRequestError, match="already in use"):
        core.add_request(EngineCoreRequest("dup", prompts[2],
                                           SamplingParams(seed=99, prompt_logprobs=1)))
    assert core.worker.generators["dup"] is gen and core.worker.prompt_logprobs["dup"] is plp
    while core.has_unfinished_requests():
        outs += core.step()
    assert _tokens(outs) == _tokens(ref)
    assert outs[0].new_logprobs.prompt.token_ids == ref[0].new_logprobs.prompt.token_ids


def _run_one(core, rid, prompt, params) -> list:
    core.add_request(EngineCoreRequest(rid, prompt, params))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    return outs


def test_no_state_kept_for_failed_requests(llm, prompts):
    core = llm.engine
    core.add_request(EngineCoreRequest("s", prompts[1], SamplingParams(seed=3,
                                                                       prompt_logprobs=1)))
    with _faulty_forward(core.model, _FailOnce(1, torch.cuda.OutOfMemoryError("injected"))):
        outs = core.step()
    assert outs[-1].finish_reason == "error" and "OutOfMemoryError" in outs[-1].error
    core.step()          # the next step tells the runner and drops per-request state
    assert "s" not in core.worker.generators and "s" not in core.worker.prompt_logprobs
