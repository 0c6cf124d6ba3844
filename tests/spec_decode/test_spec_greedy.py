"""Greedy outputs are the same with and without speculation, for every proposer, under
chunked prefill, prefix caching and preemption; drafts are what each proposer
should draft; KV pools are whole at idle.

Model: tiny DeepSeek-V4 config A (window 8, CSA ratio 4, HCA ratio 8, block 16) with a random
MTP block, so verification rejects and rolls back through every window and compressor state.
Proposers: mtp (random block: almost always rejected), ngram, draft_model = a random Llama
(rejected), and draft_model = the target itself with one draft corrupted per proposal at a
rotating position (every acceptance length 0..k happens; all other drafts must be accepted).
"""
from __future__ import annotations

import warnings

import pytest
import torch
from engine.oracle import mixed_prompts
from spec_models import llama_checkpoint, v4_mtp_checkpoint

from wideserve import LLM, SamplingParams
from wideserve.config import LoadConfig
from wideserve.worker.model_loader import load_model

MAX_NEW = 12
LENGTHS = [3, 9, 17, 30, 41, 5, 64, 12, 27, 50, 8, 33, 19, 70, 2, 45]
BLOCK = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4a_mtp")
    v4_mtp_checkpoint(path)
    llama = llama_checkpoint(tmp_path_factory.mktemp("llama_draft"), vocab=256)
    prompts = mixed_prompts(256, LENGTHS, seed=1)
    shared = mixed_prompts(256, [4, 11, 23, 7], seed=2, shared_prefix=3 * BLOCK + 5)
    base = _llm(str(path), None, max_num_batched_tokens=4096, enable_prefix_caching=False)
    return {"path": str(path), "llama": str(llama), "prompts": prompts, "shared": shared,
            "expected": _generate(base, prompts), "expected_shared": _generate(base, shared)}


def _llm(path: str, spec: dict | None, **kw) -> LLM:
    args = {"dtype": "float32", "block_size": BLOCK, "kv_cache_memory": 1 << 26,
            "skip_tokenizer_init": True, "speculative_config": spec}
    args.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, **args)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _check_idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert llm.engine.kv_manager.usage == 0.0


def _corrupt_one_draft(llm: LLM) -> None:
    """Wrap the proposer: in proposal number t, draft (t mod (k+1)) is replaced by a wrong
    token (no draft changed when that index is k), so acceptance stops exactly there."""
    prop, calls = llm.engine.spec.proposer, [0]
    original = prop.propose

    def propose(inp):
        out = original(inp)
        for d in out:
            if d:
                j = calls[0] % (llm.engine.spec.k + 1)
                calls[0] += 1
                if j < len(d):
                    d[j] = (d[j] + 1) % 256
        return out

    prop.propose = propose


SPECS = {
    "mtp": lambda c: {"method": "mtp", "num_speculative_tokens": 3},
    "ngram": lambda c: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
    "draft_llama": lambda c: {"method": "draft_model", "model": c["llama"],
                              "num_speculative_tokens": 2},
    # Every acceptance length must occur: full depth at every batch size.
    "draft_self": lambda c: {"method": "draft_model", "model": c["path"],
                             "num_speculative_tokens": 3, "batch_token_budget": 0},
}
CONDITIONS = {
    "chunked_prefix_keep": {"max_num_batched_tokens": 16, "enable_prefix_caching": True},
    "one_step_no_cache": {"max_num_batched_tokens": 4096, "enable_prefix_caching": False},
    "preemption": {"max_num_batched_tokens": 64, "num_blocks_override": 22, "max_num_seqs": 16},
}


@pytest.mark.parametrize("condition", list(CONDITIONS))
@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_equal_with_and_without_speculation(ckpt, method, condition):
    llm = _llm(ckpt["path"], SPECS[method](ckpt), **CONDITIONS[condition])
    if method == "draft_self":
        _corrupt_one_draft(llm)
    assert _generate(llm, ckpt["prompts"]) == ckpt["expected"]
    stats = llm.engine.get_stats()
    sd = stats.spec_decode
    assert sd is not None and sd.num_drafts > 0 and sd.num_draft_tokens >= sd.num_drafts
    if condition == "preemption":
        assert stats.num_preemptions > 0
    if method == "draft_self":
        # Every acceptance length occurred, and only corrupted drafts were rejected.
        per_pos = sd.num_accepted_tokens_per_pos
        assert 0 < per_pos[2] < per_pos[1] < per_pos[0] < sd.num_drafts
        assert sd.num_accepted_tokens >= 0.4 * sd.num_draft_tokens
    _check_idle(llm)


def test_prefix_hits_with_speculation(ckpt):
    llm = _llm(ckpt["path"], SPECS["draft_self"](ckpt), max_num_batched_tokens=32,
               enable_prefix_caching=True)
    first = _generate(llm, ckpt["shared"][:1])
    rest = _generate(llm, ckpt["shared"][1:])
    assert first + rest == ckpt["expected_shared"]
    stats = llm.engine.get_stats()
    assert stats.prefix_hits > 0
    # The draft model's caches hit with the target's: its drafts stay right after the hit.
    sd = stats.spec_decode
    assert sd.num_accepted_tokens == sd.num_draft_tokens
    _check_idle(llm)


def _reference_mtp_drafts(path: str, seq: list[int]) -> torch.Tensor:
    """One-shot main + MTP forward over `seq` on a fresh paged cache: [L-1, V] MTP logits
    (row p: token p with successor p + 1, predicting p + 2)."""
    from paged_harness import PagedHarness
    model = load_model(LoadConfig(model=path, dtype="float32")).model
    specs = {**model.kv_cache_specs(), **model.mtp_kv_cache_specs()}
    h = PagedHarness(model, max_reqs=1, max_len=len(seq) + 4, specs=specs)

    def fn(batch):
        model.forward(batch)
        nxt = torch.tensor(seq[1:])
        return model.compute_logits(model.mtp_forward(batch, model.last_streams, nxt))

    return h.run([0], [seq[:-1]], fn)


@pytest.mark.parametrize("condition", ["chunked_prefix_keep", "preemption"])
def test_mtp_drafts_match_a_one_shot_mtp_forward(ckpt, condition):
    """k = 1: each draft is the MTP argmax at the emitted token's previous position, as a
    one-shot forward over the final sequence gives it (so the MTP window was filled at every
    position, across prefill chunks, rejections and preemption)."""
    llm = _llm(ckpt["path"], {"method": "mtp", "num_speculative_tokens": 1},
               **CONDITIONS[condition])
    prop, log = llm.engine.spec.proposer, []
    original = prop.propose

    def propose(inp):
        out = original(inp)
        for i, d in enumerate(out):
            if d:
                c = inp.step_reqs[i].start + int(inp.num_valid[i])
                log.append((int(inp.step_reqs[i].request_id), c, d[0]))
        return out

    prop.propose = propose
    prompts = ckpt["prompts"][:6]
    assert _generate(llm, prompts) == ckpt["expected"][:6]
    refs = [_reference_mtp_drafts(ckpt["path"], p + e)
            for p, e in zip(prompts, ckpt["expected"][:6])]
    assert len(log) >= 6 * (MAX_NEW - 2) // 2
    for rid, c, draft in log:
        row = refs[rid][c - 1]
        # Equal argmax up to float ties (batch shapes change summation order).
        assert float(row.max() - row[draft]) < 1e-4, (rid, c, draft, int(row.argmax()))
    _check_idle(llm)


def test_bad_proposer_setups_are_named(ckpt, tmp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        _llm(ckpt["llama"], {"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="speculative_config.model"):
        _llm(ckpt["path"], {"method": "draft_model", "model": str(tmp_path / "none"),
                            "num_speculative_tokens": 1})
    big = llama_checkpoint(tmp_path / "big_vocab", vocab=300)
    with pytest.raises(ValueError, match="vocabulary"):
        _llm(ckpt["path"], {"method": "draft_model", "model": str(big),
                            "num_speculative_tokens": 1})


@pytest.mark.parametrize("method", ["mtp", "draft_self"])
def test_next_turn_hits_blocks_written_under_speculation(ckpt, method):
    """Turn 2's prompt is turn 1's prompt + output: it hits blocks whose positions held
    rejected drafts during turn 1 (rewound, then recomputed before publication)."""
    llm = _llm(ckpt["path"], SPECS[method](ckpt), max_num_batched_tokens=64)
    if method == "draft_self":
        _corrupt_one_draft(llm)
    plain = _llm(ckpt["path"], None, enable_prefix_caching=False)
    turn1 = ckpt["prompts"][4] + [7]                        # 42 tokens
    out1 = _generate(llm, [turn1])[0]
    assert out1 == _generate(plain, [turn1])[0]
    turn2 = turn1 + out1 + [11, 12, 13]                     # 57 tokens: 3 full blocks hit
    hits = llm.engine.get_stats().prefix_hits
    assert _generate(llm, [turn2]) == _generate(plain, [turn2])
    assert llm.engine.get_stats().prefix_hits - hits == 3 * BLOCK
    assert llm.engine.get_stats().spec_decode.num_accepted_tokens < \
        llm.engine.get_stats().spec_decode.num_draft_tokens
    _check_idle(llm)
