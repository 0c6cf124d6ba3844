"""Batched paged attention (the torch buckets) against the per-request reference op (fp32,
random q/k/v).

Caches start as NaN and the harness poisons entries that left a sliding window, so reading an
unwritten, stale or out-of-window slot shows up as NaN; reading another request's (written)
entries shows up as a mismatch with the reference.
"""
from __future__ import annotations

import pytest
import torch

from paged_harness import PagedHarness
from wideserve.kv_cache.spec import CacheKind, KVCacheSpec
from wideserve.layers.attention import paged_attention_batched as pab
from wideserve.layers.attention.paged_attention import paged_attention
from wideserve.layers.attention.paged_attention_batched import (PagedAttentionConfig,
                                                                PagedAttentionPlans,
                                                                paged_attention_batched)

TOL = 1e-5
NAME = "attn"
# Per request: new tokens per step (0 = idle that step, -1 = in the batch with no new token).
SCHEDULES = {
    "prefill": [[11], [7], [3]],
    "chunked": [[4, 4, 3], [3, 0, 4], [5, 5, 5]],
    "decode": [[6, 1, 1, 1, 1], [3, 1, 1, 1, 1], [1, 1, 1, 1, 1]],
    "mixed": [[9, 1, 1, 1], [0, 7, 1, 1], [2, 1, 6, 1], [1, 1, -1, 13]],
    "long-chunks": [[13, 1, 9, 1], [2, 11, 1, 1]],
}


# This file tests the torch buckets; the CPU's C++ op has tests/kernels/ of its own.
BUCKETS = PagedAttentionConfig(cpu_kernel=False)


def _buckets(q, k, v, b, name, scale, window=None):
    """paged_attention_batched on the torch buckets (the C++ op off for this call)."""
    return paged_attention_batched(q, k, v, b, name, scale, window,
                                   PagedAttentionPlans(b, config=BUCKETS))


class _Specs:
    def __init__(self, spec: KVCacheSpec) -> None:
        self.spec = spec

    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        return {NAME: self.spec}


def make_harness(kv_heads: int, head_dim: int, window: int | None,
                 dtype: torch.dtype = torch.float32, max_reqs: int = 4) -> PagedHarness:
    width = 2 * kv_heads * head_dim
    spec = (KVCacheSpec(CacheKind.FULL, "kv", width, dtype) if window is None else
            KVCacheSpec(CacheKind.SLIDING_WINDOW, "kv", width, dtype, window=window))
    h = PagedHarness(_Specs(spec), max_reqs=max_reqs, max_len=40, block_size=4)
    h.kv_caches[NAME].fill_(float("nan"))
    return h


def step_tokens(schedule: list[list[int]], step: int) -> tuple[list[int], list[list[int]]]:
    slots, new = [], []
    for r, chunks in enumerate(schedule):
        n = chunks[step] if step < len(chunks) else 0
        if n:
            slots.append(r)
            new.append([0] * max(n, 0))
    return slots, new


def run_both(schedule, heads: int, kv_heads: int, head_dim: int, window: int | None,
             budget: int | None = None, cache_dtype: torch.dtype = torch.float32,
             seed: int = 0) -> list[PagedAttentionPlans]:
    """Step both ops through `schedule` on identical inputs; assert outputs and caches agree.
    Returns the batched op's plans of every step."""
    ref_h = make_harness(kv_heads, head_dim, window, cache_dtype, len(schedule))
    bat_h = make_harness(kv_heads, head_dim, window, cache_dtype, len(schedule))
    g = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    all_plans = []
    for step in range(max(len(c) for c in schedule)):
        slots, new = step_tokens(schedule, step)
        t = sum(len(x) for x in new)
        q = torch.randn(t, heads, head_dim, generator=g)
        k = torch.randn(t, kv_heads, head_dim, generator=g)
        v = torch.randn(t, kv_heads, head_dim, generator=g)
        want = ref_h.run(slots, new, lambda b: paged_attention(q, k, v, b, NAME, scale, window))

        def batched(b):
            plans = PagedAttentionPlans(b, budget, BUCKETS)
            all_plans.append(plans)
            return paged_attention_batched(q, k, v, b, NAME, scale, window, plans)

        got = bat_h.run(slots, new, batched)
        assert torch.isfinite(got).all(), f"step {step}: non-finite output"
        assert (got - want).abs().max().item() <= TOL, f"step {step}"
        torch.testing.assert_close(bat_h.kv_caches[NAME], ref_h.kv_caches[NAME],
                                   rtol=0, atol=0, equal_nan=True)
    return all_plans


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 2, 5), (3, 3, None),
                                                   (4, 1, 3)])
def test_matches_reference(schedule, heads, kv_heads, window):
    run_both(SCHEDULES[schedule], heads, kv_heads, 8, window)


@pytest.mark.parametrize("window", [None, 4])
def test_chunked_prefill_and_many_buckets(window, monkeypatch):
    """A tiny score budget splits prefills into chunks and the step into several buckets."""
    monkeypatch.setattr(pab, "SMALL_ELEMENTS", 0)
    plans = run_both(SCHEDULES["mixed"], 4, 2, 8, window, budget=4 * 24)
    counts = [len(p.attention(NAME, window, 4).buckets) for p in plans]
    assert max(counts) >= 3, counts
    segs = [sum(b.n for b in p.attention(NAME, window, 4).buckets) for p in plans]
    assert segs[0] > 3, "the 9-token prefill should have been chunked"


def test_single_bucket_when_uniform():
    """Equal-length prefills, and decodes of any length, run as one call in token order."""
    plans = run_both([[8, 1, 1], [8, 1, 1], [8, 1, 1]], 4, 2, 8, None)
    for p in plans:
        plan = p.attention(NAME, None, 4)
        assert len(plan.buckets) == 1 and plan.identity


def test_bf16_cache():
    run_both(SCHEDULES["mixed"], 4, 2, 8, None, cache_dtype=torch.bfloat16)


def test_replay_keeps_stored_prefix():
    """kv_write_start: replayed positions of a FULL cache are read, never rewritten."""
    outs, caches = [], []
    for op in (paged_attention, _buckets):
        h = make_harness(2, 8, None, max_reqs=2)
        g = torch.Generator().manual_seed(3)
        scale = 8 ** -0.5

        def call(b, n, op=op, g=g):
            q, k, v = (torch.randn(n, hh, 8, generator=g) for hh in (4, 2, 2))
            return op(q, k, v, b, NAME, scale, None)

        h.run([0, 1], [[0] * 12, [0] * 5], lambda b: call(b, 17))
        stored = h.kv_caches[NAME].clone()
        h.seq_lens[0] = 8                  # replay positions 8..11, then 12, 13 are new
        outs.append(h.run([0, 1], [[0] * 6, [0]], lambda b: call(b, 7), kv_write_start=[12, 5]))
        cache = h.kv_caches[NAME].view(-1, 32)
        first = h.block_size                    # request 0 starts at block 1
        torch.testing.assert_close(cache[first + 8:first + 12],
                                   stored.view(-1, 32)[first + 8:first + 12], rtol=0, atol=0)
        caches.append(cache)
    assert (outs[0] - outs[1]).abs().max().item() <= TOL
    torch.testing.assert_close(caches[0], caches[1], rtol=0, atol=0, equal_nan=True)


def test_rejects_bad_shapes():
    h = make_harness(2, 8, None, max_reqs=1)
    q, k = torch.randn(3, 3, 8), torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        h.run([0], [[0] * 3], lambda b: paged_attention_batched(q, k, k, b, NAME, 1.0))
    q, k = torch.randn(3, 4, 8), torch.randn(3, 1, 8)
    with pytest.raises(ValueError, match="cache width"):
        h.run([0], [[0] * 3], lambda b: paged_attention_batched(q, k, k, b, NAME, 1.0))


@pytest.mark.parametrize("max_rows", [0, 1 << 30])
@pytest.mark.parametrize("schedule", ["mixed", "decode", "long-chunks"])
def test_sdpa_and_matmul_paths_each_match_reference(schedule, max_rows, monkeypatch):
    """Every bucket through SDPA (max_rows 0), or every bucket through the two GEMMs."""
    monkeypatch.setattr(pab, "MATMUL_MAX_ROWS", max_rows)
    run_both(SCHEDULES[schedule], 6, 2, 8, None)
    run_both(SCHEDULES[schedule], 4, 1, 8, 3, cache_dtype=torch.bfloat16)


class _PickSdpa:
    """A kernel choice whose attention plan is SDPA from `start` tokens (fake timings)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def plan_attention(self, heads, kv_heads, head_dim, dtype, context=False):
        from wideserve.kernels.choice import BUCKETS
        return tuple("sdpa" if lo >= self.start else "own" for lo, _ in BUCKETS)


@pytest.mark.parametrize("schedule,equal", [([[11, 1], [7, 2], [3, 1]], False),
                                            ([[6, 1], [6, 3]], True)])
def test_fresh_prefills_on_sdpa_match_the_reference(schedule, equal, monkeypatch) -> None:
    """With the C++ op on (bf16) and the choice picking SDPA, a step of whole prefills runs
    SDPA on its own k/v (ragged: per request; equal lengths: one call), writes the cache as the
    op would, and later steps (context in the cache) run the op."""
    from wideserve.kernels import loader
    loader.build()
    monkeypatch.setattr(pab, "default_choice", lambda: _PickSdpa(2))
    calls = []
    inner = pab.sdpa_prefill
    monkeypatch.setattr(pab, "sdpa_prefill", lambda *a: calls.append(a[3]) or inner(*a))
    heads, kv_heads, hd = 4, 2, 16
    ref_h = make_harness(kv_heads, hd, None, torch.bfloat16, len(schedule))
    bat_h = make_harness(kv_heads, hd, None, torch.bfloat16, len(schedule))
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        slots, new = step_tokens(schedule, step)
        t = sum(len(x) for x in new)
        q, k, v = (torch.randn(t, h, hd, generator=g).bfloat16()
                   for h in (heads, kv_heads, kv_heads))
        want = ref_h.run(slots, new, lambda b: paged_attention(
            q.float(), k.float(), v.float(), b, NAME, hd ** -0.5, None))
        got = bat_h.run(slots, new, lambda b: paged_attention_batched(
            q, k, v, b, NAME, hd ** -0.5, None, PagedAttentionPlans(b)))
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(bat_h.kv_caches[NAME].float(),
                                   ref_h.kv_caches[NAME].float(), rtol=0, atol=0,
                                   equal_nan=True)
    assert calls == [[r[0] for r in schedule]]        # the first step only


def test_sdpa_prefill_needs_whole_prefills_and_the_choice(monkeypatch) -> None:
    monkeypatch.setattr(pab, "default_choice", lambda: _PickSdpa(5))
    h = make_harness(2, 16, None, torch.bfloat16, 2)
    seen = []

    def probe(b):
        p = PagedAttentionPlans(b)
        seen.append((p.sdpa_prefill(4, 2, 16, torch.bfloat16, None),
                     p.sdpa_prefill(4, 2, 16, torch.bfloat16, 3)))
        return torch.zeros(int(b.query_start_loc_cpu[-1]), 4, 16)
    h.run([0, 1], [[0] * 6, [0] * 5], probe)           # whole prefills, shortest 5: SDPA
    h.run([0, 1], [[0] * 6, [0]], probe)               # a continued request: the op
    h2 = make_harness(2, 16, None, torch.bfloat16, 2)
    h2.run([0, 1], [[0] * 6, [0] * 4], probe)          # shortest 4: below the choice's start
    assert seen == [([6, 5], None), (None, None), (None, None)]
