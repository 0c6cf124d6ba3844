"""Chunked and mixed prefills through SDPA over the gathered context
(layers/attention/paged_prefill.py, kernels/sdpa_context.py) against the per-request
reference op: chunks of 1 and odd sizes, chunks crossing block boundaries, GQA ratios,
empty contexts (fresh prefills beside decodes), a persistent block table (req_rows), and the
split between SDPA requests and the C++ op's call for the rest."""
from __future__ import annotations

import math

import pytest
import torch

from paged_harness import PagedHarness
from wideserve.kernels import sdpa_context
from wideserve.kernels.choice import BUCKETS
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.layers.attention import paged_attention_batched as pab
from wideserve.layers.attention import paged_prefill
from wideserve.layers.attention.paged_attention import paged_attention
from wideserve.layers.attention.paged_attention_batched import (PagedAttentionConfig,
                                                                PagedAttentionPlans,
                                                                paged_attention_batched)

NAME = "attn"
NEEDS_FLASH = pytest.mark.skipif(not sdpa_context.flash_compiled(),
                                 reason="the flash kernel needs AVX512-BF16 and bf16 brgemm")


class _Specs:
    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec

    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {NAME: self.spec}


class _Pick:
    """A kernel choice picking `kernel` (SDPA or flash) from `start` query tokens, per family
    (fake timings)."""

    def __init__(self, fresh: int, context: int, kernel: str = "sdpa") -> None:
        self.fresh, self.context, self.kernel = fresh, context, kernel

    def plan_attention(self, heads, kv_heads, head_dim, dtype, context=False):
        start = self.context if context else self.fresh
        return tuple(self.kernel if lo >= start else "own" for lo, _ in BUCKETS)


def _harness(kv_heads: int, head_dim: int, reqs: int) -> PagedHarness:
    spec = KVCacheSpec(CacheKind.FULL, "kv", 2 * kv_heads * head_dim, torch.bfloat16)
    h = PagedHarness(_Specs(spec), max_reqs=reqs, max_len=48, block_size=4)
    h.kv_caches[NAME].fill_(float("nan"))       # an unwritten slot read shows up as NaN
    return h


def _persistent_table(b):
    """The batch's block table as a runner's persistent one: rows reversed behind a row of
    another request, reached through req_rows."""
    view = b.kv_groups[0]
    n = view.block_table.shape[0]
    view.block_table = torch.cat((torch.zeros_like(view.block_table[:1]),
                                  view.block_table.flip(0)))
    view.req_rows_cpu = (n - torch.arange(n)).numpy()
    view.req_rows = torch.from_numpy(view.req_rows_cpu)
    return b


def _run(schedule, heads, kv_heads, hd, pick, persistent=False, seed=0):
    """Step the reference (fp32) and the batched op (bf16, C++ op on, `pick` as the choice)
    through `schedule` (per request: new tokens per step, 0 idle); returns the splits."""
    from wideserve.kernels import loader
    loader.build()
    ref_h, bat_h = _harness(kv_heads, hd, len(schedule)), _harness(kv_heads, hd, len(schedule))
    g = torch.Generator().manual_seed(seed)
    splits = []
    for step in range(max(len(s) for s in schedule)):
        slots = [r for r, s in enumerate(schedule) if step < len(s) and s[step]]
        new = [[0] * schedule[r][step] for r in slots]
        t = sum(map(len, new))
        q, k, v = (torch.randn(t, h, hd, generator=g).bfloat16()
                   for h in (heads, kv_heads, kv_heads))

        def batched(b):
            b = _persistent_table(b) if persistent else b
            plans = PagedAttentionPlans(b)
            splits.append(plans.context_split(NAME, heads, kv_heads, hd, torch.bfloat16, None))
            return paged_attention_batched(q, k, v, b, NAME, hd ** -0.5, None, plans)
        want = ref_h.run(slots, new, lambda b: paged_attention(
            q.float(), k.float(), v.float(), b, NAME, hd ** -0.5, None))
        got = bat_h.run(slots, new, batched)
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(bat_h.kv_caches[NAME].float(),
                                   ref_h.kv_caches[NAME].float(), rtol=0, atol=0,
                                   equal_nan=True)
    return splits


SCHEDULES = {
    # chunks of odd sizes crossing the 4-entry blocks, a chunk of 1 (the op)
    "chunked": [[5, 3, 7, 1], [6, 1, 9, 2]],
    # prefills (fresh: empty context) and chunks beside decodes
    "mixed": [[9, 1, 1, 1], [0, 7, 5, 1], [3, 2, 1, 11], [1, 1, 6, 1]],
}


@pytest.mark.parametrize("kernel", ["sdpa", pytest.param("flash", marks=NEEDS_FLASH)])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_chunked_and_mixed_prefills_match_the_reference(schedule, heads, kv_heads, kernel,
                                                        monkeypatch) -> None:
    monkeypatch.setattr(pab, "default_choice", lambda: _Pick(2, 2, kernel))
    # the flash kernel takes head dims of a multiple of 32
    splits = _run(SCHEDULES[schedule], heads, kv_heads, 32 if kernel == "flash" else 16, None)
    # the requests of >1 new tokens per step (step 0 of "chunked" is all whole prefills:
    # sdpa_prefill runs it, the split is computed but not used)
    sdpa_queries = [sorted(n for _, _, n, _, _ in s.whole) for s in splits if s is not None]
    if schedule == "chunked":
        assert sdpa_queries == [[5, 6], [3], [7, 9], [2]]
    else:
        assert sdpa_queries == [[3, 9], [2, 7], [5, 6], [11]]


def test_split_follows_the_choice_per_request(monkeypatch) -> None:
    """Fresh prefills from 8 tokens, chunks after a context from 5: the others (decodes,
    short chunks) go to one C++ op call over just their rows, through a persistent table."""
    monkeypatch.setattr(pab, "default_choice", lambda: _Pick(8, 5))
    splits = _run([[6, 5, 1], [3, 4, 6], [1, 9, 1], [0, 7, 1]], 4, 2, 16, None,
                  persistent=True)
    s = splits[1]                                   # 5 (ctx 6), 4 (ctx 3), 9 (ctx 1), 7 fresh
    assert [(row, n, length, k) for row, _, n, length, k in s.whole] == \
        [(4, 5, 11, "sdpa"), (2, 9, 10, "sdpa")]
    assert s.rest_rows.tolist() == list(range(5, 9)) + list(range(18, 25))
    assert s.rest_qsl.tolist() == [0, 4, 11] and s.rest_lens.tolist() == [7, 7]
    assert s.rest_req_rows.tolist() == [3, 1]
    assert splits[0] is None                         # fresh prefills below 8 tokens
    assert splits[2].whole == [(3, 1, 6, 13, "sdpa")]   # 6 after 7 cached; three decodes
    assert splits[2].rest_req_rows.tolist() == [4, 2, 1]


def test_no_split_without_the_choice_window_or_config(monkeypatch) -> None:
    h = _harness(2, 16, 2)
    h.run([0, 1], [[0] * 6, [0] * 5], lambda b: torch.zeros(11, 4, 16))
    seen = []

    def probe(b, choice, config=None):
        monkeypatch.setattr(pab, "default_choice", lambda: choice)
        p = PagedAttentionPlans(b, config=config)
        seen.append((p.context_split(NAME, 4, 2, 16, torch.bfloat16, None) is not None,
                     p.context_split(NAME, 4, 2, 16, torch.bfloat16, 3)))
        return torch.zeros(int(b.query_start_loc_cpu[-1]), 4, 16)
    new = [[0] * 5, [0]]
    h.run([0, 1], new, lambda b: probe(b, _Pick(2, 2)))
    h.reset(0), h.reset(1)
    h.run([0, 1], [[0] * 6, [0] * 5], lambda b: torch.zeros(11, 4, 16))
    h.run([0, 1], new, lambda b: probe(b, _Pick(2, 6)))              # 5 < 6: the op
    h.reset(0), h.reset(1)
    h.run([0, 1], [[0] * 6, [0] * 5], lambda b: torch.zeros(11, 4, 16))
    h.run([0, 1], new, lambda b: probe(b, _Pick(2, 2), PagedAttentionConfig(sdpa_context=False)))
    assert seen == [(True, None), (False, None), (False, None)]


def _naive(q, k, v, scale):
    """fp32 softmax attention, query i at position S - Lq + i."""
    lq, heads, _ = q.shape
    kv_heads, s, _ = k.shape
    g = heads // kv_heads
    kk, vv = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.float(), kk) * scale
    pos = torch.arange(lq)[:, None] + s - lq
    scores = scores.masked_fill(torch.arange(s)[None, :] > pos, -math.inf)
    return torch.einsum("hqk,hkd->qhd", scores.softmax(-1), vv)


@pytest.mark.parametrize("lq,context,heads,kv_heads", [
    (1, 0, 4, 2), (1, 7, 4, 4), (3, 0, 8, 2), (5, 1, 6, 3), (17, 13, 8, 1), (2, 33, 2, 2)])
def test_sdpa_context_attend_matches_naive(lq, context, heads, kv_heads) -> None:
    g = torch.Generator().manual_seed(lq * 100 + context)
    q = torch.randn(lq, heads, 16, generator=g).bfloat16()
    k, v = (torch.randn(kv_heads, lq + context, 16, generator=g).bfloat16() for _ in range(2))
    got = sdpa_context.attend(q, k, v, 0.25)
    torch.testing.assert_close(got.float(), _naive(q, k, v, 0.25), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="keys"):
        sdpa_context.attend(q, k[:, :lq - 1], v[:, :lq - 1], 0.25)


def test_gather_context_reads_through_the_block_table() -> None:
    cache = torch.arange(5 * 4 * 8, dtype=torch.float32).view(5, 4, 8)   # [blocks, 4, 2*2*2]
    blocks = torch.tensor([3, 0, 4])
    k, v = sdpa_context.gather_context(cache, blocks, 6, 2, torch.float32)
    rows = torch.cat((cache[3], cache[0, :2]))                           # positions 0..5
    assert torch.equal(k, rows[:, :4].view(6, 2, 2).transpose(0, 1))
    assert torch.equal(v, rows[:, 4:].view(6, 2, 2).transpose(0, 1))
