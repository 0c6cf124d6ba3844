"""DeepSelect top-k (csrc/deepselect.cpp) against the stable descending sort and torch.topk:
the same indices in the same order as the sort (ties to the lowest entry), the same set as
torch.topk where scores are distinct and the same values where they tie; -inf, +-0.0,
denormals, rows of their own lengths, k = 0, k >= n; AVX512 and portable passes equal."""
from __future__ import annotations

import pytest
import torch

from wideserve.kernels import deepselect, loader
from wideserve.layers.attention.indexer import index_topk, stable_topk_indices


@pytest.fixture(scope="module", autouse=True)
def built():
    loader.build()       # a compiler error fails these tests instead of skipping them


def _ref(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The first k of a stable descending sort of each row's first lengths[r] entries, -1
    after them (one row at a time: the obvious way)."""
    n = scores.shape[-1]
    rows = scores.reshape(-1, n)
    lens = [n] * rows.shape[0] if lengths is None else lengths.reshape(-1).tolist()
    out = torch.full((rows.shape[0], k), -1, dtype=torch.int64)
    for r, m in enumerate(lens):
        got = stable_topk_indices(rows[r, :m], min(k, m))
        out[r, :got.numel()] = got
    return out.view(*scores.shape[:-1], k)


def _tie_heavy(shape, seed: int) -> torch.Tensor:
    """Few distinct values (ReLU zeros, -0.0, -inf, repeated halves) and some huge ones."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(-3, 4, shape, generator=g).float() * 0.5
    s = torch.where(torch.rand(shape, generator=g) < 0.3, 0.0, s)
    s = torch.where(torch.rand(shape, generator=g) < 0.2, -0.0, s)
    s = torch.where(torch.rand(shape, generator=g) < 0.1, float("-inf"), s)
    big = torch.randn(shape, generator=g) * 1e30
    return torch.where(torch.rand(shape, generator=g) < 0.1, big, s)


def _index_like(shape, seed: int) -> torch.Tensor:
    """What an indexer row looks like: sums of ReLU'd products (many exact zeros, a narrow
    positive range), -inf past the visible entries."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(*shape, 4, generator=g).relu() * torch.rand(4, generator=g)).sum(-1)
    cut = torch.randint(shape[-1] // 2, shape[-1] + 1, shape[:-1], generator=g)
    return s.masked_fill(torch.arange(shape[-1]) >= cut[..., None], float("-inf"))


CASES = [(1, 1), (7, 3), (40, 16), (300, 17), (3000, 512), (9000, 512), (20000, 2048)]


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("n,k", CASES)
def test_equals_the_stable_sort(n, k, portable):
    for seed in range(3):
        for s in (_tie_heavy((3, 2, n), seed), _index_like((5, n), seed),
                  torch.randn(4, n, generator=torch.Generator().manual_seed(seed))):
            ref = _ref(s, k)
            assert torch.equal(deepselect.select(s, k, portable=portable), ref)
            assert torch.equal(deepselect.keyed_topk(s, k), ref)


@pytest.mark.parametrize("n,k", [(3000, 512), (20000, 2048), (50, 7)])
def test_same_set_as_torch_topk(n, k):
    g = torch.Generator().manual_seed(n)
    distinct = torch.randn(6, n, generator=g)
    mine = deepselect.select(distinct, k)
    top = torch.topk(distinct, k, dim=-1)
    assert torch.equal(mine.sort(-1).values, top.indices.sort(-1).values)
    # Ties: which of equal scores is kept is the sort's choice (lowest entry); the values
    # kept are torch.topk's.
    tied = _tie_heavy((6, n), 1)
    mine = deepselect.select(tied, k)
    assert torch.equal(tied.gather(-1, mine), torch.topk(tied, k, dim=-1).values)


def test_special_values_keep_their_order():
    s = torch.tensor([[1e-45, -1e-45, 0.0, -0.0, 3.4e38, -3.4e38, float("inf"),
                       float("-inf"), 1e-45, -0.0, 0.0]])
    for k in range(s.shape[1] + 2):
        assert torch.equal(deepselect.select(s, k), _ref(s, k))
        assert torch.equal(deepselect.select(s, k, portable=True), _ref(s, k))


@pytest.mark.parametrize("portable", [False, True])
def test_rows_of_their_own_lengths_and_k_edges(portable):
    s = _index_like((6, 4000), 3)
    lengths = torch.tensor([0, 1, 511, 512, 513, 4000])
    for k in (0, 1, 512, 3999, 4000, 4100):
        got = deepselect.select(s, k, lengths, portable=portable)
        assert got.shape == (6, k)
        assert torch.equal(got, _ref(s, k, lengths))
        assert torch.equal(deepselect.keyed_topk(s, k, lengths), _ref(s, k, lengths))
    # All entries of a row tie (every bit): the lowest entries, in order.
    flat = torch.full((2, 5000), float("-inf"))
    assert torch.equal(deepselect.select(flat, 300, portable=portable),
                       torch.arange(300).expand(2, 300))
    assert torch.equal(deepselect.select(torch.zeros(0, 10), 3), torch.zeros(0, 3).long())


def test_bf16_scores_and_errors():
    s = _index_like((4, 3000), 5).bfloat16()
    assert torch.equal(deepselect.select(s, 100), _ref(s.float(), 100))
    with pytest.raises(RuntimeError, match="row 1 has length 11 outside 0..10"):
        deepselect.select(torch.zeros(2, 10), 3, torch.tensor([3, 11]))
    with pytest.raises(ValueError, match="k >= 0"):
        deepselect.topk(torch.zeros(2, 10), -1)


def test_the_indexer_topk_runs_it(monkeypatch):
    """index_topk's long-row path (layers/attention/indexer.py) is this op; its picks are the
    stable sort's."""
    calls = []
    real = deepselect.select
    monkeypatch.setattr(deepselect, "select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    s = _index_like((3, 2, 5000), 7)
    assert torch.equal(index_topk(s, 512), _ref(s, 512))
    assert calls


@pytest.mark.parametrize("portable", [False, True])
def test_a_sample_cut_off_above_the_kth_falls_back_to_the_whole_row(portable):
    """Rows long enough for the sampled cut-off (csrc/deepselect.cpp, choose_by_sample): here
    every sampled entry (stride n/1024) scores 2 and all others 1 or less, so fewer than k
    entries reach the cut-off and the histogram path over the whole row must give the picks."""
    n, k = 32768, 2048
    s = torch.rand(3, n)
    s[:, torch.arange(1024) * n // 1024] = 2.0
    s[1, 5] = 3.0                               # an unsampled best entry
    assert torch.equal(deepselect.select(s, k, portable=portable), _ref(s, k))
    # And where the cut-off holds (k small against n): survivors only.
    assert torch.equal(deepselect.select(s, 100, portable=portable), _ref(s, 100))
