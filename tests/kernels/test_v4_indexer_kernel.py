"""The fused lightning-indexer C++ op (wideserve/kernels/csrc/v4_indexer.cpp) against a torch
reference that gathers the keys, scores them and takes a stable descending sort: random
shapes (head counts and widths that do and do not fill the AVX512 lanes, table blocks of 1 to
64 entries), tokens with no visible entry, fewer visible than k, single tokens and an empty
batch, many tied scores, bf16 and fp32, through the AVX512 and the portable paths.

Values are small integers (and weights quarter-integers), so every product and partial sum is
exact in fp32 whatever the summation order: the picks must equal the reference's exactly, ties
included (lowest entry first). Real-valued data is checked for a valid top-k up to rounding."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from wideserve.kernels import loader
from wideserve.kernels.v4_indexer import indexer_topk
from wideserve.layers.attention.indexer import stable_topk_indices


@pytest.fixture(scope="module", autouse=True)
def built() -> Path:
    return loader.build()        # a compiler error fails every test here, never a skip


def reference(q, weights, cache, table, rows, visible, epb, k):
    """Gather, score in fp32 (exact for these values), stable sort; -1 past the visible."""
    picks = torch.full((q.shape[0], k), -1, dtype=torch.int64)
    for t in range(q.shape[0]):
        n = int(visible[t])
        if n == 0:
            continue
        e = torch.arange(n)
        keys = cache[table[rows[t], e // epb] * epb + e % epb].double()
        scores = (torch.relu(q[t].double() @ keys.T) * weights[t, :, None].double()).sum(0)
        top = stable_topk_indices(scores, min(k, n))
        picks[t, :len(top)] = top
    return picks, None


def case(seed, T, H, D, epb, k, q_dtype, cache_dtype, ints=True):
    """Random inputs: 2 table rows of 12 blocks over a cache with spare blocks; a quarter of
    the keys and one q head zero (ties); visible counts from 0 to the row's capacity."""
    g = torch.Generator().manual_seed(seed)
    blocks = 12
    draw = ((lambda *s: torch.randint(-2, 3, s, generator=g).float()) if ints
            else (lambda *s: torch.randn(*s, generator=g)))
    q = draw(T, H, D)
    if H > 1:
        q[:, 0] = 0
    cache = draw((2 * blocks + 3) * epb, D)
    cache[torch.rand(cache.shape[0], generator=g) < 0.25] = 0
    weights = (torch.randint(-8, 9, (T, H), generator=g) / 4 if ints
               else torch.randn(T, H, generator=g))
    table = torch.randperm(2 * blocks + 3, generator=g)[:2 * blocks].view(2, blocks)
    rows = torch.randint(0, 2, (T,), generator=g)
    visible = torch.randint(0, blocks * epb + 1, (T,), generator=g)
    if T:
        visible[0] = 0                                   # no compressed entry yet
    if T > 1:
        visible[1] = min(int(visible[1]), k - 1) if k > 1 else 0   # fewer than k
    return (q.to(q_dtype), weights, cache.to(cache_dtype), table.contiguous(), rows, visible,
            epb, k)


SHAPES = [  # T, H, D, epb, k
    (5, 8, 64, 64, 16),      # the benchmark's indexer shape (2 heads per 16-lane group)
    (3, 64, 128, 64, 40),    # V4-Flash's (16 heads per vector, 4 vectors)
    (1, 1, 32, 4, 7),        # single token, one head (16 lanes of one head)
    (4, 3, 24, 7, 5),        # heads padded to 4, a width that forces narrower lane groups
    (6, 20, 16, 1, 3),       # 20 heads (two vectors, the second part-padded), 1-entry blocks
    (2, 5, 30, 5, 64),       # bf16 width not a multiple of 4: 1 lane per head
    (2, 2, 15, 3, 4),        # odd width: bf16 falls back to the portable loops
    (0, 8, 64, 64, 4),       # empty batch
]
DTYPES = [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
          (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=["bf16", "fp32", "fp32-q-bf16-cache"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_picks_equal_the_reference(shape, dtypes, portable):
    args = case(sum(shape), *shape, *dtypes)
    got = indexer_topk(*args, portable=portable)
    want, _ = reference(*args)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtypes", DTYPES[:2], ids=["bf16", "fp32"])
def test_real_valued_scores_pick_a_top_k(dtypes):
    """Normal data: summation order may reorder near-equal scores, so the check is that the
    picks are distinct visible entries whose reference scores are the k best, in order, up to
    rounding."""
    q, weights, cache, table, rows, visible, epb, k = case(7, 6, 8, 64, 64, 50, *dtypes,
                                                           ints=False)
    got = indexer_topk(q, weights, cache, table, rows, visible, epb, k)
    for t in range(q.shape[0]):
        n = int(visible[t])
        e = torch.arange(n)
        keys = cache[table[rows[t], e // epb] * epb + e % epb].double()
        scores = (torch.relu(q[t].double() @ keys.T) * weights[t, :, None].double()).sum(0)
        m = min(k, n)
        picked = got[t, :m]
        assert (got[t, m:] == -1).all() and len(set(picked.tolist())) == m
        assert ((picked >= 0) & (picked < n)).all()
        best = torch.sort(scores, descending=True).values[:m]
        tol = 1e-2 if dtypes[0] == torch.bfloat16 else 1e-4
        assert torch.allclose(scores[picked], best, rtol=tol, atol=tol)


def test_bad_inputs_are_errors_not_wild_reads():
    q, weights, cache, table, rows, visible, epb, k = case(3, 2, 4, 32, 4, 4, torch.float32,
                                                           torch.float32)
    bad = table.clone()
    bad[rows[1]] = 10 ** 6
    visible[1] = 3
    with pytest.raises(RuntimeError, match="outside the cache"):
        indexer_topk(q, weights, cache, bad, rows, visible, epb, k)
    with pytest.raises(RuntimeError, match="table row holds"):
        indexer_topk(q, weights, cache, table, rows, visible + 10 ** 4, epb, k)
    with pytest.raises(RuntimeError, match="bf16 q needs a bf16 cache"):
        indexer_topk(q.bfloat16(), weights, cache, table, rows, visible, epb, k)
