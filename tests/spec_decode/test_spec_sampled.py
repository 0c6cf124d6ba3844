"""End to end: with speculation, sampled outputs follow the target model's distribution.

A tiny-vocabulary DeepSeek-V4 (config A with 12 tokens, random MTP block) samples 3 tokens
for one prompt many times with temperature, top-k and a repetition penalty (which depends on
the tokens before, drafts included). The exact distribution of (t1, t2, t3) is enumerated
from transformers' full forwards over every prefix with the same processing written out
independently; chi-square goodness of fit (fixed seeds: deterministic; each check has a 0.1%
false-positive rate for a fresh seed) on t1, t2, t3 and the pair (t1, t2).
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from models import v4_configs
from models.v4_helpers import stable_topk
from spec_models import v4_mtp_checkpoint
from stats_util import chi_square_pvalue

from wideserve import LLM, SamplingParams

V = 12
PROMPT = [3, 7, 1, 9, 4]
TEMP, TOP_K, REP = 0.9, 8, 1.3
N = 1000
ALPHA = 1e-3


@torch.no_grad()
def _processed_probs(hf, prefixes: list[list[int]]) -> torch.Tensor:
    """[P, V] next-token distribution after each prompt + prefix: repetition penalty over
    every token seen (prompt and output), / temperature, top-k, softmax."""
    ids = torch.tensor([PROMPT + p for p in prefixes])
    with stable_topk():
        logits = hf(input_ids=ids, use_cache=False).logits[:, -1].float()    # [P, V]
    seen = torch.zeros_like(logits, dtype=torch.bool)
    for r, row in enumerate(ids.tolist()):
        seen[r, row] = True
    logits = torch.where(seen, torch.where(logits > 0, logits / REP, logits * REP), logits)
    x = logits / TEMP
    kth = x.topk(TOP_K, dim=-1).values[:, -1:]
    return x.masked_fill(x < kth, float("-inf")).softmax(-1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("v4_tiny_vocab")
    hf = v4_mtp_checkpoint(path, dict(v4_configs.A, vocab_size=V), seed=11)
    p1 = _processed_probs(hf, [[]])[0]                                   # [V]
    p2 = _processed_probs(hf, [[a] for a in range(V)])                   # [V, V]
    pairs = list(itertools.product(range(V), repeat=2))
    p3 = _processed_probs(hf, [list(p) for p in pairs]).reshape(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3                      # [V, V, V]
    return str(path), joint


def test_sampled_tokens_follow_the_target_distribution(setup):
    path, joint = setup
    # Drafts = the target's argmax (the draft model is the target itself): accepted about
    # a third of the time, so acceptance, recovery and bonus tokens all occur often. (The
    # verifier does not depend on the proposer; the random MTP block is rarely accepted.)
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2,
            "batch_token_budget": 0}          # full depth at batch N
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, dtype="float32", block_size=16, skip_tokenizer_init=True,
                  kv_cache_memory=1 << 27, max_num_seqs=256, max_num_batched_tokens=2048,
                  speculative_config=spec)
    # max_tokens 4: after the prefill's t1, one verification of 2 drafts yields t2 and t3.
    sp = SamplingParams(temperature=TEMP, top_k=TOP_K, repetition_penalty=REP, max_tokens=4,
                        ignore_eos=True)
    torch.manual_seed(0)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * N, sp, use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])          # [N, 4]
    assert toks.shape == (N, 4)
    sd = llm.engine.get_stats().spec_decode
    # Both verification outcomes happened many times.
    assert sd.num_accepted_tokens_per_pos[1] > 0.05 * N
    assert 0.05 * sd.num_draft_tokens < sd.num_accepted_tokens < 0.95 * sd.num_draft_tokens
    marginals = {"t1": (toks[:, 0], joint.sum((1, 2))), "t2": (toks[:, 1], joint.sum((0, 2))),
                 "t3": (toks[:, 2], joint.sum((0, 1))),
                 "t1t2": (toks[:, 0] * V + toks[:, 1], joint.sum(2).reshape(-1))}
    for name, (obs, probs) in marginals.items():
        counts = torch.bincount(obs, minlength=probs.numel())
        assert chi_square_pvalue(counts, probs) > ALPHA, name
    llm.engine.check_integrity()
