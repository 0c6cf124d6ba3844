"""Sampler tests: each stage against a straightforward per-row reference, and the sampled
distribution against the softmax by a chi-square test."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from wideserve.worker.sampler import (Sampler, apply_min_p, apply_penalties, apply_top_k_top_p,
                                      build_sampling_metadata, compute_prompt_logprobs,
                                      inverse_cdf, make_generator, sample_categorical)
from wideserve.types.sampling_params import SamplingParams

CPU = torch.device("cpu")
_NEG = float("-inf")
# Each chi-square test fails a correct sampler with probability P_FALSE (for a random seed;
# the seeds below are fixed, so the outcome is deterministic).
P_FALSE = 1e-4


def meta(params, outputs=None, prompts=None, gens=None, vocab=8, eos=()):
    outputs = outputs if outputs is not None else [[] for _ in params]
    return build_sampling_metadata(params, outputs, prompts, gens or {}, CPU, vocab,
                                   eos_token_ids=eos)


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's statistic (scipy-free: regularised upper gamma)."""
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    expected = probs[keep] * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def ref_filtered_probs(logits: list[float], temperature: float, top_k: int, top_p: float,
                       min_p: float) -> np.ndarray:
    """Per-row reference in plain numpy float64, same order as the sampler:
    temperature -> min_p -> top_k -> top_p -> renormalise."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = p >= min_p * p.max()
    if top_k > 0:
        kth = np.sort(x[keep])[::-1][min(top_k, keep.sum()) - 1]
        keep &= x >= kth
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    order = np.argsort(-q, kind="stable")
    above = 0.0
    final = np.zeros_like(keep)
    for i in order:
        if q[i] == 0 or above >= top_p:
            break
        final[i] = True
        above += q[i]
    out = np.where(final, q, 0.0)
    return out / out.sum()


# ---- masks on hand-built logits --------------------------------------------------------------

PROBS = [0.05, 0.5, 0.15, 0.3]          # sorted: 1 (.5), 3 (.3), 2 (.15), 0 (.05)
LOGITS = torch.tensor([PROBS]).log()


@pytest.mark.parametrize("p, kept", [(0.3, {1}), (0.7, {1, 3}), (0.9, {1, 3, 2}),
                                     (0.97, {0, 1, 2, 3}), (1.0, {0, 1, 2, 3})])
def test_top_p_mask(p, kept):
    out = apply_top_k_top_p(LOGITS, None, 4, torch.tensor([p]))
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == kept
    # surviving logits are unchanged (the mask never rescales)
    assert torch.equal(out[torch.isfinite(out)], LOGITS[torch.isfinite(out)])


@pytest.mark.parametrize("k, kept", [(1, {1}), (2, {1, 3}), (3, {1, 2, 3}), (4, {0, 1, 2, 3})])
def test_top_k_mask_both_paths(k, kept):
    only_k = apply_top_k_top_p(LOGITS, torch.tensor([k]), k, None)
    with_p = apply_top_k_top_p(LOGITS, torch.tensor([k]), k, torch.tensor([1.0]))
    for out in (only_k, with_p):
        assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == kept


def test_top_k_only_path_with_rows_that_do_not_use_it():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(top_k=k) for k in (2, 0, 7, -1)]
    md = meta(params, vocab=30)
    assert md.top_p is None and md.max_top_k == 7
    out = apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)
    for row, k in enumerate((2, 30, 7, 30)):
        kept = torch.isfinite(out[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(k).indices.tolist())


def test_top_k_then_top_p_renormalises():
    # top_k=3 leaves {.5, .3, .15} -> renormalised {.526, .316, .158}; top_p=0.8 keeps 2
    # (mass above token 2 is .842 >= .8), while without the renormalisation it would keep 3.
    out = apply_top_k_top_p(LOGITS, torch.tensor([3]), 3, torch.tensor([0.8]))
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == {1, 3}


@pytest.mark.parametrize("m, kept", [(0.0, {0, 1, 2, 3}), (0.2, {1, 2, 3}), (0.5, {1, 3}),
                                     (0.9, {1})])
def test_min_p_mask(m, kept):
    out = apply_min_p(LOGITS, torch.tensor([m]))
    assert set(torch.isfinite(out[0]).nonzero().flatten().tolist()) == kept


def test_masks_per_row_against_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    ks = [0, 1, 5, 17, 0, 50]
    ps = [1.0, 0.5, 0.9, 0.3, 0.75, 0.99]
    ms = [0.0, 0.0, 0.05, 0.0, 0.1, 0.01]
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=m)
              for k, p, m in zip(ks, ps, ms)]
    md = meta(params, vocab=50)
    x = apply_min_p(logits / 0.8, md.min_p)
    x = apply_top_k_top_p(x, md.top_k, md.max_top_k, md.top_p)
    got = torch.softmax(x, -1).double().numpy()
    for i in range(6):
        ref = ref_filtered_probs(logits[i].tolist(), 0.8, ks[i], ps[i], ms[i])
        np.testing.assert_array_equal(got[i] > 0, ref > 0)
        np.testing.assert_allclose(got[i], ref, atol=1e-6)


# ---- greedy ----------------------------------------------------------------------------------

def test_greedy_equals_argmax_without_softmax_outputs():
    logits = torch.randn(9, 100, generator=torch.Generator().manual_seed(1))
    md = meta([SamplingParams(temperature=0.0)] * 9, vocab=100)
    assert md.all_greedy and md.temperature is None and md.max_num_logprobs is None
    out = Sampler()(logits, md)
    assert out.logprobs is None and out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_are_argmax():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(8)]
    md = meta(params, vocab=30)
    assert not md.all_greedy and not md.all_random and md.greedy_mask is not None
    out = Sampler()(logits, md).token_ids
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


def test_sampler_does_not_modify_logits():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=5, min_p=0.1,
                             repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=2)] * 3
    Sampler()(logits, meta(params, outputs=[[1, 2]] * 3, prompts=[[3]] * 3, vocab=20, eos=[0]))
    assert torch.equal(logits, before)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_temperature_rows_leave_the_logits_and_the_raw_logprobs_intact(dtype):
    # the draw may overwrite its own fp32 copy of the logits, never the caller's tensor, nor
    # the copy the raw logprobs are read from afterwards
    logits = (torch.randn(4, 40, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, logprobs=3)] * 4
    out = Sampler()(logits, meta(params, vocab=40))
    assert torch.equal(logits, before)
    want = logits.float().log_softmax(-1).gather(1, out.token_ids.unsqueeze(1))
    assert torch.equal(out.logprobs.logprobs[:, :1], want)
    # without logprobs the cast copy is overwritten, and the draw still follows the softmax
    n = 20000
    torch.manual_seed(6)
    rows = torch.tensor([DIST_LOGITS] * n).to(dtype)
    tokens = Sampler()(rows, meta([SamplingParams(temperature=0.8)] * n, vocab=10))
    ref = ref_filtered_probs(rows[0].float().tolist(), 0.8, 0, 1.0, 0.0)
    assert chi_square_pvalue(np.bincount(tokens.token_ids.numpy(), minlength=10), ref) > P_FALSE


# ---- penalties ---------------------------------------------------------------------------------

def ref_penalties(row: list[float], prompt: list[int], output: list[int], pres: float,
                  freq: float, rep: float) -> list[float]:
    out = list(row)
    seen = set(prompt) | set(output)
    for t in range(len(out)):
        if t in seen and rep != 1.0:
            out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
        c = output.count(t)
        out[t] -= freq * c + (pres if c > 0 else 0.0)
    return out


def test_penalties_match_per_row_reference():
    rng = np.random.default_rng(4)
    vocab, rows = 40, 6
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)).astype(np.float32))
    settings = [(0.0, 0.0, 1.0), (0.5, 0.0, 1.0), (0.0, 1.2, 1.0), (0.0, 0.0, 1.5),
                (-0.7, 0.3, 0.8), (1.0, -1.0, 2.0)]
    params = [SamplingParams(presence_penalty=a, frequency_penalty=b, repetition_penalty=c)
              for a, b, c in settings]
    prompts = [rng.integers(0, vocab, size=rng.integers(1, 20)).tolist() for _ in range(rows)]
    outputs = [rng.integers(0, vocab, size=rng.integers(0, 30)).tolist() for _ in range(rows)]
    outputs[3] = []                    # repetition over the prompt alone
    md = meta(params, outputs, prompts, vocab=vocab)
    assert md.penalties is not None and md.penalties.rows.tolist() == [1, 2, 3, 4, 5]
    got = apply_penalties(logits, md.penalties)
    for i, (a, b, c) in enumerate(settings):
        ref = ref_penalties(logits[i].tolist(), prompts[i], outputs[i], a, b, c)
        np.testing.assert_allclose(got[i].numpy(), np.array(ref, dtype=np.float32), rtol=1e-6)


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    md = meta([SamplingParams(temperature=0.0, repetition_penalty=1.2)], outputs=[[0]],
              prompts=[[2]], vocab=3)
    assert Sampler()(logits, md).token_ids.tolist() == [1]


def test_out_of_vocab_ids_are_rejected():
    with pytest.raises(ValueError, match="output_token_ids_list"):
        meta([SamplingParams(frequency_penalty=1.0)], outputs=[[9]], vocab=8)
    with pytest.raises(ValueError, match="prompt_token_ids_list"):
        meta([SamplingParams(repetition_penalty=1.1)], outputs=[[1]], prompts=[[8]], vocab=8)


# ---- min_tokens ----------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]] * 3)   # eos=1 best, stop id 2 next
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])] * 2 + [
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)]
    outputs = [[0, 0], [0, 0, 0], [0]]
    got = Sampler()(logits, meta(params, outputs, vocab=4, eos=[1])).token_ids.tolist()
    # row 0 below min_tokens -> eos and stop id masked -> 3; row 1 reached it -> eos;
    # row 2 ignores eos, so eos is not a stop id and stays allowed.
    assert got == [3, 1, 1]


# ---- seeded sampling ---------------------------------------------------------------------------

def run_steps(batch_builder, steps: int) -> list[int]:
    """Sample `steps` times; batch_builder(step) -> (logits, params, gens, target_row)."""
    out = []
    for s in range(steps):
        logits, params, gens, row, outputs = batch_builder(s)
        md = meta(params, outputs, [[0]] * len(params), gens, vocab=logits.size(1))
        out.append(int(Sampler()(logits, md).token_ids[row]))
    return out


def target_logits(step: int, vocab: int = 64) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step))


TARGET = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)


def test_seeded_sampling_reproducible_and_batch_independent():
    vocab = 64

    def alone(gen):
        return lambda s: (target_logits(s).unsqueeze(0), [TARGET], {0: gen}, 0, [[]])

    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=3),
              SamplingParams(temperature=1.0, seed=7, min_p=0.2),
              SamplingParams(temperature=0.5, frequency_penalty=1.0, presence_penalty=0.5),
              SamplingParams(temperature=1.0)]

    def crowded(gen, other_gen):
        def build(s):
            rows = torch.randn(6, vocab, generator=torch.Generator().manual_seed(s))
            rows[3] = target_logits(s)          # the target sits at row 3 this time
            params = others[:3] + [TARGET] + others[3:]
            outputs = [[1, 2, 3]] * 6
            return rows, params, {2: other_gen, 3: gen}, 3, outputs
        return build

    torch.manual_seed(0)
    a = run_steps(alone(make_generator(1234, CPU)), 40)
    torch.manual_seed(99)                       # a different global RNG state
    b = run_steps(alone(make_generator(1234, CPU)), 40)
    c = run_steps(crowded(make_generator(1234, CPU), make_generator(7, CPU)), 40)
    d = run_steps(alone(make_generator(4321, CPU)), 40)
    assert a == b == c
    assert a != d                                # the seed matters
    assert len(set(a)) > 5                       # and it is really sampling


def test_seed_without_generator_is_an_error():
    with pytest.raises(ValueError, match="generators: row 0"):
        meta([SamplingParams(seed=3)])


# ---- distribution (chi-square) -----------------------------------------------------------------

DIST_LOGITS = [1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.8, -3.0, 1.2]
DIST_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=6, top_p=0.9),
    dict(temperature=1.3, min_p=0.1),
]


@pytest.mark.parametrize("kw", DIST_CASES)
def test_sampled_frequencies_match_softmax(kw):
    n = 20000
    torch.manual_seed(5)
    params = [SamplingParams(**kw)] * n
    logits = torch.tensor([DIST_LOGITS] * n)
    tokens = Sampler()(logits, meta(params, vocab=10)).token_ids.numpy()
    counts = np.bincount(tokens, minlength=10)
    ref = ref_filtered_probs(DIST_LOGITS, kw["temperature"], kw.get("top_k", 0),
                             kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    assert chi_square_pvalue(counts, ref) > P_FALSE
    # the test has power: the same counts are rejected against a nearby wrong distribution
    wrong = ref_filtered_probs(DIST_LOGITS, kw["temperature"] * 1.15, kw.get("top_k", 0),
                               kw.get("top_p", 1.0), kw.get("min_p", 0.0))
    assert chi_square_pvalue(counts, wrong) < 1e-6


def test_seeded_rows_sample_the_right_distribution():
    n = 3000
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(n)]
    gens = {i: make_generator(10_000 + i, CPU) for i in range(n)}
    logits = torch.tensor([DIST_LOGITS] * n)
    tokens = Sampler()(logits, meta(params, gens=gens, vocab=10)).token_ids.numpy()
    ref = ref_filtered_probs(DIST_LOGITS, 0.8, 0, 1.0, 0.0)
    assert chi_square_pvalue(np.bincount(tokens, minlength=10), ref) > P_FALSE


# ---- the inverse-CDF draw across blocks --------------------------------------------------------

EDGES = torch.zeros(30)       # 30 tokens in blocks of 8 (a 6-token tail): mass at the edges
EDGES[[1, 7, 8, 15, 16, 23, 24, 29]] = torch.tensor([1.0, 2.0, 3.0, 0.5, 4.0, 1.5, 2.5, 3.0])
EDGES[[3, 12, 20, 27]] = 0.25


def test_draw_across_blocks_samples_the_distribution_and_never_a_zero_mass_token():
    n = 40000
    torch.manual_seed(11)
    counts = np.bincount(sample_categorical(EDGES.repeat(n, 1), {}, block=8).numpy(),
                         minlength=30)
    ref = (EDGES / EDGES.sum()).double().numpy()
    assert chi_square_pvalue(counts, ref) > P_FALSE       # (and no zero-mass token drawn)
    # power: a quarter of token 7's mass moved across the block edge to token 8 is rejected
    wrong = ref.copy()
    wrong[7], wrong[8] = ref[7] * 0.75, ref[8] + ref[7] * 0.25
    assert chi_square_pvalue(counts, wrong) < 1e-6


def test_draw_equals_a_full_float64_inverse_cdf_under_the_same_uniforms():
    g = torch.Generator().manual_seed(21)
    probs = torch.randn(64, 5000, generator=g).mul_(3).softmax(-1)
    probs[:, ::7] = 0.0                                # zero-mass tokens, as top-k leaves
    probs[5] = 0.0
    probs[5, 4999] = 1.0                               # all mass on the tail's last token
    u = torch.rand(64, dtype=torch.float64, generator=g)
    cdf = probs.double().cumsum(1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    for block in (1024, 64, 5000, 7):
        assert torch.equal(inverse_cdf(probs, u, block), ref)


def test_a_draw_at_the_top_of_the_range_takes_the_last_token_with_mass():
    top = torch.tensor([1.0 - 2.0 ** -53], dtype=torch.float64)
    # 1 + 6e-8 + 6e-8 in float32: the block's mass and its float64 prefix differ by rounding
    for row, want in (([1.0, 6e-8, 6e-8, 0.0, 0.0], 2), ([0.5, 0.5, 0.0, 0.0, 0.0], 1),
                      ([0.0, 0.0, 0.0, 0.0, 2.0], 4)):
        for block in (4, 5, 1024):
            assert int(inverse_cdf(torch.tensor([row]), top, block)) == want


def test_a_seeded_row_draws_one_uniform_from_its_own_generator():
    probs = EDGES.repeat(3, 1)
    gens = {0: make_generator(5, CPU), 2: make_generator(6, CPU)}
    got = sample_categorical(probs, gens, block=8)
    for row, seed in ((0, 5), (2, 6)):
        u = torch.rand(1, dtype=torch.float64, generator=make_generator(seed, CPU))
        assert int(got[row]) == int(inverse_cdf(probs[row:row + 1], u, 8))
    # its generator advanced by exactly that one draw
    nxt = make_generator(5, CPU)
    torch.rand(1, dtype=torch.float64, generator=nxt)
    assert torch.equal(gens[0].get_state(), nxt.get_state())


# ---- top-p without a sort of the vocabulary ------------------------------------------------

def _sorted_top_k_top_p(logits, top_k, _max_top_k, top_p):
    from wideserve.worker.sampler import top_k_top_p_by_sort
    return top_k_top_p_by_sort(logits, top_k, top_p)


def _rows(vocab: int, scales: list[float], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(vocab, generator=g) * s for s in scales])


def test_top_p_from_candidates_equals_the_sorted_path():
    import wideserve.worker.sampler as sampler
    vocab = 10_000                       # one try at 1,024 candidates (vocab // 8 >= 1,024)
    peaky = _rows(vocab, [6.0, 8.0, 5.0, 7.0], 31)
    p = torch.tensor([0.95, 0.5, 0.9, 1.0])                     # the last row: no top-p
    assert sampler._nucleus_from_candidates(peaky, None, vocab, p) is not None
    assert torch.equal(apply_top_k_top_p(peaky, None, vocab, p),
                       _sorted_top_k_top_p(peaky, None, vocab, p))
    # with top-k on some rows (off on others: k = vocab), inside the candidates
    k = torch.tensor([50, vocab, 7, 300])
    assert sampler._nucleus_from_candidates(peaky, k, 300, p) is not None
    assert torch.equal(apply_top_k_top_p(peaky, k, 300, p),
                       _sorted_top_k_top_p(peaky, k, 300, p))
    # a flat row's nucleus reaches past the candidates: the sort decides, same answer
    flat = torch.cat([peaky, _rows(vocab, [0.5], 32)])
    p5 = torch.tensor([0.95, 0.5, 0.9, 1.0, 0.95])
    assert sampler._nucleus_from_candidates(flat, None, vocab, p5) is None
    assert torch.equal(apply_top_k_top_p(flat, None, vocab, p5),
                       _sorted_top_k_top_p(flat, None, vocab, p5))


def test_top_p_candidates_refuse_a_top_k_tie_past_them():
    import wideserve.worker.sampler as sampler
    vocab = 10_000
    x = _rows(vocab, [6.0], 33)
    x[0, :2000] = 50.0                   # 2,000 tokens tied at the top: k = 3 keeps them all
    k, p = torch.tensor([3]), torch.tensor([0.9])
    assert sampler._nucleus_from_candidates(x, k, 3, p) is None
    got = apply_top_k_top_p(x, k, 3, p)
    assert torch.equal(got, _sorted_top_k_top_p(x, k, 3, p))
    assert int((got > _NEG).sum()) == 1800          # 0.9 of 2,000 equal tokens


# ---- logprobs --------------------------------------------------------------------------------

def test_logprobs_are_raw_with_ranks():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 25, generator=gen)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=2.0, logprobs=0, repetition_penalty=1.5),
              SamplingParams(temperature=0.5, top_k=4, logprobs=5),
              SamplingParams(temperature=1.0)]
    out = Sampler()(logits, meta(params, [[1, 2]] * 4, [[3]] * 4, vocab=25))
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (4, 6) and lp.logprobs.shape == (4, 6)
    ids, lps, ranks = lp.tolists()
    for i in range(4):
        row = torch.log_softmax(logits[i].double(), -1)
        tok = int(out.token_ids[i])
        assert ids[i][0] == tok
        assert math.isclose(lps[i][0], float(row[tok]), abs_tol=1e-5)
        assert ranks[i] == 1 + int((row > row[tok]).sum())
        top = torch.argsort(row, descending=True)[:5].tolist()
        assert ids[i][1:] == top
        np.testing.assert_allclose(lps[i][1:], row[top].numpy(), atol=1e-5)
    assert ranks[0] == 1                         # greedy picks the top token


def test_prompt_logprobs_helper():
    logits = torch.randn(5, 12, generator=torch.Generator().manual_seed(8))
    targets = torch.tensor([3, 0, 11, 5, 5])
    out = compute_prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits, -1)
    assert out.token_ids[:, 0].tolist() == targets.tolist()
    assert torch.allclose(out.logprobs[:, 0], ref[torch.arange(5), targets])
    assert out.ranks.tolist() == [1 + int((ref[i] > ref[i, t]).sum()) for i, t in
                                  enumerate(targets.tolist())]
    assert torch.equal(out.token_ids[:, 1:], ref.topk(2, -1).indices)
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(logits, targets[:3], 2)


def test_logits_shape_is_checked():
    md = meta([SamplingParams()] * 2, vocab=8)
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(3, 8), md)


@pytest.mark.parametrize("kw,plain", [
    ({}, True), ({"logprobs": 0}, False), ({"logit_bias": {1: 2.0}}, False),
    ({"presence_penalty": 0.5}, False), ({"repetition_penalty": 1.2}, False),
    ({"min_tokens": 3}, False), ({"min_tokens": 2}, True)])
def test_plain_greedy_is_what_the_sampler_does_without_metadata(kw, plain):
    """plain_greedy (the engine's fast path: argmax without SamplingMetadata) holds exactly
    when the metadata would apply nothing; then the sampler's tokens are the argmax."""
    from wideserve.worker.sampler import argmax_rows, plain_greedy
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, **kw)]
    outputs = [[1, 2], [3, 4]]
    assert plain_greedy(params, [len(o) for o in outputs]) is plain
    assert not plain_greedy([SamplingParams(temperature=0.0),
                             SamplingParams(temperature=0.7)], [0, 0])
    md = meta(params, outputs, prompts=[[1], [2]], vocab=16, eos=(5,))
    bare = (md.all_greedy and md.penalties is None and md.bias is None
            and md.stop_mask_rows is None and md.max_num_logprobs is None)
    assert bare is plain
    logits = torch.randn(2, 16, dtype=torch.bfloat16)
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1        # a tie: the first index wins
    if plain:
        assert Sampler()(logits, md).token_ids.tolist() == argmax_rows(logits.float()).tolist()
        assert argmax_rows(logits.float()).tolist()[0] == 3
