"""Structured outputs in the engine, on the bundled Shakespeare model: the grammar, not the
model, makes outputs valid; masks touch only constrained rows; speculation under a grammar
is lossless; compilation is off the step loop; a grammar that fails ends only its request."""
from __future__ import annotations

import json
import re
import threading
import warnings

import jsonschema
import pytest
import torch

from wideserve import LLM, SamplingParams
from wideserve.types.messages import EngineCoreRequest
from wideserve.worker.grammar_mask import GrammarMask, unpack_bitmask
from wideserve.types.structured_params import StructuredOutputsParams as SO

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"enum": ["merry", "sad", "wroth"]},
    "lines": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
    "required": ["name", "age", "mood", "lines"], "additionalProperties": False}
PROMPTS = ["ROMEO: Tell me of thyself.\nJULIET:", "HAMLET.\n", "To be, or not to be",
           "KING HENRY.\nMy lord,"]
REGEX = r"(ROMEO|JULIET|NURSE): [A-Z][a-z]{1,8}[.!?]"
DEAD_END = SO(grammar='start: "ab" C\nC: /x/ & /y/')


def _llm(spec: dict | None = None, **kw) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(None, dtype="float32", device="cpu", speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def llm():
    return _llm()


def _texts(llm, prompts, sp):
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_bitmask_unpacks_and_masks_only_constrained_rows():
    vocab = 70
    allowed = torch.rand(2, vocab) < 0.3
    words = torch.zeros(2, 3, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmask = words.to(torch.int32)      # wraps bit 31 into the sign, as llguidance's does
    assert torch.equal(unpack_bitmask(bitmask, vocab), allowed)
    logits = torch.randn(4, vocab)
    out = GrammarMask(torch.tensor([3, 1]), bitmask).apply(logits)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    for row, g in ((3, 0), (1, 1)):
        assert torch.equal(out[row][allowed[g]], logits[row][allowed[g]])
        assert torch.isneginf(out[row][~allowed[g]]).all()


def test_the_grammar_makes_the_tiny_model_write_valid_json(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=SO(json=json.dumps(SCHEMA)))
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=96,
                             structured_outputs=SO(json=json.dumps(SCHEMA)))
    for out in _texts(llm, PROMPTS[:3], greedy) + _texts(llm, PROMPTS[:2], sampled):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # Unconstrained, the same model writes verse, not JSON.
    free = _texts(llm, PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24))[0].text
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)


def test_regex_choice_grammar_and_unconstrained_neighbours(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = _texts(llm, PROMPTS[1:2], plain)[0].text
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(regex=REGEX)),
              plain,
              SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(
                  choice=["yea", "nay", "perchance"])),
              SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=SO(
                  grammar='start: "My " ("lord" | "liege") "," " " /[a-z]{2,6}/ "."'))]
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert re.fullmatch(REGEX, outs[0].text), outs[0].text
    assert outs[1].text == alone                 # the batch's masks left this row alone
    assert outs[2].text in ("yea", "nay", "perchance")
    assert re.fullmatch(r"My (lord|liege), [a-z]{2,6}\.", outs[3].text), outs[3].text


def test_speculation_under_a_grammar_is_lossless(llm):
    # MTP (the bundled checkpoint's head) drafts freely; the grammar refuses some drafts.
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    params = [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=SO(
        json=json.dumps(SCHEMA))), SamplingParams(temperature=0.0, max_tokens=16,
                                                  structured_outputs=SO(regex=REGEX)),
              SamplingParams(temperature=0.0, max_tokens=16)]
    prompts = PROMPTS[:3]
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec_llm = _llm(spec)
    got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert got == base
    sd = spec_llm.engine.get_stats().spec_decode
    assert sd.num_drafts > 0 and sd.num_accepted_tokens > 0   # drafts were really verified


def _request(rid: str, llm, prompt: str, sp: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(rid, llm.tokenizer.encode(prompt), sp)


def test_compilation_is_off_the_step_loop_and_failures_end_one_request(llm, monkeypatch):
    engine = llm.engine
    gate = threading.Event()
    compile_ = engine.structured._compile

    def slow_compile(request):
        gate.wait(30)
        return compile_(request)

    monkeypatch.setattr(engine.structured, "_compile", slow_compile)
    so = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=SO(choice=["ay"]))
    engine.add_request(_request("constrained", llm, PROMPTS[0], so))
    engine.add_request(_request("free", llm, PROMPTS[1], SamplingParams(temperature=0.0,
                                                                        max_tokens=4)))
    finished: dict[str, str] = {}
    for _ in range(8):                       # the free request runs to the end meanwhile
        for out in engine.step():
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert finished == {"free": "length"}
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
    assert finished["constrained"] == "stop"
    monkeypatch.undo()
    # A grammar that cannot compile (the server checks first; the engine still copes).
    bad = SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a-"))
    engine.add_request(_request("bad", llm, PROMPTS[0], bad))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error")]


def test_logit_bias_in_the_batched_sampler():
    from wideserve.worker.sampler import Sampler, build_sampling_metadata
    logits = torch.zeros(3, 10)
    logits[:, 2] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={7: 10.0}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias={2: -100.0, 4: 1.0})]
    md = build_sampling_metadata(params, [[], [], []], None, {}, "cpu", 10)
    assert Sampler()(logits, md).token_ids.tolist() == [7, 2, 4]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def _run_to_end(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_a_constraint_that_dead_ends_mid_decode_fails_its_request(llm):
    """The grammar validates and allows "ab", then nothing (the intersection of /x/ and /y/
    is empty): the request ends with an error after its valid tokens, never continues
    unconstrained (as it did: the failed matcher was dropped); its neighbour is untouched."""
    engine = llm.engine
    assert DEAD_END.error() == ""
    dead = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                          structured_outputs=DEAD_END)
    engine.add_request(_request("dead", llm, PROMPTS[0], dead))
    engine.add_request(_request("free", llm, PROMPTS[1], SamplingParams(temperature=0.0,
                                                                        max_tokens=4)))
    outs = _run_to_end(engine)
    finals = {o.request_id: o for o in outs if o.finish_reason}
    assert finals["free"].finish_reason == "length"
    assert finals["dead"].finish_reason == "error"
    assert "output constraint failed" in finals["dead"].error and finals["dead"].internal_error
    assert "Tokens" not in finals["dead"].error        # no parser dump quoting the output
    text = llm.tokenizer.decode([t for o in outs if o.request_id == "dead"
                                 for t in o.new_token_ids])
    assert "ab".startswith(text), text


def test_a_refused_token_fails_the_request_instead_of_dropping_the_constraint(llm):
    manager = llm.engine.structured
    sp = SamplingParams(structured_outputs=SO(choice=["ROMEO"]))
    from wideserve.types.request import Request
    request = Request("r", [1, 2], sp)
    assert manager.hold(request)
    assert manager.ready(5.0) == [request]
    bad = llm.tokenizer.encode("zzz", False)[0]
    manager.accept("r", [bad])
    failures = manager.take_failures()
    assert "is not allowed" in failures["r"]
    assert manager.masks([request]) is None        # no matcher left, and nothing pending
    manager.drop(["r"])


def test_compilation_is_concurrent_and_cached_by_digest(llm, monkeypatch):
    """A grammar that takes long to compile holds no other request (several compile
    threads); the same constraint is compiled once for every request asking for it."""
    manager = llm.engine.structured
    gate = threading.Event()
    built: list[str] = []
    build = manager._build

    def gated_build(grammar: str):
        built.append(grammar)
        if "SLOW" in grammar:
            gate.wait(30)
        return build(grammar)

    monkeypatch.setattr(manager, "_build", gated_build)
    from wideserve.types.request import Request
    slow = Request("slow", [1], SamplingParams(structured_outputs=SO(choice=["SLOW"])))
    fast = [Request(f"fast{i}", [1], SamplingParams(structured_outputs=SO(choice=["NURSE"])))
            for i in range(3)]
    for r in [slow, *fast]:
        manager.hold(r)
    ready: list = []
    for _ in range(100):
        ready += manager.ready(0.1)
        if len(ready) == 3:
            break
    assert ready == fast                        # while the slow one is still compiling
    gate.set()
    assert manager.ready(10.0) == [slow]
    assert sum("NURSE" in g for g in built) == 1
    manager.drop(["slow", "fast0", "fast1", "fast2"])
