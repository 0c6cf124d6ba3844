"""The rejection sampler with known target logits and draft distributions.

Statistical tests: fixed seeds (so they are deterministic); each asserts p > 1e-3, i.e. a
correct sampler would fail a given check with probability 0.1% for a fresh seed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_util import chi_square_pvalue

from wideserve.worker.sampler import Sampler, build_sampling_metadata, make_generator
from wideserve.types.sampling_params import SamplingParams
from wideserve.spec_decode.rejection_sampler import RejectionSampler

ALPHA = 1e-3


def _md(params: list[SamplingParams], num_drafts: list[int], drafts: list[list[int]],
        vocab: int, outputs: list[list[int]] | None = None, seeds: dict[int, int] | None = None,
        prompts: list[list[int]] | None = None):
    """Metadata with num_drafts + 1 rows per request; row j sees output + drafts[:j]."""
    rows_p, rows_o, rows_pr, gens = [], [], [], {}
    for i, (p, k) in enumerate(zip(params, num_drafts)):
        g = make_generator(seeds[i], "cpu") if seeds and i in seeds else None
        out = outputs[i] if outputs else []
        for j in range(k + 1):
            if g is not None:
                gens[len(rows_p)] = g
            rows_p.append(p)
            rows_o.append(out + drafts[i][:j])
            rows_pr.append(prompts[i] if prompts else [0])
    return build_sampling_metadata(rows_p, rows_o, rows_pr, gens, "cpu", vocab)


def test_greedy_accepts_while_draft_is_argmax():
    V = 6
    # Request 0: argmax per row 2, 3, 4, 5 -> drafts [2, 3, 1] accept 2 then 3, reject 1 -> 4.
    # Request 1: no drafts -> argmax 0. Request 2: all drafts right -> bonus.
    argmax = [2, 3, 4, 5, 0, 1, 5, 3, 2]
    logits = torch.full((9, V), -1.0)
    logits[torch.arange(9), torch.tensor(argmax)] = 2.0
    k = np.array([3, 0, 3])
    drafts = [[2, 3, 1], [], [1, 5, 3]]
    params = [SamplingParams(temperature=0.0)] * 3
    md = _md(params, list(k), drafts, V)
    out = RejectionSampler()(logits, md, k, np.array([t for d in drafts for t in d]))
    assert out.num_accepted.tolist() == [2, 0, 3]
    assert out.token_ids == [[2, 3, 4], [0], [1, 5, 3, 2]]


def test_forced_acceptance_keeps_drafts_whatever_they_are():
    V = 5
    logits = torch.randn(4 + 3, V, generator=torch.Generator().manual_seed(0))
    k = np.array([3, 2])
    drafts = [[4, 4, 4], [0, 0]]
    md = _md([SamplingParams(temperature=0.0)] * 2, list(k), drafts, V)
    out = RejectionSampler()(logits, md, k, np.array([4, 4, 4, 0, 0]),
                             forced_accepted=np.array([2, 5]))
    assert out.num_accepted.tolist() == [2, 2]
    assert out.token_ids[0][:2] == [4, 4] and out.token_ids[1][:2] == [0, 0]
    assert out.token_ids[0][2] == int(logits[2].argmax())
    assert out.token_ids[1][2] == int(logits[6].argmax())


def test_no_drafts_equals_the_normal_sampler():
    """k = 0 everywhere: same processing, same generator draws -> the very same tokens."""
    V, R = 50, 6
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(R, V, generator=gen) * 3
    params = [SamplingParams(temperature=0.7, top_k=10, seed=1),
              SamplingParams(temperature=1.2, top_p=0.8, seed=2),
              SamplingParams(temperature=0.9, min_p=0.05, seed=3),
              SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5,
                             frequency_penalty=0.3, seed=4),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[7], seed=5)]
    outputs = [[1, 2, 3], [], [4], [5, 5, 6, 7], [8], [1, 2]]
    prompts = [[9, 10]] * R
    seeds = {i: p.seed for i, p in enumerate(params) if p.seed is not None}
    for _ in range(3):
        md1 = _md(params, [0] * R, [[]] * R, V, outputs, seeds, prompts)
        md2 = _md(params, [0] * R, [[]] * R, V, outputs, seeds, prompts)
        ref = Sampler()(logits, md1).token_ids.tolist()
        out = RejectionSampler()(logits, md2, np.zeros(R, np.int64), np.zeros(0, np.int64))
        assert [t[0] for t in out.token_ids] == ref
        logits = torch.randn(R, V, generator=gen) * 3


def _sample_runs(p_logits: torch.Tensor, q: torch.Tensor | None, fixed_drafts: list[int] | None,
                 n: int, sp: SamplingParams, seed: int):
    """n requests with the same 3 target rows (k = 2 drafts each); drafts drawn from q (or
    fixed, one-hot). Returns the stacked outputs."""
    torch.manual_seed(seed)
    V = p_logits.size(1)
    g = torch.Generator().manual_seed(seed + 1)
    if q is not None:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g)
                              for j in range(2)], dim=1)                    # [n, 2]
        draft_probs = q.repeat(n, 1)                                        # [2n, V]
    else:
        drafts = torch.tensor([fixed_drafts] * n)
        draft_probs = None
    k = np.full(n, 2)
    dl = drafts.tolist()
    md = _md([sp] * n, list(k), dl, V)
    logits = p_logits.repeat(n, 1)
    return RejectionSampler()(logits, md, k, drafts.reshape(-1).numpy(), draft_probs)


def _probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """Independent reference: softmax of the top-k logits / T."""
    x = logits / temperature
    kth = x.topk(top_k, dim=-1).values[..., -1:]
    return x.masked_fill(x < kth, float("-inf")).softmax(-1)


@pytest.mark.parametrize("draft_kind", ["sampled", "one_hot"])
def test_sampled_outputs_follow_the_target_distribution(draft_kind):
    V, n = 6, 20000
    gen = torch.Generator().manual_seed(3)
    p_logits = torch.randn(3, V, generator=gen) * 1.5
    sp = SamplingParams(temperature=0.8, top_k=5)
    p = _probs(p_logits, 0.8, 5)
    if draft_kind == "sampled":
        q = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
        out = _sample_runs(p_logits, q, None, n, sp, seed=10)
    else:
        # Deterministic drafts (n-gram, argmax MTP): one likely token, one unlikely.
        out = _sample_runs(p_logits, None, [int(p[0].argmax()), int(p[1].argmin())], n, sp,
                           seed=11)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p[0]) > ALPHA
    # Given the first draft was accepted, the second token follows row 1's distribution.
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert second.numel() > 1000
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p[1]) > ALPHA
    third = torch.tensor([t[2] for t in out.token_ids if len(t) > 2])
    if draft_kind == "sampled":
        assert third.numel() > 500
        assert chi_square_pvalue(torch.bincount(third, minlength=V), p[2]) > ALPHA
    # Acceptance of draft 1 has probability sum_x min(p, q) (or p(d) for a one-hot draft).
    acc = (out.num_accepted >= 1).mean()
    expect = float(torch.minimum(p[0], q[0]).sum()) if draft_kind == "sampled" \
        else float(p[0].max())
    assert abs(acc - expect) < 4 * (expect * (1 - expect) / n) ** 0.5 + 1e-9


def test_seeded_requests_repeat_and_ignore_the_batch():
    V = 8
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(3, V, generator=gen)
    sp = SamplingParams(temperature=1.0, seed=123)

    def run(extra: int) -> list[int]:
        # The seeded request first, then `extra` unseeded requests with 2 drafts each.
        logits = torch.cat([base, torch.randn(3 * extra, V, generator=gen)])
        k = np.full(1 + extra, 2)
        drafts = [[1, 2]] * (1 + extra)
        params = [sp] + [SamplingParams(temperature=1.0)] * extra
        md = _md(params, list(k), drafts, V, seeds={0: 123})
        return RejectionSampler()(logits, md, k, np.array([1, 2] * (1 + extra))).token_ids[0]

    first = run(0)
    assert all(run(e) == first for e in (0, 3, 7))


def test_logprobs_rows_follow_the_emitted_tokens():
    V = 7
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(5))
    k = np.array([2, 1])
    argmax = logits.argmax(-1).tolist()
    drafts = [[argmax[0], (argmax[1] + 1) % V], [argmax[3]]]
    sp = SamplingParams(temperature=0.0, logprobs=2)
    md = _md([sp, sp], list(k), drafts, V)
    out = RejectionSampler()(logits, md, k, np.array([t for d in drafts for t in d]))
    assert out.token_ids == [[argmax[0], argmax[1]], [argmax[3], argmax[4]]]
    lp = logits.log_softmax(-1)
    rows = [0, 1, 3, 4]
    toks = [t for o in out.token_ids for t in o]
    assert out.logprobs is not None
    assert out.logprobs.token_ids[:, 0].tolist() == toks
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], lp[rows, toks])
    assert out.logprobs.ranks.tolist() == [1, 1, 1, 1]


def test_bad_shapes_are_named():
    md = _md([SamplingParams(temperature=0.0)], [1], [[0]], 4)
    with pytest.raises(ValueError, match="logits must be"):
        RejectionSampler()(torch.zeros(3, 4), md, np.array([1]), np.array([0]))
    with pytest.raises(ValueError, match="draft_token_ids"):
        RejectionSampler()(torch.zeros(2, 4), md, np.array([1]), np.array([0, 1]))
